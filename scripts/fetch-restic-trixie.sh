#!/usr/bin/env bash
# Fetches restic from Debian's `trixie` suite (0.18) for the tests, without touching the machine's
# package sources: only the `restic` package is downloaded, from the Debian archive the machine's
# apt sources already name, verified along Debian's chain of trust, and unpacked under
# target/test-tools/. Debian's own `restic` (0.14 on bookworm) stays the one on PATH.
#
#   scripts/fetch-restic-trixie.sh          # prints the path of the unpacked binary
#
# Chain of trust: dists/trixie/InRelease must carry a valid signature by a key of
# /usr/share/keyrings/debian-archive-keyring.gpg (gpgv); the SHA256 of Packages.xz is taken from
# the signed part only; the .deb's SHA256 from that Packages file. Nothing unverified is unpacked.
# Idempotent: when the binary is already there and still has the hash recorded when it was
# unpacked from a verified package, nothing is downloaded.
#
# Needs: curl, gpgv, xz, dpkg-deb, sha256sum, debian-archive-keyring (scripts/test.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

suite=trixie
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
dest=target/test-tools/restic-$suite
bin=$dest/root/usr/bin/restic

if [ -x "$bin" ] && [ -f "$dest/restic.sha256" ] &&
  [ "$(sha256sum "$bin" | cut -d' ' -f1)" = "$(cat "$dest/restic.sha256")" ]; then
  echo "$PWD/$bin"
  exit 0
fi

for tool in curl gpgv xz dpkg-deb sha256sum; do
  command -v "$tool" >/dev/null || { echo "fetch-restic-trixie: $tool is missing" >&2; exit 1; }
done
[ -f "$keyring" ] || { echo "fetch-restic-trixie: $keyring is missing (package debian-archive-keyring)" >&2; exit 1; }
arch=$(dpkg --print-architecture)

# The archive URIs of the machine's apt sources (deb822 .sources and one-line .list files), in
# order; the first one that serves a verifiable dists/trixie/InRelease is used.
uris() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    # deb [options] URI suite components...
    sed -n -E 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # Stanzas whose Types include deb; URIs may list several.
    awk 'BEGIN { IGNORECASE = 1 }
         /^[[:space:]]*$/ { if (deb) print uris; deb = 0; uris = ""; next }
         /^Types:/ { if ($0 ~ /[[:space:]]deb([[:space:]]|$)/) deb = 1 }
         /^URIs:/ { sub(/^URIs:[[:space:]]*/, ""); uris = $0 }
         END { if (deb) print uris }' "$f" | tr ' ' '\n'
  done
}

work=$(mktemp -d -t fetch-restic-XXXXXX)
trap 'rm -rf "$work"' EXIT

base=
while read -r uri; do
  [ -n "$uri" ] || continue
  uri=${uri%/}
  case $uri in http://* | https://*) ;; *) continue ;; esac
  if curl -fsSL --retry 3 -o "$work/InRelease" "$uri/dists/$suite/InRelease" 2>/dev/null &&
    gpgv --keyring "$keyring" --output "$work/Release" "$work/InRelease" 2>"$work/gpgv.log"; then
    base=$uri
    break
  fi
done < <(uris | awk '!seen[$0]++')
if [ -z "$base" ]; then
  echo "fetch-restic-trixie: no archive of the apt sources serves a verifiable dists/$suite/InRelease" >&2
  [ -f "$work/gpgv.log" ] && cat "$work/gpgv.log" >&2
  exit 1
fi

# SHA256 of main/binary-<arch>/Packages.xz, from the signed Release text only.
index=main/binary-$arch/Packages.xz
want=$(awk -v f="$index" '/^SHA256:/ { s = 1; next } /^[^ ]/ { s = 0 } s && $3 == f { print $1 }' "$work/Release")
[ -n "$want" ] || { echo "fetch-restic-trixie: $index not in the signed Release of $suite" >&2; exit 1; }
curl -fsSL --retry 3 -o "$work/Packages.xz" "$base/dists/$suite/$index"
echo "$want  $work/Packages.xz" | sha256sum -c --quiet - ||
  { echo "fetch-restic-trixie: $index does not match its signed hash" >&2; exit 1; }

# The restic stanza: Filename and SHA256 of the .deb.
read -r filename sha version < <(xz -dc "$work/Packages.xz" | awk '
  /^Package: / { p = ($2 == "restic") }
  p && /^Filename: / { f = $2 }
  p && /^SHA256: / { h = $2 }
  p && /^Version: / { v = $2 }
  /^$/ { if (p && f != "") { print f, h, v; exit } p = 0 }')
[ -n "${filename:-}" ] && [ -n "${sha:-}" ] ||
  { echo "fetch-restic-trixie: no restic package in $suite main/$arch" >&2; exit 1; }
case $filename in pool/*) ;; *) echo "fetch-restic-trixie: unexpected Filename $filename" >&2; exit 1 ;; esac
curl -fsSL --retry 3 -o "$work/restic.deb" "$base/$filename"
echo "$sha  $work/restic.deb" | sha256sum -c --quiet - ||
  { echo "fetch-restic-trixie: $filename does not match the hash in Packages" >&2; exit 1; }

rm -rf "$dest"
mkdir -p "$dest"
dpkg-deb -x "$work/restic.deb" "$dest/root"
[ -x "$bin" ] || { echo "fetch-restic-trixie: the package has no usr/bin/restic" >&2; exit 1; }
echo "$version" >"$dest/package-version"
sha256sum "$bin" | cut -d' ' -f1 >"$dest/restic.sha256"
echo "fetch-restic-trixie: restic $version unpacked ($("$bin" version))" >&2
echo "$PWD/$bin"
