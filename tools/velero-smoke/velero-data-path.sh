#!/usr/bin/env bash
# Runs Velero's own file-system data path for one PodVolumeBackup or PodVolumeRestore, as the
# data-mover pod Velero's node agent (1.17+) creates does: `velero pod-volume backup|restore
# --volume-path=... --pod-volume-backup|--pod-volume-restore=... --resource-timeout=...` (the
# command and arguments of pkg/exposer/pod_volume.go), Velero's kopia library doing the work.
#
#   velero-data-path.sh <work dir> <velero binary> backup|restore <object name> <volume path> -- <env...>
#
# It runs as a host process in a mount namespace of its own whose /dev is a small tmpfs holding
# null, zero, random, urandom and full bound from the real /dev: the data path writes its result
# to /dev/termination-log (where a kubelet reads a container's termination message), which must
# not land in the host's /dev. The message is copied to <work dir>/termination-log. Exit status:
# the data path's (0 completed, 1 failed). The caller gives the environment (NODE_NAME, TMPDIR,
# HOME, AWS_SHARED_CREDENTIALS_FILE, VELERO_NAMESPACE) and the flags after `--` are passed on.
# A restore's kopia cache (the data-path pod's cache volume) is <work dir>/cache, or
# $VDP_CACHE_VOLUME (the benchmark keeps one across restores for its warm-cache rows).
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 <work dir> <velero> backup|restore <object> <volume path> [-- velero flags...]" >&2; exit 2; }
work=$1 velero=$2 kind=$3 object=$4 volume=$5; shift 5
[ "${1:-}" != -- ] || shift
case $kind in
  backup) flags=(--pod-volume-backup="$object") ;;
  restore) cache=${VDP_CACHE_VOLUME:-$work/cache}; mkdir -p "$cache"
    flags=(--pod-volume-restore="$object" --cache-volume-path="$cache") ;;
  *) echo "$0: backup or restore, not '$kind'" >&2; exit 2 ;;
esac
mkdir -p "$work/olddev"
exec unshare --mount --propagation private bash -c '
  set -euo pipefail
  work=$1; shift
  mount --bind /dev "$work/olddev"
  mount -t tmpfs -o size=1m,mode=0755 velero-data-path-dev /dev
  for n in null zero random urandom full; do : >"/dev/$n"; mount --bind "$work/olddev/$n" "/dev/$n"; done
  ln -s /proc/self/fd /dev/fd
  rc=0
  "$@" || rc=$?
  cp /dev/termination-log "$work/termination-log" 2>/dev/null || : >"$work/termination-log"
  exit "$rc"
' velero-data-path "$work" "$velero" pod-volume "$kind" --volume-path="$volume" --resource-timeout=5m \
  "${flags[@]}" --log-level=info "$@"
