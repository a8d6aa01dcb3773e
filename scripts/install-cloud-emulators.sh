#!/usr/bin/env bash
# Installs the object-storage emulators the Azure and GCS tests run against, cached machine-wide
# by version, and prints `<azurite-blob program> <fake-gcs-server program>`:
#
#   scripts/install-cloud-emulators.sh
#
# - Azurite (Microsoft's Azure Storage emulator), the npm package at the pinned version, installed
#   with npm into the cache; its `azurite-blob` serves the Blob API.
# - fake-gcs-server (github.com/fsouza/fake-gcs-server), built from the Go module proxy at the
#   version tools/cloud-emulators/go.mod pins (-mod=readonly).
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/cloud-emulators/.
# Needs node + npm (Debian's nodejs/npm are installed when missing) and go.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AZURITE_VERSION=3.37.0
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}/cloud-emulators
say() { echo "install-cloud-emulators.sh: $*" >&2; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

# Azurite.
azurite_dir=$cache/azurite-$AZURITE_VERSION
azurite=$azurite_dir/node_modules/.bin/azurite-blob
if ! { [ -x "$azurite" ] && [ "$("$azurite" --version 2>/dev/null)" = "$AZURITE_VERSION" ]; }; then
  if ! command -v npm >/dev/null; then
    say "installing nodejs and npm (Debian)"
    sudo=
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null \
      || { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null; } \
      || { say "apt-get install nodejs npm failed"; exit 1; }
  fi
  say "installing azurite $AZURITE_VERSION from npm (about a minute, once per machine)"
  start=$(date +%s)
  tmp=$(mktemp -d "$azurite_dir.XXXXXX")
  npm install --prefix "$tmp" --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION" >&2 \
    || { rm -rf "$tmp"; say "npm install azurite@$AZURITE_VERSION failed"; exit 1; }
  rm -rf "$azurite_dir"
  mv "$tmp" "$azurite_dir"
  got=$("$azurite" --version 2>/dev/null || true)
  [ "$got" = "$AZURITE_VERSION" ] || { say "$azurite reports version '$got', expected $AZURITE_VERSION"; exit 1; }
  say "azurite $AZURITE_VERSION installed in $(($(date +%s) - start)) s"
fi

# fake-gcs-server.
mod=$root/tools/cloud-emulators
gcs_version=$(cd "$mod" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/fsouza/fake-gcs-server) \
  || { say "go list failed in $mod"; exit 1; }
gcs_dir=$cache/fake-gcs-server-$gcs_version
gcs=$gcs_dir/fake-gcs-server
if [ ! -x "$gcs" ] || [ "$(cat "$gcs_dir/version" 2>/dev/null)" != "$gcs_version" ]; then
  say "building fake-gcs-server $gcs_version from the Go module proxy (a minute or two, once per machine)"
  start=$(date +%s)
  mkdir -p "$gcs_dir"
  (cd "$mod" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$gcs.tmp" github.com/fsouza/fake-gcs-server) >&2 || { say "building fake-gcs-server failed"; exit 1; }
  mv "$gcs.tmp" "$gcs"
  echo "$gcs_version" >"$gcs_dir/version"
  say "fake-gcs-server $gcs_version built in $(($(date +%s) - start)) s"
fi
echo "$azurite $gcs"
}
