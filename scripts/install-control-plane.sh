#!/usr/bin/env bash
# Builds a real Kubernetes control plane -- kube-apiserver, kube-controller-manager, kube-scheduler
# and etcd, plus kubectl for people poking at it, and the kubelet of the same release for the real
# node (scripts/start-node.sh) -- from the Go module proxy at the versions pinned in
# tools/control-plane/go.mod (+ go.sum), into a machine-wide cache, and prints the directory
# holding the binaries on stdout (progress on stderr). Needs Go >= 1.26.0 on PATH.
#
#   dir=$(scripts/install-control-plane.sh)
#   "$dir/kube-apiserver" --version      # Kubernetes v1.37.2
#   "$dir/etcd" --version                # etcd Version: 3.7.0
#   scripts/start-control-plane.sh /tmp/cp    # runs them (see that script for the flags)
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)
#        /control-plane/<kubernetes version>-etcd<etcd version>/{kube-apiserver,kube-controller-manager,
#        kube-scheduler,kubelet,etcd,kubectl}
# A directory whose binaries are all there and report the pinned versions is used as it is: nothing
# is downloaded or built. Go's own module and build caches are shared by every clone on the machine.
#
# Pinned: Kubernetes v1.37.2 (the API version the agent is compiled against: k8s-openapi's v1_37)
# and etcd v3.7.0, the etcd that Kubernetes v1.37's own go.mod, integration tests (hack/lib/etcd.sh)
# and kubeadm default pin. Both need Go >= 1.26.0.
#
# Measured on 2 cores, 24 GiB (other builds were sharing the cores part of the time):
#   cold, empty tool cache and empty Go module and build caches: 964 s (16 min) wall,
#     1073 s CPU; the same without kubectl took 809 s wall
#   with a filled Go build cache (binaries deleted or a new cache dir): 19.5 s, linking only
#   warm (binaries present and reporting the pinned versions): 0.2-0.5 s, nothing built
#   the go build peaks at about 2.6 GB of memory (linking kube-apiserver)
# Disk: 297 MB in the cache directory (kube-apiserver 119 MB, kube-controller-manager 105 MB,
# kubectl 62 MB, etcd 25 MB); Go's module cache grows by about 610 MB and its build cache by about
# 3.8 GB (`go clean -cache` gives that back; the binaries do not need it).
# Three independent cold builds gave byte-identical binaries.
set -euo pipefail

# The whole script is one { ... } block, which bash reads completely before running any of it: a
# build takes many minutes, and bash otherwise reads a script as it goes, so a checkout that
# changes this file meanwhile would make the running copy execute garbage (it happened).
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/control-plane
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
say() { echo "install-control-plane.sh: $*" >&2; }

command -v go >/dev/null || { say "go is missing (Go 1.26.0 or newer is needed to build kube-apiserver v1.37 and etcd v3.7)"; exit 1; }

# The versions come from go.mod itself (after minimal version selection), so the cache key can
# never disagree with what is built. -mod=readonly: go.mod and go.sum are the pin; a build that
# would need to change them fails instead of silently resolving something else.
cd "$mod"
versions=$(GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' k8s.io/kubernetes go.etcd.io/etcd/server/v3) \
  || { say "go list failed in $mod (see above)"; exit 1; }
k8s=$(sed -n '1s/^v//p' <<<"$versions")
etcd=$(sed -n '2s/^v//p' <<<"$versions")
[[ $k8s =~ ^[0-9]+\.[0-9]+\.[0-9]+$ && $etcd =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] \
  || { say "could not read the pinned versions from $mod/go.mod (got '$k8s' and '$etcd')"; exit 1; }
dir=$cache/control-plane/$k8s-etcd$etcd

# A binary counts only when it runs and reports the pinned version: a partial or foreign file in
# the cache is rebuilt rather than trusted.
installed() {
  local b out
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet etcd kubectl; do [ -x "$dir/$b" ] || return 1; done
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    [ "$("$dir/$b" --version 2>/dev/null)" = "Kubernetes v$k8s" ] || return 1
  done
  # Output captured before matching, not piped into `grep -q`: grep exits at the first matching
  # line, the binary then dies of SIGPIPE writing the next one, and pipefail makes that a failure
  # (seen as a spurious rebuild under load).
  out=$("$dir/etcd" --version 2>/dev/null) || return 1
  grep -qx "etcd Version: $etcd" <<<"$out" || return 1
  out=$("$dir/kubectl" version --client 2>/dev/null) || return 1
  grep -qx "Client Version: v$k8s" <<<"$out" || return 1
}

if installed; then
  echo "$dir"
  exit 0
fi

# Several test processes or clones may ask at once: one builds, the others wait and then find it.
mkdir -p "$cache/control-plane"
exec 9>"$dir.lock"
flock 9
if installed; then
  echo "$dir"
  exit 0
fi

say "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl v$k8s and etcd v$etcd from the Go module proxy (about 16 minutes on 2 cores when Go's caches are cold; once per machine)"
start=$(date +%s)

# Built from this project's module rather than with `go install k8s.io/kubernetes/cmd/...@v`:
# kubernetes' go.mod replaces its staging modules (k8s.io/api, k8s.io/apiserver, ...) with
# ./staging paths, which go install refuses, and go install also asks the proxy for version
# lists that it answers with 403. tools/control-plane/go.mod requires k8s.io/kubernetes and
# replaces each staging module with its published v0.<minor>.<patch>, the same code.
#
# Version stamping as kubernetes' own hack/lib/version.sh does (component-base and client-go both
# carry it): without it `--version` and GET /version say v0.0.0-master. The build date is the
# module's publication time from the proxy, so two builds of the same pin are byte-identical;
# "archive" is kubernetes' tree state for a build from a source archive (no git commit known).
info=$(GOFLAGS=-mod=readonly go mod download -json "k8s.io/kubernetes@v$k8s" | sed -n 's/^\s*"Info": "\(.*\)",$/\1/p')
built=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info")
major=${k8s%%.*}
minor=${k8s#*.}
minor=${minor%%.*}
ldflags=(-s -w)
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=(-X "$pkg.gitVersion=v$k8s" -X "$pkg.gitMajor=$major" -X "$pkg.gitMinor=$minor"
            -X "$pkg.gitCommit=" -X "$pkg.gitTreeState=archive" -X "$pkg.buildDate=$built")
done

# Into a fresh directory first, then moved into place, so an interrupted build never leaves a
# directory that looks complete. CGO_ENABLED=0 and -trimpath as the upstream release builds of
# both projects: static binaries that run on any Linux of the same architecture. -buildvcs=false:
# this module sits inside the project's repository, whose commit has nothing to do with the
# binaries. One `go build` for all four shares the compilation of their common packages (kubectl
# adds about a minute and 60 MB to the apiserver and controller manager).
tmp=$(mktemp -d "$dir.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -buildvcs=false -ldflags "${ldflags[*]}" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubelet \
  k8s.io/kubernetes/cmd/kubectl \
  ./etcd >&2
mkdir -p "$dir"
mv -f "$tmp/kube-apiserver" "$tmp/kube-controller-manager" "$tmp/kube-scheduler" "$tmp/kubelet" "$tmp/kubectl" \
  "$tmp/etcd" "$dir/"

installed || {
  say "the binaries in $dir do not report kube-apiserver v$k8s / etcd $etcd:"
  "$dir/kube-apiserver" --version >&2 || true
  "$dir/etcd" --version >&2 || true
  exit 1
}
say "built in $(($(date +%s) - start)) s into $dir"
echo "$dir"
exit 0
}
