// The random cases of the NVFP4 kernel checks, shared by the GPU test
// (tests/gpu/test_nvfp4_cuda.cpp) and the kernel playground (bench/playground/nvfp4_playground.cu):
// input distributions (including infinities, NaNs, all-zero blocks and exact E2M1 ties) and
// device layouts (dense, padded or misaligned row strides, permuted leading dims), laid out
// as host bytes that the caller uploads into its poisoned device buffer.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "tests/support/metrics.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"

namespace vqad::test {

enum class Nvfp4Dist { kNormal, kHeavy, kTiny, kHuge, kZeroBlocks, kInf, kNaN, kTies };
inline const char* dist_name(Nvfp4Dist d) {
  static const char* n[] = {"normal", "heavy", "tiny", "huge", "zero-blocks", "inf", "nan", "ties"};
  return n[static_cast<int>(d)];
}

// n floats of distribution `dist` (n a multiple of 16 for the block-structured ones).
inline std::vector<float> nvfp4_case_input(int64_t n, Nvfp4Dist dist, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(1e-3f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) {
    switch (dist) {
      case Nvfp4Dist::kHeavy: v = normal(rng) / uni(rng); break;
      case Nvfp4Dist::kTiny: v = normal(rng) * 1e-4f; break;
      case Nvfp4Dist::kHuge: v = normal(rng) * 3e4f; break;
      default: v = normal(rng);
    }
  }
  std::uniform_int_distribution<int64_t> pick(0, n - 1);
  if (dist == Nvfp4Dist::kZeroBlocks) {
    for (int64_t b = 0; b < n / 16; b += 3) {
      for (int i = 0; i < 16; ++i) x[b * 16 + i] = (i % 5 == 0) ? -0.0f : 0.0f;
    }
  }
  if (dist == Nvfp4Dist::kInf) {
    for (int k = 0; k < 1 + n / 200; ++k) x[pick(rng)] = (k % 2 ? -1 : 1) * std::numeric_limits<float>::infinity();
  }
  if (dist == Nvfp4Dist::kNaN) {
    for (int k = 0; k < 1 + n / 300; ++k) x[pick(rng)] = std::nanf("");
  }
  if (dist == Nvfp4Dist::kTies) {
    // Blocks whose amax is 6 * 2^e (S exact with a unit scale) and whose elements sit on
    // E2M1 midpoints and grid points: every tie rule of the E2M1 rounding is exercised.
    static const float pts[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 0.0f};
    std::uniform_int_distribution<int> pe(-6, 6), pp(0, 13), ps(0, 1);
    for (int64_t b = 0; b < n / 16; ++b) {
      const float sc = std::ldexp(1.0f, pe(rng));
      x[b * 16] = 6.0f * sc;
      for (int i = 1; i < 16; ++i) x[b * 16 + i] = (ps(rng) ? -1.0f : 1.0f) * pts[pp(rng)] * sc;
    }
  }
  return x;
}

// The values a kernel sees: BF16 inputs are rounded (nearest even) first.
inline std::vector<float> as_input_dtype(const std::vector<float>& x, kernels::nvfp4::DType dtype) {
  if (dtype == kernels::nvfp4::DType::kF32) return x;
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_value(bf16_bits(x[i]));  // NaN -> the quiet NaN 0x7FC0
  return r;
}

// Input of a case in its device layout: `rows` logical rows of `cols`, optionally strided
// (row stride > cols) or with permuted leading dims.
enum class Nvfp4Layout { kDense, kRowStride, kMisaligned, kPermuted3d };
inline const char* layout_name(Nvfp4Layout l) {
  static const char* n[] = {"dense", "row-stride", "misaligned-stride", "permuted-3d"};
  return n[static_cast<int>(l)];
}

// The bytes of the device buffer (gaps poisoned) and the view over them (data unset).
struct Nvfp4HostLayout {
  std::vector<uint8_t> bytes;
  kernels::nvfp4::TensorView view;
};

// Places logical x [rows, cols] with the given layout and dtype.
inline Nvfp4HostLayout lay_out(const std::vector<float>& x, int64_t rows, int64_t cols, kernels::nvfp4::DType dtype,
                               Nvfp4Layout layout) {
  const size_t es = dtype == kernels::nvfp4::DType::kBF16 ? 2 : 4;
  int64_t stride = cols;
  if (layout == Nvfp4Layout::kRowStride) stride = cols + 32;
  if (layout == Nvfp4Layout::kMisaligned) stride = cols + 2;  // rows not 16-byte aligned: scalar loads
  int64_t a = 1, b = rows;  // permuted: logical [a, b, cols] stored as [b, a, cols]
  if (layout == Nvfp4Layout::kPermuted3d) {
    for (int64_t d : {3, 2}) {
      if (rows % d == 0 && rows > d) {
        a = d;
        b = rows / d;
        break;
      }
    }
  }
  Nvfp4HostLayout h;
  h.bytes.assign(rows * stride * es, kPoisonByte);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = layout == Nvfp4Layout::kPermuted3d ? ((r % b) * a + r / b) * cols : r * stride;
    if (off < 0 || static_cast<size_t>(off + cols) * es > h.bytes.size())
      throw std::logic_error("nvfp4 case layout: row " + std::to_string(r) + " lands outside the buffer");
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x[r * cols + c];
      if (dtype == kernels::nvfp4::DType::kBF16) {
        const uint16_t bits = bf16_bits(v);
        std::memcpy(&h.bytes[(off + c) * es], &bits, 2);
      } else {
        std::memcpy(&h.bytes[(off + c) * es], &v, 4);
      }
    }
  }
  kernels::nvfp4::TensorView& v = h.view;
  v.dtype = dtype;
  if (layout == Nvfp4Layout::kPermuted3d) {
    v.ndim = 3;
    v.sizes[0] = a, v.sizes[1] = b, v.sizes[2] = cols;
    v.strides[0] = cols, v.strides[1] = a * cols, v.strides[2] = 1;
  } else {
    v.ndim = 2;
    v.sizes[0] = rows, v.sizes[1] = cols;
    v.strides[0] = stride, v.strides[1] = 1;
  }
  return h;
}

}  // namespace vqad::test
