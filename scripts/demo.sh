#!/usr/bin/env bash
# Backs up a sample directory into a local restic repository with live progress, restores it
# elsewhere and compares the two trees byte for byte. Installs restic (Debian package) if missing.
#
#   scripts/demo.sh              # 300 MiB of sample data
#   DEMO_SIZE_MB=1000 scripts/demo.sh
#   DEMO_DIR=/var/tmp/pva-demo scripts/demo.sh   # keep the data somewhere specific
set -euo pipefail
cd "$(dirname "$0")/.."

size_mb=${DEMO_SIZE_MB:-300}
if ! command -v restic >/dev/null; then
  echo "restic not found: installing Debian's package"
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y restic || { apt-get update && apt-get install -y restic; }
  else sudo apt-get install -y restic; fi
fi
restic version

cargo build --release --quiet
agent=target/release/podvolume-agent

work=${DEMO_DIR:-$(mktemp -d -t podvolume-demo-XXXXXX)}
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
  echo "restored tree is byte-identical to the source ($work/restored)"
else
  echo "restored tree differs from the source" >&2
  exit 1
fi
echo "JSON progress instead of a bar: $agent backup --json --repo $work/repo --password-file $work/password $work/source"
