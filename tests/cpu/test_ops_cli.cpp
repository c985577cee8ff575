// The CLI's failure behaviour: one line per failure ("vqad: error: ..."), never a torch
// stack trace or an "internal error" for a user fault; "did you mean" for misspelt
// subcommands and flags; SIGTERM writes the final checkpoint and exits cleanly; progress
// lines for batch jobs.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct Result {
  int rc = 0;
  std::string out;
};

Result run_cli(const std::string& args) {
  const std::string cmd = std::string(VQAD_BINARY) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  Result r;
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) r.out += buf;
  const int status = ::pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A user fault: exit code 1 and one error line, "vqad: error: ...", the last line of the
// output (log lines before it are fine), with no torch backtrace and no "internal error".
void expect_one_line_error(const Result& r, const std::string& part) {
  EXPECT_EQ(r.rc, 1) << r.out;
  std::vector<std::string> lines;
  std::istringstream is(r.out);
  for (std::string l; std::getline(is, l);) lines.push_back(l);
  ASSERT_FALSE(lines.empty());
  int errors = 0;
  for (const auto& l : lines) errors += l.rfind("vqad: error: ", 0) == 0;
  EXPECT_EQ(errors, 1) << r.out;
  EXPECT_EQ(lines.back().rfind("vqad: error: ", 0), 0u) << r.out;
  EXPECT_NE(lines.back().find(part), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("frame #"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Exception raised from"), std::string::npos) << r.out;
}

struct CliFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_opscli");
    test_train::write_tiny_dataset(root / "data", 8, 2);
  }
  void TearDown() override { fs::remove_all(root); }
  std::string config(long steps, long save, const std::string& out) const {
    const fs::path cfg = root / ("c" + std::to_string(steps) + ".yaml");
    std::ofstream(cfg) << "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
                          "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
                          "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
                          "training:\n  data:\n    data_path: "
                       << (root / "data").string() << "\n    train_batch_size: 2\n"
                       << "  optimizer:\n    learning_rate: 1.0e-3\n"
                       << "  loop:\n    max_train_steps: " << steps << "\n  checkpoint:\n    output_dir: " << out
                       << "\n    training_state_checkpointing_steps: " << save << "\n";
    return cfg.string();
  }
};

}  // namespace

TEST(OpsCli, MisspeltSubcommandsAndFlagsGetDidYouMean) {
  auto r = run_cli("tarin x.yaml");
  expect_one_line_error(r, "did you mean 'train'?");
  r = run_cli("data synht /tmp/x");
  expect_one_line_error(r, "did you mean 'synth'?");
  r = run_cli("export --overwrit a b");
  expect_one_line_error(r, "did you mean '--overwrite'?");
  r = run_cli("train x.yaml --dry-rnu");
  expect_one_line_error(r, "did you mean '--dry-run'?");
}

TEST_F(CliFixture, EnvironmentAndFileFaultsAreOneLine) {
  // Output directory that is a file.
  std::ofstream(root / "a_file") << "x";
  expect_one_line_error(run_cli("train " + config(2, 1, (root / "a_file" / "run").string()) + " --device cpu"),
                        "is not a directory");
  // A checkpoint whose optimizer state and trainer state are malformed but whose metadata
  // was re-signed over them (integrity passes; the reader must still fail in one line).
  const std::string out = (root / "run").string();
  ASSERT_EQ(run_cli("train " + config(1, 1, out) + " --device cpu --no-progress").rc, 0);
  const fs::path ck = fs::path(out) / "checkpoint-1";
  std::ofstream(ck / "student" / "optimizer.safetensors") << "garbage, not safetensors";
  train::write_metadata(ck.string(), train::read_metadata(ck.string()));
  expect_one_line_error(run_cli("train " + config(2, 1, out) +
                                " --device cpu --training.checkpoint.resume_from_checkpoint latest"),
                        "optimizer.safetensors");
  ASSERT_EQ(run_cli("train " + config(1, 1, out) + " --device cpu --overwrite-run").rc, 0);
  std::ofstream(ck / "trainer_state.json") << "{\"step\": 1, \"data\": ";
  train::write_metadata(ck.string(), train::read_metadata(ck.string()));
  expect_one_line_error(run_cli("train " + config(2, 1, out) +
                                " --device cpu --training.checkpoint.resume_from_checkpoint latest"),
                        "trainer_state.json");
  // Malformed metadata.json.
  std::ofstream(ck / "metadata.json") << "{ not json";
  expect_one_line_error(run_cli("export " + ck.string() + " " + (root / "exp").string()), "metadata.json");
  expect_one_line_error(run_cli("lineage " + ck.string()), "metadata.json");
  // data synth into a non-empty directory.
  expect_one_line_error(run_cli("data synth " + (root / "data").string()), "not empty");
}

TEST_F(CliFixture, SigtermWritesTheFinalCheckpointAndExitsCleanly) {
  const std::string out = (root / "run").string();
  const std::string log = (root / "log.txt").string();
  const std::string cfg = config(100000, 100000, out);
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    (void)f;
    ::dup2(1, 2);
    ::execl(VQAD_BINARY, VQAD_BINARY, "train", cfg.c_str(), "--device", "cpu", "--no-progress", "--log-every-steps",
            "1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Wait for the first progress lines (stdout is a file: one line per step here).
  std::string text;
  for (int i = 0; i < 400 && text.find("step 3/") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  ASSERT_NE(text.find("step 3/100000  loss "), std::string::npos) << text;
  EXPECT_NE(text.find("tokens/s  ETA "), std::string::npos) << text;
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  text = ss.str();
  EXPECT_NE(text.find("stopped by SIGTERM after step"), std::string::npos) << text;
  auto all = train::list_checkpoints(out);
  ASSERT_EQ(all.size(), 1u) << text;
  EXPECT_GE(all.back().step, 3);
  EXPECT_TRUE(train::verify_directory(all.back().path).empty());
  EXPECT_FALSE(fs::exists(fs::path(out) / train::kRunLockName));
}
