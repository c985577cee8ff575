#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds and runs the CPU test suite (CTest,
# everything except the "gpu" label). This is the README's test command and CI's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Headless Chromium renders the run report in one test (it skips without the browser).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing chromium (the run-report rendering test)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
    echo "test: warning: chromium could not be installed; the report rendering test will skip"
fi
ctest --test-dir "${VQAD_BUILD_DIR:-build}" -LE gpu --output-on-failure -j"$(nproc)" "$@"
