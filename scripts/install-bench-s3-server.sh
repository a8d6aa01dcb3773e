#!/usr/bin/env bash
# Builds the benchmark's S3 server (tools/bench/s3-server: gofakes3 on a directory, over TLS),
# cached machine-wide by the gofakes3 version tools/bench/s3-server/go.mod pins (-mod=readonly),
# and prints the program's path:
#
#   scripts/install-bench-s3-server.sh
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/bench-s3-server/.
# Needs go. Only the benchmark uses it; the tests run against moto (scripts/install-moto.sh).
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/bench/s3-server
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}/bench-s3-server
say() { echo "install-bench-s3-server.sh: $*" >&2; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
version=$(cd "$mod" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/johannesboyne/gofakes3) \
  || { say "go list failed in $mod"; exit 1; }
# The program's own source counts too: a change to main.go must not reuse an old build.
src=$(sha256sum "$mod/main.go" "$mod/go.sum" | sha256sum | cut -c1-12)
dir=$cache/gofakes3-$version-$src
bin=$dir/bench-s3-server
if [ ! -x "$bin" ]; then
  say "building the benchmark's S3 server (gofakes3 $version) from the Go module proxy (once per machine)"
  start=$(date +%s)
  mkdir -p "$dir"
  (cd "$mod" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp" .) >&2 \
    || { say "building failed"; exit 1; }
  mv "$bin.tmp" "$bin"
  say "built in $(($(date +%s) - start)) s"
fi
echo "$bin"
}
