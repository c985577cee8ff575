// VSA students in training on the CPU: training.vsa (sparsity schedule, selection, top_p)
// reaches the student's attention each step, the gates train from zero and the metadata
// records them; configs/sparse_qad/stage2_dmd2.yaml runs with tiny overrides.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/config.h"
#include "vqad/train/metadata.h"
#include "vqad/train/roles.h"
#include "vqad/train/trainer.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct VsaTrainFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_vsa_train");
    // Latents [16, 5, 12, 12] -> grid 5 x 6 x 6 after the patch: 4 C128 cubes, 8 C64.
    data::SynthOptions so;
    so.latent_t = 5;
    so.latent_h = 12;
    so.latent_w = 12;
    so.text_dim = model::WanConfig::tiny().text_dim;
    so.seed = 4;
    data::write_synthetic_dataset((root / "data").string(), 8, so, data::WriterOptions{});
  }
  void TearDown() override { fs::remove_all(root); }

  std::string yaml(const std::string& out, const std::string& vsa) const {
    return "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
           "    init_from: random:tiny\n    trainable: true\n    attention_backend: VSA_QAT_TRAIN_C128\n"
           "    enable_gradient_checkpointing_type: full\n"
           "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
           "training:\n  data:\n    data_path: " + (root / "data").string() + "\n"
           "    train_batch_size: 2\n    seed: 11\n"
           "  optimizer:\n    learning_rate: 1.0e-3\n    weight_decay: 0.01\n    lr_scheduler: constant\n"
           "  loop:\n    max_train_steps: 4\n"
           "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: 4\n"
           "  vsa:\n" + vsa +
           "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n"
           "pipeline:\n  dit_config:\n    quant_config: nvfp4_qat_train\n";
  }
};

}  // namespace

TEST(VsaSchedule, ConstantOrLinearRamp) {
  train::VsaConfig c;
  c.sparsity = 0.9;
  for (long s : {1L, 7L, 1000L}) EXPECT_EQ(train::vsa_sparsity_at_step(c, s), 0.9);
  c.decay_rate = 0.25;
  c.decay_interval_steps = 10;
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 1), 0.0);
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 9), 0.0);
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 10), 0.25);
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 29), 0.5);
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 30), 0.75);
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 40), 0.9);  // clamped at the target
  EXPECT_EQ(train::vsa_sparsity_at_step(c, 5000), 0.9);
}

TEST_F(VsaTrainFixture, SftStudentTrainsWithTheScheduleAndRecordsItsGates) {
  const std::string out = (root / "out").string();
  auto run = train::parse_run_config(
      yaml(out, "    sparsity: 0.5\n    decay_rate: 0.25\n    decay_interval_steps: 2\n    selection: top-p\n"
                "    top_p: 0.9\n"));
  train::Trainer trainer(run, test_train::quiet());
  auto student = trainer.roles().at("student");
  EXPECT_EQ(student->compression_gate_initialization, "zero");
  const auto& spec = student->model->block(0).attention_spec();
  EXPECT_EQ(spec.backend, AttentionBackend::kVsaQatTrainC128);
  EXPECT_EQ(spec.vsa.selection, vsa_ref::Selection::kTopP);
  EXPECT_EQ(spec.vsa.top_p, 0.9);
  auto s = trainer.run();
  ASSERT_EQ(s.losses.size(), 4u);
  for (double l : s.losses) EXPECT_TRUE(std::isfinite(l));
  // The sparsity of each step (1-based): 0, 0.25, 0.25, 0.5.
  const auto rows = read_metrics((fs::path(out) / "metrics.jsonl").string());
  ASSERT_EQ(rows.size(), 4u);
  const double want[] = {0.0, 0.25, 0.25, 0.5};
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(rows[i].at("vsa_sparsity").get<double>(), want[i]) << "step " << i + 1;
  EXPECT_EQ(student->model->block(1).attention_spec().vsa.sparsity, 0.5);
  // The gates start at zero and train (their gradient is dO * out_c).
  EXPECT_GT(student->model->block(0).to_gate_compress->weight.abs().sum().item<double>(), 0.0);
  // Metadata: cube, selection, gates and their initialization.
  ASSERT_EQ(s.checkpoints.size(), 1u);
  const auto meta = train::read_metadata(s.checkpoints.back());
  EXPECT_EQ(meta["attention"]["cube_shape"], nlohmann::json({4, 4, 8}));
  EXPECT_EQ(meta["attention"]["selection"]["mode"], "top-p");
  EXPECT_EQ(meta["attention"]["compression_gates"]["initialization"], "zero");
  EXPECT_EQ(meta["provenance"]["lineage"]["compression_gate_initialization"], "zero");
  // The saved student holds its gates; a VSA role built from it loads them ("checkpoint").
  auto w = model::read_weights((fs::path(s.checkpoints.back()) / "student").string());
  EXPECT_TRUE(w.tensors.count("blocks.0.to_gate_compress.weight"));
  auto again = train::parse_run_config(yaml((root / "again").string(), "    sparsity: 0.5\n"),
                                       {"--models.student.init_from", (fs::path(s.checkpoints.back()) / "student").string()});
  train::Trainer t2(again, test_train::quiet());
  EXPECT_EQ(t2.roles().at("student")->compression_gate_initialization, "checkpoint");
}

TEST_F(VsaTrainFixture, ConfigErrorsNameTheKey) {
  auto expect_error = [&](const std::string& vsa, const std::string& key) {
    try {
      train::parse_run_config(yaml((root / "x").string(), vsa));
      ADD_FAILURE() << "expected an error for " << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  expect_error("    sparsity: 0.9\n    cache_tile_buf: true\n", "training.vsa.cache_tile_buf");
  expect_error("    sparsity: 1.0\n", "training.vsa.sparsity");
  expect_error("    sparsity: 0.5\n    selection: top-q\n", "training.vsa.selection");
  expect_error("    sparsity: 0.5\n    decay_rate: 0.1\n", "training.vsa.decay_interval_steps");
}

TEST_F(VsaTrainFixture, SparseDmd2RecipeRunsTinyOnTheCpu) {
  // configs/sparse_qad/stage2_dmd2.yaml as written, with tiny models, local data and one device.
  data::SynthOptions so;
  so.kind = data::DataKind::TextOnly;
  so.text_dim = model::WanConfig::tiny().text_dim;
  so.seed = 6;
  data::write_synthetic_dataset((root / "text").string(), 4, so, data::WriterOptions{});
  io::save_safetensors((root / "neg.safetensors").string(),
                       {{"negative_prompt", torch::randn({5, model::WanConfig::tiny().text_dim}) * 0.2}});
  const std::string out = (root / "dmd2").string();
  auto run = train::load_run_config(
      std::string(VQAD_SOURCE_DIR) + "/configs/sparse_qad/stage2_dmd2.yaml",
      {"--models.student.init_from", "random:tiny", "--models.teacher.init_from", "random:tiny",
       "--models.critic.init_from", "random:tiny", "--training.distributed.num_gpus", "1",
       "--training.distributed.hsdp_replicate_dim", "1", "--training.data.data_path", (root / "text").string(),
       "--training.data.train_batch_size", "1", "--training.data.num_latent_t", "5",
       "--training.data.num_height", "96", "--training.data.num_width", "96", "--training.loop.max_train_steps",
       "2", "--method.generator_update_interval", "1", "--method.negative_prompt_embedding",
       (root / "neg.safetensors").string(), "--training.checkpoint.output_dir", out,
       "--callbacks.validation.every_steps", "0"});
  EXPECT_EQ(run.role("student").attention_backend, AttentionBackend::kVsaQatTrainC128);
  train::Trainer trainer(run, test_train::quiet());
  const auto s = trainer.run();
  ASSERT_EQ(s.losses.size(), 2u);
  for (double l : s.losses) EXPECT_TRUE(std::isfinite(l));
  const auto rows = read_metrics((fs::path(out) / "metrics.jsonl").string());
  for (const auto& r : rows) EXPECT_EQ(r.at("vsa_sparsity").get<double>(), 0.9);
  // The student (VSA, with its gates) was updated; the teacher and critic are dense.
  EXPECT_GT(trainer.roles().at("student")->model->block(0).to_gate_compress->weight.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(trainer.roles().at("critic")->model->block(0).to_gate_compress, nullptr);
}
