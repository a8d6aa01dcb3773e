#!/usr/bin/env bash
# Backs up a sample directory into a local restic repository with live progress, restores it
# elsewhere and compares the two trees byte for byte. Installs restic (Debian package) if missing.
#
#   scripts/demo.sh              # 300 MiB of sample data
#   DEMO_SIZE_MB=1000 scripts/demo.sh
#   DEMO_DIR=/var/tmp/pva-demo scripts/demo.sh   # put the data there, and keep it
#   DEMO_KEEP=1 scripts/demo.sh                   # keep the temporary directory too
#
# Needs Rust 1.89 or newer (edition 2024, and kube 5 requires 1.89; `rustup update` if older).
# Measured on 2 cores: the first run builds the release binary (about 12 minutes idle, 21 beside
# other builds; cargo's progress is shown), then the demo itself takes about 9 s for 300 MiB; a
# second run builds nothing. Without DEMO_DIR the data (about twice DEMO_SIZE_MB, plus the repository) lives in a
# temporary directory that is removed at the end, also after a failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

size_mb=${DEMO_SIZE_MB:-300}
if ! command -v restic >/dev/null; then
  echo "restic not found: installing Debian's package"
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y restic || { apt-get update && apt-get install -y restic; }
  else sudo apt-get install -y restic; fi
fi
restic version

command -v cargo >/dev/null || { echo "demo.sh: cargo is missing (install Rust >= 1.89: https://rustup.rs)" >&2; exit 1; }
agent=target/release/podvolume-agent
if [ ! -x "$agent" ]; then
  echo "first build of the release binary: about 12 minutes on 2 cores (once; later runs reuse it)"
fi
# cargo's own progress (its bar on a terminal), not --quiet: a long first build must not look hung.
cargo build --release --bin podvolume-agent

keep=${DEMO_KEEP:-0}
if [ -n "${DEMO_DIR:-}" ]; then
  work=$DEMO_DIR
  keep=1
  mkdir -p "$work"
else
  work=$(mktemp -d -t podvolume-demo-XXXXXX)
fi
cleanup() {
  if [ "$keep" = 1 ]; then
    echo "the demo's data is kept in $work ($(du -sh "$work" 2>/dev/null | cut -f1)); remove it with: rm -rf $work"
  else
    rm -rf "$work"
    echo "removed the demo's data ($work); DEMO_KEEP=1 keeps it"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$work/source/docs"
echo "demo password $(date +%s%N)" > "$work/password"
chmod 600 "$work/password"
echo "sample data: ${size_mb} MiB in $work/source"
head -c "$((size_mb * 1024 * 1024))" /dev/urandom > "$work/source/big.bin"
for i in $(seq 1 200); do head -c $((RANDOM * 4)) /dev/urandom > "$work/source/docs/file-$i.dat"; done

echo
echo "== backup (Ctrl-C stops it cleanly) =="
snapshot=$("$agent" backup --repo "$work/repo" --password-file "$work/password" "$work/source")
echo "snapshot: $snapshot"

echo
echo "== restore =="
"$agent" restore --repo "$work/repo" --password-file "$work/password" --target "$work/restored" "$snapshot"

echo
if diff -r "$work/source" "$work/restored" >/dev/null; then
  echo "restored tree is byte-identical to the source"
else
  echo "restored tree differs from the source" >&2
  exit 1
fi
echo "JSON progress instead of a bar: $agent backup --json --repo REPO --password-file FILE DIR"
echo "demo finished in $(($(date +%s) - started)) s"
