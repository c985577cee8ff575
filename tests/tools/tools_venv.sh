#!/usr/bin/env bash
# Prints the interpreter of a small venv holding numpy and safetensors for the
# independent tools in tests/tools (created on first use under $VQAD_CACHE_DIR,
# default ~/.cache/vqad, the way scripts/bootstrap.sh makes its venv). When python3,
# venv or the package index is not available it prints why on stderr and exits 77
# (the tests that need it then skip with that message).
set -u
NUMPY_VERSION=2.2.6
SAFETENSORS_VERSION=0.7.0
CACHE_DIR=${VQAD_CACHE_DIR:-$HOME/.cache/vqad}
VENV=$CACHE_DIR/venv-tools-numpy$NUMPY_VERSION-safetensors$SAFETENSORS_VERSION

has_pkgs() { "$1" -c 'import numpy, safetensors' >/dev/null 2>&1; }

if [ -x "$VENV/bin/python" ] && has_pkgs "$VENV/bin/python"; then
  echo "$VENV/bin/python"
  exit 0
fi
command -v python3 >/dev/null 2>&1 || { echo "tools venv: no python3 on PATH" >&2; exit 77; }
mkdir -p "$CACHE_DIR" || { echo "tools venv: cannot create $CACHE_DIR" >&2; exit 77; }
rm -rf "$VENV"
if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
  rm -rf "$VENV"
  echo "tools venv: python3 -m venv failed (install python3-venv)" >&2
  exit 77
fi
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
    "numpy==$NUMPY_VERSION" "safetensors==$SAFETENSORS_VERSION" >"$VENV/install.log" 2>&1; then
  echo "tools venv: pip could not install numpy==$NUMPY_VERSION safetensors==$SAFETENSORS_VERSION" \
       "($(tail -n 1 "$VENV/install.log"))" >&2
  rm -rf "$VENV"
  exit 77
fi
has_pkgs "$VENV/bin/python" || { echo "tools venv: $VENV is unusable after install" >&2; exit 77; }
echo "$VENV/bin/python"
