// The BF16 parameter gathers of sharded data parallelism (training.distributed.gather_dtype
// bf16, dist/fully_sharded.h) are exact only if every reader of a parameter that
// WanModel::shard_units marks read_as_bf16 uses it rounded to BF16. On a GPU those readers are
// the CUDA paths: cuBLAS BF16 GEMMs of the cast weights, the patch embedding, the NVFP4 linear
// kernels (weight amax and quantization of bf16(w)) and their straight-through backward in the
// gradient's BF16. This checks them where the CPU tests cannot: one forward and backward of a
// Wan model on CUDA (BF16 compute, deterministic algorithms) with every marked parameter
// replaced by float(bf16(p)) gives the output and every gradient bit for bit as with the fp32
// parameters, for
//   - TORCH_SDPA attention with BF16 linears,
//   - ATTN_QAT_TRAIN with NVFP4 QAT linears (nvfp4_qat_train),
//   - VSA_QAT_TRAIN_C128 (sparsity 0.5, random compression gates) with NVFP4 QAT linears,
//     with block checkpointing;
// and rounding instead the parameters that are not marked (norm weights, modulation tables)
// changes the output, so the check can fail. Every parameter is first moved off the BF16 grid.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "vqad/dist/fully_sharded.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/train/determinism.h"

namespace {

using vqad::AttentionBackend;
using vqad::model::WanConfig;
using vqad::model::WanModel;

struct Case {
  AttentionBackend backend;
  bool nvfp4, ckpt;
  const char* name;
};

struct Step {
  torch::Tensor y;
  std::map<std::string, torch::Tensor> grads;
};

Step run_step(WanModel& m, const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
              const torch::Tensor& w) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  auto y = m.forward(x, t, text);
  (y.to(torch::kFloat32) * w).sum().backward();
  Step s;
  s.y = y.detach().clone();
  for (const auto& item : m.named_parameters()) {
    const auto& g = item.value().grad();
    if (g.defined()) s.grads[item.key()] = g.detach().clone();
  }
  return s;
}

// The first difference between two steps, or "" when they are equal bit for bit.
std::string first_difference(const Step& a, const Step& b) {
  if (!torch::equal(a.y, b.y)) {
    const auto d = (a.y.to(torch::kFloat32) - b.y.to(torch::kFloat32)).abs().max();
    return "output, max |diff| " + std::to_string(d.item<double>());
  }
  if (a.grads.size() != b.grads.size()) return "number of gradients";
  for (const auto& [k, g] : a.grads) {
    auto it = b.grads.find(k);
    if (it == b.grads.end()) return "gradient of " + k + " missing";
    if (!torch::equal(g, it->second))
      return "gradient of " + k + ", max |diff| " + std::to_string((g - it->second).abs().max().item<double>());
  }
  return "";
}

TEST(GatherBf16Cuda, ParametersReadAsBf16GiveTheSameStepWhenRounded) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  vqad::set_deterministic_algorithms(true);
  const torch::Device dev(torch::kCUDA, 0);
  for (const Case c : {Case{AttentionBackend::kTorchSdpa, false, false, "TORCH_SDPA, BF16 linears"},
                       Case{AttentionBackend::kAttnQatTrain, true, false, "ATTN_QAT_TRAIN, NVFP4 linears"},
                       Case{AttentionBackend::kVsaQatTrainC128, true, true,
                            "VSA_QAT_TRAIN_C128, NVFP4 linears, block checkpointing"}}) {
    SCOPED_TRACE(c.name);
    vqad::ops::AttentionSpec spec;
    spec.backend = c.backend;
    spec.vsa.sparsity = 0.5;
    vqad::ops::AttentionBackendScope scope(spec);
    WanConfig cfg = WanConfig::tiny();
    cfg.num_attention_heads = 2;
    cfg.attention_head_dim = 128;  // the VSA kernels' head dimension
    cfg.ffn_dim = 512;
    torch::manual_seed(17);
    WanModel m(cfg, {.device = dev, .compute_dtype = torch::kBFloat16, .gradient_checkpointing = c.ckpt});
    if (vqad::model::is_vsa_backend(c.backend)) m.set_vsa_sparsity(0.5);
    if (c.nvfp4) {
      vqad::model::QuantConfig qc;
      qc.method = vqad::model::QuantMethod::kNvfp4QatTrain;
      std::vector<std::string> names;
      for (const auto& [n, lin] : m.named_linears()) names.push_back(n);
      const auto plan = vqad::model::build_quant_plan(names, qc);
      ASSERT_FALSE(plan.entries.empty());
      vqad::model::apply_quant_plan(m, plan, qc);
    }
    std::set<std::string> marked;
    for (const auto& unit : m.shard_units(1))
      for (const auto& p : unit.params)
        if (p.read_as_bf16) marked.insert(p.name);
    ASSERT_GT(marked.size(), 10u);
    std::map<std::string, torch::Tensor> original;
    {
      torch::NoGradGuard ng;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
      for (auto& item : m.named_parameters()) {
        auto p = item.value();
        // Off the BF16 grid everywhere (the gates too: trained ones are not zero).
        p.add_(at::randn(p.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(dev), 2e-2);
        original[item.key()] = p.detach().clone();
      }
    }
    auto set_params = [&](bool round_marked, bool round_unmarked) {
      torch::NoGradGuard ng;
      for (auto& item : m.named_parameters()) {
        const bool is_marked = marked.count(item.key()) > 0;
        const auto& o = original.at(item.key());
        const bool round = is_marked ? round_marked : round_unmarked;
        item.value().copy_(round ? o.to(torch::kBFloat16).to(torch::kFloat32) : o);
      }
    };
    // Latents [1, 16, 4, 16, 32] -> a 4 x 8 x 16 token grid: 512 tokens, four 4x4x8 cubes.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(29);
    const auto f32 = torch::TensorOptions(torch::kFloat32);
    const auto x = at::randn({1, cfg.in_channels, 4, 16, 32}, gen, f32).to(dev);
    const auto text = at::randn({1, 9, cfg.text_dim}, gen, f32).to(dev);
    const auto w = at::randn({1, cfg.out_channels, 4, 16, 32}, gen, f32).to(dev);
    const auto t = torch::tensor({600.0f}).to(dev);

    set_params(false, false);
    const Step fp32 = run_step(m, x, t, text, w);
    const Step again = run_step(m, x, t, text, w);
    ASSERT_EQ(first_difference(fp32, again), "") << "the step itself is not reproducible";
    set_params(true, false);
    const Step rounded = run_step(m, x, t, text, w);
    EXPECT_EQ(first_difference(fp32, rounded), "")
        << marked.size() << " parameters read as BF16, rounded to BF16";
    set_params(false, true);
    const Step others = run_step(m, x, t, text, w);
    EXPECT_FALSE(torch::equal(others.y, fp32.y)) << "rounding the parameters that are not marked left the output "
                                                    "unchanged: the check would not see a wrong mark";
  }
  vqad::set_deterministic_algorithms(false);
}

}  // namespace
