#!/usr/bin/env bash
# Renders a run's report page in headless Chromium and saves a screenshot:
#   scripts/report_screenshot.sh RUN_DIR [OUT.png]
# (writes RUN_DIR/report.html with `vqad report` first). Needs the chromium package.
set -euo pipefail
run_dir=${1:?usage: scripts/report_screenshot.sh RUN_DIR [OUT.png]}
out=${2:-$run_dir/report.png}
vqad=${VQAD:-build/vqad}
command -v chromium >/dev/null || { echo "report_screenshot: chromium is not installed (apt-get install chromium)" >&2; exit 1; }
"$vqad" report "$run_dir"
html=$(cd "$run_dir" && pwd)/report.html
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,1800 \
  --screenshot="$out" "file://$html" 2>/dev/null
echo "report_screenshot: $out"
