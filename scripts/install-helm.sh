#!/usr/bin/env bash
# Builds the real helm CLI (helm.sh/helm/v4, cmd/helm) from the Go module proxy at the version
# pinned in tools/helm/go.mod (+ go.sum), into a machine-wide cache, and prints the path of the
# binary on stdout (progress on stderr). Needs Go >= 1.26.0 on PATH (helm v4.3's go line).
#
#   helm=$(scripts/install-helm.sh)
#   "$helm" version --template '{{.Version}}'      # v4.3.2
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/helm/<version>/helm.
# A binary that is there and reports the pinned version is used as it is: nothing is downloaded or
# built. Go's own module and build caches are shared by every clone on the machine.
#
# Pinned: helm v4.3.2. tools/helm/go.mod requires it and nothing else; helm's go.mod has no
# replace directives, and `go list -m all` there gives every module helm's own go.mod lists at the
# version it lists (so the build resolves what `go install helm.sh/helm/v4/cmd/helm@v4.3.2` would,
# which cannot run here: the proxy refuses the version list go install asks for).
#
# Measured on 2 cores shared with other builds (load average 4 to 6):
#   cold (empty tool cache, empty Go module and build caches; niced): 289 s wall, 286 s CPU
#   Go's module cache holding helm's modules, build cache warm from the control plane's build
#     (install-control-plane.sh: the same client-go v0.37.2), as in scripts/test.sh, where helm
#     is built right after the control plane: 132 s wall, 209 s CPU
#   warm (binary present and reporting the pinned version): 0.06 s, nothing built
# The binary is 67 MB; the go build peaks at about 1 GB of memory. Go's module cache grows by about
# 540 MB and its build cache by about 1.2 GB (less when the control plane's build is there).
set -euo pipefail

# One { ... } block, read by bash before any of it runs: a checkout that changes this file during
# the minutes-long build cannot make the running copy execute something else.
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mod=$root/tools/helm
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
say() { echo "install-helm.sh: $*" >&2; }

command -v go >/dev/null || { say "go is missing (Go 1.26.0 or newer is needed to build helm v4.3)"; exit 1; }
[ -f "$mod/go.mod" ] && [ -f "$mod/go.sum" ] || { say "$mod/go.mod + go.sum missing"; exit 1; }

# The version comes from go.mod itself, so the cache key can never disagree with what is built.
# -mod=readonly: go.mod and go.sum are the pin; a build that would need to change them fails
# instead of silently resolving something else.
version=$(cd "$mod" && GOFLAGS=-mod=readonly go list -m -f '{{.Version}}' helm.sh/helm/v4) \
  || { say "go list failed in $mod (see above)"; exit 1; }
[[ $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { say "could not read the pinned helm version from $mod/go.mod (got '$version')"; exit 1; }
dir=$cache/helm/${version#v}
bin=$dir/helm

# A binary counts only when it runs and reports the pinned version. The output is captured before
# it is compared (no `| grep -q` under pipefail: SIGPIPE makes that fail at random).
installed() {
  local out
  [ -x "$bin" ] && out=$("$bin" version --template '{{.Version}}' 2>/dev/null) && [ "$out" = "$version" ]
}

if installed; then
  echo "$bin"
  exit 0
fi

# Several test processes or clones may ask at once: one builds, the others wait and then find it.
mkdir -p "$cache/helm"
exec 9>"$cache/helm/.lock"
flock 9
if installed; then
  echo "$bin"
  exit 0
fi

say "building helm $version from the Go module proxy (minutes on 2 cores when Go's caches are cold; once per machine)"
start=$(date +%s)
# The version stamping of helm's own Makefile (its release builds): without -X ...version.version
# `helm version` says v4.3 only. An empty metadata marks a tagged release; the commit is not known
# from a module zip, and "clean" because the source is the module zip go.sum verifies.
# CGO_ENABLED=0, -trimpath and -s -w as the Makefile builds; -buildvcs=false: this module sits
# inside the project's repository, whose commit has nothing to do with the binary.
pkg=helm.sh/helm/v4/internal/version
tmp=$(mktemp -d "$cache/helm/.${version#v}.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(
  cd "$mod"
  CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -buildvcs=false -o "$tmp/helm" \
    -ldflags "-s -w -X $pkg.version=$version -X $pkg.metadata= -X $pkg.gitCommit= -X $pkg.gitTreeState=clean" \
    helm.sh/helm/v4/cmd/helm
) >&2
chmod 755 "$tmp" # mktemp -d made it 0700; the binary is for every user of the machine
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
installed || {
  say "$bin does not report version $version:"
  "$bin" version >&2 || true
  exit 1
}
say "helm $version built in $(($(date +%s) - start)) s into $dir"
echo "$bin"
exit 0
}
