// NVFP4 linears on the Wan model: the plan built from the real module names of the
// 1.3B model (on the meta device, no storage), and a tiny model trained one step with
// nvfp4_qat_train, calibrated and toggled with the QAD method.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>
#include <vector>

#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"

namespace {

using vqad::model::QuantConfig;
using vqad::model::QuantMethod;
using vqad::model::WanConfig;
using vqad::model::WanModel;
using vqad::nvfp4::ScaleMode;

std::vector<std::string> linear_names(WanModel& m) {
  std::vector<std::string> names;
  for (const auto& [n, lin] : m.named_linears()) names.push_back(n);
  return names;
}

QuantConfig config_of(QuantMethod m) {
  QuantConfig c;
  c.method = m;
  return c;
}

TEST(Nvfp4LinearWan, Wan13BModelPlanIsTheBlockAttentionAndFfnLinears) {
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  for (bool gate : {false, true}) {
    WanConfig cfg = WanConfig::preset("1.3B");
    cfg.gate_compress = gate;
    WanModel model(cfg, {.device = torch::kMeta});
    const auto names = linear_names(model);
    const auto plan = vqad::model::build_quant_plan(names, config_of(QuantMethod::kNvfp4QatTrain));
    // 30 blocks x (self and cross q/k/v/out + 2 FFN)
    ASSERT_EQ(plan.entries.size(), 300u) << "gate_compress=" << gate;
    std::set<std::string> got;
    for (const auto& e : plan.entries) got.insert(e.module);
    for (int b = 0; b < 30; ++b) {
      const std::string p = "blocks." + std::to_string(b) + ".";
      for (const char* s : {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                            "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"}) {
        EXPECT_EQ(got.count(p + s), 1u) << p + s;
      }
    }
    const auto qad = vqad::model::build_quant_plan(names, config_of(QuantMethod::kNvfp4Qad));
    int stat = 0;
    for (const auto& e : qad.entries) stat += e.activation_mode == ScaleMode::kStatic;
    EXPECT_EQ(stat, 60);
  }
}

struct TinyRun {
  torch::Tensor x, t, text;
};

TinyRun tiny_inputs() {
  torch::manual_seed(5);
  const WanConfig cfg = WanConfig::tiny();
  return {torch::randn({1, cfg.in_channels, 2, 4, 4}), torch::tensor({500.0f}), torch::randn({1, 6, cfg.text_dim})};
}

TEST(Nvfp4LinearWan, TinyModelTrainsWithDynamicLinears) {
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  torch::manual_seed(1);
  WanModel model(WanConfig::tiny(), {.device = torch::kCPU, .compute_dtype = torch::kBFloat16});
  const TinyRun in = tiny_inputs();
  const torch::Tensor dense = model.forward(in.x, in.t, in.text).detach();
  const QuantConfig cfg = config_of(QuantMethod::kNvfp4QatTrain);
  const auto plan = vqad::model::build_quant_plan(linear_names(model), cfg);
  EXPECT_EQ(plan.entries.size(), 20u);  // 2 blocks x 10
  const auto quants = vqad::model::apply_quant_plan(model, plan, cfg);
  EXPECT_EQ(quants.size(), 20u);
  for (const auto& [n, lin] : model.named_linears()) {
    EXPECT_EQ(lin->quant() != nullptr, plan.find(n) != nullptr) << n;
  }
  const torch::Tensor y = model.forward(in.x, in.t, in.text);
  EXPECT_EQ(y.sizes(), dense.sizes());
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_FALSE(torch::equal(y.detach(), dense));
  y.to(torch::kFloat32).pow(2).mean().backward();
  auto* to_q = model.named_linears()[0].second;
  for (const auto& [n, lin] : model.named_linears()) {
    if (n == "blocks.0.attn1.to_q") to_q = lin;
  }
  ASSERT_TRUE(to_q->weight.grad().defined());
  EXPECT_EQ(to_q->weight.grad().scalar_type(), torch::kFloat32);
  EXPECT_GT(to_q->weight.grad().abs().sum().item<float>(), 0.0f);
}

TEST(Nvfp4LinearWan, TinyModelQadCalibrationAndDisable) {
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  torch::manual_seed(2);
  WanModel model(WanConfig::tiny(), {.device = torch::kCPU, .compute_dtype = torch::kBFloat16});
  const TinyRun in = tiny_inputs();
  torch::NoGradGuard no_grad;
  const torch::Tensor dense = model.forward(in.x, in.t, in.text);
  QuantConfig cfg = config_of(QuantMethod::kNvfp4Qad);
  cfg.allow_uncalibrated = true;
  const auto plan = vqad::model::build_quant_plan(linear_names(model), cfg);
  const auto qad = vqad::model::qad_linears(vqad::model::apply_quant_plan(model, plan, cfg));
  ASSERT_EQ(qad.size(), 20u);
  // Uncalibrated static FFN linears refuse to run.
  EXPECT_THROW(model.forward(in.x, in.t, in.text), vqad::Error);
  std::map<std::string, float> amax;
  torch::Tensor while_calibrating;
  {
    vqad::ops::CalibrationScope calib(qad);
    EXPECT_EQ(calib.pending_names().size(), 4u);
    while_calibrating = model.forward(in.x, in.t, in.text);
    amax = calib.finish();
  }
  ASSERT_EQ(amax.size(), 4u);
  for (const auto& [n, v] : amax) EXPECT_GT(v, 0.0f) << n;
  // While calibrating, the static (FFN) linears ran dense and the unit-scale attention
  // projections stayed quantized, so the FFN inputs were those of the quantized model.
  std::vector<std::shared_ptr<vqad::ops::Nvfp4QadLinear>> statics;
  for (const auto& l : qad) {
    if (l->activation_mode() == ScaleMode::kStatic) statics.push_back(l);
  }
  vqad::ops::set_qad_enabled(statics, false);
  EXPECT_TRUE(torch::equal(model.forward(in.x, in.t, in.text), while_calibrating));
  EXPECT_FALSE(torch::equal(while_calibrating, dense));
  vqad::ops::set_qad_enabled(statics, true);
  const torch::Tensor quantized = model.forward(in.x, in.t, in.text);
  EXPECT_FALSE(torch::equal(quantized, dense));
  vqad::ops::set_qad_enabled(qad, false);
  EXPECT_TRUE(torch::equal(model.forward(in.x, in.t, in.text), dense));
  vqad::ops::set_qad_enabled(qad, true);
  EXPECT_TRUE(torch::equal(model.forward(in.x, in.t, in.text), quantized));
  const auto table = vqad::model::export_amax_table(qad);
  EXPECT_EQ(table.size(), 4u);
  EXPECT_TRUE(table.contains("b1.ffn.net.2"));
}

}  // namespace
