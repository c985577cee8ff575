#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds and runs the CPU test suite (CTest,
# everything except the "gpu" label). This is the README's test command and CI's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
ctest --test-dir "${VQAD_BUILD_DIR:-build}" -LE gpu --output-on-failure -j"$(nproc)" "$@"
