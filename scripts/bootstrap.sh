#!/usr/bin/env bash
# Takes a fresh Debian/Ubuntu machine (root, Debian packages + PyPI reachable) to a
# built vqad tree, or reuses what is already there:
#   1. system packages (only those missing)
#   2. LibTorch + Arrow: a machine whose python3 already has torch and pyarrow (a GPU
#      machine) uses them and installs nothing; otherwise a venv in a cache directory
#      outside the checkout (reused by later runs) holds only the torch and pyarrow wheels
#   3. configure (CMake + Ninja) and build
# Environment:
#   VQAD_BUILD_DIR   build directory (default: build)
#   VQAD_CUDA_ARCHS  CUDA targets, e.g. "90a" (default: 90a;100a;120a)
#   VQAD_CACHE_DIR   where the venv lives (default: ~/.cache/vqad)
#   VQAD_PYTHON      use this interpreter's torch/pyarrow and skip the venv
#   VQAD_BUILD_TARGETS  targets to build (default: all)
#   VQAD_PLAYGROUND=ON  also configure the kernel playgrounds (target vqad_playgrounds)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
PYARROW_VERSION=26.0.1
BUILD_DIR=${VQAD_BUILD_DIR:-build}
CACHE_DIR=${VQAD_CACHE_DIR:-$HOME/.cache/vqad}
say() { printf '[bootstrap] %s\n' "$*"; }
t0=$(date +%s)

# --- 1. system packages -------------------------------------------------------
# Each package is probed by what vqad needs from it (a command or a header), so a
# machine that has the tool from elsewhere (e.g. cmake from pip) installs nothing.
have() {
  case "$1" in
    build-essential) command -v g++ >/dev/null && command -v make >/dev/null ;;
    cmake) command -v cmake >/dev/null ;;
    ninja-build) command -v ninja >/dev/null ;;
    ccache) command -v ccache >/dev/null ;;
    git) command -v git >/dev/null ;;
    python3) command -v python3 >/dev/null ;;
    python3-venv) python3 -c 'import venv, ensurepip' >/dev/null 2>&1 ;;
    libyaml-cpp-dev) [ -f /usr/include/yaml-cpp/yaml.h ] ;;
    nlohmann-json3-dev) [ -f /usr/include/nlohmann/json.hpp ] ;;
    libcli11-dev) [ -f /usr/include/CLI/CLI.hpp ] ;;
    libgtest-dev) [ -f /usr/include/gtest/gtest.h ] ;;
    pkg-config) command -v pkg-config >/dev/null ;;
    libgloo-dev) [ -f /usr/include/gloo/rendezvous/store.h ] ;;
    *) dpkg -s "$1" >/dev/null 2>&1 ;;
  esac
}
PKGS="build-essential cmake ninja-build ccache git python3 python3-venv pkg-config libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgloo-dev libavcodec-dev libavformat-dev libswscale-dev ffmpeg"
missing=""
for p in $PKGS; do have "$p" || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing system packages:$missing"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null; }; then
      say "warning: could not install:$missing (configuration below fails clearly if one is required)"
    fi
  else
    say "warning: missing system packages:$missing (not root or no apt-get; continuing)"
  fi
else
  say "system packages: all present"
fi

# --- 2. LibTorch and Arrow from the wheels --------------------------------------
has_wheels() { "$1" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") and u.find_spec("pyarrow") else 1)' 2>/dev/null; }
if [ -n "${VQAD_PYTHON:-}" ]; then
  PY=$VQAD_PYTHON; say "using VQAD_PYTHON=$PY"
elif has_wheels python3; then
  PY=$(command -v python3); say "using preinstalled torch/pyarrow of $PY (nothing installed)"
else
  VENV=$CACHE_DIR/venv-torch$TORCH_VERSION-pyarrow$PYARROW_VERSION
  if [ -x "$VENV/bin/python" ] && has_wheels "$VENV/bin/python"; then
    say "reusing venv $VENV"
  else
    say "creating venv $VENV with torch==$TORCH_VERSION pyarrow==$PYARROW_VERSION (wheels only, no dependencies)"
    mkdir -p "$CACHE_DIR"
    python3 -m venv "$VENV"
    # --no-deps: only the C++ libraries inside the wheels are used; torch's CUDA
    # runtime packages are not needed to build or to run on CPU.
    "$VENV/bin/pip" install -q --no-deps "torch==$TORCH_VERSION" "pyarrow==$PYARROW_VERSION"
  fi
  PY=$VENV/bin/python
fi

# --- 3. configure and build ----------------------------------------------------------
torch_cuda=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_cuda=ON   # a GPU machine: link LibTorch's CUDA libraries
fi
ARCHS=${VQAD_CUDA_ARCHS:-90a;100a;120a}
say "configuring $BUILD_DIR (python=$PY, torch CUDA=$torch_cuda, CUDA archs=$ARCHS)"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${VQAD_BUILD_TYPE:-RelWithDebInfo} \
  -DVQAD_PYTHON="$PY" -DVQAD_TORCH_CUDA=$torch_cuda "-DVQAD_CUDA_ARCHS=$ARCHS" \
  -DVQAD_PLAYGROUND=${VQAD_PLAYGROUND:-OFF} >/dev/null
say "building ($(nproc) jobs)"
cmake --build "$BUILD_DIR" -j"$(nproc)" ${VQAD_BUILD_TARGETS:+--target $VQAD_BUILD_TARGETS}
say "done in $(( $(date +%s) - t0 )) s: $BUILD_DIR/vqad"
