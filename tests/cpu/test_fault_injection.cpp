// Fault injection against the real `vqad` binary: kill -9 at random moments of training
// (steps, checkpoint writes, retention) and of export; a full filesystem and write errors
// during checkpoint saves and exports. After every fault: the newest complete checkpoint
// verifies, the next start removes what the dead process left half-written, and the run
// finishes with the losses and weights of an uninterrupted run, bit for bit.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "vqad/core/metrics.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "test_dist_util.h"
#include "test_train_util.h"

extern char** environ;
namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct Proc {
  pid_t pid = -1;
  std::string log;
};

// Starts `vqad args...` with stdout+stderr in `log`; `fsize_limit` > 0 sets ulimit -f (bytes).
// `own_group`: the process leads a new process group (a launched job: kill(-pid) reaches every rank).
Proc spawn_vqad(const std::vector<std::string>& args, const std::string& log, long fsize_limit = 0,
                bool own_group = false) {
  Proc p;
  p.log = log;
  // Everything the child needs is prepared before fork (the parent has threads).
  ::setenv("OMP_NUM_THREADS", "1", 1);
  std::string bin = VQAD_BINARY;
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  argv.push_back(bin.data());
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  p.pid = ::fork();
  if (p.pid > 0 && own_group) ::setpgid(p.pid, p.pid);  // also in the child: whichever runs first
  if (p.pid == 0) {
    if (own_group) ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    if (fsize_limit > 0) {
      rlimit r{static_cast<rlim_t>(fsize_limit), static_cast<rlim_t>(fsize_limit)};
      ::setrlimit(RLIMIT_FSIZE, &r);
    }
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return p;
}

int wait_exit(const Proc& p) {
  int status = 0;
  ::waitpid(p.pid, &status, 0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> temp_dirs(const fs::path& dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".parts-", 0) == 0) out.push_back(name);
  }
  return out;
}

// A tiny run that checkpoints every `save_every` steps (every step: kills land in writes as
// often as in steps) with retention `limit` (so they land in deletions too).
fs::path write_config(const fs::path& dir, const fs::path& data, long steps, long save_every, int limit) {
  const fs::path cfg = dir / ("run_" + std::to_string(steps) + "_" + std::to_string(save_every) + "_" +
                              std::to_string(limit) + ".yaml");
  std::ofstream(cfg) << "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
                        "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
                        "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
                        "training:\n  data:\n    data_path: "
                     << data.string()
                     << "\n    train_batch_size: 2\n    seed: 5\n"
                        "  optimizer:\n    learning_rate: 1.0e-3\n"
                        "  loop:\n    max_train_steps: "
                     << steps << "\n  checkpoint:\n    output_dir: " << (dir / "unused").string()
                     << "\n    training_state_checkpointing_steps: " << save_every
                     << "\n    checkpoints_total_limit: " << limit << "\n";
  return cfg;
}

std::vector<std::string> train_args(const fs::path& cfg, const fs::path& out, bool resume = true) {
  std::vector<std::string> a = {"train", cfg.string(), "--device", "cpu", "--no-progress",
                                "--training.checkpoint.output_dir", out.string()};
  if (resume) a.insert(a.end(), {"--training.checkpoint.resume_from_checkpoint", "latest"});
  return a;
}

// The kill tests share one dataset and one uninterrupted reference run (made by the first
// of them that runs, removed at exit).
constexpr long kKillSteps = 10;
struct SharedReference {
  fs::path dir, data, config, run;
  double run_s = 0;
  ~SharedReference() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
};
const SharedReference& shared_reference() {
  static SharedReference r;
  if (r.run_s > 0) return r;
  r.dir = fs::temp_directory_path() / ("vqad_fault_shared_" + std::to_string(::getpid()));
  fs::remove_all(r.dir);
  r.data = r.dir / "data";
  test_train::write_tiny_dataset(r.data, 8, 9);
  r.config = write_config(r.dir, r.data, kKillSteps, 1, 2);
  r.run = r.dir / "reference";
  const std::string log = (r.dir / "ref.log").string();
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = wait_exit(spawn_vqad(train_args(r.config, r.run, false), log));
  EXPECT_EQ(rc, 0) << slurp(log);
  r.run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

struct FaultFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_fault");
    test_train::write_tiny_dataset(root / "data", 8, 9);
  }
  void TearDown() override { fs::remove_all(root); }
  fs::path config(long steps, long save_every = 1, int limit = 2) const {
    return write_config(root, root / "data", steps, save_every, limit);
  }
};

std::vector<double> losses_of(const fs::path& out) {
  std::vector<double> v;
  for (const auto& r : read_metrics((out / "metrics.jsonl").string())) v.push_back(r.at("loss").get<double>());
  return v;
}

// The finished run in `a` has the losses, weights and AdamW state (one file or its parts)
// of the uninterrupted run in `b`, bit for bit.
void expect_same_final_state(const fs::path& a, const fs::path& b, long step) {
  auto la = losses_of(a), lb = losses_of(b);
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  const std::string ck = "checkpoint-" + std::to_string(step);
  const fs::path sa = a / ck / "student", sb = b / ck / "student";
  auto wa = model::read_weights(sa.string());
  auto wb = model::read_weights(sb.string());
  ASSERT_EQ(wa.tensors.size(), wb.tensors.size());
  for (const auto& [k, t] : wa.tensors) EXPECT_TRUE(torch::equal(t, wb.tensors.at(k))) << k;
  int optimizer_files = 0;
  for (const auto& e : fs::directory_iterator(sb))
    if (e.path().filename().string().rfind("optimizer", 0) == 0) {
      ++optimizer_files;
      EXPECT_EQ(slurp((sa / e.path().filename()).string()), slurp(e.path().string())) << e.path().filename();
    }
  EXPECT_GE(optimizer_files, 1);
}

// What the kill loop runs: the command line for an output directory, the uninterrupted
// run it must end like, and how long that run took on this machine.
struct KillTarget {
  std::function<std::vector<std::string>(const fs::path& out)> args;
  fs::path reference;
  long steps = 0;
  double run_s = 0;
  bool launched = false;  // a `vqad launch` job: kill its whole process group
};

// Kills a training run `iterations` times at random moments, resuming each time. The
// moments are drawn from [lo, hi] times the duration of an uninterrupted run on this
// machine, so they land in start-up, steps, checkpoint writes and retention alike. A start
// that finishes before its kill must end where the uninterrupted run did; the loop then
// starts over from nothing, so later kills still land mid-run.
void kill_and_resume(FaultFixture& f, const KillTarget& t, int iterations, uint32_t seed, double lo, double hi) {
  ASSERT_GT(t.run_s, 0);
  const fs::path out = f.root / "killed";
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> delay(lo * t.run_s, hi * t.run_s);
  int killed = 0;
  long newest = 0;
  for (int it = 0; it < iterations; ++it) {
    const auto temps_before = temp_dirs(out);
    const std::string log = (f.root / ("it" + std::to_string(it) + ".log")).string();
    Proc p = spawn_vqad(t.args(out), log, 0, t.launched);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay(rng)));
    ::kill(t.launched ? -p.pid : p.pid, SIGKILL);
    const int rc = wait_exit(p);
    if (rc == 128 + SIGKILL) {
      ++killed;
    } else {
      ASSERT_EQ(rc, 0) << slurp(log);
      expect_same_final_state(out, t.reference, t.steps);
      fs::remove_all(out);
      newest = 0;
      continue;
    }
    auto all = train::list_checkpoints(out.string());
    if (!all.empty()) {
      auto problems = train::verify_directory(all.back().path);
      EXPECT_TRUE(problems.empty()) << all.back().path << ": " << problems[0];
      // A process that wrote a new checkpoint got past its start, which removes what
      // earlier (dead) runs left half-written.
      if (all.back().step > newest) {
        const auto temps_after = temp_dirs(out);
        for (const auto& d : temps_before)
          EXPECT_EQ(std::count(temps_after.begin(), temps_after.end(), d), 0) << d << " survived a start";
      }
      newest = std::max(newest, all.back().step);
    }
  }
  EXPECT_GE(killed, iterations / 3) << "most iterations must be killed mid-run";
  // The last start finishes the run and removes what the kills left.
  const std::string log = (f.root / "final.log").string();
  ASSERT_EQ(wait_exit(spawn_vqad(t.args(out), log, 0, t.launched)), 0) << slurp(log);
  EXPECT_TRUE(temp_dirs(out).empty()) << temp_dirs(out)[0];
  EXPECT_FALSE(fs::exists(out / train::kRunLockName));
  expect_same_final_state(out, t.reference, t.steps);
}

// The single-process run all kill tests of training share.
KillTarget single_process_target() {
  const SharedReference& ref = shared_reference();
  KillTarget t;
  t.args = [cfg = ref.config](const fs::path& out) { return train_args(cfg, out); };
  t.reference = ref.run;
  t.steps = kKillSteps;
  t.run_s = ref.run_s;
  return t;
}

}  // namespace

// 24 kills of training in four bounded tests (each a few seconds on one core), 12 of export below.
TEST_F(FaultFixture, KillDuringStartupAndFirstCheckpointsThenResumeIsBitIdentical) {
  kill_and_resume(*this, single_process_target(), 6, 99, 0.02, 0.5);
}

TEST_F(FaultFixture, KillDuringStepsAndCheckpointWritesThenResumeIsBitIdentical) {
  kill_and_resume(*this, single_process_target(), 6, 1234, 0.3, 1.0);
}

TEST_F(FaultFixture, KillAtRandomMomentsThenResumeIsBitIdentical) {
  kill_and_resume(*this, single_process_target(), 6, 4321, 0.05, 1.0);
}

TEST_F(FaultFixture, KillLateDuringRetentionThenResumeIsBitIdentical) {
  kill_and_resume(*this, single_process_target(), 6, 777, 0.5, 1.1);
}

TEST_F(FaultFixture, KillDuringExportLeavesNoHalfExport) {
  const auto cfg = config(2, 2, 0);
  const fs::path out = root / "run";
  ASSERT_EQ(wait_exit(spawn_vqad(train_args(cfg, out, false), (root / "t.log").string())), 0);
  const std::string ck = (out / "checkpoint-2").string();
  const fs::path exp = root / "export";
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> delay(0.01, 0.5);
  for (int it = 0; it < 12; ++it) {
    Proc p = spawn_vqad({"export", ck, exp.string(), "--overwrite"}, (root / "e.log").string());
    std::this_thread::sleep_for(std::chrono::duration<double>(delay(rng)));
    ::kill(p.pid, SIGKILL);
    wait_exit(p);
    // Either the previous complete export or nothing; never a partial one.
    if (fs::exists(exp)) {
      auto problems = train::verify_lineage(exp.string());
      EXPECT_TRUE(problems.empty()) << problems[0];
    }
  }
  ASSERT_EQ(wait_exit(spawn_vqad({"export", ck, exp.string(), "--overwrite"}, (root / "e.log").string())), 0)
      << slurp((root / "e.log").string());
  EXPECT_TRUE(train::verify_lineage(exp.string()).empty());
  for (const auto& t : temp_dirs(root)) ADD_FAILURE() << t << " survived the next export";
  EXPECT_TRUE(train::verify_directory(ck).empty());
}

TEST_F(FaultFixture, WriteErrorsDuringSaveAndExportAreOneLineAndKeepThePreviousCheckpoint) {
  // ulimit -f below the size of a checkpoint file: the first save fails.
  const auto cfg = config(3, 1, 0);
  const fs::path out = root / "run";
  const std::string log = (root / "fsize.log").string();
  // Find the size of one checkpoint's largest file first.
  ASSERT_EQ(wait_exit(spawn_vqad(train_args(config(1, 1, 0), root / "probe", false), log)), 0) << slurp(log);
  const auto opt_size = fs::file_size(root / "probe" / "checkpoint-1" / "student" / "optimizer.safetensors");
  // The weights file (4 bytes per parameter) fits under the limit, the AdamW state (8) does not.
  const int rc = wait_exit(spawn_vqad(train_args(cfg, out, false), log, static_cast<long>(opt_size * 3 / 4)));
  const std::string text = slurp(log);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("vqad: error: "), std::string::npos) << text;
  EXPECT_NE(text.find("File too large"), std::string::npos) << text;
  EXPECT_NE(text.find("no checkpoint of this run"), std::string::npos) << text;
  EXPECT_EQ(text.find("internal error"), std::string::npos) << text;
  EXPECT_TRUE(temp_dirs(out).empty());
  // Export of a good checkpoint under the same limit: one line, nothing left behind.
  const std::string probe_ck = (root / "probe" / "checkpoint-1").string();
  const int erc = wait_exit(spawn_vqad({"export", probe_ck, (root / "exp").string()}, log, 4096));
  const std::string etext = slurp(log);
  EXPECT_EQ(erc, 1) << etext;
  EXPECT_NE(etext.find("vqad: error: "), std::string::npos) << etext;
  EXPECT_FALSE(fs::exists(root / "exp"));
  EXPECT_TRUE(temp_dirs(root).empty()) << temp_dirs(root)[0];
  EXPECT_TRUE(train::verify_directory(probe_ck).empty());
}

TEST_F(FaultFixture, FullFilesystemDuringSaveAndExport) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs";
  const fs::path mnt = root / "small";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=5m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << ")";
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const fs::path out = mnt / "run";
  const std::string log = (root / "full.log").string();
  const int rc = wait_exit(spawn_vqad(train_args(config(6, 1, 0), out, false), log));
  const std::string text = slurp(log);
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("No space left on device"), std::string::npos) << text;
  EXPECT_EQ(text.find("internal error"), std::string::npos) << text;
  auto all = train::list_checkpoints(out.string());
  ASSERT_FALSE(all.empty()) << text;
  EXPECT_NE(text.find(all.back().path), std::string::npos) << "the message names the last good checkpoint: " << text;
  EXPECT_TRUE(train::verify_directory(all.back().path).empty());
  EXPECT_TRUE(temp_dirs(out).empty());
  // The failed save removed its partial files, which freed their space: fill the
  // filesystem again so that the export cannot fit.
  {
    std::ofstream filler(mnt / "filler", std::ios::binary);
    const std::string chunk(4096, 'x');
    while (filler.write(chunk.data(), static_cast<std::streamsize>(chunk.size()))) filler.flush();
  }
  // Export onto the full filesystem: one line, the checkpoint intact, no partial export.
  const int erc = wait_exit(spawn_vqad({"export", all.back().path, (mnt / "exp").string()}, log));
  const std::string etext = slurp(log);
  EXPECT_EQ(erc, 1) << etext;
  EXPECT_NE(etext.find("No space left on device"), std::string::npos) << etext;
  EXPECT_EQ(etext.find("internal error"), std::string::npos) << etext;
  EXPECT_FALSE(fs::exists(mnt / "exp"));
  EXPECT_TRUE(temp_dirs(mnt).empty());
  EXPECT_TRUE(train::verify_directory(all.back().path).empty());
  // With the space back, the same export succeeds.
  fs::remove(mnt / "filler");
  EXPECT_EQ(wait_exit(spawn_vqad({"export", all.back().path, (mnt / "exp").string()}, log)), 0) << slurp(log);
  EXPECT_TRUE(train::verify_lineage((mnt / "exp").string()).empty());
}

// Sharded data parallelism (vqad launch, 2 ranks, shard 2): each checkpoint is written as two
// parts that rank 0 publishes. kill -9 of the whole job at random moments while it
// checkpoints every step, resuming each time: the newest checkpoint always verifies, parts
// and temporary directories of the dead jobs do not survive, and the finished run has the
// uninterrupted run's losses, weights and AdamW state bit for bit.
TEST_F(FaultFixture, KillShardedJobDuringPartsThenResumeIsBitIdentical) {
  VQAD_SKIP_WITHOUT_GLOO();
  constexpr long kSteps = 6;
  KillTarget t;
  t.args = [cfg = config(kSteps, 1, 2)](const fs::path& out) {
    std::vector<std::string> a = {"launch", "--nproc", "2"};
    for (const auto& s : train_args(cfg, out)) a.push_back(s);
    for (const char* s : {"--dist-timeout", "60", "--training.distributed.num_gpus", "2",
                          "--training.distributed.sp_size", "1", "--training.distributed.hsdp_replicate_dim", "1",
                          "--training.distributed.hsdp_shard_dim", "2"})
      a.push_back(s);
    return a;
  };
  t.reference = root / "reference";
  t.steps = kSteps;
  t.launched = true;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string ref_log = (root / "ref.log").string();
  ASSERT_EQ(wait_exit(spawn_vqad(t.args(t.reference), ref_log, 0, true)), 0) << slurp(ref_log);
  t.run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const fs::path b = t.reference / "checkpoint-6" / "student";
  ASSERT_TRUE(fs::exists(b / "optimizer.safetensors.index.json"));
  int parts = 0;
  for (const auto& e : fs::directory_iterator(b)) parts += e.path().filename().string().rfind("optimizer-part-", 0) == 0;
  EXPECT_EQ(parts, 2) << "one optimizer part per shard";
  kill_and_resume(*this, t, 6, 2024, 0.2, 0.9);
}
