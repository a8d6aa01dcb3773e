#!/usr/bin/env bash
# Builds the node agent's container image, two ways, to the same content (Debian bookworm with
# ca-certificates and tini from Debian; kopia and restic built from the Go module proxy at the
# versions the agent is tested with; the agent at /usr/local/bin; entrypoint `tini --
# podvolume-agent`, command `run`; root, as the DaemonSet needs: see daemonset/Dockerfile).
#
#   scripts/build-image.sh IMAGE [--push]     with a container engine (docker, podman or buildah
#                                             bud; ENGINE=... to choose) from daemonset/Dockerfile;
#                                             --push pushes it (log in to the registry first).
#                                             About 15 minutes the first time (the Rust release
#                                             build), then a minute or two.
#   scripts/build-image.sh --oci DIR [--tag TAG] [--agent BIN] [--base TAR] [--check]
#                                             without any daemon or engine: an OCI image layout
#                                             in DIR (import it with `skopeo copy oci:DIR:TAG
#                                             docker://REGISTRY/IMAGE:TAG`), assembled with
#                                             mmdebstrap and umoci (Debian packages, installed if
#                                             missing). --agent: the agent binary to put in
#                                             (default: `cargo build --release`); --base: a root
#                                             filesystem tarball made by `--base-only` (else made
#                                             here, about 1.5 minutes); --check: unpack the image
#                                             and run, inside it (chroot), the entrypoint with
#                                             --version, `restic version` and `kopia --version`.
#   scripts/build-image.sh --base-only TAR    just the Debian root filesystem (mmdebstrap).
#
# Needs root for --oci (mmdebstrap and chroot). KOPIA_VERSION (default 0.22.3) picks kopia.
set -euo pipefail
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KOPIA_VERSION=${KOPIA_VERSION:-0.22.3}
SUITE=bookworm
PACKAGES=ca-certificates,tini
say() { echo "build-image.sh: $*" >&2; }
die() { say "$*"; exit 1; }

need_debs() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]} (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

# The Debian part of the image, as the Dockerfile's runtime stage installs it (no docs, no
# manuals, no apt lists).
make_base() {
  local out=$1
  need_debs mmdebstrap
  local t0=$SECONDS
  mmdebstrap --quiet --variant=essential --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$SUITE" "$out" || die "mmdebstrap $SUITE ($PACKAGES) failed"
  say "Debian $SUITE root filesystem with $PACKAGES: $out ($(du -h "$out" | cut -f1), $((SECONDS - t0)) s)"
}

engine_build() {
  local image=$1 push=$2 engine=${ENGINE:-}
  if [ -z "$engine" ]; then
    for e in docker podman buildah; do command -v "$e" >/dev/null && { engine=$e; break; }; done
  fi
  [ -n "$engine" ] || die "no container engine (docker, podman, buildah) found: use --oci DIR (no daemon needed)"
  local build=(build)
  [ "$(basename "$engine")" = buildah ] && build=(bud)
  "$engine" "${build[@]}" -f "$root/daemonset/Dockerfile" --build-arg "KOPIA_VERSION=$KOPIA_VERSION" \
    -t "$image" "$root"
  [ "$push" = 1 ] && "$engine" push "$image"
  say "built $image with $engine$([ "$push" = 1 ] && echo ', pushed')"
}

oci_build() {
  local oci=$1 tag=$2 agent=$3 base=$4 check=$5
  [ "$(id -u)" = 0 ] || die "--oci needs root (mmdebstrap, chroot)"
  need_debs umoci
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/build-image.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  if [ -z "$base" ]; then base=$work/base.tar; make_base "$base"; fi
  [ -f "$base" ] || die "no root filesystem tarball at $base"
  if [ -z "$agent" ]; then
    (cd "$root" && cargo build --release --locked --bin podvolume-agent) || die "cargo build --release failed"
    agent=$root/target/release/podvolume-agent
  fi
  [ -x "$agent" ] || die "no agent binary at $agent"
  local kopia
  read -r _ kopia < <("$root/scripts/install-kopia.sh" "$KOPIA_VERSION") || die "scripts/install-kopia.sh $KOPIA_VERSION failed"
  local restic restic_version
  read -r restic_version restic < <("$root/scripts/install-restic.sh") || die "scripts/install-restic.sh failed"
  local version; version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)

  rm -rf "$oci"
  umoci init --layout "$oci"
  umoci new --image "$oci:$tag"
  umoci unpack --image "$oci:$tag" "$work/bundle" >/dev/null
  tar -C "$work/bundle/rootfs" -xf "$base"
  # Stripped: debug information is no use in the image (and the test builds carry a lot).
  install -m 0755 "$agent" "$work/bundle/rootfs/usr/local/bin/podvolume-agent"
  strip "$work/bundle/rootfs/usr/local/bin/podvolume-agent" 2>/dev/null || true
  install -m 0755 "$kopia" "$work/bundle/rootfs/usr/local/bin/kopia"
  install -m 0755 "$restic" "$work/bundle/rootfs/usr/local/bin/restic"
  umoci repack --image "$oci:$tag" "$work/bundle"
  umoci config --image "$oci:$tag" \
    --config.entrypoint /usr/bin/tini --config.entrypoint -- --config.entrypoint /usr/local/bin/podvolume-agent \
    --config.cmd run \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.label "org.opencontainers.image.title=podvolume-agent" \
    --config.label "org.opencontainers.image.version=$version" \
    --config.label "io.podvolume-agent.kopia-version=$KOPIA_VERSION" \
    --config.label "io.podvolume-agent.restic-version=$restic_version"
  umoci gc --layout "$oci"
  say "OCI image $oci:$tag ($(du -sh "$oci" | cut -f1)): podvolume-agent $version, kopia $KOPIA_VERSION, restic $restic_version, Debian $SUITE $PACKAGES"

  if [ "$check" = 1 ]; then
    umoci unpack --image "$oci:$tag" "$work/check" >/dev/null
    local r=$work/check/rootfs cfg=$work/check/config.json
    # The entrypoint as the image configures it, with --version instead of the command.
    mapfile -t entry < <(python3 -c 'import json,sys; a = json.load(open(sys.argv[1]))["process"]["args"]; print("\n".join(a[:-1]))' "$cfg")
    [ "${entry[*]}" = "/usr/bin/tini -- /usr/local/bin/podvolume-agent" ] \
      || die "check: the image's entrypoint is '${entry[*]}'"
    echo "  entrypoint: ${entry[*]}; command: run"
    # tini as PID 1 of a PID namespace of its own, as in a pod.
    inside() { unshare --pid --fork --kill-child chroot "$r" "$@"; }
    local out
    out=$(inside "${entry[@]}" --version) || die "check: the agent does not run in the image"
    echo "  $out"
    out=$(inside restic version) || die "check: restic does not run in the image"
    echo "  $out"
    out=$(inside kopia --version) || die "check: kopia does not run in the image"
    echo "  kopia ${out%%$'\n'*}"
    [ -s "$r/etc/ssl/certs/ca-certificates.crt" ] || die "check: no CA certificates in the image"
    echo "  CA certificates: $(grep -c 'BEGIN CERTIFICATE' "$r/etc/ssl/certs/ca-certificates.crt") in /etc/ssl/certs/ca-certificates.crt"
    say "check passed: the image's entrypoint, restic and kopia run inside it"
  fi
}

case "${1:-}" in
  "" | -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
  --base-only) [ -n "${2:-}" ] || die "--base-only TAR"; make_base "$2" ;;
  --oci)
    oci=${2:-}; [ -n "$oci" ] || die "--oci DIR"; shift 2
    tag=latest agent= base= check=0
    while [ $# -gt 0 ]; do
      case $1 in
        --tag) tag=$2; shift 2 ;;
        --agent) agent=$2; shift 2 ;;
        --base) base=$2; shift 2 ;;
        --check) check=1; shift ;;
        *) die "unknown argument: $1" ;;
      esac
    done
    oci_build "$oci" "$tag" "$agent" "$base" "$check"
    ;;
  -*) die "unknown argument: $1" ;;
  *) image=$1 push=0; [ "${2:-}" = --push ] && push=1; engine_build "$image" "$push" ;;
esac
exit 0
}
