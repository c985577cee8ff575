// Process groups across real processes on 127.0.0.1 (Gloo from libtorch_cpu.so compiled
// against the system gloo headers): the launcher, every collective against values computed
// locally, rank 0 hosting the store (torchrun style), and the fault paths (a killed rank, a
// hung rank) naming the rank and the collective within the timeout. Plus the launch
// environment parser and the sampler state across world sizes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "test_dist_util.h"
#include "vqad/core/error.h"
#include "vqad/data/sampler.h"
#include "vqad/dist/env.h"
#include "vqad/dist/memory.h"
#include "vqad/model/wan/model.h"

namespace fs = std::filesystem;
using namespace vqad;
using test_dist::contains;

namespace {

dist::LaunchEnv env_of(const std::map<std::string, std::string>& vars) {
  return dist::launch_env_from([&](const char* k) -> const char* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

fs::path fresh(const std::string& name) {
  auto d = fs::temp_directory_path() / ("vqad_dist_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST(DistEnv, TorchrunSlurmAndSingleProcess) {
  auto none = env_of({});
  EXPECT_FALSE(none.distributed());
  EXPECT_EQ(none.source, "none");

  auto t = env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"},
                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(t.source, "torchrun");
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.local_rank, 3);
  EXPECT_EQ(t.local_world_size, 4);
  EXPECT_EQ(t.master_addr, "10.0.0.1");
  EXPECT_EQ(t.master_port, 29400);
  EXPECT_TRUE(t.agent_store);

  auto s = env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                   {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"MASTER_ADDR", "node01"}, {"SLURM_JOB_ID", "12345"}});
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.master_addr, "node01");
  EXPECT_EQ(s.master_port, 20000 + 12345 % 20000);
  EXPECT_FALSE(s.agent_store);

  auto err = [&](const std::map<std::string, std::string>& v, const std::string& needle) {
    try {
      env_of(v);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const vqad::Error& e) {
      EXPECT_TRUE(contains(e.what(), needle)) << e.what();
    }
  };
  err({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}, "RANK");
  err({{"RANK", "x"}, {"WORLD_SIZE", "4"}}, "RANK: expected an integer, found 'x'");
  err({{"RANK", "1"}}, "RANK and WORLD_SIZE must be set together");
  err({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, "MASTER_ADDR / MASTER_PORT are not set");
  err({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT");
  err({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_NUM_NODES", "2"}}, "MASTER_ADDR is not set");
}

TEST(DistSampler, StateResumesOnAnotherWorldSizeWithTheSameGlobalBatch) {
  // Global batch 4: world 4 x batch 1, world 2 x batch 2, world 1 x batch 4. The union of the
  // ranks' batches is the one-process batch, position by position (rank r holds rows r::W).
  const int64_t n = 21, seed = 5;
  data::DpSpBatchSampler one(data::sampler_options_for_rank(n, 4, 1, 1, 0, seed));
  std::vector<std::vector<int64_t>> want;
  for (int i = 0; i < 7; ++i) want.push_back(one.next());
  for (int world : {2, 4}) {
    std::vector<data::DpSpBatchSampler> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(data::sampler_options_for_rank(n, 4 / world, world, 1, r, seed));
    for (int i = 0; i < 3; ++i) {
      std::vector<int64_t> got(4);
      for (int r = 0; r < world; ++r) {
        auto b = ranks[r].next();
        for (int j = 0; j < 4 / world; ++j) got[j * world + r] = b[j];
      }
      EXPECT_EQ(got, want[i]) << "world " << world << " batch " << i;
    }
    // Saved on rank 0 of this world; loads on every rank of the other worlds and continues.
    const auto saved = ranks[0].state();
    for (int other : {1, 2, 4}) {
      for (int r = 0; r < other; ++r) {
        data::DpSpBatchSampler s(data::sampler_options_for_rank(n, 4 / other, other, 1, r, seed));
        s.load_state(saved);
        auto b = s.next();
        for (int j = 0; j < 4 / other; ++j) EXPECT_EQ(b[j], want[3][j * other + r]) << world << "->" << other;
      }
    }
  }
  // Another global batch is refused, naming it.
  data::DpSpBatchSampler bigger(data::sampler_options_for_rank(n, 4, 2, 1, 0, seed));
  try {
    bigger.load_state(one.state());
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_TRUE(contains(e.what(), "global batch was 4")) << e.what();
  }
}

// World 1 is a launched job too (one rank, no subgroup check): the form that exercises the
// NCCL backend on a single GPU (tests/gpu/test_dist_nccl_cuda.cpp).
TEST(DistCollectives, LaunchedWorldsOf1And2And4PassEveryCheck) {
  VQAD_SKIP_WITHOUT_GLOO();
  auto dir = fresh("check");
  for (int w : {1, 2, 4}) {
    auto r = test_dist::run_vqad("launch --nproc " + std::to_string(w) + " dist check --timeout 30",
                                 dir / ("w" + std::to_string(w) + ".log"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string checks = w == 1 ? "20" : "21";
    for (int k = 0; k < w; ++k)
      EXPECT_TRUE(contains(r.output, "dist check: rank " + std::to_string(k) + " of " + std::to_string(w) +
                                         " (Gloo): " + checks + " checks passed"))
          << r.output;
  }
  fs::remove_all(dir);
}

TEST(DistCollectives, CheckOutsideALaunchedJobIsRefused) {
  auto dir = fresh("check_plain");
  auto r = test_dist::run_vqad("dist check --timeout 5", dir / "plain.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "dist check: this process is not a rank of a launched job")) << r.output;
  fs::remove_all(dir);
}

TEST(DistCollectives, LogDirHoldsEachRanksOutput) {
  VQAD_SKIP_WITHOUT_GLOO();
  auto dir = fresh("logdir");
  auto r = test_dist::run_vqad("launch --nproc 2 --log-dir " + (dir / "logs").string() + " dist check --timeout 30",
                               dir / "launch.log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "checks passed")) << r.output;  // not on the launcher's terminal
  for (int k = 0; k < 2; ++k) {
    std::ifstream f(dir / "logs" / ("rank_" + std::to_string(k) + ".log"));
    std::stringstream ss;
    ss << f.rdbuf();
    EXPECT_TRUE(contains(ss.str(), "dist check: rank " + std::to_string(k) + " of 2 (Gloo): 21 checks passed"))
        << ss.str();
  }
  // A failing rank is named with its log file.
  auto bad = test_dist::run_vqad("launch --nproc 2 --grace 5 --log-dir " + (dir / "bad").string() +
                                     " dist check --timeout 20 --fault-rank 1 --fault exit",
                                 dir / "bad.log");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(contains(bad.output, "its output: " + (dir / "bad" / "rank_1.log").string())) << bad.output;
  fs::remove_all(dir);
}

TEST(DistCollectives, RankZeroHostsTheStoreWithoutTheLauncher) {
  VQAD_SKIP_WITHOUT_GLOO();
  auto dir = fresh("torchrun");
  const int port = test_dist::free_port();
  ASSERT_GT(port, 0);
  std::string line = "sh -c '";
  for (int r = 0; r < 2; ++r)
    line += "(RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
            " LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " + VQAD_BINARY +
            " dist check --timeout 30; echo rc" + std::to_string(r) + "=$?) & ";
  line += "wait'";
  auto r = test_dist::run_shell(line, dir / "log");
  EXPECT_TRUE(contains(r.output, "rc0=0")) << r.output;
  EXPECT_TRUE(contains(r.output, "rc1=0")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 of 2 (Gloo): 21 checks passed")) << r.output;
  fs::remove_all(dir);
}

TEST(DistFaults, KilledRankIsNamedByEveryOtherRank) {
  VQAD_SKIP_WITHOUT_GLOO();
  auto dir = fresh("kill");
  auto r = test_dist::run_vqad("launch --nproc 3 --grace 60 dist check --timeout 60 --fault-rank 1 --fault kill",
                               dir / "log");
  EXPECT_NE(r.exit_code, 0) << r.output;
  // The launcher names the first failure; ranks 0 and 2 name rank 1 and their collective.
  EXPECT_TRUE(contains(r.output, "launch: rank 1 of 3 failed first (was killed by signal 9")) << r.output;
  for (int k : {0, 2})
    EXPECT_TRUE(contains(r.output, "of group world (3 ranks, timeout 60 s) failed on rank " + std::to_string(k) +
                                       ": rank 1 failed: was killed by signal 9"))
        << r.output;
  EXPECT_TRUE(contains(r.output, "all_reduce(check floats) #2")) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;  // nobody waited for a timeout
  fs::remove_all(dir);
}

TEST(DistFaults, HungRankIsNamedWhenTheTimeoutPasses) {
  VQAD_SKIP_WITHOUT_GLOO();
  auto dir = fresh("hang");
  auto r = test_dist::run_vqad("launch --nproc 3 --grace 1 dist check --timeout 2 --fault-rank 2 --fault hang",
                               dir / "log");
  EXPECT_NE(r.exit_code, 0) << r.output;
  for (int k : {0, 1})
    EXPECT_TRUE(contains(r.output, "all_reduce(check floats) #2 of group world (3 ranks, timeout 2 s) failed on rank " +
                                       std::to_string(k) + ": rank 2 has not reached it (it is finished "
                                       "all_reduce(check ints) #1 of group world)"))
        << r.output;
  // timeout 2 s + diagnosis (<= 2.5 s) + grace 1 s + SIGTERM, plus process start-up (slow on a
  // loaded 2-core machine).
  EXPECT_LT(r.seconds, 30.0) << r.output;
  fs::remove_all(dir);
}

TEST(DistFaults, DeadRankWithoutLauncherIsNamedFromItsHeartbeat) {
  VQAD_SKIP_WITHOUT_GLOO();
  // No launcher to report the death: the others see rank 1's heartbeat stop.
  auto dir = fresh("dead");
  const int port = test_dist::free_port();
  ASSERT_GT(port, 0);
  std::string line = "sh -c '";
  for (int r = 0; r < 3; ++r)
    line += "(RANK=" + std::to_string(r) + " WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
            " " + VQAD_BINARY + " dist check --timeout 60 --fault-rank 1 --fault exit; echo rc" + std::to_string(r) +
            "=$?) & ";
  line += "wait'";
  auto r = test_dist::run_shell(line, dir / "log");
  EXPECT_TRUE(contains(r.output, "rc0=1")) << r.output;
  EXPECT_TRUE(contains(r.output, "rc1=3")) << r.output;
  EXPECT_TRUE(contains(r.output, "rc2=1")) << r.output;
  // Rank 0 hosts the store, so its own diagnosis always completes.
  EXPECT_TRUE(contains(r.output, "failed on rank 0: rank 1 stopped responding (no heartbeat for")) << r.output;
  EXPECT_LT(r.seconds, 45.0) << r.output;  // well before the 60 s collective timeout
  fs::remove_all(dir);
}

TEST(DistMemory, ParameterCountEqualsTheBuiltModel) {
  for (bool gate : {false, true}) {
    auto c = model::WanConfig::tiny();
    c.gate_compress = gate;
    model::WanModel m(c);
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    EXPECT_EQ(dist::wan_parameter_count(c), n) << "gate_compress " << gate;
  }
  // The published sizes: 1.3B and 14B.
  EXPECT_NEAR(static_cast<double>(dist::wan_parameter_count(model::WanConfig::wan_1_3b())), 1.42e9, 0.02e9);
  EXPECT_NEAR(static_cast<double>(dist::wan_parameter_count(model::WanConfig::wan_14b())), 14.29e9, 0.1e9);
}

TEST(DistMemory, Wan14BStage1AtShard8FitsAn80GBGpu) {
  // Stage 1 (SFT of the student only) at 480x832, 20 latent frames: 20 x 30 x 52 tokens.
  dist::MemoryMesh m;
  m.shard = 8;
  m.sp = 1;  // the hardest case: no sequence parallelism
  m.batch = 1;
  m.tokens_per_sample = 20 * 30 * 52;
  m.activation_checkpointing = true;
  auto e = dist::estimate_memory({{"student", model::WanConfig::wan_14b(), true}}, m);
  const double gib_80gb = 80e9 / (1024.0 * 1024.0 * 1024.0);
  EXPECT_LT(e.total_gib(), gib_80gb - 4.0) << e.text;  // 4 GiB left for context and allocator slack
  // Unsharded it cannot fit (14.3B x 16 bytes of states alone is 213 GiB).
  m.shard = 1;
  auto one = dist::estimate_memory({{"student", model::WanConfig::wan_14b(), true}}, m);
  EXPECT_GT(one.states_gib, 200.0) << one.text;
  EXPECT_NEAR(one.states_gib, 8.0 * e.states_gib, 1e-6);
  EXPECT_EQ(one.gathered_gib, 0.0);
}

// DMD2 at 1.3B: a trainable student and critic, a frozen teacher.
static std::vector<dist::RoleFootprint> dmd2_roles_1_3b() {
  return {{"student", model::WanConfig::wan_1_3b(), true},
          {"teacher", model::WanConfig::wan_1_3b(), false},
          {"critic", model::WanConfig::wan_1_3b(), true}};
}
// One 1.3B model's fp32 parameters (or gradients), in GiB.
static double wan_1_3b_fp32_gib() {
  return 4.0 * static_cast<double>(dist::wan_parameter_count(model::WanConfig::wan_1_3b())) /
         (1024.0 * 1024.0 * 1024.0);
}

TEST(DistMemory, FrozenRolesReplicatedOnRequest) {
  // DMD2 at 1.3B, shard 4: the frozen teacher's fp32 weights split over the shard group, or
  // whole on every rank with shard_frozen_roles false (the trainable roles stay sharded).
  dist::MemoryMesh m;
  m.shard = 4;
  m.batch = 1;
  m.tokens_per_sample = 21 * 30 * 52;
  const auto roles = dmd2_roles_1_3b();
  const auto sharded = dist::estimate_memory(roles, m);
  m.shard_frozen = false;
  const auto replicated = dist::estimate_memory(roles, m);
  EXPECT_NEAR(replicated.states_gib - sharded.states_gib, wan_1_3b_fp32_gib() * 3.0 / 4.0, 1e-9) << replicated.text;
  EXPECT_NE(replicated.text.find("teacher"), std::string::npos);
  EXPECT_NE(replicated.text.find("replicated"), std::string::npos) << replicated.text;
}

TEST(DistMemory, UnreducedAccumulationHoldsEveryTrainableRolesFullGradients) {
  // DMD2 at 1.3B, shard 4, gradient accumulation: accumulate_unreduced_gradients keeps the
  // student's and the critic's full fp32 gradients on every rank over the micro-steps (the
  // frozen teacher has none); without it only one unit's gradients are held at a time.
  dist::MemoryMesh m;
  m.shard = 4;
  m.tokens_per_sample = 21 * 30 * 52;
  const auto roles = dmd2_roles_1_3b();
  const auto per_step = dist::estimate_memory(roles, m);
  m.unreduced_accumulation = true;
  const auto unreduced = dist::estimate_memory(roles, m);
  EXPECT_NEAR(unreduced.gathered_gib - per_step.gathered_gib, 2.0 * wan_1_3b_fp32_gib(), 1e-9) << unreduced.text;
  EXPECT_NEAR(unreduced.states_gib, per_step.states_gib, 1e-12);
  EXPECT_NE(unreduced.text.find("full fp32 grads held over the micro-steps"), std::string::npos) << unreduced.text;
  EXPECT_EQ(per_step.text.find("held over the micro-steps"), std::string::npos) << per_step.text;
}
