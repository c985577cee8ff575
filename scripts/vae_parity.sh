#!/usr/bin/env bash
# Wan VAE decoder parity with Diffusers' AutoencoderKLWan (fp32, rel-L2 <= 1e-4 per frame)
# on random-weight small configs and the real Wan2.1 VAE config. Creates (once) a venv under
# ~/.cache/vqad with torch, diffusers, numpy and safetensors from PyPI (a few GB; not part of
# the default test run), builds vqad if needed, and runs tests/tools/vae_parity.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VQAD_CACHE_DIR:-$HOME/.cache/vqad}/venv-parity
if ! "$VENV/bin/python" -c 'import diffusers, torch, safetensors, numpy' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 diffusers numpy safetensors
fi
BUILD=${VQAD_BUILD_DIR:-build}
[ -x "$BUILD/vqad" ] || bash scripts/bootstrap.sh
"$VENV/bin/python" tests/tools/vae_parity.py "$PWD/$BUILD/vqad" "${1:-$(mktemp -d)}"
