// The Blackwell FP4 routes (kernels_fp4/nvfp4_fp4_routes.h) against the CPU reference:
// the cvt.rn.satfinite.e2m1x2.f32 quantizer reproduces the golden vectors and the CPU
// quantizer bit for bit; the cuBLASLt block-scaled FP4 GEMM equals the fp32 GEMM of the
// dequantized operands up to its summation order. On a GPU without FP4 tensor cores
// (sm_90) every test skips, saying why.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "vqad/core/safetensors.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels_fp4/nvfp4_fp4_routes.h"
#include "vqad/numerics/nvfp4.h"

namespace {

namespace fp4 = vqad::kernels::fp4;
namespace nv = vqad::nvfp4;

#define REQUIRE_FP4_ROUTES()                                                                      \
  do {                                                                                            \
    std::string why;                                                                              \
    if (!fp4::fp4_routes_available(-1, &why)) GTEST_SKIP() << "Blackwell FP4 routes not run: " << why; \
  } while (0)

using vqad::test::DeviceBuffer;  // poisoned device memory (tests/support)

// Quantizes rows of fp32 x (one encode scale) on the GPU; returns unpacked codes and scales.
void gpu_quantize(const std::vector<float>& x, int64_t rows, int64_t cols, float s_enc, std::vector<uint8_t>* codes,
                  std::vector<uint8_t>* scales) {
  DeviceBuffer<float> dx(x), ds(std::vector<float>{s_enc});
  DeviceBuffer<uint8_t> dc(size_t(rows * cols / 2)), dsc(size_t(rows * cols / 16));
  fp4::launch_quantize_e2m1x2(dx.get(), false, rows, cols, ds.get(), dc.get(), dsc.get(), nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  *codes = nv::unpack_codes(dc.download());
  *scales = dsc.download();
}

template <typename T>
std::vector<T> golden(const vqad::st::File& f, const std::string& name) {
  const auto& info = f.info(name);
  std::vector<T> out(info.nbytes / sizeof(T));
  std::memcpy(out.data(), f.data(name), info.nbytes);
  return out;
}

TEST(Fp4Blackwell, QuantizerReproducesTheGoldenVectors) {
  REQUIRE_FP4_ROUTES();
  const auto f = vqad::st::File::open(VQAD_GOLDEN_FILE);
  // Unit mode: one call over every row.
  const auto x = golden<float>(f, "x");
  const int64_t rows = static_cast<int64_t>(x.size() / 16);
  std::vector<uint8_t> codes, scales;
  gpu_quantize(x, rows, 16, 1.0f, &codes, &scales);
  EXPECT_EQ(scales, golden<uint8_t>(f, "scale_bits"));
  EXPECT_EQ(codes, golden<uint8_t>(f, "codes"));
  // Dynamic mode: tensors of 64 rows, each with its own encode scale.
  const auto gx = golden<float>(f, "g_x");
  const auto gamax = golden<float>(f, "g_tensor_amax");
  const auto gcodes = golden<uint8_t>(f, "g_codes"), gscales = golden<uint8_t>(f, "g_scale_bits");
  const int64_t grows = static_cast<int64_t>(gx.size() / 16);
  int bad = 0;
  for (int64_t r0 = 0; r0 < grows; r0 += 64) {
    const int64_t n = std::min<int64_t>(64, grows - r0);
    std::vector<float> part(gx.begin() + r0 * 16, gx.begin() + (r0 + n) * 16);
    gpu_quantize(part, n, 16, nv::encode_scale_from_amax(gamax[r0]), &codes, &scales);
    for (int64_t r = 0; r < n; ++r) {
      bad += scales[r] != gscales[r0 + r];
      for (int i = 0; i < 16; ++i) bad += codes[r * 16 + i] != gcodes[(r0 + r) * 16 + i];
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(Fp4Blackwell, QuantizerAndSwizzleEqualTheCpuReferenceOnRandomMatrices) {
  REQUIRE_FP4_ROUTES();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 300, cols = 272;  // rows and scale columns not multiples of 128 / 4
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = nd(rng) * std::exp(1.5f * nd(rng));
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float s_enc = nv::encode_scale_from_amax(amax);
  const nv::QuantizedMatrix ref = nv::quantize_matrix(x.data(), rows, cols, s_enc);
  std::vector<uint8_t> codes, scales;
  gpu_quantize(x, rows, cols, s_enc, &codes, &scales);
  EXPECT_EQ(codes, ref.codes);
  EXPECT_EQ(scales, ref.scales);
  DeviceBuffer<uint8_t> dsc(scales), dsw(size_t(fp4::swizzled_bytes(rows, cols / 16)));
  fp4::launch_swizzle_scales(dsc.get(), rows, cols / 16, dsw.get(), nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dsw.download(), ref.scales_swizzled);
}

TEST(Fp4Blackwell, BlockScaledGemmMatchesTheDequantizedFp32Gemm) {
  REQUIRE_FP4_ROUTES();
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t m = 256, n = 192, k = 320;
  std::vector<float> x(m * k), w(n * k);
  for (auto& v : x) v = nd(rng) * 2.0f;
  for (auto& v : w) v = nd(rng) * 0.05f;
  auto amax_of = [](const std::vector<float>& v) {
    float a = 0.0f;
    for (float e : v) a = std::max(a, std::fabs(e));
    return a;
  };
  const float sx = nv::encode_scale_from_amax(amax_of(x)), sw = nv::encode_scale_from_amax(amax_of(w));
  const auto qx = nv::quantize_matrix(x.data(), m, k, sx), qw = nv::quantize_matrix(w.data(), n, k, sw);
  const float alpha = (1.0f / sx) * (1.0f / sw);
  DeviceBuffer<uint8_t> a(qx.packed_codes()), asf(qx.scales_swizzled), b(qw.packed_codes()), bsf(qw.scales_swizzled);
  DeviceBuffer<float> ab(std::vector<float>{alpha, 0.0f});
  DeviceBuffer<uint16_t> d(size_t(m * n));
  DeviceBuffer<uint8_t> ws(fp4::kFp4GemmWorkspaceBytes);
  fp4::gemm_fp4_nt(a.get(), asf.get(), b.get(), bsf.get(), d.get(), m, n, k, ab.get(), ws.get(), ws.size(), nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = d.download();
  // Reference: the exact products e2m1 * S summed in double, times alpha.
  int bad = 0;
  double max_ref = 0.0;
  std::vector<double> ref(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double xu = nv::e2m1_decode(qx.codes[i * k + kk]) * nv::e4m3_decode(qx.scales[(i * k + kk) / 16]);
        const double wu = nv::e2m1_decode(qw.codes[j * k + kk]) * nv::e4m3_decode(qw.scales[(j * k + kk) / 16]);
        acc += xu * wu;
      }
      ref[i * n + j] = acc * alpha;
      max_ref = std::max(max_ref, std::fabs(ref[i * n + j]));
    }
  for (int64_t i = 0; i < m * n; ++i) {
    const uint32_t bits = uint32_t(got[i]) << 16;
    float g;
    std::memcpy(&g, &bits, 4);
    const double tol = std::fabs(ref[i]) * std::ldexp(1.0, -7) + 1e-5 * max_ref;
    if (!(std::fabs(g - ref[i]) <= tol) && ++bad < 5)
      ADD_FAILURE() << "d[" << i / n << ", " << i % n << "] = " << g << ", reference " << ref[i];
  }
  EXPECT_EQ(bad, 0);
}

TEST(Fp4Blackwell, BlockScaledGemmWithFp32OutputIsTheFp32SumOfTheExactProducts) {
  REQUIRE_FP4_ROUTES();
  // The output the nvfp4 linears' fp4 route takes (it adds the bias itself, in the
  // fake-quant route's order): alpha * acc in fp32, no bf16 rounding.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t m = 131, n = 72, k = 96;
  std::vector<float> x(m * k), w(n * k);
  for (auto& v : x) v = nd(rng) * std::exp(nd(rng));
  for (auto& v : w) v = nd(rng) * 0.05f;
  auto amax_of = [](const std::vector<float>& v) {
    float a = 0.0f;
    for (float e : v) a = std::max(a, std::fabs(e));
    return a;
  };
  const float sx = nv::encode_scale_from_amax(amax_of(x)), sw = nv::encode_scale_from_amax(amax_of(w));
  const auto qx = nv::quantize_matrix(x.data(), m, k, sx), qw = nv::quantize_matrix(w.data(), n, k, sw);
  const float alpha = (1.0f / sx) * (1.0f / sw);
  DeviceBuffer<uint8_t> a(qx.packed_codes()), asf(qx.scales_swizzled), b(qw.packed_codes()), bsf(qw.scales_swizzled);
  DeviceBuffer<float> ab(std::vector<float>{alpha, 0.0f});
  DeviceBuffer<float> d(size_t(m * n));
  DeviceBuffer<uint8_t> ws(fp4::kFp4GemmWorkspaceBytes);
  fp4::gemm_fp4_nt(a.get(), asf.get(), b.get(), bsf.get(), d.get(), m, n, k, ab.get(), ws.get(), ws.size(), nullptr, fp4::Fp4GemmOut::kF32);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = d.download();
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0, mag = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double xu = nv::e2m1_decode(qx.codes[i * k + kk]) * nv::e4m3_decode(qx.scales[(i * k + kk) / 16]);
        const double wu = nv::e2m1_decode(qw.codes[j * k + kk]) * nv::e4m3_decode(qw.scales[(j * k + kk) / 16]);
        acc += xu * wu;
        mag += std::fabs(xu * wu);
      }
      // fp32 accumulation in any order, then alpha: k * 2^-24 of the magnitudes, plus one rounding.
      const double ref = acc * alpha;
      const double tol =
          (double(k) * std::ldexp(1.0, -24) * mag + std::ldexp(1.0, -23) * std::fabs(acc)) * alpha + 1e-30;
      if (!(std::fabs(got[i * n + j] - ref) <= tol) && ++bad < 5)
        ADD_FAILURE() << "d[" << i << ", " << j << "] = " << got[i * n + j] << ", reference " << ref;
    }
  EXPECT_EQ(bad, 0);
}

TEST(Fp4Blackwell, RoutesAreRefusedWithAReasonWhereTheyCannotRun) {
  std::string why;
  if (fp4::fp4_routes_available(-1, &why)) GTEST_SKIP() << "this GPU runs the FP4 routes";
  EXPECT_FALSE(why.empty());
  std::cout << "FP4 routes unavailable here: " << why << "\n";
}

}  // namespace
