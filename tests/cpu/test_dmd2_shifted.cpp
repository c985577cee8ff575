// dmd2 with method.shifted_ode_schedule (seeds/004 S2): the denoising steps, the
// rollout's x0 and re-noising and the validation sampler use the shifted schedule's exact
// fp32 sigmas (checked against an independent recomputation), and a schedule that
// disagrees with the recorded values fails naming the key.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "vqad/core/error.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/dmd2.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/roles.h"

using namespace vqad;

namespace {

std::shared_ptr<train::Role> tiny_role(const std::string& name, bool trainable, uint64_t seed) {
  auto r = std::make_shared<train::Role>();
  r->name = name;
  r->config.name = name;
  r->config.trainable = trainable;
  r->config.flow_shift = 8.0;
  r->grid = train::FlowMatchGrid(8.0);
  model::WanModelOptions o;
  o.compute_dtype = torch::kFloat32;
  torch::manual_seed(seed);
  ops::AttentionBackendScope scope(AttentionBackend::kTorchSdpa);
  r->model = std::make_shared<model::WanModel>(model::WanConfig::tiny(), o);
  return r;
}

std::string dmd_yaml(const std::string& steps, const std::string& sigmas) {
  return "models:\n"
         "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
         "    trainable: true\n    attention_backend: TORCH_SDPA\n    flow_shift: 8.0\n"
         "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
         "    trainable: false\n    attention_backend: TORCH_SDPA\n    flow_shift: 8.0\n"
         "  critic:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
         "    trainable: true\n    attention_backend: TORCH_SDPA\n    flow_shift: 8.0\n"
         "method:\n  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method\n"
         "  rollout_mode: simulate\n  dmd_denoising_steps: " + steps + "\n"
         "  fake_score_learning_rate: 1.0e-4\n  fake_score_betas: [0.0, 0.999]\n"
         "  fake_score_lr_scheduler: constant\n"
         "  cfg_uncond:\n    text: zero\n"
         "  shifted_ode_schedule:\n    flow_shift: 8.0\n    teacher_steps: 48\n    student_steps: 3\n"
         "    indices: [0, 16, 32]\n    sigmas: " + sigmas + "\n"
         "    timesteps: [1000.0, 941.1763916015625, 800.0]\n    version: 1\n"
         "training:\n  data:\n    data_path: /nonexistent\n    preprocessed_data_type: text_only\n"
         "    num_latent_t: 2\n    num_height: 32\n    num_width: 32\n"
         "  optimizer:\n    learning_rate: 1.0e-4\n  loop:\n    max_train_steps: 1\n"
         "  checkpoint:\n    output_dir: /tmp/unused\n"
         "pipeline:\n  flow_shift: 8.0\n";
}

const char* kSteps = "[1000.0, 941.1763916015625, 800.0]";
const char* kSigmas = "[1.0, 0.9411764144897461, 0.800000011920929]";

}  // namespace

TEST(Dmd2Shifted, StepsAndSigmasAreTheScheduleValues) {
  auto run = train::parse_run_config(dmd_yaml(kSteps, kSigmas));
  train::Dmd2Method m(run, tiny_role("student", true, 1), tiny_role("teacher", false, 2),
                      tiny_role("critic", true, 3));
  EXPECT_EQ(m.denoising_steps(), (std::vector<double>{1000.0, 941.1763916015625, 800.0}));
  ASSERT_EQ(m.exact_sigmas().size(), 3u);
  EXPECT_EQ(m.exact_sigmas()[0], 1.0f);
  EXPECT_EQ(m.exact_sigmas()[1], 0.9411764144897461f);
  EXPECT_EQ(m.exact_sigmas()[2], 0.800000011920929f);
}

TEST(Dmd2Shifted, SimulateRolloutUsesTheExactSigmas) {
  auto run = train::parse_run_config(dmd_yaml(kSteps, kSigmas));
  auto student = tiny_role("student", true, 1);
  train::Dmd2Method m(run, student, tiny_role("teacher", false, 2), tiny_role("critic", true, 3));
  const std::vector<int64_t> shape{2, 16, 2, 4, 4};
  auto text = torch::randn({2, 6, model::WanConfig::tiny().text_dim}) * 0.3;
  const float sig[3] = {1.0f, 0.9411764144897461f, 0.800000011920929f};
  const float ts[3] = {1000.0f, 941.1763916015625f, 800.0f};
  for (uint64_t seed : {3u, 4u, 5u, 6u}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto ref_gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    torch::NoGradGuard ng;
    auto got = m.rollout({}, shape, text, gen, false);
    // Independent: the draws in the documented order, x0 = x - sigma v, x' = (1-s') x0 + s' n.
    const int64_t j = at::randint(0, 3, {1}, ref_gen, torch::TensorOptions(torch::kInt64)).item<int64_t>();
    auto x = at::randn(shape, ref_gen, torch::TensorOptions(torch::kFloat32));
    auto noise = x;
    std::vector<torch::Tensor> kept;
    auto v_at = [&](const torch::Tensor& xin, int i) {
      return student->model->forward(xin, torch::full({2}, ts[i], torch::kFloat32), text);
    };
    for (int i = 0; i < 2; ++i) {
      auto x0 = x - sig[i] * v_at(x, i);
      auto n = at::randn(shape, ref_gen, torch::TensorOptions(torch::kFloat32));
      x = (1.0f - sig[i + 1]) * x0 + sig[i + 1] * n;
      kept.push_back(x);
    }
    auto input = j == 0 ? noise : kept[j - 1];
    auto want = input - sig[j] * v_at(input, static_cast<int>(j));
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << "seed " << seed << " j " << j;
  }
}

TEST(Dmd2Shifted, ShiftedSamplerMatchesAnIndependentLoop) {
  auto student = tiny_role("student", true, 1);
  const std::vector<float> sig{1.0f, 0.9411764144897461f, 0.800000011920929f};
  const std::vector<float> ts{1000.0f, 941.1763916015625f, 800.0f};
  auto noise = torch::randn({1, 16, 2, 4, 4});
  auto text = torch::randn({1, 6, model::WanConfig::tiny().text_dim}) * 0.3;
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(9);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(9);
  auto got = train::shifted_dmd_sample(*student->model, noise, text, ts, sig, g1);
  torch::NoGradGuard ng;
  auto x = noise;
  torch::Tensor x0;
  for (int i = 0; i < 3; ++i) {
    x0 = x - sig[i] * student->model->forward(x, torch::full({1}, ts[i]), text);
    if (i < 2) x = (1 - sig[i + 1]) * x0 + sig[i + 1] * at::randn(noise.sizes(), g2, torch::TensorOptions(torch::kFloat32));
  }
  EXPECT_TRUE(torch::allclose(got, x0, 1e-5, 1e-6));
}

TEST(Dmd2Shifted, RecordedValuesThatDisagreeFailNamingTheKey) {
  auto build = [](const std::string& y) {
    auto run = train::parse_run_config(y);
    train::Dmd2Method m(run, tiny_role("student", true, 1), tiny_role("teacher", false, 2),
                        tiny_role("critic", true, 3));
  };
  auto expect_key = [&](const std::string& y, const std::string& key) {
    try {
      build(y);
      FAIL() << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  expect_key(dmd_yaml("[1000, 941.18, 800]", kSigmas), "method.dmd_denoising_steps");
  expect_key(dmd_yaml(kSteps, "[1.0, 0.9411765, 0.8]"), "method.shifted_ode_schedule.sigmas");
}

TEST(Dmd2Shifted, ValidationSamplesOnTheExactScheduleThroughTheRegistry) {
  // The registered validation sampler of dmd2 with shifted_ode_schedule is the shifted DMD
  // sampler: for the same generator it returns exactly shifted_dmd_sample on the schedule.
  auto run = train::parse_run_config(dmd_yaml(kSteps, kSigmas));
  const auto sampler = train::find_method("dmd2")->validation_sampler(run);
  EXPECT_NE(sampler.name.find("exact sigmas"), std::string::npos) << sampler.name;
  auto student = tiny_role("student", true, 1);
  auto noise = torch::randn({1, 16, 2, 4, 4});
  auto text = torch::randn({1, 6, model::WanConfig::tiny().text_dim}) * 0.3;
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(11);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(11);
  std::string description;
  auto got = sampler.sample(*student, noise, text, g1, &description);
  auto want = train::shifted_dmd_sample(*student->model, noise, text, {1000.0f, 941.1763916015625f, 800.0f},
                                        {1.0f, 0.9411764144897461f, 0.800000011920929f}, g2);
  EXPECT_TRUE(torch::equal(got, want));
  EXPECT_NE(description.find("exact sigmas"), std::string::npos) << description;
}
