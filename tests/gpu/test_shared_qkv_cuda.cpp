// linear_quantization.shared_qkv_scale on a GPU: the linears of a tiny Wan model with the
// shared global scales attached on the CPU and on the GPU. Every q/k/v of a self-attention
// and k/v of a cross-attention get one weight global scale, the amax of the group's
// concatenated bf16 weights, the same on both devices; the CUDA forward of each linear
// equals the CPU reference path within the linear tests' tolerance (one bf16 ulp plus fp32
// summation order, tests/gpu/test_nvfp4_linear_cuda.cpp) and uses the shared scale.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_linear.h"

#ifdef VQAD_WITH_TORCH_CUDA

namespace {

using vqad::model::QuantConfig;
using vqad::model::QuantMethod;
using vqad::nvfp4::ScaleMode;

#define REQUIRE_GPU()                                                   \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

float bf16_amax(const torch::Tensor& t) {
  return t.detach().cpu().to(torch::kBFloat16).to(torch::kFloat32).abs().max().item<float>();
}

std::shared_ptr<vqad::ops::WeightScaleGroup> group_of(const std::shared_ptr<vqad::ops::LinearQuant>& q) {
  if (auto d = std::dynamic_pointer_cast<vqad::ops::Nvfp4DynamicLinear>(q)) return d->weight_scale_group();
  if (auto l = std::dynamic_pointer_cast<vqad::ops::Nvfp4QadLinear>(q)) return l->weight_scale_group();
  return nullptr;
}

// The tiny model (seeded), with the k / v weights scaled so that the members of a group have
// different amaxes (the default init gives them about the same one).
std::shared_ptr<vqad::model::WanModel> tiny_model() {
  torch::manual_seed(23);
  auto m = std::make_shared<vqad::model::WanModel>(vqad::model::WanConfig::tiny());
  torch::NoGradGuard ng;
  for (auto& [name, lin] : m->named_linears()) {
    if (name.find("attn1.to_k") != std::string::npos) lin->weight.mul_(3.0f);
    if (name.find("attn1.to_v") != std::string::npos) lin->weight.mul_(0.37f);
    if (name.find("attn2.to_v") != std::string::npos) lin->weight.mul_(2.5f);
  }
  return m;
}

void check_shared_scales(QuantMethod method) {
  QuantConfig cfg;
  cfg.method = method;
  cfg.shared_qkv_scale = true;
  // QAD: the attention linears (unit activation scales), so no amax table is needed.
  if (method == QuantMethod::kNvfp4Qad) cfg.quantize_ffn = false;
  auto cpu = tiny_model();
  auto gpu = tiny_model();
  gpu->to(torch::Device(torch::kCUDA, 0));
  std::vector<std::string> names;
  std::map<std::string, vqad::model::Linear*> lin_cpu, lin_gpu;
  for (auto& [n, l] : cpu->named_linears()) {
    names.push_back(n);
    lin_cpu[n] = l;
  }
  for (auto& [n, l] : gpu->named_linears()) lin_gpu[n] = l;
  const vqad::model::QuantPlan plan = vqad::model::build_quant_plan(names, cfg);
  const auto qc = vqad::model::apply_quant_plan(*cpu, plan, cfg);
  const auto qg = vqad::model::apply_quant_plan(*gpu, plan, cfg);
  std::map<std::string, std::shared_ptr<vqad::ops::LinearQuant>> by_c(qc.begin(), qc.end()), by_g(qg.begin(), qg.end());
  const auto groups = vqad::model::shared_scale_groups(plan);
  ASSERT_EQ(groups.size(), 4u);  // 2 blocks x (self q/k/v, cross k/v)
  torch::NoGradGuard ng;
  int shared_changed_something = 0;
  for (const auto& [gname, members] : groups) {
    EXPECT_EQ(members.size(), gname.find("attn1") != std::string::npos ? 3u : 2u) << gname;
    std::vector<torch::Tensor> ws;
    for (const auto& m : members) ws.push_back(lin_cpu.at(m)->weight);
    // The CPU path's global scale: amax of the group's concatenated bf16 weights.
    const float want = bf16_amax(torch::cat(ws));
    for (const auto& m : members) {
      const auto gc = group_of(by_c.at(m)), gg = group_of(by_g.at(m));
      ASSERT_TRUE(gc && gg) << m;
      EXPECT_EQ(gc->name(), gname);
      EXPECT_EQ(gg->name(), gname);
      EXPECT_EQ(gc->amax().item<float>(), want) << m;
      const torch::Tensor ag = gg->amax();
      EXPECT_TRUE(ag.is_cuda()) << m;
      EXPECT_EQ(ag.cpu().reshape({-1})[0].item<float>(), want) << m;  // the same weight global scale on the GPU
      // Each member's CUDA forward equals the CPU reference path.
      const int64_t k = lin_cpu.at(m)->in_features;
      torch::manual_seed(static_cast<uint64_t>(k + m.size()));
      const torch::Tensor x = (torch::randn({2, 37, k}) * torch::exp(torch::randn({2, 37, k}))).to(torch::kBFloat16);
      const torch::Tensor yc = lin_cpu.at(m)->forward(x);
      const torch::Tensor yg = lin_gpu.at(m)->forward(x.cuda());
      ASSERT_EQ(yg.sizes(), yc.sizes()) << m;
      const torch::Tensor g = yg.cpu().to(torch::kFloat32), c = yc.to(torch::kFloat32);
      EXPECT_FALSE(torch::isnan(g).any().item<bool>()) << m;
      const torch::Tensor tol = c.abs() * std::ldexp(1.0, -7) + 1e-5 * c.abs().max();
      EXPECT_TRUE(((g - c).abs() <= tol).all().item<bool>())
          << m << " max err " << (g - c).abs().max().item<float>();
      EXPECT_GT((g == c).to(torch::kFloat64).mean().item<double>(), 0.9) << m;
      // ... and is the linear with the group's scale (the CPU op given the shared amax).
      const ScaleMode mode = plan.find(m)->activation_mode;
      const auto& w = lin_cpu.at(m)->weight;
      const auto& b = lin_cpu.at(m)->bias;
      EXPECT_TRUE(torch::equal(yc, vqad::ops::nvfp4_linear(x, w, b, mode, 0.0f, torch::full({}, want))));
      if (bf16_amax(w) != want) {
        ++shared_changed_something;
        EXPECT_FALSE(torch::equal(yc, vqad::ops::nvfp4_linear(x, w, b, mode))) << m;
      }
    }
  }
  EXPECT_GE(shared_changed_something, 4);  // the option is not a no-op on these weights
  // Cross-attention q and the output projections keep their own scales.
  for (const auto& [n, q] : qc)
    if (n.find("attn2.to_q") != std::string::npos || n.find("to_out") != std::string::npos)
      EXPECT_FALSE(group_of(q)) << n;
}

TEST(SharedQkvCuda, DynamicLinearsShareOneWeightScaleOnTheGpuAsOnTheCpu) {
  REQUIRE_GPU();
  check_shared_scales(QuantMethod::kNvfp4QatTrain);
}

TEST(SharedQkvCuda, QadLinearsShareOneWeightScaleOnTheGpuAsOnTheCpu) {
  REQUIRE_GPU();
  check_shared_scales(QuantMethod::kNvfp4Qad);
}

}  // namespace

#endif  // VQAD_WITH_TORCH_CUDA
