#!/usr/bin/env bash
# Builds the container runtime of the real test node -- containerd, containerd-shim-runc-v2 and ctr,
# runc, the CNI plugins bridge, host-local and loopback, and the node's pause program -- from the
# Go module proxy at the versions pinned in tools/node/go.mod (+ go.sum), into a machine-wide
# cache, and prints the directory holding the binaries on stdout (progress on stderr). The kubelet
# and kube-scheduler come with the control plane (scripts/install-control-plane.sh: same
# Kubernetes release). Needs Go >= 1.26.6, a C compiler, pkg-config and libseccomp-dev (runc is
# built with seccomp, as upstream releases it; installed with apt-get when missing).
#
#   dir=$(scripts/install-node.sh)
#   "$dir/containerd" --version     # containerd github.com/containerd/containerd/v2 v2.4.2
#   "$dir/runc" --version           # runc version 1.5.3
#   scripts/start-node.sh ...       # runs them (see that script)
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)
#        /node/containerd<v>-runc<v>-cni<v>/{containerd,containerd-shim-runc-v2,ctr,runc,pause,cni/{bridge,host-local,loopback}}
# A directory whose binaries all report the pinned versions is used as it is: nothing is built.
#
# Measured on 2 cores: see README.md ("The real node").
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/node
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
say() { echo "install-node.sh: $*" >&2; }

command -v go >/dev/null || { say "go is missing (Go 1.26.6 or newer builds containerd 2.4)"; exit 1; }

cd "$mod"
versions=$(GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' github.com/containerd/containerd/v2 \
  github.com/opencontainers/runc github.com/containernetworking/plugins) \
  || { say "go list failed in $mod (see above)"; exit 1; }
containerd=$(sed -n '1s/^v//p' <<<"$versions")
runc=$(sed -n '2s/^v//p' <<<"$versions")
cni=$(sed -n '3s/^v//p' <<<"$versions")
for v in "$containerd" "$runc" "$cni"; do
  [[ $v =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { say "could not read the pinned versions from $mod/go.mod (got '$versions')"; exit 1; }
done
dir=$cache/node/containerd$containerd-runc$runc-cni$cni

# A binary counts only when it runs and reports the pinned version.
installed() {
  local out
  for b in containerd containerd-shim-runc-v2 ctr runc pause cni/bridge cni/host-local cni/loopback; do
    [ -x "$dir/$b" ] || return 1
  done
  out=$("$dir/containerd" --version 2>/dev/null) || return 1
  [[ $out == *" v$containerd "* || $out == *" v$containerd" ]] || return 1
  out=$("$dir/runc" --version 2>/dev/null) || return 1
  [[ $out == "runc version $runc"* ]] || return 1
  out=$(env -u CNI_COMMAND "$dir/cni/bridge" 2>&1 </dev/null) || true
  [[ $out == *"v$cni"* ]] || return 1
}

if installed; then
  echo "$dir"
  exit 0
fi
mkdir -p "$cache/node"
exec 9>"$dir.lock"
flock 9
if installed; then
  echo "$dir"
  exit 0
fi

# runc's seccomp support links libseccomp (cgo).
missing=()
command -v cc >/dev/null || missing+=(gcc)
command -v pkg-config >/dev/null || missing+=(pkg-config)
dpkg -s libseccomp-dev >/dev/null 2>&1 || missing+=(libseccomp-dev)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (Debian)"
  sudo=
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null; } \
    || { say "apt-get install ${missing[*]} failed"; exit 1; }
fi

say "building containerd v$containerd, runc v$runc and the CNI plugins v$cni from the Go module proxy (once per machine)"
start=$(date +%s)
tmp=$(mktemp -d "$dir.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export GOFLAGS=-mod=readonly
# Version stamping as each project's own Makefile does, so --version says what was built.
# urfave_cli_no_docs: leaves out the man-page generator, as upstream's release builds do.
# containerd and its shim static (CGO_ENABLED=0: the btrfs snapshotter, the only cgo user, is not
# used); the shim without gRPC (it speaks ttrpc), as upstream builds it.
CGO_ENABLED=0 go build -trimpath -tags "urfave_cli_no_docs" \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=v$containerd -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2" \
  -o "$tmp/" github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/ctr >&2
CGO_ENABLED=0 go build -trimpath -tags "urfave_cli_no_docs no_grpc" \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=v$containerd" \
  -o "$tmp/" github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 >&2
# runc with seccomp (cgo, libseccomp), without upstream's libpathrs tag (a Rust library that is
# not a Go module).
CGO_ENABLED=1 go build -trimpath -tags "seccomp urfave_cli_no_docs" \
  -ldflags "-s -w -X main.version=$runc" -o "$tmp/" github.com/opencontainers/runc >&2
mkdir -p "$tmp/cni"
CGO_ENABLED=0 go build -trimpath \
  -ldflags "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=v$cni" \
  -o "$tmp/cni/" github.com/containernetworking/plugins/plugins/main/bridge \
  github.com/containernetworking/plugins/plugins/main/loopback \
  github.com/containernetworking/plugins/plugins/ipam/host-local >&2
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/pause" ./pause >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
installed || {
  say "the binaries in $dir do not report containerd v$containerd, runc $runc, CNI plugins v$cni:"
  "$dir/containerd" --version >&2 || true
  "$dir/runc" --version >&2 || true
  exit 1
}
say "built in $(($(date +%s) - start)) s into $dir"
echo "$dir"
exit 0
}
