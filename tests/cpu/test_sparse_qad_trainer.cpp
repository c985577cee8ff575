// layer_recon and recon_ode through the trainer on a tiny ODE cache: resume reproduces an
// uninterrupted run bit for bit, the optimizer holds only the trainable scope, frozen
// parameters never move, the metadata records the seeds/004 supervision, and the
// three-stage chain S0 -> S1 -> S2 (exports) verifies with `vqad lineage --verify`.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/data/ode_cache.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/train/metadata.h"
#include "vqad/train/param_groups.h"
#include "vqad/train/trainer.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

const char* kS0 = "[to_q, to_k, to_v, to_out, norm_q, norm_k, attn2, ffn]";

struct SparseQadFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_sparse_qad");
    fs::create_directories(root);
    // A tiny base model both roles start from (the student shares its embeddings).
    {
      ops::AttentionBackendScope scope(AttentionBackend::kTorchSdpa);
      torch::manual_seed(5);
      auto c = model::WanConfig::tiny();
      c.num_layers = 4;
      model::WanModel m(c);
      model::save_diffusers(m, (root / "base").string());
    }
    write_cache(root / "cache", 6);
    test_train::write_tiny_dataset(root / "text", 8, 3, data::DataKind::TextOnly);
    io::save_safetensors((root / "neg.safetensors").string(),
                         {{"negative_prompt", torch::randn({5, model::WanConfig::tiny().text_dim}) * 0.2}});
  }
  void TearDown() override { fs::remove_all(root); }

  // A 48-step shift-8 cache with anchors 0, 4, ..., 44 and random states (the methods
  // only need consistent pairs, not a real teacher trajectory).
  static void write_cache(const fs::path& dir, int64_t n) {
    data::OdeCacheMeta meta;
    meta.geometry = data::OdeGeometry::wan(5, 32, 32);  // latents [16, 2, 4, 4]
    std::vector<int64_t> anchors;
    for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
    meta.schedule = data::OdeSchedule::shifted(8.0f, 48, anchors);
    meta.teacher.model_kind = "wan-t2v-tiny";
    meta.text_len = 512;
    meta.text_dim = model::WanConfig::tiny().text_dim;
    meta.source_kind = "test";
    data::OdeCacheWriter w(dir.string(), meta, n);
    auto g = at::make_generator<at::CPUGeneratorImpl>(17);
    for (int64_t i = 0; i < n; ++i) {
      data::OdeTrajectory t;
      t.id = "traj" + std::to_string(i);
      t.caption = "prompt " + std::to_string(i);
      t.seed = i;
      auto f = torch::TensorOptions(torch::kFloat32);
      t.start_latents = at::randn({12, 16, 2, 4, 4}, g, f).to(torch::kBFloat16);
      t.final_latent = (at::randn({16, 2, 4, 4}, g, f) * 0.5).to(torch::kBFloat16);
      t.prompt_embedding = at::randn({5, meta.text_dim}, g, f) * 0.3;
      w.write(i, t);
    }
    ASSERT_TRUE(w.finalize_if_complete());
  }

  std::string yaml(const std::string& method, const std::string& out, long steps, long save,
                   const std::string& init = "") const {
    const std::string base = (root / "base").string();
    const std::string student_init = init.empty() ? base : init;
    std::string m;
    if (method == "layer_recon") {
      m = "method:\n  _target_: fastvideo.train.methods.layer_reconstruction.method.LayerReconstructionMethod\n"
          "  group_size: 2\n  trainable_modules: " + std::string(kS0) + "\n";
    } else {
      m = "method:\n  _target_: fastvideo.train.methods.reconstruction_ode.method.ReconstructionODEMethod\n"
          "  student_steps: 3\n  trainable_modules: " + std::string(kS0) + "\n";
    }
    return "models:\n"
           "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: " + student_init + "\n"
           "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n    flow_shift: 8.0\n"
           "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: " + base + "\n"
           "    trainable: false\n    disable_custom_init_weights: true\n    attention_backend: TORCH_SDPA\n"
           "    flow_shift: 8.0\n" + m +
           "training:\n  data:\n    data_path: " + (root / "cache").string() + "\n"
           "    train_batch_size: 2\n    seed: 1000\n"
           "  optimizer:\n    learning_rate: 1.0e-3\n    betas: [0.9, 0.999]\n    weight_decay: 0.01\n"
           "  loop:\n    max_train_steps: " + std::to_string(steps) + "\n    gradient_accumulation_steps: 2\n"
           "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: " +
           std::to_string(save) + "\n"
           "callbacks:\n  grad_clip:\n    max_grad_norm: 10.0\n"
           "pipeline:\n  flow_shift: 8.0\n  dit_config:\n    quant_config: nvfp4_qat_train\n";
  }
};

std::vector<double> losses(const std::string& out) {
  std::vector<double> v;
  std::ifstream f(fs::path(out) / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) v.push_back(j["loss"].get<double>());
  }
  return v;
}

void expect_resume_bit_identical(SparseQadFixture& fx, const std::string& method) {
  const auto a = (fx.root / (method + "_straight")).string();
  const auto b = (fx.root / (method + "_resumed")).string();
  train::Trainer(train::parse_run_config(fx.yaml(method, a, 4, 2)), test_train::quiet()).run();
  train::Trainer(train::parse_run_config(fx.yaml(method, b, 2, 2)), test_train::quiet()).run();
  auto s = train::Trainer(train::parse_run_config(fx.yaml(method, b, 4, 2),
                                                  {"--training.checkpoint.resume_from_checkpoint", "latest"}),
                          test_train::quiet())
               .run();
  EXPECT_EQ(s.first_step, 3);
  auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(la[i], lb[i]) << method << " step " << i + 1;
  auto wa = model::read_weights((fs::path(a) / "checkpoint-4" / "student").string());
  auto wb = model::read_weights((fs::path(b) / "checkpoint-4" / "student").string());
  for (const auto& [k, t] : wa.tensors) EXPECT_TRUE(torch::equal(t, wb.tensors.at(k))) << method << " " << k;
}

}  // namespace

TEST_F(SparseQadFixture, LayerReconResumeIsBitIdentical) { expect_resume_bit_identical(*this, "layer_recon"); }

TEST_F(SparseQadFixture, ReconOdeResumeIsBitIdentical) { expect_resume_bit_identical(*this, "recon_ode"); }

TEST_F(SparseQadFixture, OnlyTheScopeTrainsAndTheMetadataRecordsTheSupervision) {
  const auto out = (root / "s0").string();
  train::Trainer t(train::parse_run_config(yaml("layer_recon", out, 2, 2)), test_train::quiet());
  auto& student = *t.roles().at("student");
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : student.model->named_parameters()) before[item.key()] = item.value().detach().clone();
  auto s = t.run();
  size_t trained = 0;
  for (const auto& item : student.model->named_parameters()) {
    const bool scope = train::in_trainable_scope(item.key(), {"to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k",
                                                              "attn2", "ffn"});
    const bool same = torch::equal(before.at(item.key()), item.value().detach());
    if (!scope) EXPECT_TRUE(same) << item.key() << " is outside the trainable scope but changed";
    trained += scope && !same;
  }
  EXPECT_GT(trained, 0u);
  auto meta = train::read_metadata(s.checkpoints.back());
  const auto& sup = meta["training_contract"]["supervision"];
  EXPECT_EQ(sup["protocol_version"], 2);
  EXPECT_EQ(sup["objective"], "fixed_teacher_layer_reconstruction");
  EXPECT_EQ(sup["group_size"], 2);
  EXPECT_EQ(sup["trainable_parameters"].size(), student.trainable_names.size());
  EXPECT_EQ(sup["reference"]["attention_backend"], "TORCH_SDPA");
  EXPECT_EQ(sup["reference"]["weights_sha256"].get<std::string>().size(), 64u);
  EXPECT_EQ(sup["cache"]["schedule"]["teacher_steps"], 48);
  EXPECT_EQ(sup["student_initialization"]["initial_weight_equality_with_reference"], true);
  EXPECT_EQ(meta["provenance"]["lineage"]["kind"], "base_model_initialization");
  EXPECT_EQ(meta["training_contract"]["direct_lineage"], meta["provenance"]["lineage"]);
  EXPECT_TRUE(fs::is_regular_file(fs::path(out) / "resolved.yaml"));
}

TEST_F(SparseQadFixture, ThreeStageChainVerifies) {
  // S0 layer_recon -> export -> S1 recon_ode -> export -> S2 dmd2 (exact shifted schedule) -> export.
  const auto s0 = (root / "s0").string();
  auto r0 = train::Trainer(train::parse_run_config(yaml("layer_recon", s0, 1, 1)), test_train::quiet()).run();
  const auto e0 = (root / "e0").string();
  train::export_checkpoint(r0.checkpoints.back(), e0);
  const auto s1 = (root / "s1").string();
  auto r1 = train::Trainer(train::parse_run_config(yaml("recon_ode", s1, 1, 1, e0)), test_train::quiet()).run();
  auto m1 = train::read_metadata(r1.checkpoints.back());
  EXPECT_EQ(m1["provenance"]["lineage"]["kind"], "dense_qat_weight_initialization");
  EXPECT_EQ(m1["training_contract"]["supervision"]["training_schedule"]["indices"], nlohmann::json({0, 16, 32}));
  EXPECT_EQ(m1["training_contract"]["supervision"]["student_initialization"]["checkpoint_step"], 1);
  const auto e1 = (root / "e1").string();
  train::export_checkpoint(r1.checkpoints.back(), e1);
  const std::string s2 = (root / "s2").string();
  const std::string y2 =
      "models:\n"
      "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: " + e1 + "\n"
      "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n    flow_shift: 8.0\n"
      "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: " + (root / "base").string() + "\n"
      "    trainable: false\n    attention_backend: TORCH_SDPA\n    flow_shift: 8.0\n"
      "  critic:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: " + (root / "base").string() + "\n"
      "    trainable: true\n    attention_backend: TORCH_SDPA\n    flow_shift: 8.0\n"
      "method:\n  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method\n"
      "  rollout_mode: simulate\n  dmd_denoising_steps: [1000.0, 941.1763916015625, 800.0]\n"
      "  generator_update_interval: 1\n  real_score_guidance_scale: 3.5\n"
      "  fake_score_learning_rate: 1.0e-4\n  fake_score_betas: [0.0, 0.999]\n  fake_score_lr_scheduler: constant\n"
      "  negative_prompt_embedding: " + (root / "neg.safetensors").string() + "\n"
      "  shifted_ode_schedule:\n    flow_shift: 8.0\n    teacher_steps: 48\n    student_steps: 3\n"
      "    indices: [0, 16, 32]\n    sigmas: [1.0, 0.9411764144897461, 0.800000011920929]\n"
      "    timesteps: [1000.0, 941.1763916015625, 800.0]\n    version: 1\n"
      "training:\n  data:\n    data_path: " + (root / "text").string() + "\n    preprocessed_data_type: text_only\n"
      "    num_latent_t: 2\n    num_height: 32\n    num_width: 32\n    train_batch_size: 1\n    seed: 1000\n"
      "  optimizer:\n    learning_rate: 1.0e-4\n  loop:\n    max_train_steps: 1\n"
      "  checkpoint:\n    output_dir: " + s2 + "\n    training_state_checkpointing_steps: 1\n"
      "pipeline:\n  flow_shift: 8.0\n  dit_config:\n    quant_config: nvfp4_qat_train\n";
  auto r2 = train::Trainer(train::parse_run_config(y2), test_train::quiet()).run();
  const auto e2 = (root / "e2").string();
  train::export_checkpoint(r2.checkpoints.back(), e2);
  auto problems = train::verify_lineage(e2);
  for (const auto& p : problems) ADD_FAILURE() << p;
  auto m2 = train::read_metadata(e2);
  auto text = train::lineage_text(m2);
  EXPECT_NE(text.find("method dmd2"), std::string::npos) << text;
  EXPECT_NE(text.find("method recon_ode"), std::string::npos) << text;
  EXPECT_NE(text.find("method layer_recon"), std::string::npos) << text;
  EXPECT_TRUE(m2["training_contract"].contains("distillation"));
  EXPECT_FALSE(m2["training_contract"].contains("supervision"));
  // Tampering with the S1 export breaks the chain.
  {
    std::ofstream(fs::path(e1) / "resolved.yaml", std::ios::app) << "# edited\n";
  }
  EXPECT_FALSE(train::verify_lineage(e2).empty());
}

TEST_F(SparseQadFixture, BadConfigsFailBeforeWeightsLoad) {
  auto expect_key = [&](const std::string& y, const std::vector<std::string>& ov, const std::string& key) {
    try {
      train::Trainer(train::parse_run_config(y, ov), test_train::quiet());
      FAIL() << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  const auto out = (root / "bad").string();
  expect_key(yaml("layer_recon", out, 1, 1), {"--method.group_size", "3"}, "method.group_size");
  expect_key(yaml("recon_ode", out, 1, 1), {"--method.student_steps", "24"}, "method.student_steps");
  expect_key(yaml("recon_ode", out, 1, 1), {"--method.student_steps", "5"}, "method.student_steps");
}
