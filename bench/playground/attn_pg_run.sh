#!/usr/bin/env bash
# Side-by-side variants of the ATTN_QAT_TRAIN Hopper kernels through the standalone
# playgrounds (nvcc only, no CMake, no torch): builds every variant, times them at the
# benchmark shapes, checks them against the CPU reference (fresh random inputs, ragged
# tails, Nq != Nkv, NaN-poisoned outputs; backward: determinism and the dV metric) and
# profiles forward variants with Nsight Compute when it is installed. Everything is
# appended to $OUT/summary.txt. Run from the repository root on an sm_90 machine:
#   OUT=/tmp/attn_pg bash bench/playground/attn_pg_run.sh
# Variants are compile-time knobs of the kernel sources (see the VQAD_ATTN_FWD_* and
# VQAD_ATTN_BWD_* macros); FV / BV select them, "dflt" is the source as configured.
# BASE_REV=<git revision> adds a "base" variant built from that revision's kernel
# sources (against the current headers).
set -u
OUT=${OUT:-/tmp/attn_pg_out}
mkdir -p "$OUT"
B=/tmp/attn_pg; L=$B/logs
mkdir -p $B $L
NV="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc"
FWD=src/vqad/kernels/attention/sm90/attn_qat_fwd_sm90.cu
BWD=src/vqad/kernels/attention/sm90/attn_qat_bwd_wgmma.cu
S="$OUT/summary.txt"
log() { echo "$@" | tee -a "$S"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader | tee -a "$S"
t0=$(date +%s)
$NV -c src/vqad/kernels/common/device.cu -o $B/device.o &
$NV -c src/vqad/numerics/attention_qat_ref.cpp -o $B/ref.o &
$NV -c src/vqad/numerics/nvfp4.cpp -o $B/nvfp4.o &
$NV -c src/vqad/kernels/attention/fake_quant_qkv.cu -o $B/fq.o &
$NV -c bench/playground/attn_fwd_playground.cu -o $B/fpg.o &
$NV -c bench/playground/attn_bwd_playground.cu -o $B/bpg.o &
$NV -c src/vqad/kernels/attention/sm90/attn_qat_bwd.cu -o $B/bwdm.o &
FV=${FV:-"dflt u0 s0"}
BV=${BV:-"dflt"}
declare -A FF=(
  [dflt]=""
  [s0]="-DVQAD_ATTN_FWD_SKEW=0"                 # both warpgroups in step, K/V double buffered
  [k2]="-DVQAD_ATTN_FWD_SKEW_GROUPS=2"
  [k6]="-DVQAD_ATTN_FWD_SKEW_GROUPS=6"
  [g2]="-DVQAD_ATTN_FWD_GROUP_STEP=2"
  [hm]="-DVQAD_ATTN_FWD_ROWSUM_WGMMA=0"         # row sums by mma.sync
  [u0]="-DVQAD_ATTN_FWD_UNIFIED=0"              # one loop body per warpgroup
)
declare -A BF=(
  [dflt]=""
  [nt]="-DVQAD_ATTN_BWD_SCALE_TABLE=0"
  [rc]="-DVQAD_ATTN_BWD_DQ_ORDERED=0"           # dQ by the recompute pass (7 GEMMs)
  [d2]="-DVQAD_ATTN_BWD_DQ_STAGES=2"            # two dQ staging buffers
  [ts0]="-DVQAD_ATTN_BWD_TAIL_SPLIT=0"          # no tail split (last partial wave runs whole CTAs)
  [w128]="-DVQAD_ATTN_BWD_SEM_SLEEP_NS=128"      # turn wait back-off (default 32 ns)
)
if [ -n "${BASE_REV:-}" ] && git rev-parse --verify -q "$BASE_REV" > /dev/null; then
  git show "$BASE_REV:$FWD" > $B/fwd_base.cu && git show "$BASE_REV:$BWD" > $B/bwd_base.cu
  FV="base $FV"; BV="base $BV"
fi
for v in $FV; do
  if [ "$v" = base ]; then src=$B/fwd_base.cu; fl=""; else src=$FWD; fl=${FF[$v]}; fi
  $NV -Xptxas -v $fl -c $src -o $B/f_$v.o > $L/ptxas_f_$v.txt 2>&1 &
done
for v in $BV; do
  if [ "$v" = base ]; then src=$B/bwd_base.cu; fl=""; else src=$BWD; fl=${BF[$v]}; fi
  $NV -Xptxas -v $fl -c $src -o $B/b_$v.o > $L/ptxas_b_$v.txt 2>&1 &
done
wait
for v in $FV; do
  $NV $B/fpg.o $B/f_$v.o $B/fq.o $B/device.o $B/ref.o $B/nvfp4.o -o $B/fwd_$v || log "link fwd_$v failed"
  log "ptxas f_$v: $(grep -E 'registers|spill|C75' $L/ptxas_f_$v.txt | grep -v '0 bytes spill' | tr '\n' ' ' | cut -c1-300)"
done
for v in $BV; do
  $NV $B/bpg.o $B/bwdm.o $B/b_$v.o $B/device.o $B/ref.o $B/nvfp4.o -o $B/bwd_$v || log "link bwd_$v failed"
done
log "build done in $(( $(date +%s) - t0 )) s"
for v in $FV; do log "== fwd $v time"; timeout 60 $B/fwd_$v time 2>&1 | grep -E "fwd_|pre" | tee -a "$S"; done
for v in $BV; do log "== bwd $v time"; timeout 60 $B/bwd_$v time impl=wgmma 2>&1 | grep -E "^\(" | tee -a "$S"; done
for v in $FV; do log "== fwd $v again: $(timeout 60 $B/fwd_$v time 2>&1 | grep fwd_qat | head -1)"; done
for v in $BV; do log "== bwd $v again: $(timeout 30 $B/bwd_$v time impl=wgmma quick 2>&1 | grep -E '^\(' | head -1)"; done
log "timings done at $(( $(date +%s) - t0 )) s"
for v in $FV; do (timeout 120 $B/fwd_$v check > $L/check_f_$v.txt 2>&1; echo "rc=$?" >> $L/check_f_$v.txt) & done
for v in $BV; do (timeout 150 $B/bwd_$v check impl=wgmma > $L/check_b_$v.txt 2>&1; echo "rc=$?" >> $L/check_b_$v.txt) & done
wait
for f in $L/check_*.txt; do log "== $(basename $f)"; cat $f >> "$S"; grep -E "FAIL|rc=|check:|PASSED|FAILED" $f; done
log "checks done at $(( $(date +%s) - t0 )) s"
if command -v ncu > /dev/null; then
  for v in ${NCU:-dflt}; do
    log "== ncu fwd $v"
    timeout 60 ncu --kernel-name regex:attn_qat_fwd_kernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      $B/fwd_$v time 2>&1 | grep -vE "^\s*$|^==PROF==|fwd_|prepass|shape|----|OPT|INF|WRN|^ {10}" | cut -c1-110 | head -80 | tee -a "$S"
  done
fi
log "all done at $(( $(date +%s) - t0 )) s"
