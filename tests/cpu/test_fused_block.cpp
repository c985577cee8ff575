// The fused block ops on the CPU (ops/fused_block.h): against independent float64
// definitions (plain loops; gradients by float64 autograd of the definitions), the
// explicit forward/backward formulas the CUDA kernels implement against the composite's
// autograd, and the input checks.
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

// ---- against independent float64 definitions ----------------------------------------------
// The ops' definitions (ops/fused_block.h) written out as plain loops in double on the
// dtype-rounded inputs; the ops compute in fp32 and round once to the input dtype, so
// fp32 outputs agree to fp32 rounding and bf16 outputs to one bf16 ulp (three for RMSNorm,
// whose normalized value and weight are rounded to the input dtype before the product, as
// the model's composite did; RoPE outputs can cancel, so those are held to rel-L2). Gradients are checked against float64 autograd of the same definitions.

std::vector<double> doubles(const Tensor& t) {
  const Tensor d = t.detach().to(torch::kCPU).to(torch::kFloat64).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}
Tensor from_doubles(const std::vector<double>& v, torch::IntArrayRef shape) {
  return torch::tensor(v, torch::kFloat64).reshape(shape);
}

// y[b, l, c] = (x - mean) / sqrt(var + eps) * (1 + scale[b', c]) + shift[b', c], biased var.
Tensor modulated_layer_norm_loops(const Tensor& x, const Tensor& scale, const Tensor& shift, double eps) {
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), VB = scale.size(0);
  const auto xv = doubles(x), sv = doubles(scale), hv = doubles(shift);
  std::vector<double> y(xv.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const double* row = &xv[(b * L + l) * C];
      double mean = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mean += row[c];
      mean /= static_cast<double>(C);
      for (int64_t c = 0; c < C; ++c) var += (row[c] - mean) * (row[c] - mean);
      var /= static_cast<double>(C);
      const int64_t m = VB == 1 ? 0 : b;
      for (int64_t c = 0; c < C; ++c)
        y[(b * L + l) * C + c] = (row[c] - mean) / std::sqrt(var + eps) * (1 + sv[m * C + c]) + hv[m * C + c];
    }
  return from_doubles(y, x.sizes());
}

// y = x + a * gate[b', c].
Tensor gated_residual_loops(const Tensor& x, const Tensor& a, const Tensor& gate) {
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), VB = gate.size(0);
  const auto xv = doubles(x), av = doubles(a), gv = doubles(gate);
  std::vector<double> y(xv.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L * C; ++i)
      y[b * L * C + i] = xv[b * L * C + i] + av[b * L * C + i] * gv[(VB == 1 ? 0 : b) * C + i % C];
  return from_doubles(y, x.sizes());
}

// y = x / sqrt(mean_c(x^2) + eps) * w, then (optionally) each head's interleaved pairs
// (y0, y1) at position l rotated by the angle whose cos / sin are the tables' [l, pair].
Tensor rms_norm_rope_loops(const Tensor& x, const Tensor& w, double eps, int64_t heads, const Tensor& cos = {},
                           const Tensor& sin = {}) {
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), D = C / heads;
  const auto xv = doubles(x), wv = doubles(w);
  std::vector<double> cv, sv;
  if (cos.defined()) cv = doubles(cos), sv = doubles(sin);
  std::vector<double> y(xv.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const double* row = &xv[(b * L + l) * C];
      double ms = 0;
      for (int64_t c = 0; c < C; ++c) ms += row[c] * row[c];
      const double r = 1.0 / std::sqrt(ms / static_cast<double>(C) + eps);
      double* out = &y[(b * L + l) * C];
      for (int64_t c = 0; c < C; ++c) out[c] = row[c] * r * wv[c];
      if (cv.empty()) continue;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t p = 0; p < D / 2; ++p) {
          double& y0 = out[h * D + 2 * p];
          double& y1 = out[h * D + 2 * p + 1];
          const double c = cv[l * (D / 2) + p], s = sv[l * (D / 2) + p];
          const double a0 = y0, a1 = y1;
          y0 = a0 * c - a1 * s;
          y1 = a1 * c + a0 * s;
        }
    }
  return from_doubles(y, x.sizes());
}

void expect_close_to_definition(const Tensor& got, const Tensor& want, torch::ScalarType dt, int64_t max_ulps,
                                const std::string& what) {
  if (dt == torch::kFloat32) {
    EXPECT_LT(rel_l2(got, want), 1e-6) << what;
  } else {
    if (max_ulps >= 0) {  // < 0: an output that can cancel (RoPE), checked by rel-L2 only
      const auto [ulps, frac] = bf16_ulps(got, want);
      EXPECT_LE(ulps, max_ulps) << what << " (" << frac << " of the elements differ)";
    }
    EXPECT_LT(rel_l2(got, want), 8e-3) << what;
  }
}

// Gradients of `op` (in dt) against float64 autograd of `def` (the same definition).
void expect_grads_match_definition(const Fn& op, const Fn& def, const std::vector<Tensor>& inputs, const Tensor& up,
                                   torch::ScalarType dt, const std::string& what) {
  const OpRun got = run_op(op, inputs, up);
  std::vector<Tensor> in64;
  for (const auto& t : inputs) in64.push_back(t.to(torch::kFloat64));
  const OpRun want = run_op(def, in64, up.to(torch::kFloat64));
  for (size_t i = 0; i < inputs.size(); ++i)
    EXPECT_LT(rel_l2(got.grads[i], want.grads[i]), dt == torch::kFloat32 ? 1e-5 : 2e-2) << what << ": grad " << i;
}

TEST(FusedBlockCpu, ModulatedLayerNormMatchesItsDefinition) {
  const uint64_t seed = 1;
  torch::manual_seed(seed);
  const int64_t B = 2, L = 37, C = 64;
  for (auto dt : kDtypes) {
    for (int64_t vb : {B, int64_t{1}}) {
      const Tensor x = (torch::randn({B, L, C}) * 3 + 0.5).to(dt);
      const Tensor scale = 0.5 * torch::randn({vb, 1, C}), shift = torch::randn({vb, 1, C});
      const std::string what = std::string("modulated_layer_norm ") + c10::toString(dt) + " seed " + std::to_string(seed);
      const Tensor got = vqad::ops::modulated_layer_norm(x, scale, shift, kEps);
      EXPECT_EQ(got.scalar_type(), dt) << what;
      expect_close_to_definition(got, modulated_layer_norm_loops(x, scale, shift, kEps), dt, 1, what);
      expect_grads_match_definition(
          [](const std::vector<Tensor>& t) { return vqad::ops::modulated_layer_norm(t[0], t[1], t[2], kEps); },
          [](const std::vector<Tensor>& t) {
            const Tensor mean = t[0].mean(-1, true), var = (t[0] - mean).pow(2).mean(-1, true);
            return (t[0] - mean) / (var + kEps).sqrt() * (1 + t[1]) + t[2];
          },
          {x, scale, shift}, torch::randn({B, L, C}).to(dt), dt, what);
    }
  }
}

TEST(FusedBlockCpu, GatedResidualMatchesItsDefinition) {
  const uint64_t seed = 3;
  torch::manual_seed(seed);
  const int64_t B = 2, L = 41, C = 48;
  for (auto dt : kDtypes) {
    for (int64_t vb : {B, int64_t{1}}) {
      const Tensor x = torch::randn({B, L, C}).to(dt), a = torch::randn({B, L, C}).to(dt);
      const Tensor gate = torch::randn({vb, 1, C});
      const std::string what = std::string("gated_residual ") + c10::toString(dt) + " seed " + std::to_string(seed);
      const Tensor got = vqad::ops::gated_residual(x, a, gate);
      EXPECT_EQ(got.scalar_type(), dt) << what;
      expect_close_to_definition(got, gated_residual_loops(x, a, gate), dt, 1, what);
      expect_grads_match_definition(
          [](const std::vector<Tensor>& t) { return vqad::ops::gated_residual(t[0], t[1], t[2]); },
          [](const std::vector<Tensor>& t) { return t[0] + t[1] * t[2]; }, {x, a, gate},
          torch::randn({B, L, C}).to(dt), dt, what);
    }
  }
}

TEST(FusedBlockCpu, RmsNormRopeMatchesItsDefinition) {
  const uint64_t seed = 4;
  torch::manual_seed(seed);
  const int64_t B = 2, L = 30, H = 2, D = 32, C = H * D;
  auto [cos, sin] = vqad::model::rope_tables({3, 2, 5}, D, 10000.0, 1024, torch::kCPU);
  for (auto dt : kDtypes) {
    const Tensor x = (torch::randn({B, L, C}) * 2).to(dt);
    const Tensor w = 1 + 0.3 * torch::randn({C});
    const std::string what = std::string("rms_norm_rope ") + c10::toString(dt) + " seed " + std::to_string(seed);
    const Tensor got = vqad::ops::rms_norm_rope(x, w, kEps, cos, sin);
    EXPECT_EQ(got.scalar_type(), dt) << what;
    expect_close_to_definition(got, rms_norm_rope_loops(x, w, kEps, H, cos, sin), dt, -1, what);
    const Tensor plain = vqad::ops::rms_norm_rope(x, w, kEps);
    expect_close_to_definition(plain, rms_norm_rope_loops(x, w, kEps, H), dt, 3, "rms_norm " + what);
    const Tensor c64 = cos.to(torch::kFloat64), s64 = sin.to(torch::kFloat64);
    expect_grads_match_definition(
        [&](const std::vector<Tensor>& t) { return vqad::ops::rms_norm_rope(t[0], t[1], kEps, cos, sin); },
        [&](const std::vector<Tensor>& t) {
          const Tensor y = (t[0] / (t[0].pow(2).mean(-1, true) + kEps).sqrt() * t[1]).reshape({B, L, H, D / 2, 2});
          const Tensor y0 = y.select(-1, 0), y1 = y.select(-1, 1);
          const Tensor c = c64.unsqueeze(0).unsqueeze(2), s = s64.unsqueeze(0).unsqueeze(2);
          return torch::stack({y0 * c - y1 * s, y1 * c + y0 * s}, -1).reshape({B, L, C});
        },
        {x, w}, torch::randn({B, L, C}).to(dt), dt, what);
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

TEST(FusedBlockCpu, RmsNormModuleKeepsAnyLeadingShape) {
  torch::manual_seed(5);
  vqad::model::RMSNorm norm(24, kEps, torch::TensorOptions());
  {
    torch::NoGradGuard g;
    norm.weight.copy_(1 + 0.2 * torch::randn({24}));
  }
  // Every leading shape gives the rows of the [1, rows, 24] call, which matches the definition.
  const Tensor rows = torch::randn({12, 24}).to(torch::kBFloat16);
  const Tensor want = norm.forward(rows.reshape({1, 12, 24}));
  expect_close_to_definition(want, rms_norm_rope_loops(rows.reshape({1, 12, 24}), norm.weight, kEps, 1),
                             torch::kBFloat16, 3, "RMSNorm module");
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 6, 24}, {12, 24}, {2, 2, 3, 24}}) {
    const Tensor got = norm.forward(rows.reshape(shape));
    EXPECT_EQ(got.sizes().vec(), shape);
    EXPECT_TRUE(torch::equal(got.reshape({1, 12, 24}), want));
  }
  EXPECT_EQ(norm.forward(rows[0]).sizes().vec(), std::vector<int64_t>{24});
  EXPECT_TRUE(torch::equal(norm.forward(rows[0]), want[0][0]));
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
