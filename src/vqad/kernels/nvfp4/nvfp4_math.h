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

VQAD_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

VQAD_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
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

// E2M1 rounding by one float add: for c = min(a, 6) the constant C = 2^22 *
// max(2^floor(log2 c), 1) has an ulp equal to the E2M1 grid step at c (0.5 below
// 2, 1 in [2, 4), 2 in [4, 6]), so c + C rounds c onto the grid with IEEE
// round-to-nearest-even in one step and (c + C) - C is exact. min(a, 6) is the
// saturation (and maps NaN to 6: NaN blocks are handled by their callers).
VQAD_HD float min6(float a) {
#ifdef __CUDA_ARCH__
  return fminf(a, 6.0f);
#else
  return a < 6.0f ? a : 6.0f;  // any NaN, signalling included, -> 6 like fminf on the device
#endif
}

// Bits of C for c in [0, 6].
VQAD_HD uint32_t e2m1_magic_bits(float c) {
  const uint32_t e = f2u(c) & kInfBits;
  return (e > 0x3F800000u ? e : 0x3F800000u) + 0x0B000000u;
}

// E2M1 magnitude code of a >= 0 (finite or +inf): RNE onto {0,.5,1,1.5,2,3,4,6},
// saturating at 6. The grid steps counted from C (ulps) plus the codes below C's
// binade: 0 for C = 2^22, 2 for 2^23, 4 for 2^24.
VQAD_HD uint32_t e2m1_code_magnitude(float a) {
  const float c = min6(a);
  const uint32_t cb = e2m1_magic_bits(c);
  const uint32_t t = f2u(add_rn(c, u2f(cb)));
  return t - cb + ((cb - 0x4A800000u) >> 22);
}

// The value e2m1_magnitude(e2m1_code_magnitude(a)), computed directly.
VQAD_HD float e2m1_round_magnitude(float a) {
  const float c = min6(a);
  const float C = u2f(e2m1_magic_bits(c));
  return sub_rn(add_rn(c, C), C);
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

// s_dec = 1 / s_enc is passed in so that kernels compute it once, not per block.
VQAD_HD BlockScale block_scale(uint32_t amax_abs_bits, float s_enc, float s_dec) {
  BlockScale b;
  b.s_dec = s_dec;
  const float amax_b = u2f(amax_abs_bits);
  const float scaled = mul_rn(div_rn(amax_b, 6.0f), s_enc);
  b.nan = bits_are_nan(amax_abs_bits) || scaled != scaled;
  b.bits = b.nan ? 0x7Fu : e4m3_encode_nonneg(scaled);
  b.S = e4m3_decode(b.bits);
  b.zero = !b.nan && b.S == 0.0f;
  b.inv = div_rn(1.0f, mul_rn(b.S, b.s_dec));
  return b;
}

VQAD_HD BlockScale block_scale(uint32_t amax_abs_bits, float s_enc) {
  return block_scale(amax_abs_bits, s_enc, div_rn(1.0f, s_enc));
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
