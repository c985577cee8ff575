// The shipped recipes on their written meshes: `vqad launch --nproc 4 train RECIPE` on the CPU
// (Gloo on 127.0.0.1) for configs/qad_wan2_1_mixkit/stage1 (SP 4 x shard 4) and stage2 (DMD2,
// replicate 4) and configs/sparse_qad/stage0-2 (replicate 4). Only what a CPU test cannot
// have is overridden: the model weights (random tiny models; stage 1's SP 4 needs the
// 4-head tiny preset) and stage 2's weight override (stage 1's export), the data (synthetic
// parquet rows, a tiny-teacher ODE cache of the recipes' 48-step shape, a negative-prompt
// embedding) and its latent geometry, the number of steps, the output directory, validation
// (off: its prompt files are the recipes' placeholders) and stage 0's group size (5 blocks;
// the tiny model has 2). The distributed keys, methods, backends, quantization and optimizer
// settings are the files' own. Each run must finish on every rank, record a finite loss for
// every step and leave a checkpoint whose trainer state records the recipe's mesh. (That
// the meshes compute what one process computes is DistTrain's subject; this is that the
// recipes as shipped run on their meshes.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "test_dist_util.h"
#include "test_ode_util.h"
#include "test_train_util.h"
#include "vqad/core/metrics.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/config.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct DistRecipes : ::testing::Test {
  fs::path root;
  void SetUp() override {
    VQAD_SKIP_WITHOUT_GLOO();
    root = test_train::fresh_test_dir("vqad_dist_recipes");
    fs::create_directories(root);
  }
  void TearDown() override {
    if (!root.empty()) fs::remove_all(root);
  }

  std::string text_only_data() {
    const fs::path dir = root / "text";
    if (!fs::exists(dir)) {
      data::SynthOptions so;
      so.kind = data::DataKind::TextOnly;
      so.text_dim = model::WanConfig::tiny().text_dim;
      so.seed = 6;
      data::write_synthetic_dataset(dir.string(), 16, so, data::WriterOptions{});
    }
    return dir.string();
  }
  std::string negative_prompt() {
    const fs::path p = root / "negative.safetensors";
    if (!fs::exists(p))
      io::save_safetensors(p.string(),
                           {{"negative_prompt", torch::randn({5, model::WanConfig::tiny().text_dim}) * 0.2}});
    return p.string();
  }
  // The recipes' cache shape: 48 teacher steps at shift 8, anchors every 4th step (so the
  // stage-1 anchors 0, 16, 32 exist), made by the tiny teacher on the CPU; 6 trajectories, so
  // that stage 1's 3 anchors give one global batch (4 ranks x 4).
  std::string ode_cache() {
    auto f = test_ode::make_ode_fixture("vqad_dist_recipes_ode", 3, 6, 48);
    const auto r = test_dist::run_vqad("ode-cache generate " + f.recipe + " --no-progress", root / "ode.log");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const fs::path cache = root / "ode_cache";
    fs::rename(f.dir / "cache", cache);
    fs::remove_all(f.dir);
    return cache.string();
  }

  // `vqad launch --nproc 4 train RECIPE` with the overrides; checks the run as described above.
  void run_recipe(const std::string& recipe, const std::string& overrides, long steps, int sp, int shard) {
    const fs::path out = root / fs::path(recipe).stem();
    const std::string cmd = "launch --nproc 4 train " + std::string(VQAD_SOURCE_DIR) + "/" + recipe +
                            " --device cpu --no-progress --dist-timeout 120" + overrides +
                            " --training.loop.max_train_steps " + std::to_string(steps) +
                            " --training.checkpoint.training_state_checkpointing_steps " + std::to_string(steps) +
                            " --training.checkpoint.output_dir " + out.string() +
                            " --callbacks.validation.every_steps 0"
                            " --training.data.num_latent_t 2 --training.data.num_height 32"
                            " --training.data.num_width 32 --training.data.num_frames 5";
    const auto r = test_dist::run_vqad(cmd, root / (out.filename().string() + ".log"));
    ASSERT_EQ(r.exit_code, 0) << recipe << "\n" << r.output;
    const auto rows = read_metrics((out / "metrics.jsonl").string());
    ASSERT_EQ(rows.size(), static_cast<size_t>(steps)) << recipe;
    for (const auto& row : rows)
      EXPECT_TRUE(std::isfinite(row.at("loss").get<double>())) << recipe << ": " << row.dump();
    std::ifstream f(out / ("checkpoint-" + std::to_string(steps)) / "trainer_state.json");
    ASSERT_TRUE(f.good()) << recipe << ": no checkpoint-" << steps;
    const auto mesh = nlohmann::json::parse(f).at("distributed");
    EXPECT_EQ(mesh.at("world_size").get<int>(), 4) << recipe;
    EXPECT_EQ(mesh.at("sp_size").get<int>(), sp) << recipe;
    EXPECT_EQ(mesh.at("hsdp_shard_dim").get<int>(), shard) << recipe;
    EXPECT_EQ(mesh.at("hsdp_replicate_dim").get<int>(), 4 / shard) << recipe;
  }
};

TEST_F(DistRecipes, QadStage1RunsOnSp4TimesShard4) {
  test_train::write_tiny_dataset(root / "t2v", 8, 3);
  run_recipe("configs/qad_wan2_1_mixkit/stage1_attn_qat_sft.yaml",
             " --models.student.init_from random:tiny-4head --training.data.data_path " + (root / "t2v").string(), 2,
             4, 4);
}

TEST_F(DistRecipes, QadStage2Dmd2RunsOnReplicate4) {
  test_train::write_tiny_dataset(root / "t2v", 16, 4);  // the recipe reads latent rows (t2v)
  run_recipe("configs/qad_wan2_1_mixkit/stage2_attn_qat_dmd.yaml",
             " --models.student.init_from random:tiny --models.student.transformer_override_safetensor ''"
             " --models.teacher.init_from random:tiny --models.critic.init_from random:tiny"
             " --training.data.data_path " + (root / "t2v").string() +
                 " --method.negative_prompt_embedding " + negative_prompt(),
             5, 1, 1);
}

TEST_F(DistRecipes, SparseLineageStagesRunOnReplicate4) {
  const std::string cache = ode_cache();
  const std::string tiny = " --models.student.init_from random:tiny --models.teacher.init_from random:tiny";
  // Groups of 5 blocks need a model of 5k blocks; the tiny model has 2 (groups of 1).
  run_recipe("configs/sparse_qad/stage0_layer_recon.yaml",
             tiny + " --method.group_size 1 --training.data.data_path " + cache, 2, 1, 1);
  run_recipe("configs/sparse_qad/stage1_recon_ode.yaml", tiny + " --training.data.data_path " + cache, 2, 1, 1);
  run_recipe("configs/sparse_qad/stage2_dmd2.yaml",
             tiny + " --models.critic.init_from random:tiny --training.data.data_path " + text_only_data() +
                 " --method.negative_prompt_embedding " + negative_prompt(),
             5, 1, 1);
}

}  // namespace
