// The per-block NVFP4 arithmetic of the CUDA kernels, written once for host
// and device so that the CPU tests can check it exhaustively against the
// scalar reference (numerics/nvfp4.h) without a GPU.
//
// Every step follows spec/nvfp4.md in IEEE fp32 with explicit round-to-nearest
// intrinsics on the device, so nvcc can neither contract nor approximate them.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define VQAD_HD __host__ __device__ __forceinline__
#else
#define VQAD_HD inline
#endif

namespace vqad::kernels::nvfp4 {

VQAD_HD uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

VQAD_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

VQAD_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

VQAD_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;

// |x| bits; unsigned max over them is a NaN-propagating max of |x| because
// every NaN pattern is above +inf.
VQAD_HD uint32_t abs_bits(float x) { return f2u(x) & kAbsMask; }
VQAD_HD bool bits_are_nan(uint32_t abs) { return abs > kInfBits; }

// s_enc = (1 / max(amax, 1e-12)) * 2688; NaN amax -> NaN (numerics/nvfp4.h).
VQAD_HD float encode_scale_from_amax(float amax) {
  if (amax != amax) return amax;
  const float a = amax > 1e-12f ? amax : 1e-12f;
  return mul_rn(div_rn(1.0f, a), 2688.0f);
}

// E4M3 byte -> float, exact. 0x7F / 0xFF are NaN.
VQAD_HD float e4m3_decode(uint32_t bits) {
  const uint32_t exp = (bits >> 3) & 0xF, man = bits & 7;
  float v;
  if ((bits & 0x7F) == 0x7F) {
    v = u2f(0x7FC00000u);
  } else if (exp == 0) {
    v = mul_rn(static_cast<float>(man), 0.001953125f);  // man * 2^-9, exact
  } else {
    v = u2f(((exp + 120u) << 23) | (man << 20));
  }
  return (bits & 0x80) ? -v : v;
}

// Round-to-nearest-even onto E4M3 with saturation to 448; v >= 0 or NaN.
// Works on the fp32 bit pattern: normal values keep 3 mantissa bits; values
// below 2^-6 use the fixed 2^-9 subnormal grid.
VQAD_HD uint32_t e4m3_encode_nonneg(float v) {
  if (v != v) return 0x7F;
  if (v >= 448.0f) return 0x7E;
  if (v < 0.015625f) {
    // v * 512 < 8 is exact; adding 2^23 rounds it to an integer (RNE) in one step.
    const float q = v * 512.0f + 8388608.0f;
    return f2u(q) - 0x4B000000u;  // 0..8; 8 is 2^-6, the first normal
  }
  const uint32_t u = f2u(v);
  const uint32_t r = u + 0x7FFFFu + ((u >> 20) & 1u);  // RNE at mantissa bit 20
  const uint32_t exp = (r >> 23) - 120u;               // bias 127 -> bias 7
  return (exp << 3) | ((r >> 20) & 7u);
}

// E2M1 magnitude code of a >= 0 (finite or +inf): RNE onto {0,.5,1,1.5,2,3,4,6},
// saturating at 6. Below 1 the grid is fixed (step 0.5): a*2 + 2^23 rounds a*2
// to an integer once. From 1 up it keeps one mantissa bit of the fp32 pattern.
VQAD_HD uint32_t e2m1_code_magnitude(float a) {
#ifdef __CUDA_ARCH__
  const float small = __fmaf_rn(a, 2.0f, 8388608.0f);
#else
  const float small = a * 2.0f + 8388608.0f;  // a * 2 is exact
#endif
  const uint32_t code_small = f2u(small) - 0x4B000000u;  // 0, 1, 2
  const uint32_t u = f2u(a);
  const uint32_t r = u + 0x1FFFFFu + ((u >> 22) & 1u);
  uint32_t code_big = (r >> 22) - 252u;  // 1.0 -> 2, 1.5 -> 3, ..., 6 -> 7, 8 -> 8
  code_big = code_big < 7u ? code_big : 7u;
  return a < 1.0f ? code_small : code_big;
}

// Magnitude of an E2M1 code (bit 3 ignored) as fp32, exact.
VQAD_HD float e2m1_magnitude(uint32_t code) {
  const uint32_t c = code & 7u;
  const uint32_t big = (((c >> 1) + 126u) << 23) | ((c & 1u) << 22);
  return u2f(c >= 2u ? big : (c == 1u ? 0x3F000000u : 0u));
}

// One block's scale, from the block amax (|x| bits max) and s_enc.
struct BlockScale {
  uint32_t bits;  // E4M3 byte
  float S;        // decoded scale
  float inv;      // 1 / (S * s_dec)
  float s_dec;    // 1 / s_enc
  bool nan;       // NaN in the block or a NaN scale: every output NaN
  bool zero;      // S == 0: codes 0, values +0
};

VQAD_HD BlockScale block_scale(uint32_t amax_abs_bits, float s_enc) {
  BlockScale b;
  b.s_dec = div_rn(1.0f, s_enc);
  const float amax_b = u2f(amax_abs_bits);
  const float scaled = mul_rn(div_rn(amax_b, 6.0f), s_enc);
  b.nan = bits_are_nan(amax_abs_bits) || scaled != scaled;
  b.bits = b.nan ? 0x7Fu : e4m3_encode_nonneg(scaled);
  b.S = e4m3_decode(b.bits);
  b.zero = !b.nan && b.S == 0.0f;
  b.inv = div_rn(1.0f, mul_rn(b.S, b.s_dec));
  return b;
}

// Code (with sign) of element x in a block with scale b.
VQAD_HD uint32_t element_code(float x, const BlockScale& b) {
  const uint32_t sign = (f2u(x) >> 28) & 8u;
  if (b.zero) return 0u;
  if (b.nan) return 7u | sign;
  return e2m1_code_magnitude(mul_rn(u2f(f2u(x) & kAbsMask), b.inv)) | sign;
}

// Dequantized value of a code: (e2m1(code) * S) * s_dec. The sign is applied
// last as a bit, which equals the signed product since rounding is symmetric.
VQAD_HD float code_value(uint32_t code, const BlockScale& b) {
  if (b.nan) return u2f(0x7FC00000u);
  if (b.zero) return 0.0f;  // also when s_dec is inf (s_enc 0 after an infinite amax)
  const float m = mul_rn(mul_rn(e2m1_magnitude(code), b.S), b.s_dec);
  return u2f(f2u(m) | ((code & 8u) << 28));
}

}  // namespace vqad::kernels::nvfp4

namespace vqad::kernels::nvfp4 {

// Division by a runtime constant d (1 <= d < 2^31) for 32-bit dividends, by a
// multiply-high and a shift (Granlund-Montgomery, round-up multiplier), so the
// kernels split flat indices into (row, column) without a 64-bit division.
struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < divisor) ++l;
    shift = l;
    mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << l) - divisor)) / divisor + 1);
  }
  VQAD_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * mul) >> 32);
#endif
    return static_cast<uint32_t>((uint64_t{hi} + n) >> shift);
  }
};

}  // namespace vqad::kernels::nvfp4
