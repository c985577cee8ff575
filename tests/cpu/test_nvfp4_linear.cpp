// CPU tests of the NVFP4 linears (ops/nvfp4_linear): forward against a matmul of
// operands fake-quantized independently here with the scalar reference, the
// straight-through gradients against the dense linear, QAD enable/disable,
// calibration and every error case.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_linear.h"

namespace {

using vqad::nvfp4::ScaleMode;
using vqad::ops::CalibrationScope;
using vqad::ops::Nvfp4DynamicLinear;
using vqad::ops::Nvfp4QadLinear;

// Rows of `t` (fp32 values of the BF16 rounding) fake-quantized with the scalar
// reference: y = e2m1 * S * s_dec, block by block along the last axis.
std::vector<float> reference_fake_quant(const torch::Tensor& t, float s_enc) {
  const torch::Tensor v = t.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  std::vector<float> out(v.numel());
  const float* p = v.data_ptr<float>();
  for (int64_t b = 0; b < v.numel(); b += 16) {
    const auto q = vqad::nvfp4::quantize_block(p + b, s_enc);
    for (int i = 0; i < 16; ++i) out[b + i] = q.values[i];
  }
  return out;
}

float reference_amax(const torch::Tensor& t) {
  const torch::Tensor v = t.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  float m = 0.0f;
  for (int64_t i = 0; i < v.numel(); ++i) m = std::max(m, std::fabs(v.data_ptr<float>()[i]));
  return m;
}

// y = FQ(X) . FQ(W)^T + bf16(b) in double; also returns sum |terms| per output for the
// accumulation-order tolerance.
void reference_linear(const torch::Tensor& x2, const torch::Tensor& w, const torch::Tensor& b, float s_enc_x,
                      std::vector<double>* y, std::vector<double>* mag) {
  const int64_t m = x2.size(0), k = x2.size(1), n = w.size(0);
  const std::vector<float> xq = reference_fake_quant(x2, s_enc_x);
  const std::vector<float> wq = reference_fake_quant(w, 2688.0f / std::max(reference_amax(w), 1e-12f));
  torch::Tensor bb;
  if (b.defined()) bb = b.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  y->assign(m * n, 0.0);
  mag->assign(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0, a = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double t = double(xq[i * k + kk]) * double(wq[j * k + kk]);
        acc += t;
        a += std::fabs(t);
      }
      if (bb.defined()) acc += bb.data_ptr<float>()[j];
      (*y)[i * n + j] = acc;
      (*mag)[i * n + j] = a;
    }
  }
}

// Output agrees with the reference up to one BF16 rounding of the result plus the
// worst-case fp32 accumulation error over K terms. bias_after (the QAD linear's static /
// unit modes, seeds/003's order): the GEMM output is rounded to BF16 before the bias is
// added, one more BF16 rounding of the bias-free value.
void expect_matches_reference(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& w,
                              const torch::Tensor& b, float s_enc_x, bool bias_after = false) {
  const int64_t k = w.size(1), n = w.size(0);
  const torch::Tensor x2 = x.reshape({-1, k});
  std::vector<double> ref, mag, ref_nobias, mag_nobias;
  reference_linear(x2, w, b, s_enc_x, &ref, &mag);
  if (bias_after) reference_linear(x2, w, torch::Tensor(), s_enc_x, &ref_nobias, &mag_nobias);
  const torch::Tensor yf = y.reshape({-1, n}).to(torch::kFloat32).contiguous();
  ASSERT_EQ(yf.numel(), static_cast<int64_t>(ref.size()));
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double got = yf.data_ptr<float>()[i];
    double tol = std::ldexp(std::fabs(ref[i]), -8) + std::ldexp(double(k) * mag[i], -23) + 1e-30;
    if (bias_after) tol += std::ldexp(std::fabs(ref_nobias[i]), -8);
    if (!(std::fabs(got - ref[i]) <= tol) && ++bad < 5) {
      ADD_FAILURE() << "output " << i << ": got " << got << ", reference " << ref[i] << " (tol " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0);
}

torch::Tensor heavy_tailed(std::vector<int64_t> shape, uint64_t seed) {
  torch::manual_seed(seed);
  torch::Tensor t = torch::randn(shape);
  // A few large outliers per tensor make the global and block scales matter.
  return t * torch::exp(torch::randn(shape) * 1.5);
}

TEST(Nvfp4LinearCpu, UnitOperandMatchesScalarCodes) {
  torch::Tensor x = heavy_tailed({7, 48}, 1);
  x.index_put_({1, torch::indexing::Slice(0, 16)}, 0.0f);                     // zero block
  x.index_put_({2, 5}, std::numeric_limits<float>::quiet_NaN());              // NaN block
  x.index_put_({3, torch::indexing::Slice(16, 32)}, -1e-30f);                 // underflows to -0
  const float s_enc = 2688.0f / 11.5f;
  const torch::Tensor u = vqad::ops::nvfp4_unit_operand_cpu(x, s_enc);
  const torch::Tensor xb = x.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  for (int64_t b = 0; b < xb.numel(); b += 16) {
    const auto q = vqad::nvfp4::quantize_block(xb.data_ptr<float>() + b, s_enc);
    for (int i = 0; i < 16; ++i) {
      const float got = u.data_ptr<float>()[b + i];
      if (q.scale_bits == vqad::nvfp4::kE4M3NaN) {
        EXPECT_TRUE(std::isnan(got)) << "element " << b + i;
        continue;
      }
      const float want = vqad::nvfp4::e2m1_decode(q.codes[i]) * vqad::nvfp4::e4m3_decode(q.scale_bits);
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << "element " << b + i;
      EXPECT_EQ(got, want) << "element " << b + i;
      // exact in BF16: the GEMM operand loses nothing
      EXPECT_EQ(c10::BFloat16(got), got);
    }
  }
  EXPECT_TRUE(torch::isnan(u[2]).narrow(0, 0, 16).all().item<bool>());
  EXPECT_TRUE(u[1].narrow(0, 0, 16).eq(0).all().item<bool>());
}

TEST(Nvfp4LinearCpu, Bf16AmaxIgnoresNanAndRoundsToBf16) {
  torch::Tensor t = torch::tensor({1.0f, -3.00390625f, std::numeric_limits<float>::quiet_NaN(), 2.0f});
  // -3.00390625 rounds to -3.0 in BF16 (8 significant bits)
  EXPECT_EQ(vqad::ops::bf16_amax_cpu(t), 3.0f);
  EXPECT_EQ(vqad::ops::bf16_amax_cpu(torch::zeros({5})), 0.0f);
}

TEST(Nvfp4LinearCpu, DynamicForwardEqualsDequantizedOperandMatmul) {
  const torch::Tensor x = heavy_tailed({3, 37, 64}, 2);  // M = 111, not a tile multiple
  const torch::Tensor w = heavy_tailed({45, 64}, 3) * 0.05;
  const torch::Tensor b = torch::randn({45});
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor xd = x.to(dt);
    const torch::Tensor y = vqad::ops::nvfp4_linear(xd, w, b, ScaleMode::kDynamic);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 37, 45}));
    EXPECT_EQ(y.scalar_type(), dt);
    expect_matches_reference(y, xd, w, b, 2688.0f / reference_amax(xd));
    // The quantization is really applied: far from the dense result.
    const torch::Tensor dense = vqad::ops::dense_linear(xd.to(torch::kFloat32), w, b);
    EXPECT_GT((y.to(torch::kFloat32) - dense).abs().max().item<float>(), 1e-2f);
  }
  // Without bias, and through the LinearQuant interface.
  Nvfp4DynamicLinear lin("blocks.0.attn1.to_q");
  const torch::Tensor y = lin.forward(x, w, torch::Tensor());
  expect_matches_reference(y, x, w, torch::Tensor(), 2688.0f / reference_amax(x));
  EXPECT_EQ(lin.describe(), "nvfp4 W:dynamic A:dynamic");
}

TEST(Nvfp4LinearCpu, StaticAndUnitActivationScales) {
  const torch::Tensor x = heavy_tailed({29, 32}, 4);
  const torch::Tensor w = heavy_tailed({19, 32}, 5);
  const torch::Tensor b = torch::randn({19});
  const float amax = 7.25f;  // below the true amax: saturating blocks included
  expect_matches_reference(vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kStatic, amax), x, w, b, 2688.0f / amax, true);
  expect_matches_reference(vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kUnit), x, w, b, 1.0f, true);
  Nvfp4QadLinear stat("blocks.4.ffn.net.0.proj", ScaleMode::kStatic, amax);
  Nvfp4QadLinear unit("blocks.4.attn1.to_k", ScaleMode::kUnit);
  EXPECT_TRUE(torch::equal(stat.forward(x, w, b), vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kStatic, amax)));
  EXPECT_TRUE(torch::equal(unit.forward(x, w, b), vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kUnit)));
  EXPECT_EQ(unit.describe(), "nvfp4-qad W:dynamic A:unit");
  EXPECT_EQ(stat.describe(), "nvfp4-qad W:dynamic A:static(amax=7.25)");
}

TEST(Nvfp4LinearCpu, ScalesAreRecomputedEveryCall) {
  // FQ_dyn is scale-invariant under powers of two: with the scales recomputed per
  // call, scaling W (or X) by 4 scales the bias-free output by exactly 4.
  const torch::Tensor x = heavy_tailed({13, 48}, 6);
  const torch::Tensor w = heavy_tailed({11, 48}, 7);
  const torch::Tensor y = vqad::ops::nvfp4_linear(x, w, torch::Tensor(), ScaleMode::kDynamic);
  EXPECT_TRUE(torch::equal(vqad::ops::nvfp4_linear(x, w * 4, torch::Tensor(), ScaleMode::kDynamic), y * 4));
  EXPECT_TRUE(torch::equal(vqad::ops::nvfp4_linear(x * 4, w, torch::Tensor(), ScaleMode::kDynamic), y * 4));
  // A static activation scale does not follow x.
  const torch::Tensor ys = vqad::ops::nvfp4_linear(x, w, torch::Tensor(), ScaleMode::kStatic, 3.0f);
  EXPECT_FALSE(torch::equal(vqad::ops::nvfp4_linear(x * 4, w, torch::Tensor(), ScaleMode::kStatic, 3.0f), ys * 4));
}

void expect_same_grads(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0,
                       const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                         const torch::Tensor&)>& quantized) {
  torch::manual_seed(11);
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  torch::Tensor xq = leaf(x0), wq = leaf(w0), bq = leaf(b0);
  torch::Tensor xd = leaf(x0), wd = leaf(w0), bd = leaf(b0);
  const torch::Tensor yq = quantized(xq, wq, bq);
  const torch::Tensor yd = vqad::ops::dense_linear(xd, wd, bd);
  ASSERT_EQ(yq.scalar_type(), yd.scalar_type());
  const torch::Tensor g = torch::randn(yq.sizes()).to(yq.scalar_type());
  yq.backward(g);
  yd.backward(g);
  ASSERT_TRUE(xq.grad().defined() && wq.grad().defined() && bq.grad().defined());
  EXPECT_EQ(xq.grad().scalar_type(), x0.scalar_type());
  EXPECT_EQ(wq.grad().scalar_type(), w0.scalar_type());
  EXPECT_TRUE(torch::equal(xq.grad(), xd.grad())) << (xq.grad() - xd.grad()).abs().max();
  EXPECT_TRUE(torch::equal(wq.grad(), wd.grad())) << (wq.grad() - wd.grad()).abs().max();
  EXPECT_TRUE(torch::equal(bq.grad(), bd.grad())) << (bq.grad() - bd.grad()).abs().max();
  // The forward differs from the dense one, so equal gradients mean straight-through.
  EXPECT_FALSE(torch::equal(yq, yd));
}

TEST(Nvfp4LinearCpu, GradientsAreTheDenseLinearGradients) {
  const torch::Tensor x = heavy_tailed({2, 21, 32}, 8);
  const torch::Tensor w = heavy_tailed({17, 32}, 9);
  const torch::Tensor b = torch::randn({17});
  auto dynamic = [](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    return vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kDynamic);
  };
  expect_same_grads(x, w, b, dynamic);                          // fp32 activations
  expect_same_grads(x.to(torch::kBFloat16), w, b, dynamic);     // bf16 activations, fp32 master
  auto qad = std::make_shared<Nvfp4QadLinear>("blocks.0.ffn.net.2", ScaleMode::kStatic, 5.0f);
  expect_same_grads(x, w, b, [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    return qad->forward(x, w, b);
  });
}

TEST(Nvfp4LinearCpu, OnlyRequestedGradientsAreComputed) {
  const torch::Tensor x = heavy_tailed({9, 16}, 10);
  torch::Tensor w = heavy_tailed({5, 16}, 11).requires_grad_(true);
  const torch::Tensor y = vqad::ops::nvfp4_linear(x, w, torch::Tensor(), ScaleMode::kDynamic);
  y.sum().backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_FALSE(x.grad().defined());
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(vqad::ops::nvfp4_linear(x, w, torch::Tensor(), ScaleMode::kDynamic).requires_grad());
}

TEST(Nvfp4LinearCpu, DisabledQadLinearIsTheDenseLinearBitForBit) {
  const torch::Tensor x0 = heavy_tailed({4, 10, 32}, 12).to(torch::kBFloat16);
  const torch::Tensor w0 = heavy_tailed({24, 32}, 13);
  const torch::Tensor b0 = torch::randn({24});
  for (ScaleMode mode : {ScaleMode::kStatic, ScaleMode::kUnit}) {
    auto lin = std::make_shared<Nvfp4QadLinear>("blocks.1.ffn.net.0.proj", mode,
                                                mode == ScaleMode::kStatic ? std::optional<float>(4.0f)
                                                                           : std::nullopt);
    const torch::Tensor quantized = lin->forward(x0, w0, b0);
    vqad::ops::set_qad_enabled({lin}, false);
    EXPECT_FALSE(lin->enabled());
    EXPECT_NE(lin->describe().find("[disabled]"), std::string::npos);
    torch::Tensor x1 = x0.clone().requires_grad_(true), w1 = w0.clone().requires_grad_(true);
    torch::Tensor x2 = x0.clone().requires_grad_(true), w2 = w0.clone().requires_grad_(true);
    const torch::Tensor off = lin->forward(x1, w1, b0);
    const torch::Tensor dense = torch::nn::functional::linear(x2, w2.to(torch::kBFloat16), b0.to(torch::kBFloat16));
    EXPECT_TRUE(torch::equal(off, dense));
    EXPECT_FALSE(torch::equal(off, quantized));
    const torch::Tensor g = torch::randn(off.sizes()).to(off.scalar_type());
    off.backward(g);
    dense.backward(g);
    EXPECT_TRUE(torch::equal(x1.grad(), x2.grad()));
    EXPECT_TRUE(torch::equal(w1.grad(), w2.grad()));
    vqad::ops::set_qad_enabled({lin}, true);
    EXPECT_TRUE(torch::equal(lin->forward(x0, w0, b0), quantized));
  }
}

TEST(Nvfp4LinearCpu, CalibrationRecordsMaxRunsDenseAndSetsStaticScales) {
  auto ffn_in = std::make_shared<Nvfp4QadLinear>("blocks.0.ffn.net.0.proj", ScaleMode::kStatic, std::nullopt, true);
  auto ffn_out = std::make_shared<Nvfp4QadLinear>("blocks.0.ffn.net.2", ScaleMode::kStatic, std::nullopt, true);
  auto done = std::make_shared<Nvfp4QadLinear>("blocks.1.ffn.net.2", ScaleMode::kStatic, 9.0f);
  auto attn = std::make_shared<Nvfp4QadLinear>("blocks.0.attn1.to_q", ScaleMode::kUnit);
  const torch::Tensor w = heavy_tailed({8, 16}, 14);
  const torch::Tensor x1 = torch::randn({5, 16}), x2 = torch::randn({3, 16}) * 3;
  {
    CalibrationScope scope({ffn_in, ffn_out, done, attn});
    EXPECT_EQ(scope.pending_names(), (std::vector<std::string>{"blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2"}));
    EXPECT_TRUE(ffn_in->calibrating());
    EXPECT_FALSE(done->calibrating());
    EXPECT_TRUE(torch::equal(ffn_in->forward(x1, w, torch::Tensor()), vqad::ops::dense_linear(x1, w, torch::Tensor())));
    ffn_in->forward(x2, w, torch::Tensor());
    ffn_out->forward(x1, w, torch::Tensor());
    const auto values = scope.finish();
    ASSERT_EQ(values.size(), 2u);
    EXPECT_EQ(values.at("blocks.0.ffn.net.0.proj"), std::max(x1.abs().max().item<float>(), x2.abs().max().item<float>()));
    EXPECT_EQ(values.at("blocks.0.ffn.net.2"), x1.abs().max().item<float>());
  }
  EXPECT_FALSE(ffn_in->calibrating());
  EXPECT_EQ(*ffn_in->input_amax(), std::max(x1.abs().max().item<float>(), x2.abs().max().item<float>()));
  EXPECT_EQ(*done->input_amax(), 9.0f);
  // Now quantized with the calibrated scale.
  EXPECT_TRUE(torch::equal(ffn_in->forward(x1, w, torch::Tensor()),
                           vqad::ops::nvfp4_linear(x1, w, torch::Tensor(), ScaleMode::kStatic, *ffn_in->input_amax())));
  // Recalibration includes already calibrated static linears.
  CalibrationScope again({ffn_in, done}, {}, /*recalibrate=*/true);
  EXPECT_EQ(again.pending_names().size(), 2u);
}

TEST(Nvfp4LinearCpu, CalibrationReducesMaxOverRanks) {
  auto a = std::make_shared<Nvfp4QadLinear>("blocks.2.ffn.net.0.proj", ScaleMode::kStatic, std::nullopt, true);
  auto b = std::make_shared<Nvfp4QadLinear>("blocks.2.ffn.net.2", ScaleMode::kStatic, std::nullopt, true);
  const torch::Tensor w = torch::randn({4, 16});
  int calls = 0;
  // Stands in for an all-reduce with one other rank whose maxima are {10, 0}: b saw
  // nothing here but something there.
  auto reducer = [&](torch::Tensor& m) {
    ++calls;
    ASSERT_EQ(m.numel(), 2);
    m.copy_(torch::maximum(m, torch::tensor({10.0f, 0.5f})));
  };
  CalibrationScope scope({a, b}, reducer);
  a->forward(torch::full({2, 16}, 2.0f), w, torch::Tensor());
  const auto v = scope.finish();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(v.at("blocks.2.ffn.net.0.proj"), 10.0f);
  EXPECT_EQ(v.at("blocks.2.ffn.net.2"), 0.5f);
}

TEST(Nvfp4LinearCpu, CalibrationErrors) {
  auto seen = std::make_shared<Nvfp4QadLinear>("blocks.0.ffn.net.0.proj", ScaleMode::kStatic, std::nullopt, true);
  auto unseen = std::make_shared<Nvfp4QadLinear>("blocks.7.ffn.net.2", ScaleMode::kStatic, std::nullopt, true);
  const torch::Tensor w = torch::randn({4, 16});
  {
    CalibrationScope scope({seen, unseen});
    seen->forward(torch::randn({3, 16}), w, torch::Tensor());
    try {
      scope.finish();
      FAIL() << "expected an error for a linear that saw nothing";
    } catch (const vqad::Error& e) {
      EXPECT_NE(std::string(e.what()).find("blocks.7.ffn.net.2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("saw no activation"), std::string::npos) << e.what();
    }
    EXPECT_THROW(scope.finish(), vqad::Error);  // finish twice
  }
  EXPECT_FALSE(unseen->input_amax().has_value());
  // Used before calibration.
  try {
    unseen->forward(torch::randn({3, 16}), w, torch::Tensor());
    FAIL() << "expected an error for an uncalibrated static linear";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.7.ffn.net.2"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("before calibration"), std::string::npos);
  }
  // Leaving a scope without finish(): recording stops, nothing is set.
  {
    CalibrationScope scope({unseen});
    unseen->forward(torch::randn({3, 16}), w, torch::Tensor());
  }
  EXPECT_FALSE(unseen->calibrating());
  EXPECT_FALSE(unseen->input_amax().has_value());
  // NaN activations fail the calibration instead of producing a NaN scale.
  {
    CalibrationScope scope({unseen});
    unseen->forward(torch::full({1, 16}, std::numeric_limits<float>::quiet_NaN()), w, torch::Tensor());
    EXPECT_THROW(scope.finish(), vqad::Error);
  }
  // Static without an amax and without permission; bad amaxes; bad modes.
  EXPECT_THROW(Nvfp4QadLinear("blocks.0.ffn.net.2", ScaleMode::kStatic), vqad::Error);
  EXPECT_THROW(Nvfp4QadLinear("blocks.0.ffn.net.2", ScaleMode::kStatic, -1.0f), vqad::Error);
  EXPECT_THROW(Nvfp4QadLinear("blocks.0.ffn.net.2", ScaleMode::kStatic, std::numeric_limits<float>::infinity()),
               vqad::Error);
  EXPECT_THROW(Nvfp4QadLinear("blocks.0.ffn.net.2", ScaleMode::kDynamic), vqad::Error);
  Nvfp4QadLinear unit("blocks.0.attn1.to_v", ScaleMode::kUnit);
  EXPECT_THROW(unit.set_input_amax(3.0f), vqad::Error);
  EXPECT_THROW(seen->set_input_amax(0.0f), vqad::Error);
}

TEST(Nvfp4LinearCpu, InvalidInputsAreErrors) {
  const torch::Tensor w = torch::randn({8, 32});
  const torch::Tensor x = torch::randn({4, 32});
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const vqad::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  using vqad::ops::nvfp4_linear;
  const torch::Tensor none;
  expect_error([&] { nvfp4_linear(torch::randn({4, 24}), torch::randn({8, 24}), none, ScaleMode::kDynamic); },
               "multiple of the NVFP4 block");
  expect_error([&] { nvfp4_linear(torch::randn({4, 16}), w, none, ScaleMode::kDynamic); }, "does not match weight");
  expect_error([&] { nvfp4_linear(x.to(torch::kFloat16), w, none, ScaleMode::kDynamic); }, "float32 or bfloat16");
  expect_error([&] { nvfp4_linear(x, w.to(torch::kFloat64), none, ScaleMode::kDynamic); }, "float32 or bfloat16");
  expect_error([&] { nvfp4_linear(x, w, torch::randn({7}), ScaleMode::kDynamic); }, "bias must be [8]");
  expect_error([&] { nvfp4_linear(x, torch::randn({8, 32, 1}), none, ScaleMode::kDynamic); }, "weight must be [N, K]");
  expect_error([&] { nvfp4_linear(x, w, none, ScaleMode::kStatic, 0.0f); }, "positive finite amax");
  expect_error([&] { nvfp4_linear(x, w, none, ScaleMode::kStatic, std::nanf("")); }, "positive finite amax");
  expect_error([&] { vqad::ops::nvfp4_unit_operand_cpu(torch::randn({2, 20}), 1.0f); }, "not a multiple of 16");
}

TEST(Nvfp4LinearCpu, EmptyBatchGivesEmptyOutput) {
  const torch::Tensor y =
      vqad::ops::nvfp4_linear(torch::zeros({0, 32}), torch::randn({8, 32}), torch::randn({8}), ScaleMode::kDynamic);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{0, 8}));
}

}  // namespace
