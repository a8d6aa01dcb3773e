#!/usr/bin/env bash
# Benchmark of the agent against Velero 1.18's own file-system data path (case 9 of
# BENCHMARKS.md): the same volumes backed up and restored by `podvolume-agent run` (its kopia CLI
# child) and by `velero pod-volume backup|restore` (what Velero's data-path pods run), on a real
# kube-apiserver, into Velero's filesystem backend and an S3 server (tools/bench/s3-server:
# gofakes3 over TLS, fast enough for 200,000 small reads; the tests use moto). See
# tools/bench/velero_path.py.
#
#   scripts/bench-velero-path.sh [--quick] [--out FILE] [--runs N] [--stores fs,s3] [--shapes large,small,mixed]
#        [--ops backup,backup-warm,incremental,restore-cold,restore-warm,restore-sparse-cold,restore-sparse-warm]
#
# Full: one 4 GiB file, 200,000 files of 0-16 KiB, a mixed volume; 3 runs; about 3 hours 10
# minutes on 2 CPUs (one run of every shape on both stores took 63 minutes, two runs 114). --quick: 512 MiB,
# 20,000 files, a smaller mixed volume; about 90 minutes.
# Needs root (Velero's data path runs in a mount namespace of its own, and cold runs drop the page
# cache). Installs what it needs (cached by version). Work files under BENCH_WORK_PARENT (default
# /var/tmp), removed at the end unless BENCH_KEEP_WORK=1 (the agent's log is run/agent.log there;
# BENCH_AGENT_LOG sets its RUST_LOG, default warn). --ops measures some operations only (the first
# backup always runs). Refuses to start when the work disk has too little free space (about 4x the
# biggest shape plus kopia's cache: 22 GiB for the full 4 GiB file).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

quick=()
out=
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=(--quick) ;;
    --tiny) quick=(--tiny) ;;
    --out) out=$2; shift ;;
    --runs|--stores|--shapes|--ops) extra+=("$1" "$2"); shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$(id -u)" -eq 0 ] || { echo "$0: needs root (see the header)" >&2; exit 1; }

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
cargo build --release --bin podvolume-agent >&2
if [ -z "${KOPIA:-}" ]; then read -r _ KOPIA < <(scripts/install-kopia.sh 0.22.3); fi
read -r _ velero_dir < <(scripts/install-velero.sh 1.18.3)
cp_bin=$(scripts/install-control-plane.sh)
s3_server=$(scripts/install-bench-s3-server.sh)

work="$(mktemp -d "${BENCH_WORK_PARENT:-/var/tmp}/pva-bench-velero.XXXXXX")"
if [ "${BENCH_KEEP_WORK:-0}" = 1 ]; then echo "work files kept in $work" >&2; else trap 'rm -rf "$work"' EXIT; fi
"$velero_dir/velero" install --crds-only --dry-run -o yaml >"$work/crds.yaml"
python3 tools/bench/velero_path.py --root "$root" --work "$work/run" \
  --agent "$CARGO_TARGET_DIR/release/podvolume-agent" --kopia "$KOPIA" --velero "$velero_dir/velero" \
  --cp-bin "$cp_bin" --crds "$work/crds.yaml" --s3-server "$s3_server" "${quick[@]}" "${extra[@]}" \
  --out "${out:-/dev/stdout}"
