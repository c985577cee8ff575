// GPU tests of the NVFP4 linear's CUDA path against its CPU reference: amax and the
// unit-scaled operand bit for bit, the cuBLASLt GEMM with a device alpha, the whole
// forward (dynamic / static / unit) and the straight-through backward. Outputs the
// kernels write are NaN-poisoned first; shapes are not multiples of any tile.
// The forward GEMM routes: on a GPU without FP4 tensor cores (sm_90) auto is fake_quant bit
// for bit and fp4 is refused with one line; on sm_100 / sm_120 the fp4 route (Blackwell
// quantizer + block-scaled FP4 GEMM) equals the fake-quant route within the noise floor of
// two fake-quant GEMM summation orders (CPU fp32 torch mm vs CUDA cuBLASLt), measured here.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <string>

#include "tests/support/errors.h"
#include "vqad/core/error.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "vqad/kernels/linear/nvfp4_linear_kernels.h"

namespace {

using vqad::nvfp4::ScaleMode;
namespace kl = vqad::kernels::linear;

#define REQUIRE_GPU()                                                   \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

torch::Tensor heavy_tailed(std::vector<int64_t> shape, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randn(shape) * torch::exp(torch::randn(shape) * 1.5);
}

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Bitwise equality of two fp32 tensors where NaN == NaN.
void expect_bitwise_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  const torch::Tensor g = got.to(torch::kCPU, torch::kFloat32).contiguous();
  const torch::Tensor w = want.to(torch::kCPU, torch::kFloat32).contiguous();
  ASSERT_EQ(g.numel(), w.numel()) << what;
  int bad = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const float a = g.data_ptr<float>()[i], b = w.data_ptr<float>()[i];
    uint32_t ab, bb;
    std::memcpy(&ab, &a, 4);
    std::memcpy(&bb, &b, 4);
    const bool same = (std::isnan(a) && std::isnan(b)) || ab == bb;
    if (!same && ++bad <= 5) ADD_FAILURE() << what << " element " << i << ": got " << a << ", want " << b;
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(Nvfp4LinearCuda, AmaxMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t n : {1, 7, 1000, 4097, 1 << 20}) {
    torch::Tensor x = heavy_tailed({n}, 100 + n);
    if (n > 10) x.index_put_({3}, std::numeric_limits<float>::quiet_NaN());
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      const torch::Tensor xd = x.to(dt);
      const float want = vqad::ops::bf16_amax_cpu(xd);
      EXPECT_EQ(vqad::ops::bf16_amax_cuda(xd.cuda()).item<float>(), want) << "n=" << n << " " << dt;
      // Misaligned start: the scalar path.
      if (n > 2) {
        EXPECT_EQ(vqad::ops::bf16_amax_cuda(xd.cuda().narrow(0, 1, n - 1)).item<float>(),
                  vqad::ops::bf16_amax_cpu(xd.narrow(0, 1, n - 1)))
            << "n=" << n << " " << dt;
      }
    }
  }
}

TEST(Nvfp4LinearCuda, UnitOperandBitExactAgainstCpu) {
  REQUIRE_GPU();
  const int64_t rows = 333, cols = 80;  // 5 blocks per row, odd row count
  torch::Tensor x = heavy_tailed({rows, cols}, 7);
  x.index_put_({0, torch::indexing::Slice(0, 16)}, 0.0f);
  x.index_put_({1, 17}, std::numeric_limits<float>::quiet_NaN());
  x.index_put_({2, 40}, std::numeric_limits<float>::infinity());
  x.index_put_({3, torch::indexing::Slice(32, 48)}, -1e-30f);
  x.index_put_({4, torch::indexing::Slice(48, 64)}, 1e6f);
  for (float s_enc : {1.0f, 2688.0f / 37.0f, 2688.0f / 1e6f, 2688.0f / 1e-3f}) {
    for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
      const torch::Tensor xd = x.to(dt).cuda();
      torch::Tensor out = torch::full({rows, cols}, std::numeric_limits<float>::quiet_NaN(),
                                      xd.options().dtype(torch::kBFloat16));
      torch::Tensor s = torch::full({1}, s_enc, xd.options().dtype(torch::kFloat32));
      kl::launch_unit_operand(xd.data_ptr(), dt == torch::kBFloat16 ? kl::ElemType::kBF16 : kl::ElemType::kF32,
                              rows, cols, s.data_ptr<float>(), out.data_ptr(), stream());
      const torch::Tensor want = vqad::ops::nvfp4_unit_operand_cpu(x.to(dt), s_enc);
      expect_bitwise_equal(out, want, "unit operand s_enc=" + std::to_string(s_enc));
      expect_bitwise_equal(vqad::ops::nvfp4_unit_operand_cuda(xd, s), want, "nvfp4_unit_operand_cuda");
    }
  }
}

TEST(Nvfp4LinearCuda, GemmWithDeviceAlphaMatchesCpu) {
  REQUIRE_GPU();
  // N = 77: d's rows are not 16-byte aligned, the bias goes through the fp32 staging
  // copy; N = 80: cuBLASLt's bias epilogue, and once more with a bias view that is
  // not 16-byte aligned (staged again). Each must round alpha * acc + bias once.
  const int64_t m = 301, k = 96;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  for (int64_t n : {77, 80}) {
    for (int bias_kind : {0, 1, 2}) {  // none, aligned, misaligned view
      if (bias_kind == 2 && n % 8 != 0) continue;
      const bool with_bias = bias_kind != 0;
      const torch::Tensor a = vqad::ops::nvfp4_unit_operand_cpu(heavy_tailed({m, k}, 8), 2688.0f / 50.0f);
      const torch::Tensor b = vqad::ops::nvfp4_unit_operand_cpu(heavy_tailed({n, k}, 9), 2688.0f / 20.0f);
      const torch::Tensor bias = torch::randn({n}).to(torch::kBFloat16);
      const float alpha = (1.0f / (2688.0f / 50.0f)) * (1.0f / (2688.0f / 20.0f));
      torch::Tensor ab = torch::tensor({alpha, 0.0f}).cuda();
      torch::Tensor d = torch::full({m, n}, std::numeric_limits<float>::quiet_NaN(), bf16);
      const torch::Tensor ag = a.to(bf16), bg = b.to(bf16);
      torch::Tensor bias_store = torch::zeros({n + 1}, bf16);
      const torch::Tensor biasg = bias_kind == 2 ? bias_store.narrow(0, 1, n) : bias_store.narrow(0, 0, n);
      biasg.copy_(bias.cuda());
      const void* bias_ptr = with_bias ? biasg.data_ptr() : nullptr;
      const size_t ws_bytes = kl::gemm_workspace_bytes(m, n, bias_ptr, d.data_ptr());
      torch::Tensor ws = torch::empty({int64_t(ws_bytes)}, bf16.dtype(torch::kUInt8));
      kl::gemm_bf16_nt(ag.data_ptr(), bg.data_ptr(), bias_ptr, d.data_ptr(), m, n, k, ab.data_ptr<float>(),
                       ws.data_ptr(), ws_bytes, stream());
      torch::Tensor want = torch::mm(a, b.t()) * alpha;
      if (with_bias) want = want + bias.to(torch::kFloat32);
      const torch::Tensor got = d.cpu().to(torch::kFloat32);
      EXPECT_FALSE(torch::isnan(got).any().item<bool>());
      // One bf16 rounding of the result plus fp32 accumulation-order noise.
      const torch::Tensor tol =
          want.abs() * std::ldexp(1.0, -8) + std::ldexp(double(k), -23) * torch::mm(a.abs(), b.abs().t()) * alpha;
      EXPECT_TRUE(((got - want).abs() <= tol).all().item<bool>())
          << "n=" << n << " bias kind " << bias_kind << " max err " << (got - want).abs().max().item<float>();
    }
  }
}

TEST(Nvfp4LinearCuda, ForwardMatchesCpuReference) {
  REQUIRE_GPU();
  const torch::Tensor x = heavy_tailed({3, 101, 160}, 10);  // M = 303
  // N = 83: the bias takes the staged fp32 path; N = 88: cuBLASLt's bias epilogue.
  for (int64_t n : {83, 88}) {
    const torch::Tensor w = heavy_tailed({n, 160}, 11) * 0.03;
    const torch::Tensor b = torch::randn({n});
    for (auto mode : {ScaleMode::kDynamic, ScaleMode::kStatic, ScaleMode::kUnit}) {
      for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
        for (bool with_bias : {true, false}) {
          const torch::Tensor xd = x.to(dt);
          const torch::Tensor bb = with_bias ? b : torch::Tensor();
          const torch::Tensor cpu = vqad::ops::nvfp4_linear(xd, w, bb, mode, 6.5f);
          const torch::Tensor gpu = vqad::ops::nvfp4_linear(xd.cuda(), w.cuda(), with_bias ? b.cuda() : bb, mode, 6.5f);
          ASSERT_EQ(gpu.sizes(), cpu.sizes());
          ASSERT_EQ(gpu.scalar_type(), dt);
          const torch::Tensor g = gpu.cpu().to(torch::kFloat32), c = cpu.to(torch::kFloat32);
          EXPECT_FALSE(torch::isnan(g).any().item<bool>());
          // Both are bf16(alpha * acc + b) (dynamic) or bf16(bf16(alpha * acc) + b) (static /
          // unit, seeds/003's order) returned in x's dtype (compute dtype BF16,
          // spec/linear_qat.md; fp32 inputs too); they differ only in the fp32 accumulation
          // order, so at most by one bf16 ulp where a sum lands near a rounding boundary.
          const torch::Tensor tol = c.abs() * std::ldexp(1.0, -7) + 1e-5 * c.abs().max();
          const double frac_exact = (g == c).to(torch::kFloat64).mean().item<double>();
          EXPECT_TRUE(((g - c).abs() <= tol).all().item<bool>())
              << "N=" << n << " " << vqad::nvfp4::scale_mode_name(mode) << " " << dt << " bias=" << with_bias
              << " max err " << (g - c).abs().max().item<float>();
          EXPECT_GT(frac_exact, 0.9) << "N=" << n << " " << vqad::nvfp4::scale_mode_name(mode) << " " << dt
                                     << " bias=" << with_bias;
        }
      }
    }
  }
}

TEST(Nvfp4LinearCuda, MisalignedViewsMatchCpuReference) {
  REQUIRE_GPU();
  // A view starting one element into its storage is not 16-byte aligned.
  const int64_t m = 45, k = 64, n = 29;
  const torch::Tensor flat = heavy_tailed({m * k + 1}, 12).to(torch::kBFloat16);
  const torch::Tensor x = flat.cuda().narrow(0, 1, m * k).view({m, k});
  const torch::Tensor w = heavy_tailed({n, k}, 13);
  const torch::Tensor gpu = vqad::ops::nvfp4_linear(x, w.cuda(), torch::Tensor(), ScaleMode::kDynamic);
  const torch::Tensor cpu = vqad::ops::nvfp4_linear(x.cpu(), w, torch::Tensor(), ScaleMode::kDynamic);
  const torch::Tensor g = gpu.cpu().to(torch::kFloat32), c = cpu.to(torch::kFloat32);
  EXPECT_TRUE(((g - c).abs() <= c.abs() * std::ldexp(1.0, -7) + 1e-5 * c.abs().max()).all().item<bool>());
  EXPECT_EQ(vqad::ops::bf16_amax_cuda(x).item<float>(), vqad::ops::bf16_amax_cpu(x.cpu()));
}

TEST(Nvfp4LinearCuda, WanShapeRowsMatchCpuReference) {
  REQUIRE_GPU();
  // The FFN shapes of Wan 1.3B, checked on a slice of rows (static activation scale so
  // that the slice and the whole tensor share the scale).
  for (auto [k, n] : {std::pair<int64_t, int64_t>{1536, 8960}, {8960, 1536}}) {
    const int64_t m = 31200;
    torch::manual_seed(k);
    const auto cuda = torch::TensorOptions().device(torch::kCUDA);
    const torch::Tensor x = torch::randn({m, k}, cuda.dtype(torch::kBFloat16));
    const torch::Tensor w = torch::randn({n, k}, cuda) * 0.02;
    const torch::Tensor b = torch::randn({n}, cuda);
    const torch::Tensor y = vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kStatic, 3.0f);
    const torch::Tensor rows = torch::tensor({0L, 1L, 127L, 128L, 4095L, 31071L, 31199L});
    const torch::Tensor cpu = vqad::ops::nvfp4_linear(x.index_select(0, rows.cuda()).cpu(), w.cpu(), b.cpu(),
                                                      ScaleMode::kStatic, 3.0f);
    const torch::Tensor g = y.index_select(0, rows.cuda()).cpu().to(torch::kFloat32), c = cpu.to(torch::kFloat32);
    const torch::Tensor tol = c.abs() * std::ldexp(1.0, -7) + 1e-5 * c.abs().max();
    EXPECT_TRUE(((g - c).abs() <= tol).all().item<bool>()) << "K=" << k << " N=" << n;
    // Dynamic: the activation amax over all 31200 rows is the CPU one.
    EXPECT_EQ(vqad::ops::bf16_amax_cuda(x).item<float>(), vqad::ops::bf16_amax_cpu(x.cpu()));
  }
}

TEST(Nvfp4LinearCuda, BackwardIsTheDenseLinearBackward) {
  REQUIRE_GPU();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor x0 = torch::randn({2, 55, 64}, cuda.dtype(torch::kBFloat16));
  const torch::Tensor w0 = torch::randn({40, 64}, cuda);
  const torch::Tensor b0 = torch::randn({40}, cuda);
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  torch::Tensor xq = leaf(x0), wq = leaf(w0), bq = leaf(b0), xd = leaf(x0), wd = leaf(w0), bd = leaf(b0);
  const torch::Tensor yq = vqad::ops::nvfp4_linear(xq, wq, bq, ScaleMode::kDynamic);
  const torch::Tensor yd = vqad::ops::dense_linear(xd, wd, bd);
  const torch::Tensor g = torch::randn(yq.sizes(), cuda).to(yq.scalar_type());
  yq.backward(g);
  yd.backward(g);
  EXPECT_TRUE(torch::equal(xq.grad(), xd.grad()));
  EXPECT_TRUE(torch::equal(wq.grad(), wd.grad()));
  EXPECT_TRUE(torch::equal(bq.grad(), bd.grad()));
  EXPECT_FALSE(torch::equal(yq, yd));
}

TEST(Nvfp4LinearCuda, DisabledQadLinearIsDenseOnGpu) {
  REQUIRE_GPU();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor x = torch::randn({77, 48}, cuda.dtype(torch::kBFloat16));
  const torch::Tensor w = torch::randn({33, 48}, cuda), b = torch::randn({33}, cuda);
  vqad::ops::Nvfp4QadLinear lin("blocks.0.ffn.net.2", ScaleMode::kStatic, 2.0f);
  const torch::Tensor q = lin.forward(x, w, b);
  lin.set_enabled(false);
  EXPECT_TRUE(torch::equal(lin.forward(x, w, b), vqad::ops::dense_linear(x, w, b)));
  EXPECT_FALSE(torch::equal(q, vqad::ops::dense_linear(x, w, b)));
}


// ---- forward GEMM routes ------------------------------------------------------------------
using vqad::ops::Nvfp4GemmRoute;

using vqad::test::error_of;

TEST(Nvfp4LinearRoutes, WithoutFp4TensorCoresAutoIsFakeQuantBitForBitAndFp4IsRefused) {
  REQUIRE_GPU();
  const torch::Device dev(torch::kCUDA, 0);
  std::string why;
  if (vqad::ops::nvfp4_fp4_route_available(dev, &why))
    GTEST_SKIP() << "this GPU has FP4 tensor cores (see the fp4 tests)";
  std::cout << "fp4 route unavailable on this GPU: " << why << "\n";
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  const std::string sm = "sm_" + std::to_string(major * 10 + minor);
  EXPECT_NE(why.find(sm), std::string::npos) << why;  // names the capability
  EXPECT_NE(why.find("device 0 ("), std::string::npos) << why;  // and the device
  EXPECT_EQ(vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kAuto, dev, "k"), Nvfp4GemmRoute::kFakeQuant);
  const std::string e = error_of(
      [&] { vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kFp4, dev, "training.linear_quantization.gemm"); });
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_EQ(e.rfind("training.linear_quantization.gemm: the fp4 GEMM route needs a GPU with FP4 tensor cores, but "
                    "device 0 (",
                    0),
            0u)
      << e;
  EXPECT_NE(e.find(sm), std::string::npos) << e;
  // auto runs exactly the fake-quant linear (forward and backward), for every activation mode.
  const torch::Tensor x0 = heavy_tailed({3, 41, 96}, 30).to(torch::kBFloat16).cuda();
  const torch::Tensor w0 = (heavy_tailed({56, 96}, 31) * 0.05).cuda(), b0 = torch::randn({56}).cuda();
  for (auto mode : {ScaleMode::kDynamic, ScaleMode::kStatic, ScaleMode::kUnit}) {
    auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
    torch::Tensor xa = leaf(x0), wa = leaf(w0), xf = leaf(x0), wf = leaf(w0);
    const torch::Tensor ya = vqad::ops::nvfp4_linear(xa, wa, b0, mode, 5.0f, torch::Tensor(), Nvfp4GemmRoute::kAuto);
    const torch::Tensor yf =
        vqad::ops::nvfp4_linear(xf, wf, b0, mode, 5.0f, torch::Tensor(), Nvfp4GemmRoute::kFakeQuant);
    EXPECT_TRUE(torch::equal(ya, yf)) << vqad::nvfp4::scale_mode_name(mode);
    const torch::Tensor g = torch::randn(ya.sizes(), ya.options());
    ya.backward(g);
    yf.backward(g);
    EXPECT_TRUE(torch::equal(xa.grad(), xf.grad()));
    EXPECT_TRUE(torch::equal(wa.grad(), wf.grad()));
    EXPECT_NE(error_of([&] {
                vqad::ops::nvfp4_linear(x0, w0, b0, mode, 5.0f, torch::Tensor(), Nvfp4GemmRoute::kFp4);
              }).find(sm),
              std::string::npos);
  }
  // The packed (inference) linear: auto is its fake-quant forward bit for bit.
  const float s_enc_w = vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(w0.cpu()));
  vqad::ops::Nvfp4PackedLinear p("blocks.0.attn1.to_q", vqad::ops::nvfp4_unit_operand_cpu(w0.cpu(), s_enc_w),
                                 1.0f / s_enc_w, ScaleMode::kUnit);
  torch::NoGradGuard ng;
  const torch::Tensor pf = p.forward(x0, torch::Tensor(), b0);
  p.set_gemm_route(Nvfp4GemmRoute::kAuto);
  EXPECT_TRUE(torch::equal(p.forward(x0, torch::Tensor(), b0), pf));
  EXPECT_TRUE(torch::equal(pf, vqad::ops::nvfp4_linear(x0, w0, b0, ScaleMode::kUnit)));
}

// Per element: one bf16 rounding of the result plus the fp32 accumulation-order term (the
// tolerance of ForwardMatchesCpuReference); the ratio max |got - want| / tol.
double worst_ratio(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor g = got.cpu().to(torch::kFloat32), c = want.cpu().to(torch::kFloat32);
  const torch::Tensor tol = c.abs() * std::ldexp(1.0, -7) + 1e-5 * c.abs().max() + 1e-30;
  return ((g - c).abs() / tol).max().item<double>();
}
double frac_equal(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.cpu().to(torch::kFloat32) == want.cpu().to(torch::kFloat32)).to(torch::kFloat64).mean().item<double>();
}

#define REQUIRE_FP4_ROUTE()                                                                         \
  do {                                                                                              \
    REQUIRE_GPU();                                                                                  \
    std::string why;                                                                                \
    if (!vqad::ops::nvfp4_fp4_route_available(torch::Device(torch::kCUDA, 0), &why))                \
      GTEST_SKIP() << "fp4 GEMM route not run (needs FP4 tensor cores): " << why;                   \
  } while (0)

TEST(Nvfp4LinearRoutes, Fp4RouteEqualsFakeQuantWithinTheSummationOrderNoiseFloor) {
  REQUIRE_FP4_ROUTE();
  EXPECT_EQ(vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kAuto, torch::Device(torch::kCUDA, 0), "k"),
            Nvfp4GemmRoute::kFp4);
  // K = 160 and 48 are not multiples of 32 (the FP4 GEMM's K step): zero blocks pad them.
  for (int64_t k : {160, 48, 256}) {
    const torch::Tensor x = heavy_tailed({3, 101, k}, 40 + k);  // M = 303
    for (int64_t n : {83, 88}) {
      const torch::Tensor w = heavy_tailed({n, k}, 41 + n) * 0.03;
      const torch::Tensor b = torch::randn({n});
      for (auto mode : {ScaleMode::kDynamic, ScaleMode::kStatic, ScaleMode::kUnit}) {
        for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
          for (bool with_bias : {true, false}) {
            const torch::Tensor xd = x.to(dt), bb = with_bias ? b : torch::Tensor();
            const torch::Tensor cpu = vqad::ops::nvfp4_linear(xd, w, bb, mode, 6.5f);
            const torch::Tensor fq = vqad::ops::nvfp4_linear(xd.cuda(), w.cuda(), with_bias ? b.cuda() : bb, mode, 6.5f,
                                                             torch::Tensor(), Nvfp4GemmRoute::kFakeQuant);
            const torch::Tensor f4 = vqad::ops::nvfp4_linear(xd.cuda(), w.cuda(), with_bias ? b.cuda() : bb, mode, 6.5f,
                                                             torch::Tensor(), Nvfp4GemmRoute::kFp4);
            ASSERT_EQ(f4.sizes(), cpu.sizes());
            ASSERT_EQ(f4.scalar_type(), dt);
            EXPECT_FALSE(torch::isnan(f4.cpu()).any().item<bool>());
            // The noise floor: two fake-quant GEMMs that differ only in their summation order.
            const double floor_ratio = worst_ratio(fq, cpu), floor_eq = frac_equal(fq, cpu);
            const double r = worst_ratio(f4, cpu), eq = frac_equal(f4, cpu);
            const std::string what = "K=" + std::to_string(k) + " N=" + std::to_string(n) + " " +
                                     vqad::nvfp4::scale_mode_name(mode) + " " + std::string(c10::toString(dt)) +
                                     " bias=" + std::to_string(with_bias);
            std::cout << what << ": noise floor (CUDA fake-quant vs CPU) max err/tol " << floor_ratio << ", exact "
                      << floor_eq << "; fp4 route max err/tol " << r << ", exact " << eq << "\n";
            EXPECT_LE(r, std::max(1.0, 2.0 * floor_ratio)) << what;
            EXPECT_GE(eq, std::min(0.9, floor_eq - 0.05)) << what;
          }
        }
      }
    }
  }
}

TEST(Nvfp4LinearRoutes, Fp4RouteKeepsTheStraightThroughBackwardAndThePackedPath) {
  REQUIRE_FP4_ROUTE();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor x0 = torch::randn({2, 55, 64}, cuda.dtype(torch::kBFloat16));
  const torch::Tensor w0 = torch::randn({40, 64}, cuda) * 0.1, b0 = torch::randn({40}, cuda);
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  torch::Tensor x4 = leaf(x0), w4 = leaf(w0), b4 = leaf(b0), xf = leaf(x0), wf = leaf(w0), bf = leaf(b0);
  const torch::Tensor y4 = vqad::ops::nvfp4_linear(x4, w4, b4, ScaleMode::kDynamic, 0.0f, torch::Tensor(),
                                                   Nvfp4GemmRoute::kFp4);
  const torch::Tensor yf = vqad::ops::nvfp4_linear(xf, wf, bf, ScaleMode::kDynamic);
  const torch::Tensor g = torch::randn(y4.sizes(), cuda).to(y4.scalar_type());
  y4.backward(g);
  yf.backward(g);
  EXPECT_TRUE(torch::equal(x4.grad(), xf.grad()));
  EXPECT_TRUE(torch::equal(w4.grad(), wf.grad()));
  EXPECT_TRUE(torch::equal(b4.grad(), bf.grad()));
  // Packed: the weight's codes recovered from the stored unit weight; within the floor of
  // the fake-quant packed forward.
  torch::NoGradGuard ng;
  for (auto mode : {ScaleMode::kStatic, ScaleMode::kUnit, ScaleMode::kDynamic}) {
    const float s_enc_w = vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(w0.cpu()));
    vqad::ops::Nvfp4PackedLinear p("blocks.0.ffn.net.0.proj", vqad::ops::nvfp4_unit_operand_cpu(w0.cpu(), s_enc_w),
                                   1.0f / s_enc_w, mode, mode == ScaleMode::kStatic ? 4.0f : 0.0f);
    const torch::Tensor cpu = p.forward(x0.cpu(), torch::Tensor(), b0.cpu());
    const torch::Tensor fq = p.forward(x0, torch::Tensor(), b0);
    p.set_gemm_route(Nvfp4GemmRoute::kFp4);
    const torch::Tensor f4 = p.forward(x0, torch::Tensor(), b0);
    EXPECT_LE(worst_ratio(f4, cpu), std::max(1.0, 2.0 * worst_ratio(fq, cpu))) << vqad::nvfp4::scale_mode_name(mode);
    EXPECT_GE(frac_equal(f4, cpu), std::min(0.9, frac_equal(fq, cpu) - 0.05));
  }
}

}  // namespace
#endif  // VQAD_WITH_TORCH_CUDA
