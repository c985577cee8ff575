// `vqad bench attention` command line: the shapes are validated before any GPU work (a
// build without LibTorch's CUDA libraries checks them, then refuses the command). The
// timed runs happen on a GPU machine only.
#include <gtest/gtest.h>

#include <string>

#include "tests/support/cli.h"

namespace {

using vqad::test::CliResult;
using vqad::test::has;
CliResult run_vqad(const std::string& args) { return vqad::test::run_vqad_scratch(args, "bench_attention"); }

TEST(BenchAttentionCli, HelpNamesTheHeadDims) {
  const CliResult r = run_vqad("bench attention --help");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_TRUE(has(r.output, "B,H,L or B,H,L,D")) << r.output;
  EXPECT_TRUE(has(r.output, "128 or 64")) << r.output;
}

// A head dim the kernels do not take and a malformed shape are one-line errors naming the
// flag's value; they are reported before the build's GPU requirement.
TEST(BenchAttentionCli, BadShapesAreRefusedNamingTheValue) {
  CliResult r = run_vqad("bench attention --shape 1,3,1000,96");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--shape '1,3,1000,96'")) << r.output;
  EXPECT_TRUE(has(r.output, "D must be 64 or 128, found 96")) << r.output;
  r = run_vqad("bench attention --shape 1,3,1000,64,2");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "must be B,H,L or B,H,L,D with positive integers")) << r.output;
  r = run_vqad("bench attention --shape 1,0,1000");
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--shape '1,0,1000'")) << r.output;
}

}  // namespace
