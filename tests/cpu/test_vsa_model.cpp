// VSA in the Wan model: the block computes to_gate_compress on norm1's output and hands it
// to the VSA op with the post-patchify grid; the gate is never NVFP4-quantized; a
// checkpoint without gates loads them at zero and says so; activation checkpointing gives
// the gradients of the plain forward; the sparsity setter reaches every block.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "vqad/core/error.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/fused_block.h"

namespace fs = std::filesystem;

namespace {

using vqad::AttentionBackend;
using vqad::model::WanConfig;
using vqad::model::WanModel;
using vqad::model::WanModelOptions;

std::shared_ptr<WanModel> make_model(AttentionBackend b, double sparsity, bool ckpt, int64_t seed,
                                     torch::ScalarType dtype = torch::kFloat32) {
  vqad::ops::AttentionSpec spec;
  spec.backend = b;
  spec.vsa.sparsity = sparsity;
  vqad::ops::AttentionBackendScope scope(spec);
  torch::manual_seed(seed);
  return std::make_shared<WanModel>(WanConfig::tiny(), WanModelOptions{torch::kCPU, dtype, ckpt});
}

void copy_weights(WanModel& from, WanModel& to) {
  torch::NoGradGuard ng;
  auto src = from.named_parameters();
  for (auto& item : to.named_parameters()) item.value().copy_(src[item.key()]);
}

void randomize_gates(WanModel& m, double scale) {
  torch::NoGradGuard ng;
  for (int64_t i = 0; i < m.num_blocks(); ++i) {
    auto& g = *m.block(i).to_gate_compress;
    g.weight.copy_(torch::randn_like(g.weight) * scale);
    g.bias.copy_(torch::randn_like(g.bias) * scale);
  }
}

// Latents [1, 16, 5, 12, 12] -> grid 5 x 6 x 6 after the (1, 2, 2) patch: 8 C64 cubes.
struct Batch {
  torch::Tensor x, t, text;
};
Batch batch(int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({1, 16, 5, 12, 12}), torch::tensor({400.0f}), torch::randn({1, 3, WanConfig::tiny().text_dim})};
}

}  // namespace

TEST(VsaModel, BlockPassesTheGateAndTheGridToTheOp) {
  auto m = make_model(AttentionBackend::kVsaQatTrainC64, 0.5, false, 1);
  randomize_gates(*m, 0.2);
  Batch b = batch(2);
  auto e = m->embed(b.x, b.t, b.text);
  EXPECT_EQ(e.cond.grid, (std::array<int64_t, 3>{5, 6, 6}));
  auto& blk = m->block(0);
  // The block's self-attention output, recomputed from its parts.
  torch::NoGradGuard ng;
  auto mod = (blk.scale_shift_table + e.cond.time_mod).chunk(6, 1);
  auto h1 = vqad::ops::modulated_layer_norm(e.hidden, mod[1], mod[0], blk.eps);
  vqad::model::BlockTaps taps;
  blk.forward(e.hidden, e.cond, &taps);
  auto& a = *blk.attn1;
  const int64_t B = 1, L = h1.size(1), H = a.heads;
  auto q = a.norm_q->forward_rope(a.to_q->forward(h1), e.cond.rope_cos, e.cond.rope_sin).reshape({B, L, H, -1});
  auto k = a.norm_k->forward_rope(a.to_k->forward(h1), e.cond.rope_cos, e.cond.rope_sin).reshape({B, L, H, -1});
  auto v = a.to_v->forward(h1).reshape({B, L, H, -1});
  auto gate = blk.to_gate_compress->forward(h1).reshape({B, L, H, -1});
  auto o = vqad::ops::vsa_attention(q, k, v, gate, e.cond.grid, AttentionBackend::kVsaQatTrainC64,
                                    blk.attention_spec().vsa);
  auto want = a.to_out_0->forward(o.reshape({B, L, -1}));
  EXPECT_TRUE(torch::equal(taps.attn_out, want));
  // Without the gate the result differs: the gate is really used.
  auto o0 = vqad::ops::vsa_attention(q, k, v, {}, e.cond.grid, AttentionBackend::kVsaQatTrainC64,
                                     blk.attention_spec().vsa);
  EXPECT_GT((a.to_out_0->forward(o0.reshape({B, L, -1})) - want).abs().max().item<double>(), 1e-4);
}

TEST(VsaModel, DenseSparsityWithoutGateIsCloseToDenseAttention) {
  // VSA_TRAIN at sparsity 0 with zero gates attends to every token: the model equals the
  // TORCH_SDPA model up to the bf16 rounding of P.
  auto vsa = make_model(AttentionBackend::kVsaTrain, 0.0, false, 3);
  auto dense = make_model(AttentionBackend::kTorchSdpa, 0.0, false, 3);
  {
    torch::NoGradGuard ng;
    auto src = dense->named_parameters();
    for (auto& item : vsa->named_parameters())
      if (item.key().find("to_gate_compress") == std::string::npos) item.value().copy_(src[item.key()]);
  }
  Batch b = batch(4);
  torch::NoGradGuard ng;
  auto ov = vsa->forward(b.x, b.t, b.text), od = dense->forward(b.x, b.t, b.text);
  const double err = (ov - od).abs().max().item<double>() / od.abs().max().item<double>();
  std::printf("  VSA_TRAIN sparsity 0 vs TORCH_SDPA: %.2e\n", err);
  EXPECT_LT(err, 1e-2);
  vsa->set_vsa_sparsity(0.8);
  auto os = vsa->forward(b.x, b.t, b.text);
  EXPECT_GT((os - ov).abs().max().item<double>() / od.abs().max().item<double>(), 1e-3)
      << "the sparsity setter did not reach the blocks";
  for (int64_t i = 0; i < vsa->num_blocks(); ++i) EXPECT_EQ(vsa->block(i).attention_spec().vsa.sparsity, 0.8);
  EXPECT_THROW(vsa->set_vsa_sparsity(1.0), vqad::Error);
}

TEST(VsaModel, ActivationCheckpointingGivesTheSameGradients) {
  auto plain = make_model(AttentionBackend::kVsaQatTrainC128, 0.5, false, 5, torch::kBFloat16);
  auto ckpt = make_model(AttentionBackend::kVsaQatTrainC128, 0.5, true, 5, torch::kBFloat16);
  randomize_gates(*plain, 0.1);
  copy_weights(*plain, *ckpt);
  Batch b = batch(6);
  plain->forward(b.x, b.t, b.text).to(torch::kFloat32).square().mean().backward();
  ckpt->forward(b.x, b.t, b.text).to(torch::kFloat32).square().mean().backward();
  auto pp = plain->named_parameters(), cp = ckpt->named_parameters();
  int64_t compared = 0;
  for (auto& item : pp) {
    const auto& g = item.value().grad();
    ASSERT_TRUE(g.defined()) << item.key();
    const torch::Tensor& gc = cp[item.key()].grad();
    ASSERT_TRUE(gc.defined()) << item.key();
    if (item.key().rfind("blocks.", 0) == 0) {
      // Inside a checkpointed block the recomputation is the same arithmetic: bitwise equal.
      EXPECT_TRUE(torch::equal(g, gc)) << item.key();
    } else {
      // Parameters before the blocks (embedders) sum contributions of every block; with
      // checkpointing they arrive in another order, so equal up to bf16 accumulation rounding.
      const double scale = 1.0 + g.abs().max().item<double>();
      EXPECT_LE((g.to(torch::kFloat32) - gc.to(torch::kFloat32)).abs().max().item<double>(), 1e-2 * scale)
          << item.key();
    }
    ++compared;
  }
  EXPECT_GT(pp["blocks.1.to_gate_compress.weight"].grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(compared, static_cast<int64_t>(pp.size()));
}

TEST(VsaModel, GateIsNotQuantized) {
  auto m = make_model(AttentionBackend::kVsaQatTrainC128, 0.9, false, 7);
  vqad::model::QuantConfig qc;
  qc.method = vqad::model::QuantMethod::kNvfp4QatTrain;
  std::vector<std::string> names;
  for (auto& [n, lin] : m->named_linears()) names.push_back(n);
  const auto plan = vqad::model::build_quant_plan(names, qc);
  vqad::model::apply_quant_plan(*m, plan, qc);
  for (auto& [n, lin] : m->named_linears()) {
    if (n.find("to_gate_compress") != std::string::npos) {
      EXPECT_EQ(lin->quant(), nullptr) << n;
      EXPECT_EQ(plan.find(n), nullptr) << n;
    }
  }
  EXPECT_NE(m->block(0).attn1->to_q->quant(), nullptr);
}

TEST(VsaModel, CheckpointWithoutGatesLoadsThemAtZeroAndReportsIt) {
  const fs::path dir = fs::temp_directory_path() / ("vqad_vsa_model_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto dense = make_model(AttentionBackend::kTorchSdpa, 0.0, false, 8);
  vqad::model::save_diffusers(*dense, (dir / "dense").string());
  vqad::model::LoadReport report;
  std::shared_ptr<WanModel> m;
  {
    vqad::ops::AttentionBackendScope scope(AttentionBackend::kVsaQatTrainC128);
    m = vqad::model::wan_from_pretrained((dir / "dense").string(), {}, &report);
  }
  EXPECT_TRUE(report.gates_zeroed());
  EXPECT_EQ(report.zeroed_gate_keys.size(), 2u * static_cast<size_t>(m->num_blocks()));
  EXPECT_EQ(m->block(1).to_gate_compress->weight.abs().sum().item<double>(), 0.0);
  // A VSA checkpoint carries its gates: nothing is zeroed.
  randomize_gates(*m, 0.3);
  vqad::model::save_diffusers(*m, (dir / "vsa").string());
  vqad::model::LoadReport again;
  auto back = vqad::model::wan_from_pretrained((dir / "vsa").string(), {}, &again);
  EXPECT_FALSE(again.gates_zeroed());
  EXPECT_TRUE(torch::equal(back->block(1).to_gate_compress->weight, m->block(1).to_gate_compress->weight));
  fs::remove_all(dir);
}
