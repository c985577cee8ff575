// `vqad bench attention` command line: the shapes are validated before any GPU work (a
// build without LibTorch's CUDA libraries checks them, then refuses the command). The
// timed runs happen on a GPU machine only.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

struct CliResult {
  int rc;
  std::string output;
};

CliResult run_vqad(const std::string& args) {
  const fs::path dir = fs::temp_directory_path() / ("vqad_test_bench_attention_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path log = dir / "cli.log";
  const std::string cmd = std::string(VQAD_BINARY) + " " + args + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  fs::remove_all(dir);
  return {WEXITSTATUS(status), ss.str()};
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

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
