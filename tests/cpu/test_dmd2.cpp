// dmd2 on tiny models: the DMD gradient reaching the student's x0 (checked against an
// independent recomputation), update cadence, resume equality, simulate rollout draws,
// score timesteps, checkpoint roles and config errors.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/dmd2.h"
#include "vqad/train/trainer.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct Dmd2Fixture : ::testing::Test {
  fs::path root;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_dmd2");
    test_train::write_tiny_dataset(root / "data", 12, 5);
    test_train::write_tiny_dataset(root / "text", 12, 5, data::DataKind::TextOnly);
    io::save_safetensors((root / "neg.safetensors").string(),
                         {{"negative_prompt", torch::randn({5, model::WanConfig::tiny().text_dim}) * 0.2}});
  }
  void TearDown() override { fs::remove_all(root); }

  std::string yaml(const std::string& out, const std::string& rollout = "data_latent", long steps = 6,
                   long save = 3, long interval = 2, bool negative = true) const {
    std::string y =
        "models:\n"
        "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n"
        "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: false\n    disable_custom_init_weights: true\n    attention_backend: TORCH_SDPA\n"
        "  critic:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
        "    trainable: true\n    disable_custom_init_weights: true\n    attention_backend: TORCH_SDPA\n"
        "method:\n  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method\n"
        "  rollout_mode: " + rollout + "\n"
        "  dmd_denoising_steps: [1000, 941.18, 800]\n"
        "  generator_update_interval: " + std::to_string(interval) + "\n"
        "  min_timestep_ratio: 0.02\n  max_timestep_ratio: 0.98\n  real_score_guidance_scale: 3.5\n"
        "  fake_score_learning_rate: 2.0e-3\n  fake_score_betas: [0.0, 0.999]\n"
        "  fake_score_lr_scheduler: constant\n";
    if (negative) y += "  negative_prompt_embedding: " + (root / "neg.safetensors").string() + "\n";
    y += "training:\n  data:\n    data_path: " + (root / (rollout == "simulate" ? "text" : "data")).string() + "\n"
         "    preprocessed_data_type: " + std::string(rollout == "simulate" ? "text_only" : "t2v") + "\n"
         "    num_latent_t: 2\n    num_height: 32\n    num_width: 32\n"
         "    train_batch_size: 2\n    seed: 21\n"
         "  optimizer:\n    learning_rate: 1.0e-3\n    betas: [0.0, 0.999]\n    weight_decay: 0.01\n"
         "    lr_scheduler: constant_with_warmup\n    lr_warmup_steps: 2\n"
         "  loop:\n    max_train_steps: " + std::to_string(steps) + "\n"
         "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: " +
         std::to_string(save) + "\n"
         "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n"
         "pipeline:\n  flow_shift: 3.0\n  dit_config:\n    quant_config: nvfp4_qat_train\n";
    return y;
  }
  static train::TrainerOptions quiet() { return test_train::quiet(); }
};

std::map<std::string, torch::Tensor> role_weights(const fs::path& ckpt, const std::string& role) {
  return model::read_weights((ckpt / role).string()).tensors;
}

bool same_weights(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a)
    if (!torch::equal(t, b.at(k))) return false;
  return true;
}

}  // namespace

// dL_gen/dx0 = (critic_x0 - teacher_cfg_x0) / mean|x0 - teacher_cfg_x0| / numel, with
// every quantity recomputed here from the models and the same random draws.
TEST_F(Dmd2Fixture, GradientAtX0IsTheNormalizedDmdGradient) {
  train::Trainer trainer(train::parse_run_config(yaml((root / "o").string())), quiet());
  const auto& roles = trainer.roles();
  train::Dmd2Method m(train::parse_run_config(yaml((root / "o").string())), roles.at("student"),
                      roles.at("teacher"), roles.at("critic"));
  auto text = torch::randn({2, 512, model::WanConfig::tiny().text_dim}).mul(0.2).to(torch::kBFloat16);
  auto x0 = torch::randn({2, 16, 2, 4, 4}).requires_grad_(true);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  auto replay = gen.clone();
  auto parts = m.dmd_loss(x0, text, gen);
  parts.loss.backward();
  const auto got = x0.grad();

  // Independent recomputation.
  torch::NoGradGuard ng;
  const double r = static_cast<double>(at::randint(0, 1000, {1}, replay, torch::TensorOptions(torch::kInt64)).item<int64_t>());
  double t = 1000.0 * 3.0 * (r / 1000.0) / (1.0 + 2.0 * (r / 1000.0));
  t = std::min(std::max(t, 20.0), 980.0);
  EXPECT_DOUBLE_EQ(parts.timestep, t);
  auto noise = at::randn({2, 16, 2, 4, 4}, replay, torch::TensorOptions(torch::kFloat32)).to(torch::kBFloat16);
  // Noising and x0 conversion of the flow-matching grid (tested on their own elsewhere).
  const auto& grid = roles.at("student")->grid;
  auto t64 = torch::full({2}, t, torch::kFloat64);
  auto x_t = grid.add_noise(x0.detach().to(torch::kBFloat16), noise, t64);
  auto tt = torch::full({2}, t, torch::kFloat32);
  auto x0_of = [&](train::Role& role, const torch::Tensor& txt) {
    return role.grid.predict_x0(x_t, role.model->forward(x_t, tt, txt), t64).to(torch::kFloat32);
  };
  auto neg = io::load_safetensors((root / "neg.safetensors").string()).begin()->second;
  auto uncond = torch::zeros({1, 512, neg.size(1)});
  uncond[0].narrow(0, 0, neg.size(0)).copy_(neg);
  uncond = uncond.expand({2, -1, -1}).to(torch::kBFloat16);
  auto f = x0_of(*roles.at("critic"), text);
  auto rc = x0_of(*roles.at("teacher"), text);
  auto ru = x0_of(*roles.at("teacher"), uncond);
  auto real = ru + 3.5 * (rc - ru);
  auto expected = (f - real) / (x0.detach() - real).abs().mean() / static_cast<double>(x0.numel());
  const double scale = expected.abs().max().item<double>();
  ASSERT_GT(scale, 0.0);
  const double err = (got - expected).abs().max().item<double>();
  EXPECT_LE(err, 1e-4 * scale) << "max |grad - expected| " << err << " (scale " << scale << ")";
  // And the parts the method reports are the same quantities.
  EXPECT_LE((parts.grad / static_cast<double>(x0.numel()) - expected).abs().max().item<double>(), 1e-4 * scale);
}

// In a real micro-step the gradient that reaches the student's graded x0 is grad / numel.
TEST_F(Dmd2Fixture, StudentStepBackpropagatesTheDmdGradientThroughX0) {
  const auto out = (root / "o").string();
  train::Trainer trainer(train::parse_run_config(yaml(out)), quiet());
  const auto& roles = trainer.roles();
  train::Dmd2Method m(train::parse_run_config(yaml(out)), roles.at("student"), roles.at("teacher"),
                      roles.at("critic"));
  torch::Tensor x0_g, grad;
  m.probe = [&](torch::Tensor& x, const train::DmdLossParts& p) {
    x.retain_grad();
    x0_g = x;
    grad = p.grad;
  };
  data::DatasetOptions dopt;
  dopt.text_dim = model::WanConfig::tiny().text_dim;
  auto ds = data::ParquetDataset::open((root / "data").string(), dopt);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto r = m.micro_step(ds->get_batch({0, 1}), gen, torch::kCPU, /*step=*/2, 1.0);
  ASSERT_TRUE(x0_g.defined());
  EXPECT_EQ(r.metrics.at("update_student"), 1.0);
  auto want = (grad / static_cast<double>(x0_g.numel()));
  auto got = x0_g.grad().to(torch::kFloat32);
  // x0_g is bf16: its gradient is the fp32 value rounded to bf16.
  EXPECT_LE((got - want).abs().max().item<double>(), 1.0 / 128 * want.abs().max().item<double>());
  // The student received a gradient, the critic too (its own loss), the teacher none.
  bool student_grad = false, critic_grad = false;
  for (auto& p : roles.at("student")->model->parameters()) student_grad |= p.grad().defined() && p.grad().abs().sum().item<double>() > 0;
  for (auto& p : roles.at("critic")->model->parameters()) critic_grad |= p.grad().defined() && p.grad().abs().sum().item<double>() > 0;
  for (auto& p : roles.at("teacher")->model->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(student_grad);
  EXPECT_TRUE(critic_grad);
}

TEST_F(Dmd2Fixture, StudentUpdatesExactlyOnMultiplesOfTheInterval) {
  const auto out = fs::path(root / "cadence");
  // Constant LR: every update moves the weights (a warmup starts at LR 0).
  auto s = train::Trainer(train::parse_run_config(yaml(out.string(), "data_latent", 7, 1, 3),
                                                  {"--training.optimizer.lr_scheduler", "constant"}),
                          quiet())
               .run();
  ASSERT_EQ(s.checkpoints.size(), 7u);
  auto metrics = read_metrics((out / "metrics.jsonl").string());
  ASSERT_EQ(metrics.size(), 7u);
  for (long k = 2; k <= 7; ++k) {
    const fs::path prev = out / ("checkpoint-" + std::to_string(k - 1)), cur = out / ("checkpoint-" + std::to_string(k));
    const bool student_changed = !same_weights(role_weights(prev, "student"), role_weights(cur, "student"));
    const bool critic_changed = !same_weights(role_weights(prev, "critic"), role_weights(cur, "critic"));
    EXPECT_EQ(student_changed, k % 3 == 0) << "step " << k;
    EXPECT_TRUE(critic_changed) << "step " << k;
  }
  for (long k = 1; k <= 7; ++k) {
    const auto& rec = metrics[k - 1];
    EXPECT_EQ(rec.at("update_student").get<double>(), k % 3 == 0 ? 1.0 : 0.0) << "step " << k;
    EXPECT_EQ(rec.contains("grad_norm/student"), k % 3 == 0) << "step " << k;
    EXPECT_TRUE(rec.contains("grad_norm/critic"));
  }
  // The critic uses the fake-score learning rate.
  EXPECT_DOUBLE_EQ(metrics[3].at("lr/critic").get<double>(), 2.0e-3);
  // Checkpoints hold the trainable roles only.
  EXPECT_TRUE(fs::is_directory(out / "checkpoint-7" / "student"));
  EXPECT_TRUE(fs::is_directory(out / "checkpoint-7" / "critic"));
  EXPECT_FALSE(fs::exists(out / "checkpoint-7" / "teacher"));
}

TEST_F(Dmd2Fixture, ResumeReproducesUninterruptedRun) {
  for (const std::string rollout : {"data_latent", "simulate"}) {
    SCOPED_TRACE(rollout);
    const auto a = (root / ("straight_" + rollout)).string();
    const auto b = (root / ("resumed_" + rollout)).string();
    train::Trainer(train::parse_run_config(yaml(a, rollout)), quiet()).run();
    train::Trainer(train::parse_run_config(yaml(b, rollout), {"--training.loop.max_train_steps", "3"}), quiet()).run();
    auto s2 = train::Trainer(
                  train::parse_run_config(yaml(b, rollout), {"--training.checkpoint.resume_from_checkpoint", "latest"}),
                  quiet())
                  .run();
    EXPECT_EQ(s2.first_step, 4);
    auto ma = read_metrics((fs::path(a) / "metrics.jsonl").string());
    auto mb = read_metrics((fs::path(b) / "metrics.jsonl").string());
    ASSERT_EQ(ma.size(), 6u);
    ASSERT_EQ(mb.size(), 6u);
    for (size_t i = 0; i < ma.size(); ++i)
      for (const char* key : {"loss", "generator_loss", "fake_score_loss", "update_student"})
        EXPECT_EQ(ma[i].at(key).get<double>(), mb[i].at(key).get<double>()) << key << " step " << i + 1;
    for (const char* role : {"student", "critic"})
      EXPECT_TRUE(same_weights(role_weights(fs::path(a) / "checkpoint-6", role),
                               role_weights(fs::path(b) / "checkpoint-6", role)))
          << role;
    // The generator loss is live on update steps.
    EXPECT_GT(ma[1].at("generator_loss").get<double>(), 0.0);
    // The student's warmup (2 updates) advances per student update (steps 2, 4, 6), the
    // critic's constant fake-score LR applies every step.
    EXPECT_DOUBLE_EQ(mb[1].at("lr/student").get<double>(), 0.0);
    EXPECT_DOUBLE_EQ(mb[3].at("lr/student").get<double>(), 0.5e-3);
    EXPECT_DOUBLE_EQ(mb[5].at("lr/student").get<double>(), 1.0e-3);
    EXPECT_DOUBLE_EQ(mb[4].at("lr/critic").get<double>(), 2.0e-3);
  }
}

// simulate runs all len-1 no-grad student steps whatever step it grades: the generator
// advances by randint + len normal draws of the latent shape.
TEST_F(Dmd2Fixture, SimulateRolloutAlwaysRunsEveryNoGradStep) {
  const auto out = (root / "o").string();
  auto run = train::parse_run_config(yaml(out, "simulate"));
  train::Trainer trainer(run, quiet());
  const auto& roles = trainer.roles();
  train::Dmd2Method m(run, roles.at("student"), roles.at("teacher"), roles.at("critic"));
  auto text = torch::zeros({1, 512, model::WanConfig::tiny().text_dim}, torch::kBFloat16);
  const std::vector<int64_t> shape{1, 16, 2, 4, 4};
  for (uint64_t seed = 0; seed < 6; ++seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto ref = gen.clone();
    auto x0 = m.rollout({}, shape, text, gen, false);
    EXPECT_EQ(x0.sizes().vec(), shape);
    at::randint(0, 3, {1}, ref, torch::TensorOptions(torch::kInt64));
    for (int i = 0; i < 3; ++i) at::randn(shape, ref, torch::TensorOptions(torch::kFloat32));
    EXPECT_TRUE(torch::equal(gen.get_state(), ref.get_state())) << "seed " << seed;
  }
}

TEST_F(Dmd2Fixture, ScoreTimestepsAreShiftedAndClamped) {
  const auto out = (root / "o").string();
  auto run = train::parse_run_config(yaml(out));
  train::Trainer trainer(run, quiet());
  const auto& roles = trainer.roles();
  train::Dmd2Method m(run, roles.at("student"), roles.at("teacher"), roles.at("critic"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto ref = gen.clone();
  double lo = 1e9, hi = -1e9, mean = 0;
  for (int i = 0; i < 4000; ++i) {
    const double t = m.score_timestep(gen);
    const double r = static_cast<double>(at::randint(0, 1000, {1}, ref, torch::TensorOptions(torch::kInt64)).item<int64_t>());
    const double want = std::min(std::max(train::shift_timestep(r, 3.0), 20.0), 980.0);
    ASSERT_EQ(t, want);
    lo = std::min(lo, t);
    hi = std::max(hi, t);
    mean += t / 4000;
  }
  EXPECT_EQ(lo, 20.0);
  EXPECT_EQ(hi, 980.0);
  EXPECT_GT(mean, 600.0);  // shift 3 skews toward high noise (unshifted mean 500)
  EXPECT_EQ(m.denoising_steps(), (std::vector<double>{1000, 941.18, 800}));
}

TEST_F(Dmd2Fixture, ConfigErrorsNameTheKey) {
  const auto out = (root / "o").string();
  // No negative prompt embedding and no cfg_uncond: the teacher's CFG cannot run.
  try {
    train::Trainer(train::parse_run_config(yaml(out, "data_latent", 2, 1, 1, false)), quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("method.negative_prompt_embedding"), std::string::npos) << e.what();
  }
  // cfg_uncond.text zero needs no embedding.
  std::string y = yaml(out, "data_latent", 2, 1, 1, false);
  y.replace(y.find("  fake_score_lr_scheduler"), 0, "  cfg_uncond:\n    text: zero\n");
  EXPECT_NO_THROW(train::Trainer(train::parse_run_config(y), quiet()));
  // A missing embedding file names the key and the path.
  try {
    train::Trainer(train::parse_run_config(yaml(out), {"--method.negative_prompt_embedding", "/nonexistent/neg.st"}),
                   quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/neg.st"), std::string::npos) << e.what();
  }
  // text_only data with data_latent rollout is refused by the config.
  std::string t = yaml(out, "data_latent");
  t.replace(t.find("preprocessed_data_type: t2v"), 27, "preprocessed_data_type: text_only");
  try {
    train::parse_run_config(t);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("method.rollout_mode"), std::string::npos) << e.what();
  }
}

TEST(Dmd2Recipes, StageTwoAndSparseDmd2LoadWithTheSeedValues) {
  auto q = train::parse_run_config(
      [] {
        std::ifstream f(std::string(VQAD_SOURCE_DIR) + "/configs/qad_wan2_1_mixkit/stage2_attn_qat_dmd.yaml");
        return std::string(std::istreambuf_iterator<char>(f), {});
      }());
  ASSERT_EQ(q.method.kind, train::MethodKind::kDmd2);
  const auto& d = q.method.dmd2;
  EXPECT_EQ(d.rollout_mode, train::RolloutMode::kDataLatent);
  EXPECT_EQ(d.dmd_denoising_steps, (std::vector<double>{1000, 757, 522}));
  EXPECT_EQ(d.generator_update_interval, 5);
  EXPECT_EQ(d.real_score_guidance_scale, 3.0);
  EXPECT_EQ(d.fake_score_learning_rate, 2e-6);
  EXPECT_EQ(q.role("student").attention_backend, AttentionBackend::kAttnQatTrain);
  EXPECT_EQ(q.role("teacher").attention_backend, AttentionBackend::kFlashAttn);
  EXPECT_FALSE(q.role("teacher").trainable);
  EXPECT_EQ(q.training.checkpoint.checkpoints_total_limit, 3);

  auto sp = train::load_run_config(std::string(VQAD_SOURCE_DIR) + "/configs/sparse_qad/stage2_dmd2.yaml");
  const auto& s = sp.method.dmd2;
  EXPECT_EQ(s.rollout_mode, train::RolloutMode::kSimulate);
  ASSERT_EQ(s.dmd_denoising_steps.size(), 3u);
  EXPECT_EQ(s.dmd_denoising_steps[0], 1000.0);
  EXPECT_NEAR(s.dmd_denoising_steps[1], 941.18, 0.01);
  EXPECT_EQ(s.dmd_denoising_steps[2], 800.0);
  EXPECT_EQ(s.real_score_guidance_scale, 3.5);
  EXPECT_EQ(s.fake_score_betas, (std::array<double, 2>{0.0, 0.999}));
  EXPECT_EQ(sp.training.optimizer.betas, (std::array<double, 2>{0.0, 0.999}));
  EXPECT_EQ(sp.training.optimizer.learning_rate, 2e-6);
  EXPECT_EQ(s.fake_score_learning_rate, 4e-7);
  EXPECT_EQ(s.generator_update_interval, 5);
  EXPECT_EQ(sp.training.data.preprocessed_data_type, "text_only");
  EXPECT_EQ(sp.role("student").flow_shift, 8.0);
  EXPECT_EQ(sp.role("student").quant_config, "nvfp4_qat_train");
  EXPECT_EQ(sp.role("critic").quant_config, "none");
  EXPECT_EQ(sp.role("student").attention_backend, AttentionBackend::kVsaQatTrainC128);
  EXPECT_EQ(sp.training.vsa.sparsity, 0.9);
  // The VSA student is accepted on the CPU; what stops the recipe with its documented
  // one-GPU override is its placeholder weight path (a tiny run of this recipe is in
  // test_vsa_train.cpp).
  try {
    train::Trainer(train::load_run_config(std::string(VQAD_SOURCE_DIR) + "/configs/sparse_qad/stage2_dmd2.yaml",
                                          {"--training.distributed.num_gpus", "1",
                                           "--training.distributed.hsdp_replicate_dim", "1"}),
                   train::TrainerOptions{});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("attention_backend"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("init_from"), std::string::npos) << e.what();
  }
}

// `vqad bench dmd2` runs the trainer end to end; on the CPU with the tiny preset it is a
// smoke test of the command (the H200 numbers come from the GPU script).
TEST(Dmd2BenchCli, TinyPresetRunsBothRolloutsOnTheCpu) {
  const fs::path dir = fs::temp_directory_path() / ("vqad_bench_dmd2_cli_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string cmd = std::string(VQAD_BINARY) +
                          " bench dmd2 --device cpu --preset tiny --frames 2 --height 4 --width 4 --steps 1 "
                          "--warmup 1 --out " + dir.string() + " > " + (dir.string() + ".log") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir.string() + ".log");
  const std::string out((std::istreambuf_iterator<char>(log)), {});
  ASSERT_EQ(rc, 0) << out;
  std::ifstream f(dir / "dmd2.json");
  ASSERT_TRUE(f.good()) << out;
  auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& r : j["results"]) {
    EXPECT_GT(r["iteration_s_median"].get<double>(), 0.0);
    EXPECT_EQ(r["last_metrics"]["update_student"].get<double>(), 1.0);
  }
  fs::remove_all(dir);
  fs::remove(dir.string() + ".log");
}

// Validation during dmd2 uses the student's few-step DMD sampler.
TEST_F(Dmd2Fixture, ValidationSamplesWithTheDmdSampler) {
  const auto out = root / "val";
  std::string y = yaml(out.string(), "simulate", 2, 0, 1);
  y.replace(y.find("pipeline:"), 0,
            "  validation:\n    _target_: fastvideo.train.methods.ode_init.dmd_validation.ShiftedDMDValidationCallback\n"
            "    dataset_file: " + (root / "text").string() + "\n    every_steps: 2\n    sampling_steps: [2]\n"
            "    sampling_timesteps: [1000, 700]\n    run_at_start: false\n");
  train::Trainer(train::parse_run_config(y), quiet()).run();
  std::map<std::string, std::string> meta;
  auto t = io::load_safetensors((out / "validation" / "step-2" / "samples.safetensors").string(), &meta);
  EXPECT_EQ(t.at("latents").sizes().vec(), (std::vector<int64_t>{12, 16, 2, 4, 4}));
  EXPECT_NE(meta.at("sampler").find("dmd, timesteps [1000.0,700.0]"), std::string::npos) << meta.at("sampler");
  EXPECT_FALSE(fs::exists(out / "validation" / "step-0"));
}

// warp_denoising_step maps each step s to the student grid's timestep at index 1000 - s.
TEST_F(Dmd2Fixture, WarpedDenoisingStepsFollowTheStudentGrid) {
  const auto out = (root / "warp").string();
  auto run = train::parse_run_config(yaml(out), {"--method.warp_denoising_step", "true",
                                                 "--method.dmd_denoising_steps", "[1000, 757, 522]"});
  train::Trainer trainer(run, quiet());
  const auto& g = trainer.roles().at("student")->grid;
  train::Dmd2Method m(run, trainer.roles().at("student"), trainer.roles().at("teacher"), trainer.roles().at("critic"));
  EXPECT_EQ(m.denoising_steps(), (std::vector<double>{g.timestep(0), g.timestep(243), g.timestep(478)}));
  // Shift 3: index 243 is s = 0.757 -> sigma = 3 s / (1 + 2 s) = 0.9034.
  EXPECT_NEAR(m.denoising_steps()[1], 1000.0 * 3 * 0.757 / (1 + 2 * 0.757), 1e-9);
  // Fractional steps cannot be warped.
  auto bad = train::parse_run_config(yaml(out), {"--method.warp_denoising_step", "true"});
  EXPECT_THROW(train::Dmd2Method(bad, trainer.roles().at("student"), trainer.roles().at("teacher"),
                                 trainer.roles().at("critic")),
               Error);
}
