// The fused block ops on the CPU (ops/fused_block.h): bit for bit the model's composite
// expressions they replaced (forward and autograd), the explicit forward/backward
// formulas the CUDA kernels implement against the composite's autograd, and the input
// checks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "vqad/model/wan/modules.h"
#include "vqad/ops/fused_block.h"

namespace {

using torch::Tensor;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

struct OpRun {
  Tensor out;
  std::vector<Tensor> grads;
};

// fn on fresh leaves of `inputs` (those flagged in `needs_grad`), backpropagates `upstream`.
OpRun run_op(const Fn& fn, const std::vector<Tensor>& inputs, const Tensor& upstream,
        std::vector<bool> needs_grad = {}) {
  std::vector<Tensor> leaves;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool g = needs_grad.empty() || needs_grad[i];
    leaves.push_back(inputs[i].detach().clone().requires_grad_(g));
  }
  OpRun r;
  Tensor out = fn(leaves);
  out.backward(upstream);
  r.out = out.detach();
  for (auto& t : leaves) r.grads.push_back(t.requires_grad() ? t.grad() : Tensor());
  return r;
}

void expect_same_bits(const OpRun& got, const OpRun& want, const std::string& what) {
  EXPECT_EQ(got.out.scalar_type(), want.out.scalar_type()) << what;
  EXPECT_TRUE(torch::equal(got.out, want.out)) << what << ": output";
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    ASSERT_EQ(got.grads[i].defined(), want.grads[i].defined()) << what << ": grad " << i;
    if (!got.grads[i].defined()) continue;
    EXPECT_EQ(got.grads[i].scalar_type(), want.grads[i].scalar_type()) << what << ": grad " << i;
    EXPECT_TRUE(torch::equal(got.grads[i], want.grads[i])) << what << ": grad " << i;
  }
}

double rel_l2(const Tensor& got, const Tensor& want) {
  const Tensor g = got.detach().to(torch::kFloat64), w = want.detach().to(torch::kFloat64);
  EXPECT_EQ(g.sizes(), w.sizes());
  const double den = w.norm().item<double>();
  return (g - w).norm().item<double>() / (den > 0 ? den : 1.0);
}

// Largest distance in bf16 ulps (ordered bit patterns) of the two tensors rounded to
// bf16 over the elements that differ by more than 2^-16 * max |want| (a last-bit fp32
// difference of the terms of a nearly cancelling output can be several ulps of that
// small output), and the fraction of elements that differ at all.
std::pair<int64_t, double> bf16_ulps(const Tensor& got, const Tensor& want) {
  auto ordered = [](const Tensor& t) {
    const Tensor bits = t.detach().to(torch::kCPU).to(torch::kBFloat16).contiguous().view(torch::kInt16).to(torch::kInt64);
    return torch::where(bits < 0, -(bits.bitwise_and(0x7fff)), bits);
  };
  const Tensor d = (ordered(got) - ordered(want)).abs();
  const Tensor g = got.detach().to(torch::kBFloat16).to(torch::kFloat64);
  const Tensor w = want.detach().to(torch::kBFloat16).to(torch::kFloat64);
  const Tensor above = (g - w).abs().gt(std::ldexp(w.abs().max().item<double>(), -16));
  return {(d * above).max().item<int64_t>(), d.ne(0).to(torch::kFloat64).mean().item<double>()};
}

Tensor round_to(const Tensor& t, torch::ScalarType dt) { return t.to(dt).to(torch::kFloat32); }

constexpr double kEps = 1e-6;
const std::vector<torch::ScalarType> kDtypes{torch::kFloat32, torch::kBFloat16};

// ---- bit-for-bit the model's composite ----------------------------------------------------

TEST(FusedBlockCpu, ModulatedLayerNormIsTheModelCompositeBitForBit) {
  torch::manual_seed(1);
  const int64_t B = 2, L = 37, C = 64;
  for (auto dt : kDtypes) {
    for (int64_t vb : {B, int64_t{1}}) {
      const Tensor x = (torch::randn({B, L, C}) * 3 + 0.5).to(dt);
      const Tensor scale = 0.5 * torch::randn({vb, 1, C}), shift = torch::randn({vb, 1, C});
      const Tensor up = torch::randn({B, L, C}).to(dt);
      const OpRun got = run_op([](const std::vector<Tensor>& t) { return vqad::ops::modulated_layer_norm(t[0], t[1], t[2], kEps); },
                          {x, scale, shift}, up);
      const OpRun want = run_op(
          [](const std::vector<Tensor>& t) {
            return (vqad::model::layer_norm_fp32(t[0], kEps) * (1 + t[1]) + t[2]).to(t[0].scalar_type());
          },
          {x, scale, shift}, up);
      expect_same_bits(got, want, std::string("modulated_layer_norm ") + c10::toString(dt));
    }
  }
}

TEST(FusedBlockCpu, ModulatedLayerNormTakesChunksOfTheModulation) {
  torch::manual_seed(2);
  const int64_t B = 2, L = 5, C = 16;
  const Tensor x = torch::randn({B, L, C}).to(torch::kBFloat16);
  const Tensor e = torch::randn({B, 6, C});
  const auto parts = e.chunk(6, 1);  // [B, 1, C] views with batch stride 6C
  const Tensor got = vqad::ops::modulated_layer_norm(x, parts[1], parts[0], kEps);
  const Tensor want = vqad::ops::modulated_layer_norm(x, parts[1].contiguous(), parts[0].contiguous(), kEps);
  EXPECT_TRUE(torch::equal(got, want));
}

TEST(FusedBlockCpu, GatedResidualIsTheModelCompositeBitForBit) {
  torch::manual_seed(3);
  const int64_t B = 2, L = 41, C = 48;
  for (auto dt : kDtypes) {
    for (int64_t vb : {B, int64_t{1}}) {
      const Tensor x = torch::randn({B, L, C}).to(dt), a = torch::randn({B, L, C}).to(dt);
      const Tensor gate = torch::randn({vb, 1, C});
      const Tensor up = torch::randn({B, L, C}).to(dt);
      const OpRun got = run_op([](const std::vector<Tensor>& t) { return vqad::ops::gated_residual(t[0], t[1], t[2]); },
                          {x, a, gate}, up);
      const OpRun want = run_op(
          [](const std::vector<Tensor>& t) {
            return (t[0].to(torch::kFloat32) + t[1].to(torch::kFloat32) * t[2]).to(t[0].scalar_type());
          },
          {x, a, gate}, up);
      expect_same_bits(got, want, std::string("gated_residual ") + c10::toString(dt));
    }
  }
}

// The model's RMSNorm before fusion.
Tensor old_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return normed.to(x.scalar_type()) * (weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type()));
}

TEST(FusedBlockCpu, RmsNormRopeIsTheModelCompositeBitForBit) {
  torch::manual_seed(4);
  const int64_t B = 2, L = 30, H = 2, D = 32, C = H * D;
  auto [cos, sin] = vqad::model::rope_tables({3, 2, 5}, D, 10000.0, 1024, torch::kCPU);
  for (auto dt : kDtypes) {
    const Tensor x = (torch::randn({B, L, C}) * 2).to(dt);
    const Tensor w = 1 + 0.3 * torch::randn({C});
    const Tensor up = torch::randn({B, L, C}).to(dt);
    const OpRun got = run_op(
        [&](const std::vector<Tensor>& t) { return vqad::ops::rms_norm_rope(t[0], t[1], kEps, cos, sin); }, {x, w},
        up);
    const OpRun want = run_op(
        [&](const std::vector<Tensor>& t) {
          return vqad::model::apply_rope(old_rms_norm(t[0], t[1], kEps).reshape({B, L, H, D}), cos, sin)
              .reshape({B, L, C});
        },
        {x, w}, up);
    expect_same_bits(got, want, std::string("rms_norm_rope ") + c10::toString(dt));
    const OpRun got_plain = run_op([](const std::vector<Tensor>& t) { return vqad::ops::rms_norm_rope(t[0], t[1], kEps); },
                              {x, w}, up);
    const OpRun want_plain = run_op([](const std::vector<Tensor>& t) { return old_rms_norm(t[0], t[1], kEps); }, {x, w}, up);
    expect_same_bits(got_plain, want_plain, std::string("rms_norm ") + c10::toString(dt));
  }
}

TEST(FusedBlockCpu, RmsNormModuleKeepsAnyLeadingShape) {
  torch::manual_seed(5);
  vqad::model::RMSNorm norm(24, kEps, torch::TensorOptions());
  {
    torch::NoGradGuard g;
    norm.weight.copy_(1 + 0.2 * torch::randn({24}));
  }
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{24}, {5, 24}, {2, 3, 24}, {2, 2, 3, 24}}) {
    const Tensor x = torch::randn(shape).to(torch::kBFloat16);
    EXPECT_TRUE(torch::equal(norm.forward(x), old_rms_norm(x, norm.weight, kEps)));
  }
}

// ---- the kernels' explicit formulas against the composite's autograd ---------------------
// These are the arithmetic the CUDA kernels do (same rounding points), written with torch
// ops: a wrong formula here fails on the CPU before any GPU run.

TEST(FusedBlockCpu, ModulatedLayerNormKernelFormulasMatchAutograd) {
  torch::manual_seed(6);
  const int64_t B = 2, L = 300, C = 96;
  for (auto dt : kDtypes) {
    for (int64_t vb : {B, int64_t{1}}) {
      const Tensor x = (torch::randn({B, L, C}) * 2 + 1).to(dt);
      const Tensor scale = 0.5 * torch::randn({vb, 1, C}), shift = torch::randn({vb, 1, C});
      const Tensor up = torch::randn({B, L, C}).to(dt);
      const OpRun ref = run_op([](const std::vector<Tensor>& t) { return vqad::ops::modulated_layer_norm(t[0], t[1], t[2], kEps); },
                          {x, scale, shift}, up);
      // forward
      const Tensor xf = x.to(torch::kFloat32);
      const Tensor mean = xf.mean(-1, true);
      const Tensor rstd = torch::rsqrt((xf - mean).pow(2).mean(-1, true) + kEps);
      const Tensor n = (xf - mean) * rstd;
      const Tensor out = (n * (1 + scale) + shift).to(dt);
      const auto [ulps, frac] = bf16_ulps(out, ref.out);
      EXPECT_LE(ulps, 1) << dt;
      EXPECT_LE(frac, 0.01) << dt;
      // backward
      const Tensor g = up.to(torch::kFloat32);
      const Tensor dn = g * (1 + scale);
      const Tensor s1 = dn.sum(-1, true), s2 = (dn * n).sum(-1, true);
      const Tensor dx = ((rstd / C) * (C * dn - s1 - n * s2)).to(dt);
      Tensor dscale = (g * n).sum(1, true), dshift = g.sum(1, true);
      if (vb == 1) dscale = dscale.sum(0, true), dshift = dshift.sum(0, true);
      std::printf("  modulated_layer_norm %s: rel L2 dx %.2e dscale %.2e dshift %.2e\n", c10::toString(dt),
                  rel_l2(dx, ref.grads[0]), rel_l2(dscale, ref.grads[1]), rel_l2(dshift, ref.grads[2]));
      EXPECT_LE(rel_l2(dx, ref.grads[0]), 1e-3) << dt;
      EXPECT_LE(rel_l2(dscale, ref.grads[1]), 1e-5) << dt;
      EXPECT_LE(rel_l2(dshift, ref.grads[2]), 1e-5) << dt;
      EXPECT_EQ(dx.scalar_type(), ref.grads[0].scalar_type());
    }
  }
}

TEST(FusedBlockCpu, GatedResidualKernelFormulasMatchAutograd) {
  torch::manual_seed(7);
  const int64_t B = 2, L = 200, C = 40;
  for (auto dt : kDtypes) {
    const Tensor x = torch::randn({B, L, C}).to(dt), a = torch::randn({B, L, C}).to(dt);
    const Tensor gate = torch::randn({B, 1, C});
    const Tensor up = torch::randn({B, L, C}).to(dt);
    const OpRun ref = run_op([](const std::vector<Tensor>& t) { return vqad::ops::gated_residual(t[0], t[1], t[2]); },
                        {x, a, gate}, up);
    EXPECT_TRUE(torch::equal((x.to(torch::kFloat32) + a.to(torch::kFloat32) * gate).to(dt), ref.out));
    EXPECT_TRUE(torch::equal(up, ref.grads[0])) << "dx is the upstream gradient itself";
    EXPECT_TRUE(torch::equal((up.to(torch::kFloat32) * gate).to(dt), ref.grads[1]));
    EXPECT_LE(rel_l2((up.to(torch::kFloat32) * a.to(torch::kFloat32)).sum(1, true), ref.grads[2]), 1e-5);
  }
}

TEST(FusedBlockCpu, RmsNormRopeKernelFormulasMatchAutograd) {
  torch::manual_seed(8);
  const int64_t B = 2, L = 30, H = 4, D = 32, C = H * D;
  auto [cos, sin] = vqad::model::rope_tables({3, 2, 5}, D, 10000.0, 1024, torch::kCPU);
  for (auto dt : kDtypes) {
    for (bool rope : {true, false}) {
      const Tensor x = (torch::randn({B, L, C}) * 2).to(dt);
      const Tensor w = 1 + 0.3 * torch::randn({C});
      const Tensor up = torch::randn({B, L, C}).to(dt);
      const Tensor cs = rope ? cos : Tensor(), sn = rope ? sin : Tensor();
      const OpRun ref = run_op(
          [&](const std::vector<Tensor>& t) { return vqad::ops::rms_norm_rope(t[0], t[1], kEps, cs, sn); }, {x, w}, up);
      const Tensor c4 = cos.unsqueeze(0).unsqueeze(2), s4 = sin.unsqueeze(0).unsqueeze(2);  // [1, L, 1, D/2]
      // forward
      const Tensor xf = x.to(torch::kFloat32);
      const Tensor r = torch::rsqrt((xf * xf).sum(-1, true) / C + kEps);
      const Tensor nb = round_to(xf * r, dt);
      Tensor y = round_to(nb * round_to(w, dt), dt);
      if (rope) {
        const Tensor y5 = y.reshape({B, L, H, D / 2, 2});
        const Tensor y0 = y5.select(-1, 0), y1 = y5.select(-1, 1);
        y = torch::stack({y0 * c4 - y1 * s4, y1 * c4 + y0 * s4}, -1).reshape({B, L, C});
      }
      const auto [ulps, frac] = bf16_ulps(y.to(dt), ref.out);
      EXPECT_LE(ulps, 1) << dt << " rope " << rope;
      EXPECT_LE(frac, 0.01) << dt << " rope " << rope;
      // backward
      Tensor dy = up.to(torch::kFloat32);
      if (rope) {
        const Tensor g5 = dy.reshape({B, L, H, D / 2, 2});
        const Tensor g0 = g5.select(-1, 0), g1 = g5.select(-1, 1);
        dy = round_to(torch::stack({g0 * c4 + g1 * s4, -g0 * s4 + g1 * c4}, -1).reshape({B, L, C}), dt);
      }
      const Tensor dw = round_to(round_to(dy * nb, dt).sum(at::IntArrayRef{0, 1}), dt);
      const Tensor dn = round_to(dy * round_to(w, dt), dt);
      const Tensor S = (dn * xf).sum(-1, true);
      const Tensor dx = (dn * r - xf * (r * r * r * S / C)).to(dt);
      const double e_dx = rel_l2(dx, ref.grads[0]), e_dw = rel_l2(dw, ref.grads[1]);
      std::printf("  rms_norm%s %s: rel L2 dx %.2e dweight %.2e (dweight without the per-product rounding %.2e)\n",
                  rope ? "_rope" : "", c10::toString(dt), e_dx, e_dw,
                  rel_l2((dy * nb).sum(at::IntArrayRef{0, 1}), ref.grads[1]));
      EXPECT_LE(e_dx, 1e-3) << dt << " rope " << rope;
      EXPECT_LE(e_dw, 1e-3) << dt << " rope " << rope;
      EXPECT_EQ(ref.grads[1].scalar_type(), torch::kFloat32);
    }
  }
}

// ---- input checks ---------------------------------------------------------------------------

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << parts.front() << "'";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(FusedBlockCpu, BadInputsNameTheOpTensorAndShapes) {
  const Tensor x = torch::randn({2, 5, 8}).to(torch::kBFloat16);
  const Tensor v = torch::randn({2, 1, 8});
  using vqad::ops::gated_residual;
  using vqad::ops::modulated_layer_norm;
  using vqad::ops::rms_norm_rope;
  expect_error([&] { modulated_layer_norm(x.to(torch::kFloat64), v, v, kEps); },
               {"modulated_layer_norm", "x must be float32 or bfloat16", "Double"});
  expect_error([&] { modulated_layer_norm(x.reshape({10, 8}), v, v, kEps); },
               {"modulated_layer_norm", "x must be [B, L, C]", "[10, 8]"});
  expect_error([&] { modulated_layer_norm(x, torch::randn({2, 2, 8}), v, kEps); },
               {"modulated_layer_norm", "scale must be [2 or 1, 1, 8]", "[2, 5, 8]", "found [2, 2, 8]"});
  expect_error([&] { modulated_layer_norm(x, v, v.to(torch::kBFloat16), kEps); },
               {"modulated_layer_norm", "shift must be float32", "BFloat16"});
  expect_error([&] { modulated_layer_norm(x, v, torch::Tensor(), kEps); }, {"modulated_layer_norm", "shift is undefined"});
  expect_error([&] { gated_residual(x, x.to(torch::kFloat32), v); },
               {"gated_residual", "a must match x", "BFloat16", "Float"});
  expect_error([&] { gated_residual(x, x.narrow(1, 0, 4), v); }, {"gated_residual", "a must match x", "[2, 4, 8]"});
  expect_error([&] { gated_residual(x, x, torch::randn({3, 1, 8})); },
               {"gated_residual", "gate must be [2 or 1, 1, 8]", "found [3, 1, 8]"});
  expect_error([&] { rms_norm_rope(x, torch::ones({7}), kEps); }, {"rms_norm_rope", "weight must be [8]", "found [7]"});
  const Tensor c = torch::ones({5, 2});
  expect_error([&] { rms_norm_rope(x, torch::ones({8}), kEps, c, Tensor()); }, {"rms_norm_rope", "cos and sin"});
  expect_error([&] { rms_norm_rope(x, torch::ones({8}), kEps, torch::ones({4, 2}), torch::ones({4, 2})); },
               {"rms_norm_rope", "RoPE tables", "L = 5", "found cos [4, 2]"});
  expect_error([&] { rms_norm_rope(x, torch::ones({8}), kEps, torch::ones({5, 3}), torch::ones({5, 3})); },
               {"rms_norm_rope", "C divisible by D"});
}

}  // namespace
