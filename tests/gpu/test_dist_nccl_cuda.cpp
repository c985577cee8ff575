// The NCCL backend of vqad's process groups (dist/nccl_backend.cpp) on one GPU. NCCL refuses
// two ranks on one device, so a single GPU can only form a world of one; through
// `vqad launch --nproc 1 dist check --device cuda` that world still runs every collective
// vqad uses (all-reduce sum / avg / max, broadcast, all-gather of fp32 and bf16,
// reduce-scatter, all-to-all, barrier) on CUDA tensors through ProcessGroupNCCL, plus the Wan
// model under Ulysses (dense and VSA_TRAIN, with and without block checkpointing) and under
// sharded data parallelism (fp32 and BF16 gathers), each against the unsharded model. What
// this catches: an nccl.h of another generation than the library inside the wheel
// (ProcessGroupNCCL::Options embeds ncclConfig_t), a collective on the wrong stream or
// device, a dtype NCCL does not take. What it cannot: anything that needs a second rank.
#include <gtest/gtest.h>

#include <string>

#include "tests/support/cli.h"
#include "vqad/dist/backend.h"

namespace {

using vqad::test::has;
using vqad::test::run_vqad_scratch;

TEST(DistNcclCuda, LaunchedWorldOfOnePassesEveryCheck) {
  ASSERT_TRUE(vqad::dist::nccl_available()) << "this CUDA build of vqad has no NCCL backend";
  const auto r = run_vqad_scratch("launch --nproc 1 dist check --device cuda --timeout 120", "nccl_world1");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(has(r.output, "dist check: rank 0 of 1 (NCCL): 20 checks passed")) << r.output;
}

}  // namespace
