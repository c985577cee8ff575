// Replicated data parallelism end to end (vqad launch -> vqad train, Gloo on 127.0.0.1):
// worlds of 2 and 4 ranks against one process with the same global batch, and a checkpoint
// written at world 4 resumed at world 2 and then at world 1.
//
// Tolerance. The runs differ only in the order of fp32 sums: the loss mean over the global
// batch (one mean of 4 rows vs a mean of per-rank means), the gradient sums of the batch
// rows inside backward, and the all-reduce (ring order over ranks). Each reordering changes
// a sum of k terms by at most ~k ulp of its magnitude, so the per-step loss agrees to a
// relative 1e-5 and the gradients to a relative ~1e-6. AdamW turns a relative gradient error
// e into an update error <= lr * e * (1 + |g| / (sqrt(v) + eps)) per step, i.e. ~lr * 1e-6;
// with lr 1e-3 and 6 steps the weights agree to 1e-7 absolute plus rounding of the weights
// themselves: 1e-6 absolute + 1e-5 relative is used. The check is far below the size of
// one update (lr = 1e-3), so a wrong average (sum instead of mean, a missing rank, another
// sample's noise) fails it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "test_dist_util.h"
#include "test_train_util.h"
#include "vqad/core/metrics.h"
#include "vqad/model/wan/weights.h"

namespace fs = std::filesystem;
using namespace vqad;
using test_dist::contains;

namespace {

struct DistTrain : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_dist_train");
    test_train::write_tiny_dataset(root / "data", 16, 3);
  }
  void TearDown() override { fs::remove_all(root); }

  // Global batch 4 = world x per-rank batch; 2 micro-batches per step.
  fs::path recipe(int world, const fs::path& out, long steps, long save) const {
    const std::string y =
        "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
        "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
        "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
        "training:\n  distributed:\n    num_gpus: " + std::to_string(world) + "\n    sp_size: 1\n"
        "    hsdp_replicate_dim: " + std::to_string(world) + "\n    hsdp_shard_dim: 1\n"
        "  data:\n    data_path: " + (root / "data").string() + "\n"
        "    train_batch_size: " + std::to_string(4 / world) + "\n    training_cfg_rate: 0.25\n    seed: 11\n"
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

  test_dist::RunResult train(int world, const fs::path& out, long steps, long save, const std::string& extra = "") {
    const std::string cmd = "train " + recipe(world, out, steps, save).string() + " --device cpu --no-progress --dist-timeout 60" + extra;
    return test_dist::run_vqad(world == 1 ? cmd : "launch --nproc " + std::to_string(world) + " " + cmd,
                               root / (out.filename().string() + "_w" + std::to_string(world) + ".log"));
  }
};

std::vector<double> losses(const fs::path& out) {
  std::vector<double> v;
  for (const auto& r : read_metrics((out / "metrics.jsonl").string())) v.push_back(r.at("loss").get<double>());
  return v;
}

void expect_close_losses(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << what << " step " << i + 1;
}

void expect_close_weights(const fs::path& a, const fs::path& b, const std::string& what) {
  auto wa = model::read_weights(a.string());
  auto wb = model::read_weights(b.string());
  ASSERT_EQ(wa.tensors.size(), wb.tensors.size()) << what;
  double worst = 0;
  for (const auto& [k, t] : wa.tensors) {
    const auto& u = wb.tensors.at(k);
    EXPECT_TRUE(torch::allclose(t, u, 1e-5, 1e-6)) << what << ": " << k;
    worst = std::max(worst, (t.to(torch::kFloat64) - u.to(torch::kFloat64)).abs().max().item<double>());
  }
  EXPECT_LT(worst, 1e-6) << what;
}

}  // namespace

TEST_F(DistTrain, ReplicatedWorldsOf2And4MatchOneProcess) {
  auto r1 = train(1, root / "w1", 3, 3);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  const auto ref = losses(root / "w1");
  ASSERT_EQ(ref.size(), 3u);
  for (int w : {2, 4}) {
    const auto out = root / ("w" + std::to_string(w));
    auto r = train(w, out, 3, 3);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_close_losses(losses(out), ref, "world " + std::to_string(w));
    expect_close_weights(out / "checkpoint-3" / "student", root / "w1" / "checkpoint-3" / "student",
                         "world " + std::to_string(w));
    // Rank 0 alone wrote the metrics and the checkpoint, with the mesh recorded.
    std::ifstream f(out / "checkpoint-3" / "trainer_state.json");
    auto state = nlohmann::json::parse(f);
    EXPECT_EQ(state.at("distributed").at("world_size").get<int>(), w);
    EXPECT_EQ(state.at("distributed").at("hsdp_replicate_dim").get<int>(), w);
  }
}

TEST_F(DistTrain, CheckpointOfWorld4ResumesOnWorld2ThenOnOneProcess) {
  auto straight = train(1, root / "straight", 6, 2);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto out = root / "resumed";
  auto a = train(4, out, 2, 2);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = train(2, out, 4, 2, " --training.checkpoint.resume_from_checkpoint latest");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  auto c = train(1, out, 6, 2, " --training.checkpoint.resume_from_checkpoint latest");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  expect_close_losses(losses(out), losses(root / "straight"), "4 -> 2 -> 1");
  expect_close_weights(out / "checkpoint-6" / "student", root / "straight" / "checkpoint-6" / "student",
                       "4 -> 2 -> 1");
}

TEST_F(DistTrain, MeshThatDoesNotMatchTheLaunchIsRefused) {
  // num_gpus 2 in one process: the error says how to launch.
  auto one = test_dist::run_vqad("train " + recipe(2, root / "single", 1, 1).string() + " --device cpu --no-progress",
                                 root / "single.log");
  EXPECT_NE(one.exit_code, 0);
  EXPECT_TRUE(contains(one.output, "training.distributed.num_gpus = 2 but this process is one of 1")) << one.output;
  EXPECT_TRUE(contains(one.output, "vqad launch --nproc 2")) << one.output;
  // Sharding is refused by name (not silently replicated).
  auto sharded = test_dist::run_vqad("launch --nproc 2 train " + recipe(2, root / "sharded", 1, 1).string() +
                                         " --device cpu --no-progress --training.distributed.hsdp_replicate_dim 1 "
                                         "--training.distributed.hsdp_shard_dim 2",
                                     root / "sharded.log");
  EXPECT_NE(sharded.exit_code, 0);
  EXPECT_TRUE(contains(sharded.output, "training.distributed.hsdp_shard_dim = 2: sharded data parallelism is not "
                                       "available")) << sharded.output;
}
