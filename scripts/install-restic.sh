#!/usr/bin/env bash
# Installs restic built from the Go module proxy at the version tools/restic/go.mod pins, with
# every backend (Debian's restic 0.18 is built without the Azure backend), cached machine-wide,
# and prints `<version> <path to the binary>`:
#
#   scripts/install-restic.sh
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/restic/<version>/restic.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/restic
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
say() { echo "install-restic.sh: $*" >&2; }
command -v go >/dev/null || { say "go is missing"; exit 1; }
v=$(cd "$mod" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/restic/restic) \
  || { say "go list failed in $mod"; exit 1; }
v=${v#v}
dir=$cache/restic/$v
bin=$dir/restic
if [ -x "$bin" ] && "$bin" version 2>/dev/null | grep -q "^restic $v "; then
  echo "$v $bin"
  exit 0
fi
mkdir -p "$dir"
exec 9>"$dir.lock"
flock 9
if ! { [ -x "$bin" ] && "$bin" version 2>/dev/null | grep -q "^restic $v "; }; then
  say "building restic $v from the Go module proxy (a minute or two, once per machine)"
  start=$(date +%s)
  (cd "$mod" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X main.version=$v" -o "$bin.tmp" github.com/restic/restic/cmd/restic) >&2 \
    || { say "building restic $v failed"; exit 1; }
  mv "$bin.tmp" "$bin"
  "$bin" version | grep -q "^restic $v " || { say "$bin does not report version $v"; exit 1; }
  say "restic $v built in $(($(date +%s) - start)) s"
fi
echo "$v $bin"
}
