// `vqad bench step` command line: options are validated before any GPU work, and a
// build without LibTorch's CUDA libraries refuses the command instead of running
// something else. The timed step itself runs on a GPU machine only.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/cli.h"

namespace {

namespace fs = std::filesystem;

using vqad::test::CliResult;
using vqad::test::has;
CliResult run_vqad(const std::string& args) { return vqad::test::run_vqad_scratch(args, "bench_step"); }

TEST(BenchStepCli, HelpListsTheOptions) {
  const CliResult r = run_vqad("bench step --help");
  EXPECT_EQ(r.rc, 0) << r.output;
  for (const char* opt : {"--attention", "--linears", "--steps", "--layers", "--out", "--no-baseline"})
    EXPECT_TRUE(has(r.output, opt)) << opt << "\n" << r.output;
}

TEST(BenchStepCli, UnknownLinearsValueIsAnError) {
  const CliResult r = run_vqad("bench step --linears int8 --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--linears")) << r.output;
  EXPECT_TRUE(has(r.output, "'int8'")) << r.output;
  EXPECT_TRUE(has(r.output, "nvfp4, dense")) << r.output;
}

// The VSA backends pass the option checks (on a CPU build the run then stops at the GPU
// requirement, not at the backend); an unknown backend and a sparsity outside [0, 1) are
// refused naming the flag.
TEST(BenchStepCli, VsaBackendsAreAcceptedAndBadValuesRefused) {
  CliResult r = run_vqad("bench step --attention VSA_QAT_TRAIN_C128 --sparsity 0.9 --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_FALSE(has(r.output, "--attention")) << r.output;
  r = run_vqad("bench step --attention NOT_A_BACKEND --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "NOT_A_BACKEND")) << r.output;
  r = run_vqad("bench step --attention VSA_TRAIN --sparsity 1.5 --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--sparsity")) << r.output;
}

TEST(BenchStepCli, UnknownAttentionNameIsAnError) {
  const CliResult r = run_vqad("bench step --attention SAGE --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "SAGE")) << r.output;
  EXPECT_TRUE(has(r.output, "--attention")) << r.output;
}

// --qat-full-nograd-forward adds a second configuration of each QAT backend (ATTN_QAT_TRAIN,
// VSA_QAT_TRAIN_*); with none to add it to, it is refused instead of ignored.
TEST(BenchStepCli, FullNogradForwardNeedsTheQatBackend) {
  const CliResult r = run_vqad("bench step --attention TORCH_SDPA --qat-full-nograd-forward --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--qat-full-nograd-forward")) << r.output;
  EXPECT_TRUE(has(r.output, "TORCH_SDPA")) << r.output;
  const CliResult bf16_vsa = run_vqad("bench step --attention VSA_TRAIN_C128 --qat-full-nograd-forward --layers 1");
  EXPECT_EQ(bf16_vsa.rc, 1) << bf16_vsa.output;
  EXPECT_TRUE(has(bf16_vsa.output, "--qat-full-nograd-forward")) << bf16_vsa.output;
}

TEST(BenchStepCli, BadStepCountIsAnError) {
  const CliResult r = run_vqad("bench step --steps 0 --layers 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--steps")) << r.output;
}

#ifndef VQAD_WITH_TORCH_CUDA
TEST(BenchStepCli, CpuBuildRefusesTheCommand) {
  const CliResult r = run_vqad("bench step --layers 1 --steps 1");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "needs a GPU build")) << r.output;
}
#endif

}  // namespace
