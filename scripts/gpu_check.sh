#!/usr/bin/env bash
# The one command for a GPU machine: build with the machine's torch (CUDA
# LibTorch), run the GPU-labelled tests and the CPU tests, run the benchmarks,
# and print a short table last. Results (logs, benchmark JSON) go to
# ${OUT:-out/gpu_check}.
#   VQAD_GPU_TESTS=0      skip the GPU-labelled tests
#   VQAD_GPU_BENCH=0      skip the benchmarks
#   VQAD_GPU_BENCHES=".."  which benchmarks (default: quant linear fused attention step dmd2)
#   VQAD_GPU_CPU_TESTS=0  skip the CPU test suite
#   VQAD_BENCH_TIMEOUT=s  per-benchmark time limit (default 300)
# A second run on the same machine reuses the build directory (ninja no-op), so the
# work can be split over two calls, e.g. tests + kernel benches, then step + dmd2.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-out/gpu_check}
mkdir -p "$RESULTS"
export VQAD_BUILD_DIR=${VQAD_BUILD_DIR:-build-gpu}
export VQAD_CUDA_ARCHS=${VQAD_CUDA_ARCHS:-90a}
# The kernel playgrounds (bench/playground) are part of the default build here, so they
# cannot drift from the product kernels (VQAD_PLAYGROUND=OFF leaves them out).
export VQAD_PLAYGROUND=${VQAD_PLAYGROUND:-ON}
declare -a ROWS
row() { ROWS+=("$(printf '%-34s %-8s %s' "$1" "$2" "$3")"); }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RESULTS/gpu.txt"
t0=$(date +%s)
if bash scripts/bootstrap.sh > "$RESULTS/build.log" 2>&1; then
  row "build ($VQAD_CUDA_ARCHS)" ok "$(( $(date +%s) - t0 )) s"
else
  row "build ($VQAD_CUDA_ARCHS)" FAIL "see build.log"; tail -40 "$RESULTS/build.log"
  printf '%s\n' "${ROWS[@]}"; exit 1
fi
B=$VQAD_BUILD_DIR
"$B/vqad" env | tee "$RESULTS/env.txt"

run_ctest() {  # label-args name
  local name=$1; shift
  local t=$(date +%s)
  if ctest --test-dir "$B" "$@" --output-on-failure --timeout 900 > "$RESULTS/$name.log" 2>&1; then
    row "$name" ok "$(grep -E 'tests passed' "$RESULTS/$name.log" | tail -1) ($(( $(date +%s) - t )) s)"
  else
    row "$name" FAIL "$(grep -E 'tests passed|tests failed' "$RESULTS/$name.log" | tail -1)"
    grep -E "^\s+[0-9]+ - |Failure|error" "$RESULTS/$name.log" | head -30
  fi
}
[ "${VQAD_GPU_TESTS:-1}" = 1 ] && run_ctest gpu-tests -L gpu

if [ "${VQAD_GPU_BENCH:-1}" = 1 ]; then
  for b in ${VQAD_GPU_BENCHES:-quant linear fused attention step dmd2}; do
    if "$B/vqad" bench "$b" --help > /dev/null 2>&1; then
      if timeout "${VQAD_BENCH_TIMEOUT:-300}" "$B/vqad" bench "$b" --out "$RESULTS/bench_$b" > "$RESULTS/bench_$b.txt" 2>&1; then
        row "bench $b" ok "$RESULTS/bench_$b.txt"
      else
        row "bench $b" FAIL "$(tail -1 "$RESULTS/bench_$b.txt")"
      fi
      cat "$RESULTS/bench_$b.txt"
    else
      row "bench $b" absent "subcommand not built"
    fi
  done
fi
[ "${VQAD_GPU_CPU_TESTS:-1}" = 1 ] && run_ctest cpu-tests -LE gpu -j"$(nproc)"
echo
echo "== vqad gpu_check ($(( $(date +%s) - t0 )) s) =="
printf '%s\n' "${ROWS[@]}"
