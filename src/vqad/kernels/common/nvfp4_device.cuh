// NVFP4 device arithmetic of the attention kernels (spec/nvfp4.md): the block
// scale S = E4M3(amax / 6), the E2M1 magnitude rounding (ties to the even code,
// saturating at 6) and the E4M3 encodes, in the instruction forms the kernels use.
// The scalar definitions these equal are nvfp4/nvfp4_math.h (host + device, checked
// exhaustively on the CPU) and numerics/nvfp4.h.
//
// Two E2M1 rounding forms exist because the kernels were tuned with each; both give
// the nearest E2M1 magnitude with ties to even and saturation at 6 for every a >= 0:
//   e2m1_rne_magnitude: the magic constant picked by two compares (forward, fake quant)
//   e2m1_round_nonneg:  the magic constant built from a's exponent bits (backward)
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace vqad::kernels::nvfp4_device {

// amax / 6 correctly rounded without the IEEE division routine: a product with
// RN(1/6) is within an ulp, and one FMA residual correction makes it the correctly
// rounded quotient for every normal result (Markstein; checked exhaustively over all
// positive floats: only subnormal quotients differ, and those round to E4M3 0 either way).
__device__ __forceinline__ float div6(float x) {
  const float c = 1.0f / 6.0f;
  const float q0 = x * c;
  const float r = fmaf(-q0, 6.0f, x);
  return fmaf(r, c, q0);
}

// Nearest E2M1 magnitude of a >= 0, ties to the even code, saturating at 6. Adding
// 2^22 / 2^23 / 2^24 moves a into a binade whose ulp is the grid spacing of
// [0,2) / [2,4) / [4,6] (0.5 / 1 / 2), so the fp32 adder does the RNE; the even
// multiple of the spacing is the even code in every binade. NaN and inf give 6.
__device__ __forceinline__ float e2m1_rne_magnitude(float a) {
  const float magic = a < 2.0f ? 4194304.0f : (a < 4.0f ? 8388608.0f : 16777216.0f);
  return fminf(__fsub_rn(__fadd_rn(a, magic), magic), 6.0f);
}

// The same rounding with 2^(22 + max(E, 0)) (E = exponent of a) as the constant.
__device__ __forceinline__ float e2m1_round_nonneg(float a) {
  const int eb = max(__float_as_int(a) & 0x7f800000, 0x3f800000);
  const float magic = __int_as_float(eb + (22 << 23));
  return fminf((a + magic) - magic, 6.0f);
}

// 1/s for the positive E4M3 scales (2^-9 <= s <= 448): the approximate reciprocal
// plus one Newton step gives the correctly rounded fp32 value; s == 0 gives 0.
__device__ __forceinline__ float scale_reciprocal(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
  const float e = fmaf(-s, r, 1.0f);
  r = fmaf(r, e, r);
  return s > 0.0f ? r : 0.0f;
}

// E4M3 (round-to-nearest-even, satfinite) of x, decoded back to fp32.
__device__ __forceinline__ float e4m3_rn_satfinite(float x) {
  const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// E4M3 bytes (round-to-nearest-even, satfinite) of two values, a in the low byte.
__device__ __forceinline__ uint32_t e4m3_bytes2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace vqad::kernels::nvfp4_device
