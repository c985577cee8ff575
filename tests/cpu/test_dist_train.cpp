// Data parallelism end to end (vqad launch -> vqad train, Gloo on 127.0.0.1): replicated,
// Ulysses SP and sharded meshes of 2 and 4 ranks against one process with the same global
// batch, and checkpoints written at world 4 (replicated, sharded) resumed on smaller worlds.
//
// Tolerance. The runs differ only in the order of fp32 sums (the loss mean over the global
// batch vs a mean of per-rank means, the GEMM blocking of batch 4 vs 2 vs 1, the ring order of
// the all-reduce). The model computes in BF16, so an fp32 difference of one ulp in a GEMM
// result occasionally rounds to the neighbouring BF16 value (a relative 2^-8 at that element):
// step 1 (same weights everywhere) agrees to ~1e-7 in the loss and ~1e-5 in the global gradient
// norm. AdamW then amplifies per element: its first updates are lr * g / (|g| + eps), +-lr for
// most elements, so an element whose gradient is near zero can move by up to 2 lr differently.
// Checked: step-1 loss to 1e-6 and gradient norm to 1e-4 (relative; averaging the sum instead
// of the mean, a missing rank or another sample's noise moves them by > 1e-2), later losses
// to 1e-3, and the weights to a mean absolute difference below 5% of lr with no element
// further apart than the updates of all steps (steps x 2 lr).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "test_dist_util.h"
#include "test_train_util.h"
#include "vqad/core/metrics.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"

namespace fs = std::filesystem;
using namespace vqad;
using test_dist::contains;

namespace {

struct DistTrain : ::testing::Test {
  fs::path root;
  void SetUp() override {
    VQAD_SKIP_WITHOUT_GLOO();
    root = test_train::fresh_test_dir("vqad_dist_train");
    test_train::write_tiny_dataset(root / "data", 16, 3);
  }
  void TearDown() override {
    if (!root.empty()) fs::remove_all(root);
  }

  // Global batch 4 = (world / sp) x per-rank batch; 2 micro-batches per step. The ranks of an
  // SP group share their batch.
  fs::path recipe(int world, const fs::path& out, long steps, long save, int sp = 1, int shard = 1) const {
    const int dp = world / sp;
    const std::string y =
        "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
        "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
        "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
        "training:\n  distributed:\n    num_gpus: " + std::to_string(world) + "\n    sp_size: " + std::to_string(sp) + "\n"
        "    hsdp_replicate_dim: " + std::to_string(world / shard) + "\n    hsdp_shard_dim: " +
        std::to_string(shard) + "\n"
        "  data:\n    data_path: " + (root / "data").string() + "\n"
        "    train_batch_size: " + std::to_string(4 / dp) + "\n    training_cfg_rate: 0.25\n    seed: 11\n"
        "  optimizer:\n    learning_rate: 1.0e-3\n    weight_decay: 0.01\n    lr_scheduler: cosine\n"
        "    lr_warmup_steps: 2\n"
        "  loop:\n    max_train_steps: " + std::to_string(steps) + "\n    gradient_accumulation_steps: 2\n"
        "  checkpoint:\n    output_dir: " + out.string() + "\n    training_state_checkpointing_steps: " +
        std::to_string(save) + "\n"
        "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n";
    const fs::path p = root / ("recipe_w" + std::to_string(world) + "_" + out.filename().string() + ".yaml");
    std::ofstream(p) << y;
    return p;
  }

  test_dist::RunResult train(int world, const fs::path& out, long steps, long save, const std::string& extra = "",
                             int sp = 1, int shard = 1) {
    return train_recipe(world, recipe(world, out, steps, save, sp, shard), extra,
                        root / (out.filename().string() + "_w" + std::to_string(world) + ".log"));
  }

  // `vqad train RECIPE` on the CPU, launched as `world` ranks (one plain process for 1).
  static test_dist::RunResult train_recipe(int world, const fs::path& recipe, const std::string& extra,
                                           const fs::path& log) {
    const std::string cmd = "train " + recipe.string() + " --device cpu --no-progress --dist-timeout 60" + extra;
    return test_dist::run_vqad(world == 1 ? cmd : "launch --nproc " + std::to_string(world) + " " + cmd, log);
  }

  struct Leg {
    int world, sp, shard;
  };
  // Trains `legs` in turn into one output directory, 2 steps each with a checkpoint every 2,
  // each leg resuming the previous one's, and compares with one uninterrupted process. The
  // legs stop early by running with a smaller max_train_steps. A cosine schedule is computed
  // over max_train_steps, so each leg would follow a different LR curve from its first
  // post-warmup update on (a 4-step leg decays to zero at step 4, ~1% off the 6-step run at
  // step 5, on any world size, one process included). The legs therefore use a schedule that
  // does not depend on the total: constant after the warmup.
  void expect_resume_chain(const std::string& name, const std::string& dir, const std::vector<Leg>& legs);

};

// The mesh a checkpoint's trainer state records.
nlohmann::json mesh_of(const fs::path& checkpoint) {
  std::ifstream f(checkpoint / "trainer_state.json");
  return nlohmann::json::parse(f).at("distributed");
}

// A sharded run's checkpoint: each rank of the first shard group wrote its units as its own
// part files, and rank 0 published them with index files (tensor -> part) and one metadata
// listing every file; no parts directory is left behind.
void expect_sharded_layout(const fs::path& out, const std::string& checkpoint, int shard, const std::string& what) {
  const fs::path ck = out / checkpoint;
  for (const auto& [dir, prefix] : {std::pair<std::string, std::string>{"student/transformer", "diffusion_pytorch_model"},
                                    {"student", "optimizer"}}) {
    EXPECT_FALSE(fs::exists(ck / dir / (prefix + ".safetensors"))) << what << ": " << dir << " holds one whole file";
    std::ifstream f(ck / dir / (prefix + ".safetensors.index.json"));
    ASSERT_TRUE(f.good()) << what << ": no index in " << (ck / dir).string();
    const auto index = nlohmann::json::parse(f);
    std::set<std::string> parts;
    for (const auto& [tensor, file] : index.at("weight_map").items()) {
      const std::string name = file.get<std::string>();
      EXPECT_TRUE(fs::is_regular_file(ck / dir / name)) << what << ": " << name;
      EXPECT_NE(name.find("-of-" + std::string(5 - std::to_string(shard).size(), '0') + std::to_string(shard)),
                std::string::npos) << what << ": " << name;
      parts.insert(name);
    }
    EXPECT_GE(parts.size(), 2u) << what << ": " << dir << " was written by one rank";
    // Every part file is listed in the signed metadata (what lineage --verify and resume check).
    std::ifstream m(ck / "metadata.json");
    const auto files = nlohmann::json::parse(m).at("files");
    for (const auto& p : parts) EXPECT_TRUE(files.contains(dir + "/" + p)) << what << ": " << p << " not in metadata";
  }
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_NE(e.path().filename().string().rfind(".parts-", 0), 0u) << what << ": left behind " << e.path();
}

std::vector<double> losses(const fs::path& out) {
  std::vector<double> v;
  for (const auto& r : read_metrics((out / "metrics.jsonl").string())) v.push_back(r.at("loss").get<double>());
  return v;
}

void expect_close_metrics(const fs::path& a, const fs::path& b, const std::string& what) {
  auto ra = read_metrics((a / "metrics.jsonl").string()), rb = read_metrics((b / "metrics.jsonl").string());
  ASSERT_EQ(ra.size(), rb.size()) << what;
  for (size_t i = 0; i < ra.size(); ++i) {
    const double la = ra[i].at("loss").get<double>(), lb = rb[i].at("loss").get<double>();
    EXPECT_NEAR(la, lb, (i == 0 ? 1e-6 : 1e-3) * std::abs(lb)) << what << " step " << i + 1;
  }
  const double ga = ra[0].at("grad_norm/student").get<double>(), gb = rb[0].at("grad_norm/student").get<double>();
  EXPECT_NEAR(ga, gb, 1e-4 * gb) << what << ": step-1 gradient norm";
}

void expect_close_weights(const fs::path& a, const fs::path& b, long steps, const std::string& what) {
  const double lr = 1e-3;
  auto wa = model::read_weights(a.string());
  auto wb = model::read_weights(b.string());
  ASSERT_EQ(wa.tensors.size(), wb.tensors.size()) << what;
  double worst = 0, sum = 0;
  int64_t n = 0;
  for (const auto& [k, t] : wa.tensors) {
    auto d = (t.to(torch::kFloat64) - wb.tensors.at(k).to(torch::kFloat64)).abs();
    worst = std::max(worst, d.max().item<double>());
    sum += d.sum().item<double>();
    n += d.numel();
  }
  EXPECT_LT(sum / static_cast<double>(n), 0.05 * lr) << what << ": mean absolute weight difference";
  EXPECT_LT(worst, 2.0 * lr * static_cast<double>(steps)) << what << ": largest weight difference";
}

void DistTrain::expect_resume_chain(const std::string& name, const std::string& dir, const std::vector<Leg>& legs) {
  const std::string lr = " --training.optimizer.lr_scheduler constant_with_warmup";
  const long steps = 2 * static_cast<long>(legs.size());
  const auto straight = root / ("straight" + std::to_string(steps));  // shared by chains of the same length
  if (!fs::exists(straight / ("checkpoint-" + std::to_string(steps)))) {
    auto one = train(1, straight, steps, 2, lr);
    ASSERT_EQ(one.exit_code, 0) << one.output;
  }
  const auto out = root / dir;
  for (size_t i = 0; i < legs.size(); ++i) {
    const auto& l = legs[i];
    auto r = train(l.world, out, 2 * static_cast<long>(i + 1), 2,
                   lr + (i ? " --training.checkpoint.resume_from_checkpoint latest" : ""), l.sp, l.shard);
    ASSERT_EQ(r.exit_code, 0) << name << ", leg " << i + 1 << "\n" << r.output;
  }
  expect_close_metrics(out, straight, name);
  const std::string last = "checkpoint-" + std::to_string(steps);
  expect_close_weights(out / last / "student", straight / last / "student", steps, name);
}

}  // namespace

TEST_F(DistTrain, ReplicatedWorldsOf2And4MatchOneProcess) {
  auto r1 = train(1, root / "w1", 3, 3);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  ASSERT_EQ(losses(root / "w1").size(), 3u);
  for (int w : {2, 4}) {
    const auto out = root / ("w" + std::to_string(w));
    auto r = train(w, out, 3, 3);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_close_metrics(out, root / "w1", "world " + std::to_string(w));
    expect_close_weights(out / "checkpoint-3" / "student", root / "w1" / "checkpoint-3" / "student", 3,
                         "world " + std::to_string(w));
    // Rank 0 alone wrote the metrics and the checkpoint, with the mesh recorded.
    const auto mesh = mesh_of(out / "checkpoint-3");
    EXPECT_EQ(mesh.at("world_size").get<int>(), w);
    EXPECT_EQ(mesh.at("hsdp_replicate_dim").get<int>(), w);
  }
}

// Ulysses SP 2: world 2 (one SP group, both ranks on the global batch of 4) and world 4 (two
// SP groups x batch 2). The tiny model's 8 tokens are split 4 + 4; q, k, v go to the whole
// sequence for one head each and back. Same tolerances as replication: the SP runs differ from
// one process in the GEMM row blocking (4 tokens per rank) and in the sum of the two ranks'
// partial parameter gradients. A missing SUM over the SP group halves the gradient (the step-1
// gradient norm check fails by 50%), a rank on the wrong slice of RoPE or of the output
// changes the step-1 loss by far more than 1e-6.
TEST_F(DistTrain, SequenceParallelWorldsOf2And4MatchOneProcess) {
  auto r1 = train(1, root / "w1", 3, 3);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  for (int w : {2, 4}) {
    const auto out = root / ("sp2_w" + std::to_string(w));
    auto r = train(w, out, 3, 3, "", 2);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_close_metrics(out, root / "w1", "SP 2, world " + std::to_string(w));
    expect_close_weights(out / "checkpoint-3" / "student", root / "w1" / "checkpoint-3" / "student", 3,
                         "SP 2, world " + std::to_string(w));
    const auto mesh = mesh_of(out / "checkpoint-3");
    EXPECT_EQ(mesh.at("sp_size").get<int>(), 2);
    EXPECT_EQ(mesh.at("dp_size").get<int>(), w / 2);
  }
}

// Sharded data parallelism: every rank holds 1/S of each parameter, gradient and AdamW
// moment; a block's parameters are all-gathered before it runs and again for its backward
// (the linear weights as BF16, the rest fp32), and its gradients reduce-scattered after it.
// The arithmetic is the replicated run's (the same values in every GEMM), so the same
// tolerances hold. Meshes: shard 2;
// replicate 2 x shard 2 under SP 2 with activation checkpointing (the recomputation runs
// after the backward gather); shard 4 with both blocks in one unit kept gathered from
// forward to backward. A shard missing from the gather, a gradient reduced twice or a
// replicate group left out moves the step-1 loss or gradient norm far outside them.
TEST_F(DistTrain, ShardedMeshesMatchOneProcess) {
  auto r1 = train(1, root / "w1", 3, 3);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  struct Mesh {
    int world, sp, shard;
    std::string extra, name;
  };
  const std::vector<Mesh> meshes = {
      {2, 1, 2, "", "shard 2"},
      {4, 2, 2, " --models.student.enable_gradient_checkpointing_type full", "replicate 2 x shard 2, SP 2, checkpointing"},
      {4, 1, 4,
       " --training.distributed.fsdp_modules_per_group 2 --training.distributed.reshard_after_forward false",
       "shard 4, 2 blocks per unit, no reshard"},
      {2, 1, 2, " --training.distributed.accumulate_unreduced_gradients true",
       "shard 2, full gradients accumulated and reduced once per step"}};
  for (size_t i = 0; i < meshes.size(); ++i) {
    const auto& m = meshes[i];
    const auto out = root / ("sharded" + std::to_string(i));
    auto r = train(m.world, out, 3, 3, m.extra, m.sp, m.shard);
    ASSERT_EQ(r.exit_code, 0) << m.name << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "sharded data parallel: parameters, gradients and AdamW state")) << r.output;
    expect_close_metrics(out, root / "w1", m.name);
    expect_close_weights(out / "checkpoint-3" / "student", root / "w1" / "checkpoint-3" / "student", 3, m.name);
    const auto mesh = mesh_of(out / "checkpoint-3");
    EXPECT_EQ(mesh.at("hsdp_shard_dim").get<int>(), m.shard) << m.name;
    EXPECT_EQ(mesh.at("hsdp_replicate_dim").get<int>(), m.world / m.shard) << m.name;
    expect_sharded_layout(out, "checkpoint-3", m.shard, m.name);
  }
  // The recipe accumulates 2 micro-steps: by default each one reduce-scatters every unit's
  // gradients; with accumulate_unreduced_gradients only the last one does (the same units).
  const auto every = read_metrics((root / "sharded0" / "metrics.jsonl").string());
  const auto once = read_metrics((root / "sharded3" / "metrics.jsonl").string());
  ASSERT_EQ(every.size(), once.size());
  for (size_t i = 0; i < once.size(); ++i) {
    const double n_every = every[i].at("reduce_scatters/student").get<double>();
    const double n_once = once[i].at("reduce_scatters/student").get<double>();
    EXPECT_GE(n_once, 3) << "step " << i + 1 << ": the root unit and the two blocks";
    EXPECT_EQ(n_every, 2 * n_once) << "step " << i + 1;
  }
  // The meshes above gather the linear weights as BF16 (training.distributed.gather_dtype
  // bf16, the default); with every parameter gathered as fp32 the run is the same bit for bit
  // (the BF16 compute reads those weights only rounded to BF16), at about twice the bytes.
  {
    const auto out = root / "sharded_fp32_gathers";
    auto r = train(2, out, 3, 3, " --training.distributed.gather_dtype fp32", 1, 2);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "parameters gathered as fp32")) << r.output;
    const auto bf16 = read_metrics((root / "sharded0" / "metrics.jsonl").string());
    const auto fp32 = read_metrics((out / "metrics.jsonl").string());
    ASSERT_EQ(bf16.size(), fp32.size());
    double mib_bf16 = 0, mib_fp32 = 0;
    for (size_t i = 0; i < bf16.size(); ++i) {
      EXPECT_EQ(bf16[i].at("loss").get<double>(), fp32[i].at("loss").get<double>()) << "step " << i + 1;
      EXPECT_EQ(bf16[i].at("grad_norm/student").get<double>(), fp32[i].at("grad_norm/student").get<double>())
          << "step " << i + 1;
      mib_bf16 += bf16[i].at("all_gather_mib/student").get<double>();
      mib_fp32 += fp32[i].at("all_gather_mib/student").get<double>();
    }
    EXPECT_GT(mib_fp32, 0.0);
    EXPECT_LT(mib_bf16, 0.6 * mib_fp32) << "BF16 gathers moved " << mib_bf16 << " MiB, fp32 ones " << mib_fp32;
    auto wa = model::read_weights((root / "sharded0" / "checkpoint-3" / "student").string());
    auto wb = model::read_weights((out / "checkpoint-3" / "student").string());
    ASSERT_EQ(wa.tensors.size(), wb.tensors.size());
    for (const auto& [k, t] : wa.tensors) EXPECT_TRUE(torch::equal(t, wb.tensors.at(k))) << k;
  }
  // The sharded checkpoint is a complete, verifiable one (every file hashed in its metadata).
  auto verify = test_dist::run_vqad("lineage " + (root / "sharded0" / "checkpoint-3").string() + " --verify",
                                    root / "verify.log");
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

// DMD2 under SP 2: student, frozen teacher (with CFG) and critic all run whole-model forwards
// that split the sequence; the rollout, the re-noising and the critic's timesteps are drawn
// alike on both ranks. Same tolerances; both trained roles are compared. Then DMD2 sharded.
TEST_F(DistTrain, Dmd2UnderSequenceParallelAndShardingMatchesItsReference) {
  auto dmd = [&](int world, const fs::path& out, int sp, int shard) {
    const std::string y =
        "models:\n"
        "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: true\n    attention_backend: TORCH_SDPA\n"
        "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: false\n    disable_custom_init_weights: true\n    attention_backend: TORCH_SDPA\n"
        "  critic:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: true\n    disable_custom_init_weights: true\n    attention_backend: TORCH_SDPA\n"
        "method:\n  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method\n"
        "  rollout_mode: data_latent\n  dmd_denoising_steps: [1000, 941.18, 800]\n"
        "  generator_update_interval: 1\n  real_score_guidance_scale: 3.5\n"
        "  fake_score_learning_rate: 1.0e-3\n  fake_score_betas: [0.0, 0.999]\n"
        "  fake_score_lr_scheduler: constant\n  cfg_uncond:\n    text: zero\n"
        "training:\n  distributed:\n    num_gpus: " + std::to_string(world) + "\n    sp_size: " +
        std::to_string(sp) + "\n    hsdp_replicate_dim: " + std::to_string(world / shard) +
        "\n    hsdp_shard_dim: " + std::to_string(shard) + "\n"
        "  data:\n    data_path: " + (root / "data").string() + "\n"
        "    num_latent_t: 2\n    num_height: 32\n    num_width: 32\n    train_batch_size: " +
        std::to_string(2 / (world / sp)) + "\n    seed: 21\n"
        "  optimizer:\n    learning_rate: 1.0e-3\n    betas: [0.0, 0.999]\n    weight_decay: 0.01\n"
        "    lr_scheduler: constant\n"
        "  loop:\n    max_train_steps: 3\n"
        "  checkpoint:\n    output_dir: " + out.string() + "\n    training_state_checkpointing_steps: 3\n"
        "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n"
        "pipeline:\n  flow_shift: 3.0\n";
    const fs::path p = root / (out.filename().string() + ".yaml");
    std::ofstream(p) << y;
    return train_recipe(world, p, "", root / (out.filename().string() + ".log"));
  };
  // Both trained roles of a run against its reference.
  auto expect_twins = [&](const std::string& dir, const std::string& ref, const std::string& name) {
    expect_close_metrics(root / dir, root / ref, name);
    for (const char* role : {"student", "critic"})
      expect_close_weights(root / dir / "checkpoint-3" / role, root / ref / "checkpoint-3" / role, 3,
                           name + " " + role);
  };
  auto one = dmd(1, root / "dmd1", 1, 1);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto sp2 = dmd(2, root / "dmd_sp2", 2, 1);
  ASSERT_EQ(sp2.exit_code, 0) << sp2.output;
  expect_twins("dmd_sp2", "dmd1", "dmd2 SP 2");
  // Sharded: student, frozen teacher and critic all sharded over 2 data-parallel ranks (batch 1
  // each). The distribution-matching gradient is normalized by the mean |x0 - teacher x0| of
  // each rank's batch (as in FastVideo), so data-parallel DMD2 is not the one-process run
  // (step-1 loss 3e-5 apart); the shard-2 run is compared with its replicated twin instead.
  auto rep2 = dmd(2, root / "dmd_rep2", 1, 1);
  ASSERT_EQ(rep2.exit_code, 0) << rep2.output;
  auto shard2 = dmd(2, root / "dmd_shard2", 1, 2);
  ASSERT_EQ(shard2.exit_code, 0) << shard2.output;
  expect_twins("dmd_shard2", "dmd_rep2", "dmd2 shard 2 vs replicate 2");
  EXPECT_TRUE(contains(shard2.output, "state of 3 role(s) split over shard groups of 2")) << shard2.output;
  // The frozen teacher replicated (shard_frozen_roles false) while student and critic stay
  // sharded: the teacher computes with the same fp32 weights, so the run is the same.
  auto frozen = train_recipe(2, root / "dmd_shard2.yaml", " --training.distributed.shard_frozen_roles false "
                             "--training.checkpoint.output_dir " + (root / "dmd_shard2_rt").string(),
                             root / "dmd_shard2_rt.log");
  ASSERT_EQ(frozen.exit_code, 0) << frozen.output;
  EXPECT_TRUE(contains(frozen.output, "state of 2 role(s) split over shard groups of 2 (frozen, replicated on every "
                                      "rank: teacher)")) << frozen.output;
  expect_twins("dmd_shard2_rt", "dmd_shard2", "dmd2 shard 2, teacher replicated vs sharded");
  expect_sharded_layout(root / "dmd_shard2_rt", "checkpoint-3", 2, "dmd2 shard 2");
}

// Checkpoints resumed on other meshes continue like the uninterrupted one-process run: world 4
// -> world 2 -> one process (replicated); SP 2 -> one process; shard 4 -> shard 2 -> one
// process (the sharded state is gathered in full for the checkpoint; losing the AdamW moments
// would change the first resumed update by up to lr per element).
TEST_F(DistTrain, CheckpointsResumeOnOtherMeshes) {
  expect_resume_chain("4 -> 2 -> 1", "resumed", {{4, 1, 1}, {2, 1, 1}, {1, 1, 1}});
  expect_resume_chain("SP 2 -> 1", "sp_resumed", {{2, 2, 1}, {1, 1, 1}});
  expect_resume_chain("shard 4 -> shard 2 -> 1", "sharded_resumed", {{4, 1, 4}, {2, 1, 2}, {1, 1, 1}});
}

// Validation of a sharded student: the ranks of the first shard group sample together, the
// student's units gathered one at a time by its forward, and rank 0 writes. Before the first
// step every rank holds the one-process run's weights, so the samples are the same bits.
TEST_F(DistTrain, ShardedValidationSamplesLikeOneProcess) {
  fs::create_directories(root / "prompts");
  nlohmann::json list = nlohmann::json::array();
  for (int i = 0; i < 2; ++i) {
    const std::string f = "p" + std::to_string(i) + ".safetensors";
    io::save_safetensors((root / "prompts" / f).string(),
                         {{"emb", torch::randn({3 + i, model::WanConfig::tiny().text_dim}) * 0.2}});
    list.push_back({{"caption", "prompt " + std::to_string(i)}, {"embedding", f}});
  }
  std::ofstream(root / "prompts" / "validation.json") << nlohmann::json{{"data", list}}.dump(2);
  const std::string validation =
      "  validation:\n    _target_: fastvideo.train.callbacks.validation.ValidationCallback\n"
      "    dataset_file: " + (root / "prompts" / "validation.json").string() + "\n"
      "    every_steps: 1\n    run_at_start: true\n    sampling_steps: [3]\n    guidance_scale: 3.0\n"
      "    height: 32\n    width: 32\n    num_frames: 5\n    vae: none\n";
  auto run = [&](int world, int shard, const std::string& dir) {
    const auto out = root / dir;
    const fs::path p = recipe(world, out, 1, 1, 1, shard);
    std::ofstream(p, std::ios::app) << validation;
    auto r = train_recipe(world, p, "", root / (dir + ".log"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return io::load_safetensors((out / "validation" / "step-0" / "samples.safetensors").string()).at("latents");
  };
  auto one = run(1, 1, "val1");
  auto sharded = run(2, 2, "val_shard2");
  EXPECT_TRUE(torch::equal(one, sharded)) << "max |difference| " << (one - sharded).abs().max().item<double>();
  EXPECT_TRUE(fs::is_regular_file(root / "val_shard2" / "validation" / "step-1" / "samples.safetensors"));
}

TEST_F(DistTrain, MeshThatDoesNotMatchTheLaunchIsRefused) {
  // num_gpus 2 in one process: the error says how to launch.
  auto one = test_dist::run_vqad("train " + recipe(2, root / "single", 1, 1).string() + " --device cpu --no-progress",
                                 root / "single.log");
  EXPECT_NE(one.exit_code, 0);
  EXPECT_TRUE(contains(one.output, "training.distributed.num_gpus = 2 but this process is one of 1")) << one.output;
  EXPECT_TRUE(contains(one.output, "vqad launch --nproc 2")) << one.output;
  // A sharding option vqad does not offer is refused by name (not silently ignored).
  auto pinned = test_dist::run_vqad("launch --nproc 2 train " + recipe(2, root / "pinned", 1, 1, 1, 2).string() +
                                        " --device cpu --no-progress --training.distributed.pin_cpu_memory true",
                                    root / "pinned.log");
  EXPECT_NE(pinned.exit_code, 0);
  EXPECT_TRUE(contains(pinned.output, "training.distributed.pin_cpu_memory")) << pinned.output;
  EXPECT_TRUE(contains(pinned.output, "no host offload")) << pinned.output;
  // SP must divide the heads (the tiny model has 2).
  auto sp4 = test_dist::run_vqad("launch --nproc 4 train " + recipe(4, root / "sp4", 1, 1, 4).string() +
                                     " --device cpu --no-progress",
                                 root / "sp4.log");
  EXPECT_NE(sp4.exit_code, 0);
  EXPECT_TRUE(contains(sp4.output, "training.distributed.sp_size = 4: Ulysses splits the attention heads over the SP "
                                   "ranks, but models.student has 2 heads")) << sp4.output;
}

