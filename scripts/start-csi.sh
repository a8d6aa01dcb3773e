#!/usr/bin/env bash
# Starts CSI storage with snapshots beside a node made by scripts/start-node.sh, so that
# PersistentVolumeClaims are provisioned, mounted by the kubelet, snapshotted and restored from
# snapshots through the real Kubernetes CSI machinery:
#   - the VolumeSnapshot CRDs and the snapshot-controller (external-snapshotter),
#   - the tests' CSI driver (tools/csi/hostpath: volumes are directories under CSI_DIR/state,
#     snapshots are copies), registered with the kubelet's plugin watcher on the node,
#   - csi-provisioner and csi-snapshotter talking to it over its socket,
#   - a CSIDriver (no attach), StorageClass `podvolume-csi` (WaitForFirstConsumer, Delete) and
#     VolumeSnapshotClass `podvolume-csi` (labelled velero.io/csi-volumesnapshot-class=true, as
#     Velero's CSI support picks a class).
# All run as host processes with the control plane's admin credentials (test use only).
#
#   scripts/start-csi.sh CP_DIR NODE_DIR CSI_DIR    start (after the node is Ready)
#   scripts/start-csi.sh --stop CSI_DIR             stop them and remove the driver's state; run
#                                                   after the node's --stop (the kubelet unmounts
#                                                   or the node's stop does)
#
# Environment: CSI_BIN (scripts/install-csi.sh's directory), CONTROL_PLANE_BIN (for kubectl).
# Prints the versions on stderr; on success stdout is CSI_DRIVER=, CSI_STORAGE_CLASS=,
# CSI_SNAPSHOT_CLASS= (also in CSI_DIR/env). Needs root (the driver bind-mounts).
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "start-csi.sh: $*" >&2; }
die() { say "$*"; exit 1; }
usage() { say "usage: $0 CP_DIR NODE_DIR CSI_DIR | $0 --stop CSI_DIR"; exit 2; }
DRIVER=hostpath.csi.podvolume.test
PLUGIN_DIR=/var/lib/kubelet/plugins/$DRIVER
REG_SOCK=/var/lib/kubelet/plugins_registry/$DRIVER-reg.sock

stop_csi() {
  local dir=$1 p pid
  for p in csi-provisioner csi-snapshotter snapshot-controller hostpath; do
    [ -f "$dir/$p.pid" ] || continue
    pid=$(cat "$dir/$p.pid")
    # Only the process started as this PID: its executable is the one of that name.
    if [ "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" = "$p" ]; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/$p.pid"
  done
  # A volume still mounted somewhere (a pod the node's stop did not reach) keeps its directory.
  grep -F " $dir/state/" /proc/self/mountinfo | awk '{print $5}' | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done
  rm -rf "$dir/state" "$PLUGIN_DIR" "$REG_SOCK"
}

if [ "${1:-}" = --stop ]; then
  [ $# -eq 2 ] || usage
  [ -d "$2" ] || exit 0
  stop_csi "$(cd "$2" && pwd)"
  exit 0
fi
[ $# -eq 3 ] || usage
[ "$(id -u)" -eq 0 ] || die "needs root (the driver bind-mounts volumes)"
cp=$(cd "$1" && pwd)
node=$(cd "$2" && pwd)
mkdir -p "$3"
dir=$(cd "$3" && pwd)
[ -f "$node/env" ] || die "$node is not a running node's directory (no env)"
# shellcheck disable=SC1091
. "$node/env"
CSI_BIN=${CSI_BIN:-$("$root/scripts/install-csi.sh")}
CONTROL_PLANE_BIN=${CONTROL_PLANE_BIN:-$("$root/scripts/install-control-plane.sh")}
kubeconfig=$cp/admin.kubeconfig
k() { "$CONTROL_PLANE_BIN/kubectl" --kubeconfig "$kubeconfig" "$@"; }
trap 'rc=$?; [ $rc -eq 0 ] || { say "failed; stopping what was started"; stop_csi "$dir"; }' EXIT

say "external-snapshotter $("$CSI_BIN/csi-snapshotter" --version 2>&1 | awk '{print $NF}'), external-provisioner $("$CSI_BIN/csi-provisioner" --version 2>&1 | awk '{print $NF}'), the tests' hostpath driver"
k apply --server-side -f "$CSI_BIN/crds/" >/dev/null
k wait --for condition=established --timeout=60s \
  crd/volumesnapshots.snapshot.storage.k8s.io crd/volumesnapshotcontents.snapshot.storage.k8s.io \
  crd/volumesnapshotclasses.snapshot.storage.k8s.io >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {name: $DRIVER}
spec: {attachRequired: false, podInfoOnMount: false, fsGroupPolicy: File, volumeLifecycleModes: [Persistent]}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: podvolume-csi}
provisioner: $DRIVER
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshotClass
metadata:
  name: podvolume-csi
  labels: {velero.io/csi-volumesnapshot-class: "true"}
driver: $DRIVER
deletionPolicy: Delete
YAML

start() { # <name> <args...>: a host process in a session of its own, its PID recorded
  local name=$1; shift
  setsid "$CSI_BIN/$name" "$@" >"$dir/$name.log" 2>&1 </dev/null &
  echo $! >"$dir/$name.pid"
}
mkdir -p "$dir/state" "$PLUGIN_DIR"
start hostpath --endpoint "$PLUGIN_DIR/csi.sock" --node-id "$NODE_NAME" --state-dir "$dir/state" \
  --registration-dir /var/lib/kubelet/plugins_registry
for _ in $(seq 100); do [ -S "$PLUGIN_DIR/csi.sock" ] && break; sleep 0.1; done
[ -S "$PLUGIN_DIR/csi.sock" ] || die "the driver did not listen (see $dir/hostpath.log)"
common=(--kubeconfig "$kubeconfig" --leader-election=false --v=2)
start snapshot-controller "${common[@]}"
start csi-snapshotter "${common[@]}" --csi-address "$PLUGIN_DIR/csi.sock"
start csi-provisioner "${common[@]}" --csi-address "$PLUGIN_DIR/csi.sock" --extra-create-metadata
# The kubelet registers the driver on the Node's CSINode object.
for _ in $(seq 300); do
  k get csinode "$NODE_NAME" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -qw "$DRIVER" && break
  sleep 0.2
done
k get csinode "$NODE_NAME" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -qw "$DRIVER" \
  || die "the kubelet did not register $DRIVER on CSINode $NODE_NAME (see $dir/hostpath.log and the kubelet's log)"
for p in hostpath snapshot-controller csi-snapshotter csi-provisioner; do
  kill -0 "$(cat "$dir/$p.pid")" 2>/dev/null || die "$p exited (see $dir/$p.log)"
done
printf 'CSI_DRIVER=%s\nCSI_STORAGE_CLASS=podvolume-csi\nCSI_SNAPSHOT_CLASS=podvolume-csi\n' "$DRIVER" | tee "$dir/env"
say "CSI driver $DRIVER registered on $NODE_NAME; stop with: $0 --stop $dir"
trap - EXIT
exit 0
}
