#!/usr/bin/env bash
# Builds the CSI parts of the real test node from the Go module proxy at the versions pinned in
# tools/csi/go.mod and tools/csi-provisioner/go.mod (+ go.sum) into a machine-wide cache, and prints the directory holding them on
# stdout (progress on stderr):
#   snapshot-controller, csi-snapshotter   github.com/kubernetes-csi/external-snapshotter/v8
#   csi-provisioner                        github.com/kubernetes-csi/external-provisioner/v5
#   hostpath                               the tests' own CSI driver (tools/csi/hostpath: no CSI
#                                          driver with snapshots is served by the module proxy)
#   crds/                                  the VolumeSnapshot CRDs of the snapshot controller's
#                                          client module
#
#   dir=$(scripts/install-csi.sh)
#   "$dir/csi-snapshotter" --version     # v8.7.0
#   scripts/start-csi.sh ...             # runs them beside a node (see that script)
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)
#        /csi/snapshotter<v>-provisioner<v>-hostpath<hash of tools/csi>/
# A directory whose binaries all report the pinned versions is used as it is: nothing is built.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/csi
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
say() { echo "install-csi.sh: $*" >&2; }

command -v go >/dev/null || { say "go is missing"; exit 1; }

cd "$mod"
versions=$(GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-snapshotter/v8 \
  github.com/kubernetes-csi/external-snapshotter/client/v8) \
  || { say "go list failed in $mod (see above)"; exit 1; }
# The provisioner builds against an older Kubernetes client than the snapshotter (v5.3.0 does not
# compile with client-go 0.37): a module of its own.
provisioner=$(cd "$root/tools/csi-provisioner" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/kubernetes-csi/external-provisioner/v5) \
  || { say "go list failed in $root/tools/csi-provisioner (see above)"; exit 1; }
snapshotter=$(sed -n 1p <<<"$versions")
client=$(sed -n 2p <<<"$versions")
for v in "$snapshotter" "$provisioner" "$client"; do
  [[ $v =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { say "could not read the pinned versions from $mod/go.mod (got '$versions')"; exit 1; }
done
# The driver is ours: its cache key is its source.
hostpath=$(cat go.mod go.sum hostpath/*.go | sha256sum | cut -c1-12)
dir=$cache/csi/snapshotter$snapshotter-provisioner$provisioner-hostpath$hostpath

installed() {
  local b
  for b in snapshot-controller csi-snapshotter csi-provisioner hostpath; do
    [ -x "$dir/$b" ] || return 1
  done
  [ -f "$dir/crds/snapshot.storage.k8s.io_volumesnapshots.yaml" ] || return 1
  [[ $("$dir/csi-snapshotter" --version 2>&1) == *"$snapshotter"* ]] || return 1
  [[ $("$dir/snapshot-controller" --version 2>&1) == *"$snapshotter"* ]] || return 1
  [[ $("$dir/csi-provisioner" --version 2>&1) == *"$provisioner"* ]] || return 1
}

if installed; then
  echo "$dir"
  exit 0
fi
mkdir -p "$cache/csi"
exec 9>"$dir.lock"
flock 9
if installed; then
  echo "$dir"
  exit 0
fi

say "building snapshot-controller and csi-snapshotter $snapshotter, csi-provisioner $provisioner and the tests' hostpath driver (once per machine)"
start=$(date +%s)
tmp=$(mktemp -d "$dir.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export GOFLAGS=-mod=readonly CGO_ENABLED=0
# Version stamping as the projects' own release builds do, so --version says what was built.
go build -trimpath -ldflags "-s -w -X main.version=$snapshotter" -o "$tmp/" \
  github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller \
  github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter >&2
go build -trimpath -ldflags "-s -w" -o "$tmp/hostpath" ./hostpath >&2
(cd "$root/tools/csi-provisioner" && go build -trimpath -ldflags "-s -w -X main.version=$provisioner" -o "$tmp/" \
  github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner) >&2
crds=$(go list -m -f '{{.Dir}}' github.com/kubernetes-csi/external-snapshotter/client/v8)/config/crd
mkdir -p "$tmp/crds"
cp "$crds"/snapshot.storage.k8s.io_*.yaml "$tmp/crds/"
chmod -R u+w "$tmp/crds"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
installed || {
  say "the binaries in $dir do not report external-snapshotter $snapshotter / external-provisioner $provisioner:"
  "$dir/csi-snapshotter" --version >&2 || true
  "$dir/csi-provisioner" --version >&2 || true
  exit 1
}
say "built in $(($(date +%s) - start)) s into $dir"
echo "$dir"
exit 0
}
