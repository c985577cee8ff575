#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds, and runs the main job on its built-in
# default: `vqad demo`, the QAD recipe at tiny scale on synthetic data (CPU, a few
# minutes). Extra arguments go to `vqad demo` (e.g. --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
VQAD_BUILD_TARGETS=vqad bash scripts/bootstrap.sh
exec "${VQAD_BUILD_DIR:-build}/vqad" demo "$@"
