// NVFP4 scalar reference (numerics/nvfp4.h) and the shared kernel arithmetic
// (kernels/common/nvfp4_math.h) checked against independent brute-force
// definitions of the formats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/numerics/nvfp4.h"

namespace nv = vqad::nvfp4;
namespace km = vqad::kernels::nvfp4;

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
}

// Brute force E4M3: nearest of the 127 non-negative finite values, ties to the
// even byte, anything >= 448 saturates.
uint8_t e4m3_brute(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= 448.0) return sign | 0x7E;
  uint8_t best = 0;
  double best_d = 1e300;
  for (int b = 0; b <= 0x7E; ++b) {
    const double d = std::fabs(static_cast<double>(nv::e4m3_decode(static_cast<uint8_t>(b))) - a);
    if (d < best_d || (d == best_d && (b % 2 == 0))) {
      best_d = d;
      best = static_cast<uint8_t>(b);
    }
  }
  return sign | best;
}

// Brute force E2M1 magnitude: nearest grid value, ties to the even code, >= 6 -> 6.
uint8_t e2m1_brute(float a) {
  static const double kGrid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if (a >= 6.0f) return 7;
  uint8_t best = 0;
  double best_d = 1e300;
  for (int c = 0; c < 8; ++c) {
    const double d = std::fabs(kGrid[c] - static_cast<double>(a));
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best_d = d;
      best = static_cast<uint8_t>(c);
    }
  }
  return best;
}

// Random blocks of several kinds; `kind` selects the distribution.
void fill_block(std::mt19937& rng, int kind, float* x) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 15);
  for (int i = 0; i < 16; ++i) {
    switch (kind) {
      case 0: x[i] = normal(rng); break;
      case 1: x[i] = normal(rng) / std::max(1e-3f, std::fabs(uni(rng))); break;  // heavy tail
      case 2: x[i] = normal(rng) * 1e-4f; break;                                // E4M3 underflow region
      case 3: x[i] = normal(rng) * 1e4f; break;                                 // saturation region
      case 4: x[i] = std::exp(4.0f * uni(rng)) / 60.0f; break;                  // softmax-like, >= 0
      case 5: x[i] = std::ldexp(uni(rng), static_cast<int>(pick(rng)) - 20); break;
      default: x[i] = 0.0f;
    }
  }
  if (kind == 6 && pick(rng) < 8) x[pick(rng)] = -0.0f;
}

}  // namespace

TEST(Nvfp4Scalar, E2M1DecodeTable) {
  const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = nv::e2m1_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(std::fabs(v), mags[c & 7]) << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << c;
    EXPECT_EQ(km::e2m1_magnitude(static_cast<uint32_t>(c)), mags[c & 7]) << c;
  }
}

TEST(Nvfp4Scalar, E2M1TiesGoToEvenCode) {
  // The spec's tie list: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
  const struct { float a; uint8_t code; } cases[] = {
      {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},
      {6.0f, 7},  {7.0f, 7},  {1e30f, 7}, {std::numeric_limits<float>::infinity(), 7},
      {0.0f, 0},  {0.2500001f, 1}, {0.7499999f, 1}, {5.0000005f, 7}, {4.9999995f, 6}};
  for (const auto& c : cases) {
    EXPECT_EQ(nv::e2m1_encode_magnitude(c.a), c.code) << c.a;
    EXPECT_EQ(km::e2m1_code_magnitude(c.a), c.code) << c.a;
  }
}

TEST(Nvfp4Scalar, E2M1EncodeMatchesBruteForceAndKernelMath) {
  // Every float in [2^-3, 16) (all mantissas of 7 binades), a sample below, and
  // random values: reference == brute force == kernel bit arithmetic.
  for (uint32_t u = bits_of(0.125f); u < bits_of(16.0f); u += 1) {
    const float a = from_bits(u);
    const uint8_t ref = nv::e2m1_encode_magnitude(a);
    if (ref != km::e2m1_code_magnitude(a)) FAIL() << "kernel math differs at " << a;
    if ((u & 0xFFF) == 0 && ref != e2m1_brute(a)) FAIL() << "reference differs from brute force at " << a;
  }
  for (uint32_t u = 0; u < bits_of(0.125f); u += 4099) {
    const float a = from_bits(u);
    ASSERT_EQ(nv::e2m1_encode_magnitude(a), 0) << a;
    ASSERT_EQ(km::e2m1_code_magnitude(a), 0u) << a;
  }
  for (float a : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f}) {
    for (float b : {std::nextafter(a, 0.0f), a, std::nextafter(a, 10.0f)}) {
      EXPECT_EQ(nv::e2m1_encode_magnitude(b), e2m1_brute(b)) << b;
    }
  }
}

TEST(Nvfp4Scalar, E2M1RoundMagnitudeEqualsComparisonChainOnEveryNonNegativeFloat) {
  // The reference's comparisons (numerics/nvfp4.cpp) as magnitudes, written out here as the
  // independent definition: the NVFP4 linear kernel's former local form, which it replaced
  // by e2m1_round_magnitude. Every non-negative bit pattern, +inf and the NaNs (-> 6)
  // included; the code form gives the same magnitude.
  const auto chain = [](float a) {
    if (a <= 0.25f) return 0.0f;
    if (a < 0.75f) return 0.5f;
    if (a <= 1.25f) return 1.0f;
    if (a < 1.75f) return 1.5f;
    if (a <= 2.5f) return 2.0f;
    if (a < 3.5f) return 3.0f;
    if (a <= 5.0f) return 4.0f;
    return 6.0f;
  };
  uint64_t bad_round = 0, bad_code = 0;
  uint32_t first_round = 0, first_code = 0;
  for (uint64_t i = 0; i <= 0x7FFFFFFFu; ++i) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float a = from_bits(u);
    const uint32_t want = bits_of(chain(a));
    if (bits_of(km::e2m1_round_magnitude(a)) != want && bad_round++ == 0) first_round = u;
    if (bits_of(km::e2m1_magnitude(km::e2m1_code_magnitude(a))) != want && bad_code++ == 0) first_code = u;
  }
  EXPECT_EQ(bad_round, 0u) << "e2m1_round_magnitude differs first at bits " << std::hex << first_round;
  EXPECT_EQ(bad_code, 0u) << "e2m1_magnitude(e2m1_code_magnitude) differs first at bits " << std::hex << first_code;
}

TEST(Nvfp4Scalar, E4M3DecodeEncodeRoundTripAllBytes) {
  for (int b = 0; b < 256; ++b) {
    const float v = nv::e4m3_decode(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << b;
      EXPECT_TRUE(std::isnan(km::e4m3_decode(static_cast<uint32_t>(b)))) << b;
      continue;
    }
    EXPECT_TRUE(same_float(v, km::e4m3_decode(static_cast<uint32_t>(b)))) << b;
    EXPECT_EQ(nv::e4m3_encode_rn_satfinite(v), b) << b << " value " << v;
    if (b < 0x80) EXPECT_EQ(km::e4m3_encode_nonneg(v), static_cast<uint32_t>(b)) << b;
  }
  EXPECT_EQ(nv::e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(nv::e4m3_decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(nv::e4m3_decode(0x08), std::ldexp(1.0f, -6));
}

TEST(Nvfp4Scalar, E4M3EncodeRoundsToNearestEvenAndSaturates) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(448.0f), 0x7E);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(463.9f), 0x7E);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(464.0f), 0x7E);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(1e30f), 0x7E);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(inf), 0x7E);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(-inf), 0xFE);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(std::nanf("")), 0x7F);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(std::ldexp(1.0f, -10)), 0x00);  // tie -> even 0
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(3 * std::ldexp(1.0f, -10)), 0x02);  // 1.5 ulp -> 2
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(1.0625f), 0x38);   // 1 + 1/16: tie -> 1.0
  EXPECT_EQ(nv::e4m3_encode_rn_satfinite(1.1875f), 0x3A);   // 1 + 3/16: tie -> 1.25
  EXPECT_EQ(km::e4m3_encode_nonneg(inf), 0x7Eu);
  EXPECT_EQ(km::e4m3_encode_nonneg(std::nanf("")), 0x7Fu);
  // Midpoints between all neighbours and one ulp either side, plus random values.
  std::vector<float> probes;
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = nv::e4m3_decode(static_cast<uint8_t>(b)), hi = nv::e4m3_decode(static_cast<uint8_t>(b + 1));
    const float mid = (lo + hi) / 2;  // exact in fp32
    probes.insert(probes.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), lo, hi});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-12.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) probes.push_back(std::exp2(e(rng)));
  for (float p : probes) {
    const uint8_t brute = e4m3_brute(p);
    ASSERT_EQ(nv::e4m3_encode_rn_satfinite(p), brute) << p;
    ASSERT_EQ(km::e4m3_encode_nonneg(p), brute) << p;
  }
}

TEST(Nvfp4Scalar, ScaleModesAndEncodeScale) {
  EXPECT_EQ(nv::parse_scale_mode("unit", "--mode"), nv::ScaleMode::kUnit);
  EXPECT_EQ(nv::parse_scale_mode("dynamic", "--mode"), nv::ScaleMode::kDynamic);
  EXPECT_EQ(nv::parse_scale_mode("static", "--mode"), nv::ScaleMode::kStatic);
  try {
    nv::parse_scale_mode("dyn", "--mode");
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--mode"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("dyn"), std::string::npos);
  }
  // Reciprocal then multiply (the golden vectors' rounding), floor 1e-12.
  EXPECT_EQ(nv::encode_scale_from_amax(0.0f), (1.0f / 1e-12f) * 2688.0f);
  EXPECT_EQ(nv::encode_scale_from_amax(1e-20f), (1.0f / 1e-12f) * 2688.0f);
  EXPECT_EQ(nv::encode_scale_from_amax(2.0f), 1344.0f);
  // 5.43020535 (golden tensor 7): a true division gives a different fp32 value.
  const float a7 = 5.43020535f;
  EXPECT_EQ(nv::encode_scale_from_amax(a7), (1.0f / a7) * 2688.0f);
  EXPECT_EQ(nv::encode_scale_from_amax(std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(nv::encode_scale_from_amax(std::nanf(""))));
  for (float a : {0.0f, 1e-13f, 3.0f, 1e6f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    EXPECT_TRUE(same_float(nv::encode_scale_from_amax(a), km::encode_scale_from_amax(a))) << a;
  }
}

TEST(Nvfp4Scalar, LinearEncodeScaleFloorsNaNAmax) {
  // The NVFP4 linear kernel's s_enc, encode_scale_from_amax(amax > 1e-12 ? amax : 1e-12),
  // equals its former local form (1 / (amax > 1e-12 ? amax : 1e-12)) * 2688 for every
  // amax, NaN (-> the floor) included: every 61st bit pattern of both signs plus specials.
  const auto former = [](float amax) { return (1.0f / (amax > 1e-12f ? amax : 1e-12f)) * 2688.0f; };
  const auto now = [](float amax) { return km::encode_scale_from_amax(amax > 1e-12f ? amax : 1e-12f); };
  for (float a : {0.0f, -0.0f, 1e-12f, std::nextafter(1e-12f, 0.0f), std::nextafter(1e-12f, 1.0f),
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), std::nanf(""), -std::nanf(""), from_bits(0x7F800001u),
                  from_bits(0xFFFFFFFFu), 448.0f * 6.0f, 1.0f}) {
    ASSERT_EQ(bits_of(now(a)), bits_of(former(a))) << "amax bits " << std::hex << bits_of(a);
  }
  for (uint64_t i = 0; i <= 0xFFFFFFFFu; i += 61) {
    const float a = from_bits(static_cast<uint32_t>(i));
    if (bits_of(now(a)) != bits_of(former(a))) FAIL() << "amax bits " << std::hex << i;
  }
}

TEST(Nvfp4Block, SpecialBlocks) {
  float x[16] = {};
  // Zero block (and E4M3 underflow: amax <= 6 * 2^-10): codes 0, values +0, even for negatives.
  for (int i = 0; i < 16; ++i) x[i] = (i % 2 ? -1.0f : 1.0f) * 0.005859375f;
  nv::BlockQuant q = nv::quantize_block(x, 1.0f);
  EXPECT_EQ(q.scale_bits, 0);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(q.codes[i], 0);
    EXPECT_EQ(bits_of(q.values[i]), 0u);
  }
  // Just above the underflow limit the scale is the smallest subnormal.
  x[3] = std::nextafter(0.005859375f, 1.0f);
  q = nv::quantize_block(x, 1.0f);
  EXPECT_EQ(q.scale_bits, 0x01);
  // Infinity: S = 448, inf -> +-6, finite members against 448.
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i) * 10.0f;
  x[5] = -std::numeric_limits<float>::infinity();
  q = nv::quantize_block(x, 1.0f);
  EXPECT_EQ(q.scale_bits, 0x7E);
  EXPECT_EQ(q.codes[5], 15);
  EXPECT_EQ(q.values[5], -2688.0f);
  EXPECT_EQ(q.codes[15], 1);  // 150 / 448 = 0.33 -> 0.5
  EXPECT_EQ(q.values[15], nv::e2m1_decode(nv::e2m1_encode_magnitude(150.0f / 448.0f)) * 448.0f);
  // Saturation: amax 1e6 with unit scale clips to 448 * 6.
  for (int i = 0; i < 16; ++i) x[i] = 1e6f * (i % 3 == 0 ? -1.0f : 1.0f);
  q = nv::quantize_block(x, 1.0f);
  EXPECT_EQ(q.scale_bits, 0x7E);
  EXPECT_EQ(q.values[0], -2688.0f);
  EXPECT_EQ(q.values[1], 2688.0f);
  // NaN anywhere: all NaN, scale byte 0x7F.
  for (int i = 0; i < 16; ++i) x[i] = 1.0f;
  x[9] = std::nanf("");
  q = nv::quantize_block(x, 1.0f);
  EXPECT_EQ(q.scale_bits, nv::kE4M3NaN);
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(q.values[i])) << i;
  // Exact representation: a block already on the grid survives unchanged.
  const float grid[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.5f, -1, -1.5f, -2, -3, -4, -6, 6};
  q = nv::quantize_block(grid, 1.0f);
  EXPECT_EQ(q.scale_bits, 0x38);  // S = 1
  for (int i = 0; i < 16; ++i) EXPECT_EQ(q.values[i], grid[i]) << i;
}

TEST(Nvfp4Block, KernelMathMatchesReferenceOnRandomBlocks) {
  // The exact per-block pipeline the CUDA kernels run (nvfp4_math.h) against
  // quantize_block, for every distribution and several encode scales.
  std::mt19937 rng(1234);
  const float inf = std::numeric_limits<float>::infinity();
  const float scales[] = {1.0f, 2688.0f / 3.7f, 2688.0f / 1e-12f, 2688.0f / 5e4f, 0.0f, 1e30f};
  float x[16];
  int checked = 0;
  for (int kind = 0; kind < 8; ++kind) {
    for (float s_enc : scales) {
      for (int it = 0; it < 400; ++it) {
        fill_block(rng, kind == 7 ? 1 : kind, x);
        if (kind == 7) {  // specials
          x[it % 16] = (it % 3 == 0) ? inf : (it % 3 == 1 ? -inf : std::nanf(""));
        }
        const nv::BlockQuant ref = nv::quantize_block(x, s_enc);
        uint32_t m = 0;
        for (float v : x) m = std::max(m, km::abs_bits(v));
        const km::BlockScale b = km::block_scale(m, s_enc);
        ASSERT_EQ(b.bits, ref.scale_bits) << "kind " << kind << " s_enc " << s_enc;
        for (int i = 0; i < 16; ++i) {
          const uint32_t code = km::element_code(x[i], b);
          ASSERT_EQ(code, ref.codes[i]) << "kind " << kind << " s_enc " << s_enc << " elem " << x[i];
          ASSERT_TRUE(same_float(km::code_value(code, b), ref.values[i]))
              << "kind " << kind << " s_enc " << s_enc << " elem " << x[i];
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 8 * 6 * 400);
}

TEST(Nvfp4Block, ValuesAreExactInBf16WithUnitScale) {
  std::mt19937 rng(99);
  float x[16];
  for (int it = 0; it < 5000; ++it) {
    fill_block(rng, it % 6, x);
    const nv::BlockQuant q = nv::quantize_block(x, 1.0f);
    for (float v : q.values) ASSERT_EQ(bits_of(v) & 0xFFFFu, 0u) << v;  // low 16 bits zero
  }
}

TEST(Nvfp4Block, PartialBlockIgnoresAbsentElements) {
  float x[16];
  for (int i = 0; i < 16; ++i) x[i] = 1000.0f;  // would dominate the scale if read
  x[0] = 1.0f;
  x[1] = 0.5f;
  float y[2];
  nv::fake_quantize_partial_block(x, y, 2, 1.0f);
  // Same as a full block whose absent elements are zero: amax 1 -> S = e4m3(1/6) = 0.171875.
  const float full[16] = {1.0f, 0.5f};
  const nv::BlockQuant q = nv::quantize_block(full, 1.0f);
  EXPECT_EQ(q.scale_bits, nv::e4m3_encode_rn_satfinite(1.0f / 6.0f));
  EXPECT_EQ(y[0], q.values[0]);
  EXPECT_EQ(y[1], q.values[1]);
  EXPECT_EQ(y[0], 1.03125f);  // 1 / 0.171875 = 5.82 -> 6, 6 * 0.171875
  EXPECT_THROW(nv::fake_quantize_partial_block(x, y, 0, 1.0f), vqad::Error);
  EXPECT_THROW(nv::fake_quantize(x, x, 15, 1.0f), vqad::Error);
}

TEST(Nvfp4Pack, PackUnpackRoundTrip) {
  const std::vector<uint8_t> codes = {0x1, 0xA, 0xF, 0x0, 0x7, 0x8};
  const std::vector<uint8_t> packed = nv::pack_codes(codes);
  ASSERT_EQ(packed.size(), 3u);
  EXPECT_EQ(packed[0], 0xA1);  // element 0 in the low nibble
  EXPECT_EQ(packed[1], 0x0F);
  EXPECT_EQ(packed[2], 0x87);
  EXPECT_EQ(nv::unpack_codes(packed), codes);
  std::mt19937 rng(5);
  std::vector<uint8_t> many(4096);
  for (auto& c : many) c = static_cast<uint8_t>(rng() & 0xF);
  EXPECT_EQ(nv::unpack_codes(nv::pack_codes(many)), many);
  std::vector<uint8_t> bytes(2048);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  EXPECT_EQ(nv::pack_codes(nv::unpack_codes(bytes)), bytes);
  uint8_t out[2];
  EXPECT_THROW(nv::pack_codes(codes.data(), 3, out), vqad::Error);
}

TEST(Nvfp4Swizzle, HandComputedOffsets) {
  // rows 130 -> 2 row tiles (padded to 256); scale_cols 5 -> 2 column tiles (padded to 8).
  // offset = tile*512 + (m%32)*16 + ((m%128)/32)*4 + k%4, tile = (m/128)*2 + k/4.
  EXPECT_EQ(nv::swizzled_scales_size(130, 5), 256 * 8);
  EXPECT_EQ(nv::swizzled_scales_size(128, 4), 512);
  EXPECT_EQ(nv::swizzled_scales_size(1, 1), 512);
  EXPECT_EQ(nv::swizzled_scale_offset(0, 0, 5), 0);
  EXPECT_EQ(nv::swizzled_scale_offset(0, 1, 5), 1);
  EXPECT_EQ(nv::swizzled_scale_offset(1, 0, 5), 16);
  EXPECT_EQ(nv::swizzled_scale_offset(32, 0, 5), 4);
  EXPECT_EQ(nv::swizzled_scale_offset(33, 2, 5), 16 + 4 + 2);
  EXPECT_EQ(nv::swizzled_scale_offset(127, 3, 5), 31 * 16 + 3 * 4 + 3);  // 511: end of tile 0
  EXPECT_EQ(nv::swizzled_scale_offset(0, 4, 5), 512);                    // tile 1
  EXPECT_EQ(nv::swizzled_scale_offset(128, 0, 5), 1024);                 // tile 2
  EXPECT_EQ(nv::swizzled_scale_offset(129, 4, 5), 3 * 512 + 16);         // tile 3
  EXPECT_EQ(nv::swizzled_scale_offset(100, 1, 5), 4 * 16 + 3 * 4 + 1);   // 100%32=4, 100/32=3
}

TEST(Nvfp4Swizzle, RoundTripWithZeroPadding) {
  std::mt19937 rng(11);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {130, 5}, {128, 4}, {300, 7}, {37, 12}}) {
    std::vector<uint8_t> lin(rows * cols);
    for (auto& b : lin) b = static_cast<uint8_t>(1 + rng() % 255);  // never 0: pads are visible
    std::vector<uint8_t> swz(nv::swizzled_scales_size(rows, cols), 0xCD);
    nv::swizzle_scales(lin.data(), rows, cols, swz.data());
    std::vector<bool> used(swz.size(), false);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t off = nv::swizzled_scale_offset(r, c, cols);
        ASSERT_FALSE(used[off]) << "offset " << off << " hit twice";
        used[off] = true;
      }
    for (size_t i = 0; i < swz.size(); ++i) {
      if (!used[i]) ASSERT_EQ(swz[i], 0) << "pad byte " << i << " of [" << rows << ", " << cols << "]";
    }
    std::vector<uint8_t> back(lin.size(), 0);
    nv::unswizzle_scales(swz.data(), rows, cols, back.data());
    EXPECT_EQ(back, lin);
  }
}

TEST(Nvfp4Matrix, QuantizeDequantizeConsistent) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t rows = 37, cols = 48;
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = normal(rng);
  x[5] = 0.0f;
  for (int i = 16; i < 32; ++i) x[i] = 0.0f;  // a zero block
  const float s_enc = nv::encode_scale_from_amax(nv::amax(x.data(), x.size()));
  const nv::QuantizedMatrix q = nv::quantize_matrix(x.data(), rows, cols, s_enc);
  ASSERT_EQ(q.codes.size(), x.size());
  ASSERT_EQ(q.scales.size(), static_cast<size_t>(rows * cols / 16));
  std::vector<float> fq(x.size());
  nv::fake_quantize(x.data(), fq.data(), x.size(), s_enc);
  std::vector<float> y(x.size());
  nv::dequantize_matrix(q.codes.data(), q.scales.data(), rows, cols, s_enc, y.data());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(same_float(q.values[i], fq[i])) << i;
    ASSERT_TRUE(same_float(y[i], fq[i])) << i;
  }
  for (int64_t b = 0; b < rows * cols / 16; ++b) {
    const nv::BlockQuant bq = nv::quantize_block(x.data() + b * 16, s_enc);
    ASSERT_EQ(q.scales[b], bq.scale_bits);
  }
  std::vector<uint8_t> lin(q.scales.size());
  nv::unswizzle_scales(q.scales_swizzled.data(), rows, cols / 16, lin.data());
  EXPECT_EQ(lin, q.scales);
  EXPECT_THROW(nv::quantize_matrix(x.data(), 1, 40, 1.0f), vqad::Error);
}

TEST(Nvfp4Matrix, AmaxPropagatesNaN) {
  std::vector<float> x = {1.0f, -7.5f, 3.0f};
  EXPECT_EQ(nv::amax(x.data(), x.size()), 7.5f);
  x[2] = std::nanf("");
  EXPECT_TRUE(std::isnan(nv::amax(x.data(), x.size())));
}

TEST(Nvfp4KernelIndex, FastDivMatchesDivision) {
  std::mt19937 rng(17);
  for (uint32_t d : {1u, 2u, 3u, 7u, 192u, 1120u, 1000003u, 0x7FFFFFFFu, 65536u}) {
    const km::FastDiv f(d);
    for (uint32_t n : {0u, 1u, d - 1, d, d + 1, 0xFFFFFFFFu, 0xFFFFFFFEu, 0x80000000u}) {
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
    for (int i = 0; i < 20000; ++i) {
      const uint32_t n = static_cast<uint32_t>(rng());
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}
