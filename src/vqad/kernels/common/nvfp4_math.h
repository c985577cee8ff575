// The NVFP4 arithmetic of every CUDA kernel (spec/nvfp4.md), in one header.
//
// 1. Scalar forms, host + device (namespace vqad::kernels::nvfp4): f2u/u2f, the
//    round-to-nearest operations, encode_scale_from_amax, e4m3_encode_nonneg,
//    e4m3_decode, e2m1_code_magnitude, e2m1_round_magnitude, e2m1_magnitude,
//    block_scale, element_code, code_value, FastDiv. Every step is IEEE fp32 with
//    explicit round-to-nearest intrinsics on the device, so nvcc can neither contract
//    nor approximate them. This part compiles without nvcc, and the CPU tests check it
//    against the scalar reference (numerics/nvfp4.h) and brute-force definitions of
//    the formats: tests/cpu/test_nvfp4.cpp (E2M1 rounding on every non-negative
//    float, E4M3 on all bytes, midpoints and random values, whole blocks) and
//    tests/cpu/test_nvfp4_golden.cpp (the golden vectors).
//    Used by nvfp4/nvfp4_kernels.cu and linear/nvfp4_linear_kernels.cu.
//
// 2. Fast device forms (namespace vqad::kernels::nvfp4_device, only under nvcc): the
//    instruction forms of the tuned kernels. Each equals a scalar form of part 1 on the
//    domain below; tests/gpu/test_nvfp4_device_forms_cuda.cu runs every form on the
//    GPU over every input of that domain (all 2^31 non-negative fp32 bit patterns,
//    +inf and the NaNs included, or all E4M3 bytes) and requires 0 mismatches.
//
//    fast form               equals                                   on
//    div6(x)                 __fdiv_rn(x, 6) (block_scale's amax / 6) every finite x >= 0, bit for bit,
//                                                                     except where the quotient is subnormal
//                                                                     (x < 6 * 2^-126): there at most 1 ulp
//                                                                     (2^-149) apart, and e4m3_encode_nonneg
//                                                                     gives the same byte (0) for both.
//                                                                     div6(+inf) and div6(NaN) are NaN.
//    e2m1_rne_magnitude(a)   e2m1_round_magnitude(a)                  every a >= 0, +inf and NaN -> 6
//    e2m1_round_nonneg(a)    e2m1_round_magnitude(a)                  every a >= 0, +inf and NaN -> 6
//    sat6_bf16x2(pack of     the bf16 of e2m1_round_magnitude(a)      every a >= 0, +inf and NaN -> 6
//     e2m1_round_unsat(a))
//    e2m1_code_byte(x, inv)  low byte: e2m1_code_magnitude(|x * inv|) every x >= 0 with inv = 1
//    scale_reciprocal(s)     __fdiv_rn(1, s)                          the 126 positive finite E4M3 values;
//                                                                     0 and NaN give 0
//    e4m3_byte(x)            e4m3_encode_nonneg(x)                    every x >= 0, +inf -> 0x7E, NaN -> 0x7F
//    e4m3_rn_satfinite(x)    e4m3_decode(e4m3_encode_nonneg(x))       every x >= 0 (NaN -> a NaN)
//    e4m3x2_bytes(lo, hi),   e4m3_byte(lo) | e4m3_byte(hi) << 8       every x >= 0 as lo and as hi
//    e4m3_bytes2(lo, hi)
//    e4m3_value(b)           e4m3_decode(b)                           all 256 bytes (0x7F, 0xFF: a NaN)
//    e4m3x2_values(pair)     {e4m3_decode(low byte), e4m3_decode(high byte)}  all 65536 byte pairs
//
//    Users: attention/sm90 (forward: div6, e2m1_round_unsat + sat6_bf16x2, e4m3_bytes2, e4m3_value;
//    backward: div6, e2m1_round_nonneg, scale_reciprocal, e4m3x2_bytes, e4m3x2_values,
//    e4m3_value), attention/fake_quant_qkv.cu and vsa/ (e2m1_rne_magnitude,
//    e4m3_rn_satfinite, div6, e4m3_bytes2, e4m3_value), nvfp4/nvfp4_kernels.cu (e4m3_byte,
//    e2m1_code_byte), linear/ (e4m3_rn_satfinite), kernels_fp4/ (e4m3_byte, e4m3_value;
//    its cvt.rn.satfinite.e2m1x2 is sm_100+ and stays there).
//
//    The E2M1 magnitude fast forms differ in their instructions, not their results:
//    e2m1_rne_magnitude picks the magic constant with two compares (fake quant, VSA),
//    e2m1_round_nonneg builds it from a's exponent bits and saturates after the add
//    (backward), e2m1_round_unsat builds the same constant with one add-max and leaves
//    the saturation to min.bf16x2 on the packed pair (forward: half an instruction per
//    element). e2m1_round_magnitude of part 1 is the same constant from the exponent
//    bits of min(a, 6); e2m1_code_byte adds the code offset to that constant.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

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

#ifdef __CUDACC__
namespace vqad::kernels::nvfp4_device {

// --- amax / 6 ---------------------------------------------------------------------------
// amax / 6 correctly rounded without the IEEE division routine: a product with RN(1/6) is
// within an ulp, and one FMA residual correction makes it the correctly rounded quotient
// for every normal result (Markstein). Subnormal quotients may be an ulp off; they round
// to E4M3 0 either way. Not for +inf (gives NaN): the callers' amax are probabilities.
__device__ __forceinline__ float div6(float x) {
  const float c = 1.0f / 6.0f;
  const float q0 = x * c;
  const float r = fmaf(q0, -6.0f, x);  // (not fmaf(-q0, 6, x): ptxas forms -q0 with a second FMUL)
  return fmaf(r, c, q0);
}

// --- E2M1 rounding ----------------------------------------------------------------------
// Nearest E2M1 magnitude of a >= 0, ties to the even code, saturating at 6. Adding 2^22 /
// 2^23 / 2^24 moves a into a binade whose ulp is the grid spacing of [0,2) / [2,4) / [4,6]
// (0.5 / 1 / 2), so the fp32 adder does the RNE; the even multiple of the spacing is the
// even code in every binade. NaN and inf give 6.
__device__ __forceinline__ float e2m1_rne_magnitude(float a) {
  const float magic = a < 2.0f ? 4194304.0f : (a < 4.0f ? 8388608.0f : 16777216.0f);
  return fminf(__fsub_rn(__fadd_rn(a, magic), magic), 6.0f);
}

// The nearest E2M1 grid value of a >= 0 without the saturation: 2^(22 + max(E, 0))
// (E = exponent of a) as the constant, formed with one add-max (VIADDMNMX on sm_90).
// For a >= 2^107 the sum overflows to a negative int and the constant is 2^22; those a,
// +inf and NaN come back unchanged (all above 6), so the saturating users give 6.
__device__ __forceinline__ float e2m1_round_unsat(float a) {
  const int e = __float_as_int(a) & 0x7f800000;
  const float magic = __int_as_float(__viaddmax_s32(e, 22 << 23, 0x4A800000));  // 0x4A800000 = 2^22
  return __fsub_rn(__fadd_rn(a, magic), magic);
}

// The same constant with a separate max and add, saturated at 6: values >= 6 round to at
// least 6 in their own binade. (Built on e2m1_round_unsat instead, the backward's visit
// kernels spilled more registers and ran 2% slower.)
__device__ __forceinline__ float e2m1_round_nonneg(float a) {
  const int eb = max(__float_as_int(a) & 0x7f800000, 0x3f800000);
  const float magic = __int_as_float(eb + (22 << 23));
  return fminf((a + magic) - magic, 6.0f);
}

// min(x, 6) of two bf16 values (a NaN gives 6: min returns the other operand). With
// e2m1_round_unsat (exact in bf16: at most two significant bits, or +inf / NaN),
// sat6_bf16x2(pack_bf16(e2m1_round_unsat(x), e2m1_round_unsat(y))) is the bf16 pair of
// e2m1_round_magnitude(x), e2m1_round_magnitude(y).
__device__ __forceinline__ uint32_t sat6_bf16x2(uint32_t x) {
  uint32_t y;
  asm("min.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(0x40C040C0u));  // bf16 6.0 twice
  return y;
}

// e2m1_code_magnitude(|x * inv|) in the low byte of the result (bits 8.. are not
// zero). The magic constant of e2m1_round_magnitude, C = 2^(22+j) for c in binade
// j = 0, 1, 2 (c < 2, [2, 4), [4, 6]), gets 2j in its low mantissa bits:
// C = ((e + 22) << 23) + 2 (e - 127) with e = max(exponent of c, 127), one
// multiply-add. c + C rounds c onto the E2M1 grid (the offset is even, so ties to
// even are unchanged) and its low bits count grid steps from 2j, which is the
// code: 0..4 for j = 0, 2 + {2, 3, 4} for j = 1, 4 + {2, 3} for j = 2.
__device__ __forceinline__ uint32_t e2m1_code_byte(float x, float inv) {
  const float c = fminf(fabsf(nvfp4::mul_rn(x, inv)), 6.0f);
  const uint32_t e = max(nvfp4::f2u(c) >> 23, 127u);
  const uint32_t cb = e * 0x800002u + (0x0B000000u - 254u);
  return nvfp4::f2u(nvfp4::add_rn(c, nvfp4::u2f(cb)));
}

// --- scale reciprocal -------------------------------------------------------------------
// 1/s for the positive E4M3 scales (2^-9 <= s <= 448): the approximate reciprocal plus one
// Newton step gives the correctly rounded fp32 value; s == 0 (and NaN) gives 0.
__device__ __forceinline__ float scale_reciprocal(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
  const float e = fmaf(-s, r, 1.0f);
  r = fmaf(r, e, r);
  return s > 0.0f ? r : 0.0f;
}

// --- E4M3 by the hardware conversions (cvt ... e4m3x2, sm_89+) -----------------------------
// E4M3 byte of x (round-to-nearest-even, satfinite; NaN -> 0x7F).
__device__ __forceinline__ uint8_t e4m3_byte(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Value of an E4M3 byte, exact (0x7F / 0xFF: NaN).
__device__ __forceinline__ float e4m3_value(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

// E4M3 (round-to-nearest-even, satfinite) of x, decoded back to fp32.
__device__ __forceinline__ float e4m3_rn_satfinite(float x) { return e4m3_value(e4m3_byte(x)); }

// E4M3 bytes of two values in one instruction: lo in bits 0..7, hi in bits 8..15 (the
// instruction takes its first source operand into the upper byte).
__device__ __forceinline__ uint16_t e4m3x2_bytes(float lo, float hi) {
  uint16_t pk;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pk) : "f"(hi), "f"(lo));
  return pk;
}

// The same two bytes as a 32-bit word (bits 16.. zero), lo in the low byte.
__device__ __forceinline__ uint32_t e4m3_bytes2(float lo, float hi) { return e4m3x2_bytes(lo, hi); }

// Values of two E4M3 bytes (low byte -> .x, high byte -> .y) in one instruction.
__device__ __forceinline__ float2 e4m3x2_values(uint16_t pair) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(pair));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

}  // namespace vqad::kernels::nvfp4_device
#endif  // __CUDACC__
