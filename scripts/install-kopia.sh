#!/usr/bin/env bash
# Installs the real kopia CLI at the pinned versions the tests run, built from the Go module proxy,
# each into a directory of its own in a machine-wide cache, and prints one line per version: `<version> <path to the binary>`.
#
#   scripts/install-kopia.sh              # every pinned version
#   scripts/install-kopia.sh 0.22.3       # one version
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/kopia/<version>/kopia.
# A version whose binary is there and reports that version is neither downloaded nor built
# again; Go's own module and build caches are shared by every clone on the machine.
#
# Pinned: 0.21.1 (the kopia base of Velero 1.17), 0.22.3 (Velero 1.18's), 0.23.1 (newest 0.23
# the module proxy serves here; 0.23 prints progress to a non-terminal only with --progress).
set -euo pipefail
pinned=(0.21.1 0.22.3 0.23.1)
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("${pinned[@]}")
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
command -v go >/dev/null || { echo "install-kopia.sh: go is missing (Go 1.26 or newer is needed to build kopia)" >&2; exit 1; }

for v in "${versions[@]}"; do
  dir=$cache/kopia/$v
  bin=$dir/kopia
  if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "^$v "; then
    echo "$v $bin"
    continue
  fi
  mkdir -p "$dir/src"
  echo "install-kopia.sh: building kopia $v from the Go module proxy (a few minutes on 2 cores, once per machine)" >&2
  start=$(date +%s)
  # Built from a throw-away module that requires kopia at that version, not with `go install
  # github.com/kopia/kopia@v$v`: go install also asks the proxy for the module's version list
  # (deprecation check) and the proxy here answers that with 403, failing the install. kopia's
  # go.mod has no replace directive, so the requirement graph is the same as go install's.
  # The version is linked in as kopia's release builds do (a dependency's build info has none).
  (
    cd "$dir/src"
    [ -f go.mod ] || go mod init podvolume-agent.test/kopia-build >/dev/null 2>&1
    go get "github.com/kopia/kopia@v$v" >/dev/null 2>&1 || go get "github.com/kopia/kopia@v$v"
    CGO_ENABLED=0 go build -trimpath -o "$bin" \
      -ldflags "-X github.com/kopia/kopia/repo.BuildVersion=$v -X github.com/kopia/kopia/repo.BuildInfo=go-module-proxy" \
      github.com/kopia/kopia
  ) >&2
  got=$("$bin" --version 2>/dev/null | awk '{print $1}')
  [ "$got" = "$v" ] || { echo "install-kopia.sh: $bin reports version '$got', expected $v" >&2; exit 1; }
  echo "install-kopia.sh: kopia $v built in $(($(date +%s) - start)) s" >&2
  echo "$v $bin"
done
