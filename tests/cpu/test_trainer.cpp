// Trainer: resume determinism, export -> init_from round trip, lineage
// verification, NaN guard, config errors before anything is loaded.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/data/synthetic.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/config.h"
#include "vqad/train/metadata.h"
#include "vqad/train/trainer.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct TrainerFixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_trainer");
    test_train::write_tiny_dataset(root / "data", 12, 3);
  }
  void TearDown() override { fs::remove_all(root); }

  std::string yaml(const std::string& out, const std::string& backend = "TORCH_SDPA",
                   const std::string& quant = "none", long steps = 6, long save = 3) const {
    std::string y = "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
                    "    init_from: random:tiny\n    trainable: true\n    attention_backend: " + backend + "\n"
                    "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
                    "training:\n  data:\n    data_path: " + (root / "data").string() + "\n"
                    "    train_batch_size: 2\n    training_cfg_rate: 0.25\n    seed: 11\n"
                    "  optimizer:\n    learning_rate: 1.0e-3\n    weight_decay: 0.01\n    lr_scheduler: cosine\n"
                    "    lr_warmup_steps: 2\n"
                    "  loop:\n    max_train_steps: " + std::to_string(steps) + "\n    gradient_accumulation_steps: 2\n"
                    "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: " +
                    std::to_string(save) + "\n"
                    "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n";
    if (quant != "none") y += "pipeline:\n  dit_config:\n    quant_config: " + quant + "\n";
    return y;
  }
  static train::TrainerOptions quiet() { return test_train::quiet(); }
};

std::vector<double> metric_losses(const fs::path& out) {
  std::vector<double> v;
  for (const auto& r : read_metrics((out / "metrics.jsonl").string())) v.push_back(r.at("loss").get<double>());
  return v;
}

}  // namespace

TEST_F(TrainerFixture, ResumeReproducesUninterruptedRun) {
  const auto a = (root / "straight").string();
  const auto b = (root / "resumed").string();
  train::Trainer(train::parse_run_config(yaml(a)), quiet()).run();
  // Half the steps, then a fresh process-like trainer resuming from `latest`.
  train::Trainer(train::parse_run_config(yaml(b), {"--training.loop.max_train_steps", "3"}), quiet()).run();
  auto s2 = train::Trainer(train::parse_run_config(yaml(b), {"--training.checkpoint.resume_from_checkpoint", "latest"}),
                           quiet())
                .run();
  EXPECT_EQ(s2.first_step, 4);
  auto la = metric_losses(a), lb = metric_losses(b);
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  // Final weights equal too.
  auto wa = model::read_weights((fs::path(a) / "checkpoint-6" / "student").string());
  auto wb = model::read_weights((fs::path(b) / "checkpoint-6" / "student").string());
  for (const auto& [k, t] : wa.tensors) EXPECT_TRUE(torch::equal(t, wb.tensors.at(k))) << k;
}

TEST_F(TrainerFixture, QatStudentTrainsAndExportLoadsBitExact) {
  const auto out = (root / "qat").string();
  auto run = train::parse_run_config(yaml(out, "ATTN_QAT_TRAIN", "nvfp4_qat_train", 2, 2));
  train::Trainer trainer(run, quiet());
  auto s = trainer.run();
  ASSERT_EQ(s.checkpoints.size(), 1u);
  EXPECT_EQ(trainer.roles().at("student")->plan.entries.size(), 20u);  // 2 blocks x (self 4 + cross 4 + ffn 2)
  const auto exp = (root / "export").string();
  train::export_checkpoint(s.checkpoints.back(), exp);
  model::WanModelOptions mo;
  std::shared_ptr<model::WanModel> loaded;
  {
    ops::AttentionBackendScope scope(AttentionBackend::kTorchSdpa);
    loaded = model::wan_from_pretrained(exp, mo);
  }
  auto trained = trainer.roles().at("student")->model->named_parameters();
  auto got = loaded->named_parameters();
  ASSERT_EQ(trained.size(), got.size());
  for (const auto& item : trained) EXPECT_TRUE(torch::equal(item.value().detach(), got[item.key()])) << item.key();
  // Lineage: the export verifies; a tampered weight file fails verification.
  EXPECT_TRUE(train::verify_lineage(exp).empty());
  auto meta = train::read_metadata(exp);
  EXPECT_EQ(meta["checkpoint_state"], "inference_export");
  EXPECT_EQ(meta["training_contract"]["linear_quantization"]["method"], "nvfp4_qat_train");
  const auto wfile = fs::path(exp) / "transformer" / "diffusion_pytorch_model.safetensors";
  {
    std::fstream f(wfile, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  auto problems = train::verify_lineage(exp);
  ASSERT_FALSE(problems.empty());
  EXPECT_NE(problems[0].find("diffusion_pytorch_model.safetensors"), std::string::npos) << problems[0];
}

TEST_F(TrainerFixture, ChildRunRecordsParentLineage) {
  const auto parent_out = (root / "parent").string();
  auto s = train::Trainer(train::parse_run_config(yaml(parent_out, "TORCH_SDPA", "none", 1, 1)), quiet()).run();
  const auto parent_export = (root / "parent_export").string();
  train::export_checkpoint(s.checkpoints.back(), parent_export);
  std::string child = yaml((root / "child").string(), "ATTN_QAT_TRAIN", "none", 1, 1);
  child.replace(child.find("random:tiny"), 11, parent_export);
  auto cs = train::Trainer(train::parse_run_config(child), quiet()).run();
  auto meta = train::read_metadata(cs.checkpoints.back());
  auto parent_meta = train::read_metadata(parent_export);
  const auto& lin = meta["provenance"]["lineage"];
  EXPECT_EQ(lin["checkpoint_id"], parent_meta["checkpoint"]["id"]);
  EXPECT_EQ(lin["kind"], "dense_weight_initialization");  // the parent trained dense (TORCH_SDPA, no QAT)
  EXPECT_EQ(lin["parent_attention_backend"], "TORCH_SDPA");
  EXPECT_EQ(lin["parent_metadata"], parent_meta);
  EXPECT_EQ(meta["training_contract"]["direct_lineage"], lin);
  EXPECT_FALSE(meta.contains("lineage"));
  EXPECT_EQ(meta["metadata_schema_version"], 2);
  EXPECT_TRUE(train::verify_lineage(cs.checkpoints.back()).empty());
  EXPECT_NE(train::lineage_text(meta).find(parent_meta["checkpoint"]["id"].get<std::string>()), std::string::npos);
}

TEST_F(TrainerFixture, NonFiniteLossStopsNamingTheRoleAndKeepsWeights) {
  const auto out = (root / "nan").string();
  train::Trainer trainer(train::parse_run_config(yaml(out, "TORCH_SDPA", "none", 2, 1)), quiet());
  auto& m = *trainer.roles().at("student")->model;
  {
    torch::NoGradGuard g;
    m.proj_out->weight.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  auto before = m.blocks->parameters()[0].detach().clone();
  try {
    trainer.run();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("role 'student'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("non-finite"), std::string::npos) << msg;
  }
  EXPECT_TRUE(torch::equal(before, m.blocks->parameters()[0].detach()));
  EXPECT_TRUE(train::list_checkpoints(out).empty());
}

TEST(TrainCli, TypoInBackendFailsBeforeLoadingAnything) {
  const auto dir = fs::temp_directory_path() / ("vqad_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto cfg = dir / "bad.yaml";
  std::ofstream(cfg) << "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
                        "    init_from: /nonexistent/model\n    attention_backend: ATTN_QAT_TRIAN\n"
                        "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
                        "training:\n  data:\n    data_path: /nonexistent/data\n";
  const std::string cmd = std::string(VQAD_BINARY) + " train " + cfg.string() + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) output += buf;
  const int rc = ::pclose(p);
  EXPECT_NE(rc, 0);
  EXPECT_NE(output.find("models.student.attention_backend"), std::string::npos) << output;
  EXPECT_NE(output.find("ATTN_QAT_TRAIN"), std::string::npos) << output;
  EXPECT_NE(output.find("TORCH_SDPA"), std::string::npos) << output;
  EXPECT_EQ(output.find("/nonexistent"), std::string::npos) << "nothing may be loaded first: " << output;
  fs::remove_all(dir);
}
