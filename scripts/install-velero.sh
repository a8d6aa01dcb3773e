#!/usr/bin/env bash
# Builds the real Velero server/CLI binary and velero-plugin-for-aws from the Go module proxy, at
# the versions pinned in tools/velero/ (go.mod + go.sum per version), into a machine-wide cache,
# and prints one line per Velero version on stdout: `<version> <directory>` (progress on stderr).
#
#   scripts/install-velero.sh               # every pinned version: 1.18.3 and 1.16.2
#   scripts/install-velero.sh 1.18.3        # one version ("v1.18.3" is accepted too)
#   dir=$(scripts/install-velero.sh 1.18.3 | cut -d' ' -f2)
#   "$dir/velero" server --plugin-dir "$dir/plugins" ...     # see tools/velero/README.md
#
# Cache: $PODVOLUME_TOOLS_CACHE (default ~/.cache/podvolume-agent/tools)/velero/<version>/
#          velero                            the Velero binary (server, CLI and built-in plugins)
#          velero-restore-helper             the init container Velero adds to restored pods (its image)
#          plugins/velero-plugin-for-aws     what `velero server --plugin-dir <dir>/plugins` runs
# A version whose binaries are there and report the pinned versions is neither downloaded nor
# built again; Go's own module and build caches are shared by every clone on the machine.
#
# Pinned (tools/velero/README.md says why, and how to add a version):
#   Velero 1.18.3  (newest 1.18.x the proxy serves) + velero-plugin-for-aws v1.14.3 (the plugin's
#                  README pairs v1.14.x with Velero v1.18.x)
#   Velero 1.16.2  (newest 1.16.x the proxy serves) + velero-plugin-for-aws v1.14.3 as well: no
#                  v1.12.x (the line paired with 1.16) is served here; the plugin gRPC protocol
#                  (pkg/plugin/proto, handshake) is byte-identical between Velero 1.16.2 and 1.18.3.
# All build with the Go 1.26 toolchain (go lines: 1.26.0, 1.23.0, plugin 1.25.7); no GOTOOLCHAIN.
#
# Measured on 2 cores, 24 GiB, with other builds running beside it (load average 8 to 12):
#   cold, 1.18.3 (empty tool cache, empty Go module and build caches): 24 min 4 s
#     (velero 959 s, then the plugin 485 s)
#   1.16.2 afterwards, Go's module cache already filled: 21 min 10 s (velero 827 s, plugin 443 s;
#     the plugin is now copied from 1.18.3's directory instead, so about 14 min there)
#   1.16.2 in the test command's order (after the control plane, helm, kopia and 1.18.3 filled
#     Go's caches; nothing else running): 170 s wall, 300 s CPU (user 265 s + system 35 s)
#   warm (binaries present): 0.10 s for one version, 0.2-0.35 s for both; nothing built
#   a version rebuilt with Go's build cache warm: 14 s (builds are byte-identical: -trimpath)
# The tools cache takes ~255 MB per version (velero 150 MB for 1.18.3, 134 MB for 1.16.2; the
# plugin 117 MB). For 1.18.3 + plugin alone, Go's module cache grows by ~1.5 GB and its build
# cache by ~2.8 GB; 1.16.2 shares part of that.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mods=$root/tools/velero
cache=${PODVOLUME_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/podvolume-agent/tools}
pinned=(1.18.3 1.16.2)
say() { echo "install-velero.sh: $*" >&2; }

# The velero-plugin-for-aws version built beside each Velero version. The plugin is a separate
# binary with its own module graph (it requires Velero v1.18.1 as a library), so it is built in its
# own module, tools/velero/plugin-for-aws-v<version>, never inside Velero's: minimal version
# selection would otherwise move the plugin's dependencies (or Velero's) to each other's versions.
aws_plugin_for() {
  case $1 in
    1.18.*) echo 1.14.3 ;;
    # Substitute, not the paired line: v1.12.0-v1.12.2 and v1.13.0-v1.13.2 all answer 403 at the
    # proxy. Velero 1.16.2 and 1.18.3 have identical pkg/plugin/proto/*.proto and
    # pkg/plugin/framework/handshake.go, so the server talks to this plugin as to its own.
    1.16.*) echo 1.14.3 ;;
    *) return 1 ;;
  esac
}

command -v go >/dev/null || { say "go is missing (Go 1.26 or newer builds every pinned version)"; exit 1; }

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("${pinned[@]}")

# -mod=readonly: go.mod and go.sum are the pin; a build that would need to change them fails
# instead of silently resolving something else. GOFLAGS from the caller is kept (e.g. -x).
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=readonly"
# Velero's release build (hack/build.sh) links statically with cgo off; the plugin's Dockerfile too.
export CGO_ENABLED=0

# A binary counts only when it runs and reports the pinned version: a partial or foreign file in
# the cache is rebuilt rather than trusted. `go version -m` reads the module versions the Go linker
# embedded, the only version a velero-plugin-for-aws binary carries.
# The output is captured before grep reads it: `cmd | grep -q` under pipefail fails at random when
# grep exits at the first match and cmd then dies of SIGPIPE writing the rest.
velero_ok() { # <binary> <version>
  local out
  [ -x "$1" ] && out=$("$1" version --client-only 2>/dev/null) \
    && grep -qE "^[[:space:]]*Version: v$2\$" <<<"$out"
}
module_ok() { # <binary> <module path> <version>
  local out
  [ -x "$1" ] && out=$(go version -m "$1" 2>/dev/null) \
    && grep -qE "^[[:space:]]+(mod|dep)[[:space:]]+$2[[:space:]]+v$3([[:space:]]|\$)" <<<"$out"
}

mkdir -p "$cache/velero"
# Two clones installing at once would otherwise build into and rename over the same directory.
exec 9>"$cache/velero/.lock"
flock 9

for v in "${versions[@]}"; do
  v=${v#v}
  vmod=$mods/velero-v$v
  p=$(aws_plugin_for "$v") || { say "no velero-plugin-for-aws version is pinned for Velero $v (see aws_plugin_for)"; exit 1; }
  pmod=$mods/plugin-for-aws-v$p
  for m in "$vmod" "$pmod"; do
    [ -f "$m/go.mod" ] && [ -f "$m/go.sum" ] \
      || { say "$m/go.mod + go.sum missing: version not pinned (tools/velero/README.md says how to add one)"; exit 1; }
  done
  dir=$cache/velero/$v
  plugin=$dir/plugins/velero-plugin-for-aws
  if velero_ok "$dir/velero" "$v" && module_ok "$plugin" github.com/vmware-tanzu/velero-plugin-for-aws "$p" \
    && module_ok "$dir/velero-restore-helper" github.com/vmware-tanzu/velero "$v"; then
    echo "$v $dir"
    continue
  fi

  say "building Velero $v and velero-plugin-for-aws v$p from the Go module proxy (several minutes on 2 cores, once per machine)"
  start=$(date +%s)
  # Built in a scratch directory beside the final one and renamed at the end, so an interrupted
  # build never leaves a directory that looks installed.
  tmp=$(mktemp -d "$cache/velero/.$v.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/plugins"

  # Not `go install github.com/vmware-tanzu/velero/cmd/velero@v$v`: go install asks the proxy for
  # the module's version list (deprecation check), which the proxy here refuses with 403, and it
  # refuses outright a module whose go.mod has replace directives (Velero's replaces kopia with its
  # fork). The module in tools/velero/velero-v<version> requires Velero at that version with the
  # same replace lines, so the build resolves what upstream's does (README: the one exception).
  #
  # The ldflags are those of Velero's hack/build.sh: without them `velero version` prints an empty
  # version. GitSHA is the tag's commit when the proxy's .info reports one (it does not for every
  # version); the source is the module zip, which go.sum verifies, not a git checkout.
  info=$(go env GOMODCACHE)/cache/download/github.com/vmware-tanzu/velero/@v/v$v.info
  (cd "$vmod" && go mod download github.com/vmware-tanzu/velero) >&2
  sha=$(sed -n 's/.*"Hash" *: *"\([0-9a-f]\{40\}\)".*/\1/p' "$info" 2>/dev/null | head -1)
  pkg=github.com/vmware-tanzu/velero/pkg/buildinfo
  (
    cd "$vmod"
    go build -trimpath -o "$tmp/velero" \
      -ldflags "-X $pkg.Version=v$v -X $pkg.ImageRegistry=velero -X $pkg.GitSHA=${sha:-unknown} -X $pkg.GitTreeState=clean" \
      github.com/vmware-tanzu/velero/cmd/velero
    # The restore helper of Velero's image (the init container Velero adds to restored pods), for
    # the real node's image of Velero (scripts/velero-smoke.sh).
    go build -trimpath -o "$tmp/velero-restore-helper" github.com/vmware-tanzu/velero/cmd/velero-restore-helper
  ) >&2
  say "velero $v built in $(($(date +%s) - start)) s"
  # The plugin does not depend on the Velero version it is paired with: when another version's
  # directory already holds a verified build of the same plugin version, copy it (a -trimpath
  # build of the same pinned module is byte-identical) instead of spending minutes rebuilding it.
  same=
  for other in "$cache"/velero/*/plugins/velero-plugin-for-aws; do
    if module_ok "$other" github.com/vmware-tanzu/velero-plugin-for-aws "$p"; then same=$other; break; fi
  done
  if [ -n "$same" ]; then
    say "velero-plugin-for-aws v$p: copying the verified build in $(dirname "$same")"
    cp "$same" "$tmp/plugins/velero-plugin-for-aws"
  else
    (
      cd "$pmod"
      go build -trimpath -o "$tmp/plugins/velero-plugin-for-aws" \
        github.com/vmware-tanzu/velero-plugin-for-aws/velero-plugin-for-aws
    ) >&2
  fi

  velero_ok "$tmp/velero" "$v" \
    || { say "$tmp/velero does not report version v$v:"; "$tmp/velero" version --client-only >&2 || true; exit 1; }
  module_ok "$tmp/plugins/velero-plugin-for-aws" github.com/vmware-tanzu/velero-plugin-for-aws "$p" \
    || { say "the plugin binary was not built from velero-plugin-for-aws v$p"; exit 1; }
  chmod 755 "$tmp" # mktemp -d made it 0700; the binaries are for every user of the machine
  rm -rf "$dir"
  mv "$tmp" "$dir"
  trap - EXIT
  say "Velero $v + velero-plugin-for-aws v$p built in $(($(date +%s) - start)) s"
  echo "$v $dir"
done
