#!/usr/bin/env bash
# Installs the S3 server the object-storage tests run against: moto's server mode (PyPI package
# `moto[server]`, pinned), into a private virtual environment under the build directory. The
# system Python is not changed. Idempotent: a venv that already has this version is kept.
#
#   scripts/install-moto.sh            # -> target/test-tools/moto/bin/moto_server
#
# The tests find the server through PODVOLUME_MOTO_SERVER (default: the path above) and fail,
# naming this script, when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

MOTO_VERSION=5.2.5
venv="${PODVOLUME_MOTO_VENV:-target/test-tools/moto}"

if [ -x "$venv/bin/moto_server" ] &&
  [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("moto"))' 2>/dev/null)" = "$MOTO_VERSION" ]; then
  echo "moto $MOTO_VERSION already installed in $venv"
  exit 0
fi

python=$(command -v python3 || true)
if [ -z "$python" ]; then
  echo "install-moto: python3 is needed (Debian: apt-get install python3 python3-venv)" >&2
  exit 1
fi
# Debian splits venv support out of python3.
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  if command -v apt-get >/dev/null; then
    apt-get install -y python3-venv || { apt-get update && apt-get install -y python3-venv; }
  else
    echo "install-moto: python3's venv module (with ensurepip) is needed" >&2
    exit 1
  fi
fi

rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION"
"$venv/bin/moto_server" --help >/dev/null
echo "moto $MOTO_VERSION installed in $venv ($venv/bin/moto_server)"
