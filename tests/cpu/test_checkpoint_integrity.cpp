// Checkpoint operations: integrity checks wherever a checkpoint or export is read,
// signed metadata, non-finite guards, run directories that are never clobbered, the
// asynchronous writer and its error path.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "tests/support/errors.h"
#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/core/sha256.h"
#include "vqad/data/parquet_writer.h"
#include "vqad/data/synthetic.h"
#include "vqad/model/wan/model.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/checkpoint_writer.h"
#include "vqad/train/config.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "vqad/train/trainer.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

using vqad::test::error_of;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void flip_byte(const fs::path& p, std::streamoff from_end) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c = 0;
  f.get(c);
  f.seekp(-from_end, std::ios::end);
  f.put(static_cast<char>(c ^ 0x40));  // an exponent bit of a little-endian fp32
}

// The sha256 that coreutils' sha256sum prints for p ("" when it cannot run).
std::string coreutils_sha256(const fs::path& p) {
  FILE* pipe = ::popen(("sha256sum " + p.string()).c_str(), "r");
  if (pipe == nullptr) return "";
  char buf[65] = {0};
  const size_t got = std::fread(buf, 1, 64, pipe);
  ::pclose(pipe);
  return got == 64 ? std::string(buf) : "";
}

void truncate_by(const fs::path& p, uintmax_t n) { fs::resize_file(p, fs::file_size(p) - n); }

struct OpsFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_ops");
    test_train::write_tiny_dataset(root / "data", 8, 5);
  }
  void TearDown() override { fs::remove_all(root); }

  std::string yaml(const std::string& out, long steps, long save, const std::string& lr = "1.0e-3",
                   const std::string& data = "") const {
    return "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
           "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
           "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
           "training:\n  data:\n    data_path: " + (data.empty() ? (root / "data").string() : data) + "\n"
           "    train_batch_size: 2\n    seed: 3\n"
           "  optimizer:\n    learning_rate: " + lr + "\n    weight_decay: 0.01\n"
           "  loop:\n    max_train_steps: " + std::to_string(steps) + "\n"
           "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: " +
           std::to_string(save) + "\n";
  }
  train::TrainSummary train(const std::string& y, std::vector<std::string> overrides = {}) {
    return train::Trainer(train::parse_run_config(y, overrides), test_train::quiet()).run();
  }
  // A copy of a checkpoint directory to damage.
  fs::path copy_of(const std::string& ckpt, const std::string& name) {
    const fs::path dst = root / name / fs::path(ckpt).filename();
    fs::create_directories(dst.parent_path());
    fs::copy(ckpt, dst, fs::copy_options::recursive);
    return dst;
  }
};

}  // namespace

TEST_F(OpsFixture, EveryKindOfDamageIsDetectedByExportResumeAndLineage) {
  const auto out = (root / "run").string();
  auto s = train(yaml(out, 2, 2));
  ASSERT_EQ(s.checkpoints.size(), 1u);
  const std::string ck = s.checkpoints.back();
  EXPECT_TRUE(train::verify_directory(ck).empty());
  EXPECT_TRUE(train::verify_lineage(ck).empty());
  struct Damage {
    std::string name, file;
    std::function<void(const fs::path&)> apply;
  };
  const std::vector<Damage> damages = {
      {"weights_bitflip", "student/transformer/diffusion_pytorch_model.safetensors", [](auto p) { flip_byte(p, 3); }},
      {"weights_truncated", "student/transformer/diffusion_pytorch_model.safetensors", [](auto p) { truncate_by(p, 16); }},
      {"optimizer_bitflip", "student/optimizer.safetensors", [](auto p) { flip_byte(p, 7); }},
      {"optimizer_truncated", "student/optimizer.safetensors", [](auto p) { truncate_by(p, 1); }},
      {"config_edit", "student/transformer/config.json", [](auto p) { std::ofstream(p, std::ios::app) << " "; }},
      {"state_edit", "trainer_state.json", [](auto p) { flip_byte(p, 5); }},
      {"yaml_edit", "resolved.yaml", [](auto p) { std::ofstream(p, std::ios::app) << "# edited\n"; }},
      {"metadata_edit", "metadata.json",
       [](auto p) {
         std::ifstream f(p);
         auto m = nlohmann::json::parse(f);
         m["checkpoint"]["step"] = 1000;  // no file hash covers this: only the metadata's own hash does
         std::ofstream(p) << m.dump(2);
       }},
      {"stray_file", "student/transformer/extra.safetensors",
       [](auto p) { std::ofstream(p) << "not listed in metadata"; }},
      {"missing_file", "student/optimizer.safetensors", [](auto p) { fs::remove(p); }},
  };
  for (const auto& d : damages) {
    SCOPED_TRACE(d.name);
    const fs::path bad = copy_of(ck, d.name);
    d.apply(bad / d.file);
    auto problems = train::verify_lineage(bad.string());
    ASSERT_FALSE(problems.empty());
    const std::string fname = fs::path(d.file).filename().string();
    bool named = false;
    for (const auto& p : problems) named |= contains(p, fname);
    EXPECT_TRUE(named) << problems[0];
    const std::string exp_err =
        error_of([&] { train::export_checkpoint(bad.string(), (root / (d.name + "_export")).string()); });
    EXPECT_TRUE(contains(exp_err, "integrity")) << exp_err;
    EXPECT_FALSE(fs::exists(root / (d.name + "_export")));
    const std::string res_err = error_of([&] {
      train(yaml((root / (d.name + "_resume")).string(), 3, 1), {"--training.checkpoint.resume_from_checkpoint", bad.string()});
    });
    EXPECT_TRUE(contains(res_err, "resume_from_checkpoint")) << res_err;
    EXPECT_TRUE(contains(res_err, "integrity")) << res_err;
  }
}

TEST_F(OpsFixture, InitFromADamagedExportAndAMissingParentAreRefused) {
  auto s = train(yaml((root / "parent").string(), 1, 1));
  const auto exp = (root / "parent_export").string();
  train::export_checkpoint(s.checkpoints.back(), exp);
  EXPECT_TRUE(train::verify_lineage(exp).empty());
  std::string child = yaml((root / "child").string(), 1, 1);
  child.replace(child.find("random:tiny"), 11, exp);
  auto cs = train(child);
  EXPECT_TRUE(train::verify_lineage(cs.checkpoints.back()).empty());
  // A damaged parent is refused as init_from and fails the child's lineage.
  flip_byte(fs::path(exp) / "transformer" / "diffusion_pytorch_model.safetensors", 2);
  EXPECT_FALSE(train::verify_lineage(cs.checkpoints.back()).empty());
  const std::string err = error_of([&] { train(child, {"--training.checkpoint.output_dir", (root / "child2").string()}); });
  EXPECT_TRUE(contains(err, "models.student.init_from")) << err;
  // A parent that is gone fails verification.
  fs::remove_all(exp);
  auto problems = train::verify_lineage(cs.checkpoints.back());
  ASSERT_FALSE(problems.empty());
  EXPECT_TRUE(contains(problems.back(), "not on disk")) << problems.back();
}

TEST_F(OpsFixture, InfiniteLearningRateSavesNothingAndNamesTheLastGoodCheckpoint) {
  const auto out = (root / "inf").string();
  // A fresh run: nothing may be written and the message must not claim a checkpoint.
  std::string err = error_of([&] { train(yaml(out, 3, 1, ".inf")); });
  EXPECT_TRUE(contains(err, "non-finite")) << err;
  EXPECT_TRUE(contains(err, "role 'student'")) << err;
  EXPECT_TRUE(contains(err, "no checkpoint of this run")) << err;
  EXPECT_TRUE(train::list_checkpoints(out).empty());
  // Two good steps, then resuming with lr=inf: checkpoint-2 is named as the last good one.
  const auto out2 = (root / "inf2").string();
  train(yaml(out2, 2, 1));
  err = error_of([&] {
    train(yaml(out2, 4, 1, ".inf"), {"--training.checkpoint.resume_from_checkpoint", "latest"});
  });
  EXPECT_TRUE(contains(err, "non-finite")) << err;
  EXPECT_TRUE(contains(err, "checkpoint-2")) << err;
  auto all = train::list_checkpoints(out2);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.back().step, 2);
  EXPECT_TRUE(train::verify_directory(all.back().path).empty());
  auto w = model::read_weights((fs::path(all.back().path) / "student").string());
  for (const auto& [k, t] : w.tensors) EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << k;
}

TEST_F(OpsFixture, NonFiniteDataNamesTheFileAndRow) {
  data::SynthOptions so;
  so.latent_t = 2;
  so.latent_h = 4;
  so.latent_w = 4;
  so.text_dim = model::WanConfig::tiny().text_dim;
  data::WriterOptions wo;
  wo.rows_per_file = 4;
  {
    data::ParquetDatasetWriter w((root / "nan_data").string(), wo);
    for (int64_t g = 0; g < 8; ++g) {
      auto r = data::synth_record(so, g);
      if (g == 6) r.latent.view(-1)[5] = std::numeric_limits<float>::quiet_NaN();
      w.add(std::move(r));
    }
    w.close();
  }
  const std::string err =
      error_of([&] { train(yaml((root / "nan_run").string(), 8, 100, "1.0e-3", (root / "nan_data").string())); });
  EXPECT_TRUE(contains(err, "non-finite")) << err;
  EXPECT_TRUE(contains(err, ".parquet row 2")) << err;  // global row 6 = row 2 of the second file
  EXPECT_TRUE(contains(err, "synth_00000006")) << err;
}

TEST_F(OpsFixture, ANewRunNeverReplacesAnotherRun) {
  const auto out = (root / "run").string();
  train(yaml(out, 2, 1));
  const auto before = read_metrics((fs::path(out) / "metrics.jsonl").string()).size();
  std::string err = error_of([&] { train(yaml(out, 2, 1)); });
  EXPECT_TRUE(contains(err, "holds another run")) << err;
  EXPECT_EQ(train::list_checkpoints(out).size(), 2u);
  EXPECT_EQ(read_metrics((fs::path(out) / "metrics.jsonl").string()).size(), before);
  // --overwrite-run replaces it.
  train::TrainerOptions o = test_train::quiet();
  o.overwrite_run = true;
  auto s = train::Trainer(train::parse_run_config(yaml(out, 1, 1)), o).run();
  EXPECT_EQ(train::list_checkpoints(out).size(), 1u);
  // One run per directory: a held lock refuses a second run; a stale lock file is taken over.
  {
    train::RunLock lock(out);
    err = error_of([&] { train(yaml(out, 2, 1), {"--training.checkpoint.resume_from_checkpoint", "latest"}); });
    EXPECT_TRUE(contains(err, "in use by another vqad run")) << err;
    EXPECT_TRUE(contains(err, "pid " + std::to_string(::getpid()))) << err;
  }
  std::ofstream(fs::path(out) / train::kRunLockName) << "pid 999999 host " << "nohost" << " started x\n";
  EXPECT_NO_THROW(train(yaml(out, 2, 1), {"--training.checkpoint.resume_from_checkpoint", "latest"}));
  EXPECT_FALSE(fs::exists(fs::path(out) / train::kRunLockName));
}

TEST_F(OpsFixture, ExportOverwriteReplacesOnlyAnEarlierExport) {
  const auto out = (root / "run").string();
  auto s = train(yaml(out, 2, 1));
  const std::string ck = s.checkpoints.back();
  const auto exp = (root / "exp").string();
  train::export_checkpoint(ck, exp);
  EXPECT_TRUE(contains(error_of([&] { train::export_checkpoint(ck, exp); }), "--overwrite"));
  EXPECT_NO_THROW(train::export_checkpoint(ck, exp, "student", true));  // an earlier export
  // Never a checkpoint, a run directory, the source or what holds it.
  for (const std::string& target : {s.checkpoints.front(), out, ck, (fs::path(ck) / "student").string(), root.string()}) {
    SCOPED_TRACE(target);
    const std::string err = error_of([&] { train::export_checkpoint(ck, target, "student", true); });
    EXPECT_FALSE(err.empty());
    EXPECT_TRUE(fs::exists(target));
  }
  EXPECT_EQ(train::list_checkpoints(out).size(), 2u);
  EXPECT_TRUE(train::verify_directory(ck).empty());
  // A directory with unrelated content is not an export either.
  fs::create_directories(root / "mine");
  std::ofstream(root / "mine" / "notes.txt") << "keep";
  EXPECT_FALSE(error_of([&] { train::export_checkpoint(ck, (root / "mine").string(), "student", true); }).empty());
  EXPECT_TRUE(fs::exists(root / "mine" / "notes.txt"));
}

TEST_F(OpsFixture, StaleTemporaryDirectoriesOfDeadRunsAreRemovedAtStart) {
  const auto out = (root / "run").string();
  train(yaml(out, 1, 1));
  fs::create_directories(fs::path(out) / ".tmp-checkpoint-7-12345" / "student");
  std::ofstream(fs::path(out) / ".tmp-checkpoint-7-12345" / "student" / "x") << "partial";
  // An export temp directory of a dead process on this host, next to the target.
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const fs::path stale_export = root / (std::string(".tmp-export-exp.") + host + ".999999");
  fs::create_directories(stale_export);
  train(yaml(out, 2, 1), {"--training.checkpoint.resume_from_checkpoint", "latest"});
  EXPECT_FALSE(fs::exists(fs::path(out) / ".tmp-checkpoint-7-12345"));
  train::export_checkpoint(train::list_checkpoints(out).back().path, (root / "exp").string());
  EXPECT_FALSE(fs::exists(stale_export));
}

TEST_F(OpsFixture, ResumeUnderADifferentContractRecordsANewLineageSegment) {
  const auto out = (root / "run").string();
  train(yaml(out, 2, 1));
  auto m2 = train::read_metadata(train::list_checkpoints(out).back().path);
  ASSERT_EQ(m2["provenance"]["lineage"]["segments"].size(), 1u);
  train(yaml(out, 3, 1), {"--training.checkpoint.resume_from_checkpoint", "latest"});  // same contract
  auto m3 = train::read_metadata(train::list_checkpoints(out).back().path);
  EXPECT_EQ(m3["provenance"]["lineage"]["segments"].size(), 1u);
  train(yaml(out, 4, 1, "5.0e-4"), {"--training.checkpoint.resume_from_checkpoint", "latest"});
  auto m4 = train::read_metadata(train::list_checkpoints(out).back().path);
  ASSERT_EQ(m4["provenance"]["lineage"]["segments"].size(), 2u) << m4["provenance"]["lineage"].dump();
  EXPECT_EQ(m4["provenance"]["lineage"]["segments"][1]["start_step"], 4);
  EXPECT_EQ(m4["provenance"]["lineage"]["segments"][0]["contract"]["learning_rate"], 1.0e-3);
  EXPECT_EQ(m4["provenance"]["lineage"]["segments"][1]["contract"]["learning_rate"], 5.0e-4);
  EXPECT_EQ(m4["training_contract"]["direct_lineage"], m4["provenance"]["lineage"]);
  EXPECT_TRUE(train::verify_lineage(train::list_checkpoints(out).back().path).empty());
}

TEST(CheckpointWriter, WriteErrorsReachTheCallerAndKeepThePreviousCheckpoint) {
  const fs::path dir = test_train::fresh_test_dir("vqad_ckwriter");
  train::CheckpointWriter w(dir.string(), 0, /*async=*/true);
  auto big = torch::randn({1 << 18});  // 1 MiB
  auto build = [&](train::HostStaging& st, std::vector<train::SnapshotFile>& files) {
    train::SnapshotFile f;
    f.rel = "blob.safetensors";
    f.safetensors = true;
    f.tensors.emplace_back("x", st.stage("x", big));
    files.push_back(std::move(f));
  };
  auto meta = [] { return nlohmann::json{{"metadata_schema", "test"}}; };
  w.save_files(1, build, meta());
  w.wait();
  ASSERT_EQ(w.written().size(), 1u);
  EXPECT_TRUE(train::verify_directory(w.last_good()).empty());
  // The file size limit (ulimit -f) below the checkpoint size: the background write fails.
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  rlimit lim = old;
  lim.rlim_cur = 256 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  w.save_files(2, build, meta());
  std::string err;
  try {
    w.wait();
  } catch (const Error& e) {
    err = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_TRUE(contains(err, "checkpoint-2 was not written")) << err;
  EXPECT_TRUE(contains(err, "File too large")) << err;
  EXPECT_TRUE(contains(err, "checkpoint-1")) << err;
  EXPECT_TRUE(train::verify_directory((dir / "checkpoint-1").string()).empty());
  EXPECT_FALSE(fs::exists(dir / "checkpoint-2"));
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_NE(e.path().filename().string().rfind(".tmp", 0), 0u) << e.path();
  // The writer keeps working afterwards.
  w.save_files(3, build, meta());
  w.wait();
  EXPECT_TRUE(train::verify_directory((dir / "checkpoint-3").string()).empty());
  fs::remove_all(dir);
}

TEST(Sha256, MatchesCoreutilsOnLargeRandomFiles) {
  const fs::path dir = test_train::fresh_test_dir("vqad_sha");
  fs::create_directories(dir);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  for (int64_t n : {0L, 63L, 64L, 65L, 1000003L}) {
    auto bytes = torch::randint(0, 256, {n}, gen, torch::kUInt8);
    const fs::path p = dir / ("f" + std::to_string(n));
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), n);
    EXPECT_EQ(sha256_file(p.string()), coreutils_sha256(p)) << n;
  }
  fs::remove_all(dir);
}

TEST(Sha256, FilesAcrossTheReadChunkBoundaryMatchCoreutils) {
  const fs::path dir = test_train::fresh_test_dir("vqad_sha_chunks");
  fs::create_directories(dir);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const int64_t chunk = int64_t(16) << 20;  // sha256_file reads 16 MiB at a time
  for (int64_t n : {chunk - 1, chunk, chunk + 1, 2 * chunk + 4093}) {
    auto bytes = torch::randint(0, 256, {n}, gen, torch::kUInt8);
    const fs::path p = dir / ("f" + std::to_string(n));
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), n);
    EXPECT_EQ(sha256_file(p.string()), coreutils_sha256(p)) << n;
    fs::remove(p);
  }
  fs::remove_all(dir);
}

TEST(CheckpointWriter, PreparedHostBuffersAreReusedBySaves) {
  train::HostStaging st;
  st.prepare({{"a", {3, 4}, torch::kFloat32, torch::Device(torch::kCPU)},
              {"b", {5}, torch::kBFloat16, torch::Device(torch::kCPU)}});
  EXPECT_EQ(st.allocated_bytes(), 3u * 4 * 4 + 5 * 2);
  auto x = torch::randn({3, 4});
  auto h1 = st.stage("a", x);
  st.record();
  st.synchronize();
  EXPECT_TRUE(torch::equal(h1, x));
  auto h2 = st.stage("a", x * 2);
  EXPECT_EQ(h1.data_ptr(), h2.data_ptr());
  EXPECT_TRUE(torch::equal(h2, x * 2));
  EXPECT_EQ(st.allocated_bytes(), 3u * 4 * 4 + 5 * 2);  // nothing new
  auto h3 = st.stage("a", torch::randn({4, 4}));          // a new shape gets a new buffer
  EXPECT_NE(h3.data_ptr(), h1.data_ptr());
  EXPECT_EQ(st.allocated_bytes(), 3u * 4 * 4 + 5 * 2 + 4 * 4 * 4);
}

// A checkpoint larger than the shard size is written as shards + index (weights and AdamW
// state), verifies, and loads back bit for bit.
TEST(CheckpointWriter, ShardedCheckpointVerifiesAndLoadsBackBitwise) {
  const fs::path dir = test_train::fresh_test_dir("vqad_ckshard");
  torch::manual_seed(3);
  auto make_role = [] {
    auto role = std::make_shared<train::Role>();
    role->name = "student";
    role->config.trainable = true;
    role->model = std::make_shared<model::WanModel>(model::WanConfig::tiny(), model::WanModelOptions{});
    return role;
  };
  auto role = make_role();
  train::RoleOptimizers opts;
  for (auto& p : role->model->parameters()) opts["student"].params.push_back(p);
  opts["student"].adamw = std::make_unique<torch::optim::AdamW>(opts["student"].params, torch::optim::AdamWOptions(1e-3));
  {
    torch::NoGradGuard ng;
    for (auto& p : opts["student"].params) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(7);
      s->exp_avg(torch::randn_like(p));
      s->exp_avg_sq(torch::rand_like(p));
      opts["student"].adamw->state()[p.unsafeGetTensorImpl()] = std::move(s);
    }
  }
  train::RoleMap roles{{"student", role}};
  train::CheckpointWriter w(dir.string(), 0, /*async=*/true, /*shard_bytes=*/64 << 10);
  w.prepare(roles, {"student"}, opts);
  const nlohmann::json state = {{"step", 4}, {"data", nlohmann::json::object()}, {"generator_state", ""}};
  w.save(4, roles, {"student"}, opts, state, "x: 1\n", nlohmann::json{{"metadata_schema", "test"}});
  w.wait();
  const fs::path ck = dir / "checkpoint-4";
  EXPECT_TRUE(train::verify_directory(ck.string()).empty());
  ASSERT_TRUE(fs::is_regular_file(ck / "student/transformer/diffusion_pytorch_model.safetensors.index.json"));
  ASSERT_TRUE(fs::is_regular_file(ck / "student/optimizer.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(ck / "student/optimizer.safetensors"));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(ck / "student")) shards += e.path().filename().string().rfind("optimizer-", 0) == 0;
  EXPECT_GT(shards, 2);
  for (const auto& e : fs::recursive_directory_iterator(ck / "student"))
    if (e.is_regular_file()) EXPECT_LE(fs::file_size(e.path()) >> 10, 64u + 64) << e.path();
  int wshards = 0;
  for (const auto& e : fs::directory_iterator(ck / "student/transformer"))
    wshards += e.path().filename().string().rfind("diffusion_pytorch_model-", 0) == 0;
  EXPECT_GT(wshards, 1);

  auto fresh = make_role();
  train::RoleOptimizers fopts;
  for (auto& p : fresh->model->parameters()) fopts["student"].params.push_back(p);
  fopts["student"].adamw = std::make_unique<torch::optim::AdamW>(fopts["student"].params, torch::optim::AdamWOptions(1e-3));
  train::RoleMap froles{{"student", fresh}};
  train::load_checkpoint_state(ck.string(), froles, {"student"}, fopts);
  auto a = role->model->named_parameters(true), b = fresh->model->named_parameters(true);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) {
    const auto& p = item.value();
    const auto& q = b[item.key()];
    EXPECT_TRUE(torch::equal(p, q)) << item.key();
    const auto& sp = static_cast<const torch::optim::AdamWParamState&>(*opts["student"].adamw->state().at(p.unsafeGetTensorImpl()));
    const auto& sq = static_cast<const torch::optim::AdamWParamState&>(*fopts["student"].adamw->state().at(q.unsafeGetTensorImpl()));
    EXPECT_TRUE(torch::equal(sp.exp_avg(), sq.exp_avg())) << item.key();
    EXPECT_TRUE(torch::equal(sp.exp_avg_sq(), sq.exp_avg_sq())) << item.key();
    EXPECT_EQ(sp.step(), sq.step());
  }
  // The sharded weights are what every reader of a role directory sees (export, init_from).
  auto ws = model::read_weights((ck / "student").string());
  EXPECT_EQ(ws.tensors.size(), a.size());
  // A damaged shard is caught by the integrity check.
  {
    fs::path victim;
    for (const auto& e : fs::directory_iterator(ck / "student"))
      if (e.path().filename().string().rfind("optimizer-00002-of-", 0) == 0) victim = e.path();
    ASSERT_FALSE(victim.empty());
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 3));
    f.put('\x7f');
  }
  auto problems = train::verify_directory(ck.string());
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(contains(problems[0], "optimizer-00002-of-")) << problems[0];
  fs::remove_all(dir);
}

// A decaying LR schedule is computed over max_train_steps: resuming with another total
// follows another curve from then on, which the lineage records; a constant one does not.
TEST_F(OpsFixture, ResumeWithAnotherTotalUnderADecayingScheduleRecordsANewSegment) {
  const auto out = (root / "run").string();
  const std::vector<std::string> cosine = {"--training.optimizer.lr_scheduler", "cosine"};
  train(yaml(out, 2, 1), cosine);
  auto resume = cosine;
  resume.insert(resume.end(), {"--training.checkpoint.resume_from_checkpoint", "latest"});
  train(yaml(out, 4, 1), resume);
  auto m = train::read_metadata(train::list_checkpoints(out).back().path);
  const auto& seg = m["provenance"]["lineage"]["segments"];
  ASSERT_EQ(seg.size(), 2u) << seg.dump();
  EXPECT_EQ(seg[0]["contract"]["lr_schedule_total_steps"], 2);
  EXPECT_EQ(seg[1]["contract"]["lr_schedule_total_steps"], 4);
  EXPECT_EQ(seg[1]["start_step"], 3);
}
