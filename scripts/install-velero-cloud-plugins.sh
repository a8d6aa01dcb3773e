#!/usr/bin/env bash
# Builds Velero's own object-store plugins for Azure and Google Cloud from the Go module proxy at
# the versions tools/velero/plugin-for-*-v<version>/go.mod pin (-mod=readonly), cached
# machine-wide, and prints one `<plugin binary>` per line:
#
#   scripts/install-velero-cloud-plugins.sh
#
# Pinned: velero-plugin-for-microsoft-azure v1.9.2 and velero-plugin-for-gcp v1.14.2, the newest
# each the proxy serves here (azure v1.9.3 and v1.10.0 onwards, gcp v1.14.3 onwards answer 403).
# The plugin gRPC protocol (ObjectStore v1) is the one Velero 1.16 and 1.18 speak.
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/velero-plugins/.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}/velero-plugins
say() { echo "install-velero-cloud-plugins.sh: $*" >&2; }
command -v go >/dev/null || { say "go is missing"; exit 1; }
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=readonly" CGO_ENABLED=0
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
for spec in "microsoft-azure 1.9.2" "gcp 1.14.2"; do
  read -r name v <<<"$spec"
  module=github.com/vmware-tanzu/velero-plugin-for-$name
  mod=$root/tools/velero/plugin-for-$name-v$v
  [ -f "$mod/go.mod" ] && [ -f "$mod/go.sum" ] || { say "$mod/go.mod + go.sum missing"; exit 1; }
  bin=$cache/$name-v$v/velero-plugin-for-$name
  out=$(go version -m "$bin" 2>/dev/null || true)
  if ! grep -qE "^[[:space:]]+(mod|dep)[[:space:]]+$module[[:space:]]+v$v([[:space:]]|\$)" <<<"$out"; then
    say "building velero-plugin-for-$name v$v from the Go module proxy (several minutes on 2 cores, once per machine)"
    start=$(date +%s)
    mkdir -p "$(dirname "$bin")"
    (cd "$mod" && go build -trimpath -o "$bin.tmp" "$module/velero-plugin-for-$name") >&2 \
      || { say "building velero-plugin-for-$name v$v failed"; exit 1; }
    mv "$bin.tmp" "$bin"
    say "velero-plugin-for-$name v$v built in $(($(date +%s) - start)) s"
  fi
  echo "$bin"
done
}
