// Flow-matching grid, LR schedules and atomic checkpoint directories.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/flow_matching.h"
#include "vqad/train/lr_schedule.h"

namespace fs = std::filesystem;
using namespace vqad::train;

TEST(FlowMatching, GridEndpointsAndShift) {
  FlowMatchGrid g(3.0);
  ASSERT_EQ(g.size(), 1000);
  EXPECT_DOUBLE_EQ(g.sigma(0), 1.0);
  EXPECT_DOUBLE_EQ(g.timestep(0), 1000.0);
  // sigma_999 = 3 * 0.001 / (1 + 2 * 0.001)
  EXPECT_NEAR(g.sigma(999), 0.003 / 1.002, 1e-15);
  EXPECT_NEAR(g.sigma(999), 0.002994, 1e-6);
  for (int i = 1; i < g.size(); ++i) ASSERT_LT(g.sigma(i), g.sigma(i - 1));
  FlowMatchGrid unshifted(1.0);
  EXPECT_NEAR(unshifted.sigma(500), 0.5, 1e-15);
}

TEST(FlowMatching, NearestIndexMatchesBruteForce) {
  FlowMatchGrid g(3.0);
  for (double t : {1000.0, 999.9, 757.0, 522.3, 1.0, 0.0, 2.9, 500.0, 1200.0}) {
    int best = 0;
    for (int i = 1; i < g.size(); ++i)
      if (std::fabs(g.timestep(i) - t) < std::fabs(g.timestep(best) - t)) best = i;
    EXPECT_EQ(g.nearest_index(t), best) << "t=" << t;
  }
}

TEST(FlowMatching, AddNoiseAndPredictX0AreInverse) {
  FlowMatchGrid g(3.0);
  torch::manual_seed(0);
  auto x0 = torch::randn({2, 16, 3, 4, 4});
  auto n = torch::randn_like(x0);
  auto t = torch::tensor({1000.0, 351.7});
  auto xt = g.add_noise(x0, n, t);
  const double s1 = g.sigma(g.nearest_index(351.7));
  auto expect1 = (1 - s1) * x0[1] + s1 * n[1];
  EXPECT_TRUE(torch::allclose(xt[1], expect1, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(xt[0], n[0]));  // sigma = 1 at t = 1000
  auto v = n - x0;
  auto x0_hat = g.predict_x0(xt, v, t);
  EXPECT_TRUE(torch::allclose(x0_hat, x0, 1e-5, 1e-5));
}

TEST(FlowMatching, TimestepWarpUsesTheGridFormula) {
  // The sampling schedules live in sample::shifted_schedule (tests/cpu/test_schedule.cpp);
  // the warp of a training timestep is the grid's fp64 formula at t / 1000.
  EXPECT_DOUBLE_EQ(shift_timestep(400.0, 1.0), 400.0);
  EXPECT_NEAR(shift_timestep(500.0, 3.0), 750.0, 1e-9);
  EXPECT_NEAR(shift_timestep(250.0, 8.0), 1000.0 * shifted_sigma(0.25, 8.0), 1e-9);
  FlowMatchGrid g(8.0);
  EXPECT_DOUBLE_EQ(g.sigma(750), shifted_sigma(0.25, 8.0));
}

TEST(LrSchedule, Shapes) {
  LrScheduleConfig c;
  c.total_steps = 100;
  c.warmup_steps = 10;
  c.kind = LrSchedule::kConstant;
  EXPECT_EQ(lr_multiplier(c, 0), 1.0);
  c.kind = LrSchedule::kConstantWithWarmup;
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 0), 0.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 5), 0.5);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 50), 1.0);
  c.kind = LrSchedule::kLinear;
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 10), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 55), 0.5);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 100), 0.0);
  c.kind = LrSchedule::kCosine;
  EXPECT_NEAR(lr_multiplier(c, 55), 0.5, 1e-12);
  EXPECT_NEAR(lr_multiplier(c, 100), 0.0, 1e-12);
  c.kind = LrSchedule::kCosineWithMinLr;
  EXPECT_NEAR(lr_multiplier(c, 100), 0.5, 1e-12);
}

TEST(LrSchedule, FromOptimizerConfig) {
  OptimizerConfig opt;
  opt.lr_warmup_steps = 4;
  auto c = lr_schedule_from(opt, LrSchedule::kLinear, 20);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 2), 0.5);
  EXPECT_DOUBLE_EQ(lr_multiplier(c, 12), 0.5);
  EXPECT_THROW(lr_schedule_from(opt, LrSchedule::kPiecewiseConstant, 20), vqad::Error);
}

namespace {
fs::path fresh_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("vqad_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
void write_text(const fs::path& p, const std::string& s) { std::ofstream(p) << s; }
std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
}  // namespace

TEST(CheckpointDir, WriteListResolveRetention) {
  auto out = fresh_dir("ckpt");
  for (long step : {10L, 20L, 30L})
    write_checkpoint_dir(out.string(), step, [&](const std::string& d) {
      write_text(fs::path(d) / "weights.bin", "w" + std::to_string(step));
    });
  auto all = list_checkpoints(out.string());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all.back().step, 30);
  EXPECT_EQ(read_text(fs::path(all.back().path) / "weights.bin"), "w30");
  auto latest = resolve_resume("latest", out.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 30);
  auto named = resolve_resume((out / "checkpoint-20").string(), out.string());
  EXPECT_EQ(named->step, 20);
  apply_retention(out.string(), 2);
  all = list_checkpoints(out.string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.front().step, 20);
  // A checkpoint directory without its marker is skipped, and naming it is an error.
  fs::create_directories(out / "checkpoint-40");
  write_text(out / "checkpoint-40" / "weights.bin", "partial");
  EXPECT_EQ(resolve_resume("latest", out.string())->step, 30);
  EXPECT_THROW(resolve_resume((out / "checkpoint-40").string(), out.string()), vqad::Error);
  EXPECT_FALSE(resolve_resume("latest", (out / "nothing").string()).has_value());
  fs::remove_all(out);
}

TEST(CheckpointDir, FailureDuringWriteKeepsPreviousCheckpoint) {
  auto out = fresh_dir("ckpt_fail");
  write_checkpoint_dir(out.string(), 1, [&](const std::string& d) { write_text(fs::path(d) / "a", "one"); });
  EXPECT_THROW(write_checkpoint_dir(out.string(), 2,
                                    [&](const std::string& d) {
                                      write_text(fs::path(d) / "a", "two");
                                      vqad::fail("disk full");
                                    }),
               vqad::Error);
  auto latest = resolve_resume("latest", out.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 1);
  EXPECT_EQ(read_text(fs::path(latest->path) / "a"), "one");
  fs::remove_all(out);
}

TEST(CheckpointDir, KillDuringWriteKeepsPreviousCheckpoint) {
  auto out = fresh_dir("ckpt_kill");
  write_checkpoint_dir(out.string(), 5, [&](const std::string& d) { write_text(fs::path(d) / "a", "five"); });
  const auto flag = out / "child_started";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: a checkpoint write that is killed half-way (after some files are written).
    write_checkpoint_dir(out.string(), 6, [&](const std::string& d) {
      write_text(fs::path(d) / "a", "six-partial");
      write_text(flag, "1");
      ::sleep(30);
    });
    ::_exit(0);
  }
  for (int i = 0; i < 500 && !fs::exists(flag); ++i) ::usleep(10000);
  ASSERT_TRUE(fs::exists(flag));
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  auto latest = resolve_resume("latest", out.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 5);
  EXPECT_EQ(read_text(fs::path(latest->path) / "a"), "five");
  // A later retention pass removes the stray temporary directory.
  apply_retention(out.string(), 0);
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp-", 0), std::string::npos) << e.path();
  fs::remove_all(out);
}
