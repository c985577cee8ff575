// The fast device forms of kernels/common/nvfp4_math.h (namespace nvfp4_device) against
// the scalar forms of the same header (namespace nvfp4, checked on the CPU against
// numerics/nvfp4.h), on the GPU, over every input of their documented domain: every
// non-negative fp32 bit pattern 0x00000000..0x7FFFFFFF (2^31 values; +inf and the NaNs
// are the patterns from 0x7F800000 up) and every E4M3 byte (pair). A mismatch count per
// form must be 0; the first mismatching inputs that arrive are reported. Two deliberately
// different forms run through the same comparison and must mismatch, so the harness is
// seen to compare.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"

namespace {

namespace km = vqad::kernels::nvfp4;
namespace kd = vqad::kernels::nvfp4_device;

enum Form : int {
  // Over every non-negative fp32 bit pattern u:
  kDiv6,          // div6(x) vs __fdiv_rn(x, 6), x finite: bit-equal, or (quotient subnormal) <= 1 ulp
  kDiv6E4m3,      // e4m3_encode_nonneg of both, x finite: the same byte
  kDiv6Special,   // div6(+inf), div6(NaN): NaN
  kE2m1Rne,       // e2m1_rne_magnitude(x) vs e2m1_round_magnitude(x)
  kE2m1Nonneg,    // e2m1_round_nonneg(x) vs e2m1_round_magnitude(x)
  kE2m1Sat6Bf16,  // sat6_bf16x2 of the bf16 pair of e2m1_round_unsat(x) vs bf16 of e2m1_round_magnitude(x)
  kE2m1CodeByte,  // low byte of e2m1_code_byte(x, 1) vs e2m1_code_magnitude(x)
  kE2m1Code,      // e2m1_magnitude(e2m1_code_magnitude(x)) vs e2m1_round_magnitude(x)
  kE2m1Chain,     // e2m1_round_magnitude(x) vs the reference's comparison chain (independent)
  kE4m3Byte,      // e4m3_byte(x) vs e4m3_encode_nonneg(x)
  kE4m3Value,     // e4m3_rn_satfinite(x) vs e4m3_decode(e4m3_encode_nonneg(x)) (NaN == NaN)
  kE4m3x2Bytes,   // e4m3x2_bytes(x, y), e4m3_bytes2(x, y) vs the two scalar bytes (y: a permutation of x)
  // Over E4M3 bytes:
  kE4m3Decode,    // e4m3_value(b) vs e4m3_decode(b), all 256 bytes (NaN == NaN)
  kE4m3x2Decode,  // e4m3x2_values(p) vs the two e4m3_decode, all 65536 pairs
  kScaleRcp,      // scale_reciprocal(S) vs __fdiv_rn(1, S), bytes 0x00..0x7F (0 and NaN -> 0)
  // Deliberately different forms (must mismatch):
  kSanityDiv6,    // x * RN(1/6) without the residual correction vs __fdiv_rn(x, 6)
  kSanityTies,    // the comparison chain with ties to the odd code vs e2m1_round_magnitude:
                  // exactly the 7 ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
  kForms
};

constexpr const char* kFormNames[kForms] = {
    "div6 vs __fdiv_rn(x, 6)",
    "E4M3 byte of div6 vs of __fdiv_rn(x, 6)",
    "div6(+inf / NaN) is NaN",
    "e2m1_rne_magnitude vs e2m1_round_magnitude",
    "e2m1_round_nonneg vs e2m1_round_magnitude",
    "sat6_bf16x2(bf16 of e2m1_round_unsat) vs bf16 of e2m1_round_magnitude",
    "e2m1_code_byte vs e2m1_code_magnitude",
    "e2m1_magnitude(e2m1_code_magnitude) vs e2m1_round_magnitude",
    "e2m1_round_magnitude vs comparison chain",
    "e4m3_byte vs e4m3_encode_nonneg",
    "e4m3_rn_satfinite vs e4m3_decode(e4m3_encode_nonneg)",
    "e4m3x2_bytes / e4m3_bytes2 vs two e4m3_encode_nonneg",
    "e4m3_value vs e4m3_decode",
    "e4m3x2_values vs two e4m3_decode",
    "scale_reciprocal vs __fdiv_rn(1, S)",
    "sanity: x * RN(1/6) vs __fdiv_rn(x, 6)",
    "sanity: ties-to-odd chain vs e2m1_round_magnitude",
};

constexpr int kSamples = 4;

struct Sample {
  uint32_t input, got, want;
};

struct Results {
  unsigned long long count[kForms];
  uint32_t smallest[kForms];  // smallest mismatching input (0xFFFFFFFF: none)
  uint32_t n_samples[kForms];
  Sample samples[kForms][kSamples];
  unsigned long long div6_ulp_allowed;  // finite x whose subnormal quotient used the 1-ulp allowance
};

// The reference's E2M1 comparisons (numerics/nvfp4.cpp, e2m1_encode_magnitude), as values;
// also the NVFP4 linear kernel's former local form. NaN -> 6.
__device__ float chain_magnitude(float a) {
  if (a <= 0.25f) return 0.0f;
  if (a < 0.75f) return 0.5f;
  if (a <= 1.25f) return 1.0f;
  if (a < 1.75f) return 1.5f;
  if (a <= 2.5f) return 2.0f;
  if (a < 3.5f) return 3.0f;
  if (a <= 5.0f) return 4.0f;
  return 6.0f;
}

// Wrong on purpose: ties to the odd code (every comparison of the chain flipped between
// < and <=), so it differs from the right rounding at each of the 7 ties and nowhere else.
__device__ float ties_to_odd_magnitude(float a) {
  if (a < 0.25f) return 0.0f;
  if (a <= 0.75f) return 0.5f;
  if (a < 1.25f) return 1.0f;
  if (a <= 1.75f) return 1.5f;
  if (a < 2.5f) return 2.0f;
  if (a <= 3.5f) return 3.0f;
  if (a < 5.0f) return 4.0f;
  return 6.0f;
}

__device__ bool same_value(float a, float b) {
  return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
}

// Per-thread mismatch counts; a thread's first mismatch of a form is offered as a sample
// and as the smallest input (threads walk their inputs in increasing order).
struct Tally {
  uint32_t n[kForms] = {};
  __device__ void check(bool ok, int f, uint32_t input, uint32_t got, uint32_t want, Results* r) {
    if (ok) return;
    if (n[f]++ == 0) {
      atomicMin(&r->smallest[f], input);
      const uint32_t i = atomicAdd(&r->n_samples[f], 1u);
      if (i < kSamples) r->samples[f][i] = Sample{input, got, want};
    }
  }
  __device__ void flush(Results* r) const {
#pragma unroll
    for (int f = 0; f < kForms; ++f)
      if (n[f]) atomicAdd(&r->count[f], static_cast<unsigned long long>(n[f]));
  }
};

__global__ void every_nonneg_float_kernel(Results* r) {
  Tally t;
  unsigned long long allowed = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= 0x7FFFFFFFull; i += stride) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = __uint_as_float(u);
    const bool finite = u < 0x7F800000u;

    // amax / 6.
    const float q = kd::div6(x), qr = __fdiv_rn(x, 6.0f);
    const uint32_t qb = __float_as_uint(q), qrb = __float_as_uint(qr);
    if (finite) {
      const uint32_t d = qb > qrb ? qb - qrb : qrb - qb;
      const bool within = qrb < 0x00800000u && d <= 1u;  // subnormal (or zero) quotient, 1 ulp
      allowed += (qb != qrb && within) ? 1u : 0u;
      t.check(qb == qrb || within, kDiv6, u, qb, qrb, r);
      const uint32_t b6 = km::e4m3_encode_nonneg(q), b6r = km::e4m3_encode_nonneg(qr);
      t.check(b6 == b6r, kDiv6E4m3, u, b6, b6r, r);
      const float naive = __fmul_rn(x, 1.0f / 6.0f);
      t.check(__float_as_uint(naive) == qrb, kSanityDiv6, u, __float_as_uint(naive), qrb, r);
    } else {
      t.check(q != q, kDiv6Special, u, qb, 0x7FC00000u, r);
    }

    // E2M1 rounding.
    const float m = km::e2m1_round_magnitude(x);
    const uint32_t mb = __float_as_uint(m);
    const uint32_t rne = __float_as_uint(kd::e2m1_rne_magnitude(x));
    t.check(rne == mb, kE2m1Rne, u, rne, mb, r);
    const uint32_t nn = __float_as_uint(kd::e2m1_round_nonneg(x));
    t.check(nn == mb, kE2m1Nonneg, u, nn, mb, r);
    {
      // the forward's form: x in the low half, x's neighbour below in the high half
      const float y = __uint_as_float(u == 0 ? 0u : u - 1u);
      const uint32_t pair = vqad::kernels::sm90::pack_bf16(kd::e2m1_round_unsat(x), kd::e2m1_round_unsat(y));
      const uint32_t sat = kd::sat6_bf16x2(pair);
      const uint32_t want = vqad::kernels::sm90::pack_bf16(m, km::e2m1_round_magnitude(y));
      t.check(sat == want, kE2m1Sat6Bf16, u, sat, want, r);
    }
    const uint32_t code = km::e2m1_code_magnitude(x);
    const uint32_t cbyte = kd::e2m1_code_byte(x, 1.0f) & 0xFFu;
    t.check(cbyte == code, kE2m1CodeByte, u, cbyte, code, r);
    const uint32_t cm = __float_as_uint(km::e2m1_magnitude(code));
    t.check(cm == mb, kE2m1Code, u, cm, mb, r);
    const uint32_t ch = __float_as_uint(chain_magnitude(x));
    t.check(ch == mb, kE2m1Chain, u, mb, ch, r);
    const uint32_t ta = __float_as_uint(ties_to_odd_magnitude(x));
    t.check(ta == mb, kSanityTies, u, ta, mb, r);

    // E4M3.
    const uint32_t eb = kd::e4m3_byte(x), ebr = km::e4m3_encode_nonneg(x);
    t.check(eb == ebr, kE4m3Byte, u, eb, ebr, r);
    const float ev = kd::e4m3_rn_satfinite(x), evr = km::e4m3_decode(ebr);
    t.check(same_value(ev, evr), kE4m3Value, u, __float_as_uint(ev), __float_as_uint(evr), r);
    const float y = __uint_as_float(u ^ 0x2AAAAAAAu);  // a permutation of [0, 2^31): every x is a y once
    const uint32_t pair_r = ebr | (km::e4m3_encode_nonneg(y) << 8);
    const uint32_t p16 = kd::e4m3x2_bytes(x, y), p32 = kd::e4m3_bytes2(x, y);
    t.check(p16 == pair_r && p32 == pair_r, kE4m3x2Bytes, u, p16 == pair_r ? p32 : p16, pair_r, r);
  }
  t.flush(r);
  if (allowed) atomicAdd(&r->div6_ulp_allowed, allowed);
}

// p = 0 .. 65535: the E4M3 byte pair p (low byte first); bytes alone and scales for p < 256.
__global__ void every_e4m3_byte_kernel(Results* r) {
  Tally t;
  const uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < 65536u) {
    const uint32_t lo = p & 0xFFu, hi = p >> 8;
    const float2 v = kd::e4m3x2_values(static_cast<uint16_t>(p));
    const float lr = km::e4m3_decode(lo), hr = km::e4m3_decode(hi);
    const bool ok = same_value(v.x, lr) && same_value(v.y, hr);
    t.check(ok, kE4m3x2Decode, p, same_value(v.x, lr) ? __float_as_uint(v.y) : __float_as_uint(v.x),
            same_value(v.x, lr) ? __float_as_uint(hr) : __float_as_uint(lr), r);
    if (hi == 0) {
      const float s = kd::e4m3_value(static_cast<uint8_t>(lo));
      t.check(same_value(s, lr), kE4m3Decode, lo, __float_as_uint(s), __float_as_uint(lr), r);
      if (lo < 0x80u) {
        const float rc = kd::scale_reciprocal(lr);
        const float rr = (lo == 0u || lo == 0x7Fu) ? 0.0f : __fdiv_rn(1.0f, lr);
        t.check(__float_as_uint(rc) == __float_as_uint(rr), kScaleRcp, lo, __float_as_uint(rc),
                __float_as_uint(rr), r);
      }
    }
  }
  t.flush(r);
}

std::string describe(const Results& r, int f) {
  std::ostringstream os;
  os << kFormNames[f] << ": " << r.count[f] << " mismatches";
  if (r.count[f]) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "; smallest input 0x%08X; first arrived:", r.smallest[f]);
    os << buf;
    const uint32_t n = r.n_samples[f] < kSamples ? r.n_samples[f] : kSamples;
    for (uint32_t i = 0; i < n; ++i) {
      const Sample& s = r.samples[f][i];
      float in, got, want;
      std::memcpy(&in, &s.input, 4);
      std::memcpy(&got, &s.got, 4);
      std::memcpy(&want, &s.want, 4);
      std::snprintf(buf, sizeof(buf), " [in 0x%08X (%g) got 0x%08X want 0x%08X]", s.input, in, s.got, s.want);
      os << buf;
    }
  }
  return os.str();
}

// ex2.approx.ftz (sm90::fast_exp2) is non-decreasing over every non-NaN float, walked in
// value order: -inf, the negatives up to -0, then +0 up to +inf (2 * 0x7F800001 values,
// each pair of neighbours compared). The forward takes a 16-key group's amax as the exp2
// of its largest score (attn_qat_fwd_sm90.cu, group_scale), which is exact only if
// exp2 is monotone. The reversed function exp2(-x) runs through the same walk and must
// decrease somewhere, so the walk is seen to compare.
constexpr uint64_t kOrderedFloats = 2ull * 0x7F800001ull;
__host__ __device__ uint32_t ordered_bits(uint64_t k) {  // bits of the k-th non-NaN float in value order
  return k <= 0x7F800000ull ? 0xFF800000u - static_cast<uint32_t>(k) : static_cast<uint32_t>(k - 0x7F800001ull);
}
__device__ float ordered_float(uint64_t k) { return __uint_as_float(ordered_bits(k)); }
struct MonotoneResults {
  unsigned long long decreases, reversed_decreases;
  uint32_t first_step;  // smallest k with exp2(float k) > exp2(float k + 1) (0xFFFFFFFF: none)
};
__global__ void exp2_monotone_kernel(MonotoneResults* r) {
  unsigned long long n = 0, nr = 0;
  uint32_t first = 0xFFFFFFFFu;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t k = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; k + 1 < kOrderedFloats; k += stride) {
    const float a = ordered_float(k), b = ordered_float(k + 1);
    if (vqad::kernels::sm90::fast_exp2(a) > vqad::kernels::sm90::fast_exp2(b)) {
      ++n;
      first = min(first, static_cast<uint32_t>(k));  // k < 2^32
    }
    if (vqad::kernels::sm90::fast_exp2(-a) > vqad::kernels::sm90::fast_exp2(-b)) ++nr;
  }
  if (n) atomicAdd(&r->decreases, n), atomicMin(&r->first_step, first);
  if (nr) atomicAdd(&r->reversed_decreases, nr);
}

}  // namespace

TEST(Nvfp4DeviceForms, FastExp2IsMonotoneOverEveryFloat) {
  MonotoneResults* d = nullptr;
  VQAD_CUDA_CHECK(cudaMalloc(&d, sizeof(MonotoneResults)));
  MonotoneResults h{0, 0, 0xFFFFFFFFu};
  static_assert(kOrderedFloats <= 0x100000000ull, "ordered indices fit in 32 bits");
  VQAD_CUDA_CHECK(cudaMemcpy(d, &h, sizeof(h), cudaMemcpyHostToDevice));
  exp2_monotone_kernel<<<4096, 256>>>(d);
  VQAD_CUDA_CHECK_LAUNCH("exp2_monotone_kernel");
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  VQAD_CUDA_CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  VQAD_CUDA_CHECK(cudaFree(d));
  const uint32_t first_bits = h.first_step != 0xFFFFFFFFu ? ordered_bits(h.first_step) : 0u;  // first decreasing step
  std::printf("ex2.approx.ftz: %llu decreasing steps over %llu ordered floats (first from 0x%08X); exp2(-x): %llu\n",
              h.decreases, static_cast<unsigned long long>(kOrderedFloats), first_bits, h.reversed_decreases);
  EXPECT_EQ(h.decreases, 0u);
  EXPECT_GT(h.reversed_decreases, 0u);  // the walk compares
}

TEST(Nvfp4DeviceForms, EveryNonNegativeFloatMatchesTheScalarForms) {
  Results* d = nullptr;
  VQAD_CUDA_CHECK(cudaMalloc(&d, sizeof(Results)));
  Results h;
  std::memset(&h, 0, sizeof(h));
  for (int f = 0; f < kForms; ++f) h.smallest[f] = 0xFFFFFFFFu;
  VQAD_CUDA_CHECK(cudaMemcpy(d, &h, sizeof(h), cudaMemcpyHostToDevice));
  every_nonneg_float_kernel<<<2048, 256>>>(d);
  VQAD_CUDA_CHECK_LAUNCH("every_nonneg_float_kernel");
  every_e4m3_byte_kernel<<<256, 256>>>(d);
  VQAD_CUDA_CHECK_LAUNCH("every_e4m3_byte_kernel");
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  VQAD_CUDA_CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  VQAD_CUDA_CHECK(cudaFree(d));

  for (int f = 0; f < kForms; ++f) std::printf("%s\n", describe(h, f).c_str());
  std::printf("div6: %llu finite inputs with a subnormal quotient 1 ulp from __fdiv_rn(x, 6)\n",
              h.div6_ulp_allowed);
  for (int f = 0; f < kSanityDiv6; ++f) EXPECT_EQ(h.count[f], 0u) << describe(h, f);
  // The harness compares: a form without the residual correction differs somewhere, and
  // rounding ties to the odd code differs at exactly the seven ties, the first at 0.25.
  EXPECT_GT(h.count[kSanityDiv6], 0u) << describe(h, kSanityDiv6);
  EXPECT_EQ(h.count[kSanityTies], 7u) << describe(h, kSanityTies);
  EXPECT_EQ(h.smallest[kSanityTies], 0x3E800000u) << describe(h, kSanityTies);  // 0.25
}
