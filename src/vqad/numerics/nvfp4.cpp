#include "vqad/numerics/nvfp4.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "vqad/core/error.h"

namespace vqad::nvfp4 {

float e2m1_decode(uint8_t code) {
  static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float m = kMag[code & 7];
  return (code & 8) ? -m : m;
}

uint8_t e2m1_encode_magnitude(float a) {
  // Midpoints between neighbours; at a midpoint the even code wins, so the
  // comparison is <= where the lower neighbour's code is even, < otherwise.
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;  // (5, inf] and NaN
}

float e4m3_decode(uint8_t bits) {
  const int sign = bits >> 7;
  const int exp = (bits >> 3) & 0xF;
  const int man = bits & 7;
  float v;
  if (exp == 0xF && man == 7) {
    v = std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man * 2^-9
  } else {
    v = std::ldexp(1.0f + man / 8.0f, exp - 7);
  }
  return sign ? -v : v;
}

uint8_t e4m3_encode_rn_satfinite(float v) {
  if (std::isnan(v)) return kE4M3NaN;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (a >= kE4M3Max) return sign | 0x7E;  // saturate (Inf included)
  if (a < 0.015625f) {                    // below 2^-6: subnormal grid of 2^-9
    // a * 2^9 is exact; nearbyint rounds half to even in the default mode.
    const float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);  // q == 8 encodes 2^-6 (exp 1, man 0)
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // a = (1 + f) * 2^(e-1), f in [0, 1); three mantissa bits: q = round(f * 8)
  const int exp = e - 1;
  float q = std::nearbyint((m * 2.0f - 1.0f) * 8.0f);
  int ex = exp;
  if (q == 8.0f) {
    q = 0.0f;
    ex += 1;
  }
  return sign | static_cast<uint8_t>(((ex + 7) << 3) | static_cast<int>(q));
}

const char* scale_mode_name(ScaleMode m) {
  switch (m) {
    case ScaleMode::kUnit: return "unit";
    case ScaleMode::kDynamic: return "dynamic";
    case ScaleMode::kStatic: return "static";
  }
  return "?";
}

ScaleMode parse_scale_mode(const char* s, const char* what) {
  const std::string v = s ? s : "";
  if (v == "unit") return ScaleMode::kUnit;
  if (v == "dynamic") return ScaleMode::kDynamic;
  if (v == "static") return ScaleMode::kStatic;
  fail(what, ": unknown NVFP4 scale mode '", v, "' (valid: unit, dynamic, static)");
}

float encode_scale_from_amax(float amax_value) {
  if (std::isnan(amax_value)) return amax_value;
  const float a = amax_value > kAmaxFloor ? amax_value : kAmaxFloor;
  // A reciprocal, then a multiply: the golden vectors (and torch's `2688 / t`)
  // round this way, which differs from a true division by an ulp for ~30% of amaxes.
  return (1.0f / a) * kGlobalAmaxTarget;
}

static BlockQuant quantize_n(const float* x, int valid, float s_enc) {
  BlockQuant r{};
  bool has_nan = false;
  float amax_b = 0.0f;
  for (int i = 0; i < valid; ++i) {
    if (std::isnan(x[i])) has_nan = true;
    amax_b = std::fmax(amax_b, std::fabs(x[i]));
  }
  const float s_dec = 1.0f / s_enc;
  const float scaled = (amax_b / 6.0f) * s_enc;
  if (has_nan || std::isnan(scaled)) {
    r.scale_bits = kE4M3NaN;
    for (int i = 0; i < valid; ++i) {
      r.codes[i] = static_cast<uint8_t>(7 | (std::signbit(x[i]) ? 8 : 0));
      r.values[i] = std::nanf("");
    }
    return r;
  }
  r.scale_bits = e4m3_encode_rn_satfinite(scaled);
  const float S = e4m3_decode(r.scale_bits);
  if (S == 0.0f) return r;  // zero block: codes 0, values +0
  const float inv = 1.0f / (S * s_dec);
  for (int i = 0; i < valid; ++i) {
    const float a = std::fabs(x[i]) * inv;
    const uint8_t code = static_cast<uint8_t>(e2m1_encode_magnitude(a) | (std::signbit(x[i]) ? 8 : 0));
    r.codes[i] = code;
    r.values[i] = (e2m1_decode(code) * S) * s_dec;
  }
  return r;
}

BlockQuant quantize_block(const float* x, float s_enc) { return quantize_n(x, kBlock, s_enc); }

void fake_quantize(const float* x, float* y, size_t n, float s_enc) {
  VQAD_CHECK(n % kBlock == 0, "nvfp4::fake_quantize: length ", n, " is not a multiple of 16");
  for (size_t b = 0; b < n; b += kBlock) {
    const BlockQuant q = quantize_n(x + b, kBlock, s_enc);
    std::memcpy(y + b, q.values, sizeof(q.values));
  }
}

void fake_quantize_partial_block(const float* x, float* y, int valid, float s_enc) {
  VQAD_CHECK(valid >= 1 && valid <= kBlock, "nvfp4::fake_quantize_partial_block: valid=", valid,
             " outside 1..16");
  const BlockQuant q = quantize_n(x, valid, s_enc);
  std::memcpy(y, q.values, sizeof(float) * valid);
}

float amax(const float* x, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return x[i];
    m = std::fmax(m, std::fabs(x[i]));
  }
  return m;
}

void pack_codes(const uint8_t* codes, size_t n, uint8_t* packed) {
  VQAD_CHECK(n % 2 == 0, "nvfp4::pack_codes: ", n, " codes, expected an even count");
  for (size_t i = 0; i < n / 2; ++i) {
    packed[i] = static_cast<uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
  }
}

void unpack_codes(const uint8_t* packed, size_t n, uint8_t* codes) {
  VQAD_CHECK(n % 2 == 0, "nvfp4::unpack_codes: ", n, " codes, expected an even count");
  for (size_t i = 0; i < n / 2; ++i) {
    codes[2 * i] = packed[i] & 0xF;
    codes[2 * i + 1] = packed[i] >> 4;
  }
}

std::vector<uint8_t> pack_codes(const std::vector<uint8_t>& codes) {
  std::vector<uint8_t> out(codes.size() / 2);
  pack_codes(codes.data(), codes.size(), out.data());
  return out;
}

std::vector<uint8_t> unpack_codes(const std::vector<uint8_t>& packed) {
  std::vector<uint8_t> out(packed.size() * 2);
  unpack_codes(packed.data(), out.size(), out.data());
  return out;
}

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int64_t swizzled_scales_size(int64_t rows, int64_t scale_cols) {
  return round_up(rows, kSwizzleRows) * round_up(scale_cols, kSwizzleCols);
}

int64_t swizzled_scale_offset(int64_t row, int64_t scale_col, int64_t scale_cols) {
  const int64_t col_tiles = (scale_cols + kSwizzleCols - 1) / kSwizzleCols;
  const int64_t tile = (row / 128) * col_tiles + scale_col / 4;
  return tile * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + scale_col % 4;
}

void swizzle_scales(const uint8_t* linear, int64_t rows, int64_t scale_cols, uint8_t* swizzled) {
  std::memset(swizzled, 0, static_cast<size_t>(swizzled_scales_size(rows, scale_cols)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < scale_cols; ++c) {
      swizzled[swizzled_scale_offset(r, c, scale_cols)] = linear[r * scale_cols + c];
    }
  }
}

void unswizzle_scales(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* linear) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < scale_cols; ++c) {
      linear[r * scale_cols + c] = swizzled[swizzled_scale_offset(r, c, scale_cols)];
    }
  }
}

QuantizedMatrix quantize_matrix(const float* x, int64_t rows, int64_t cols, float s_enc) {
  VQAD_CHECK(rows >= 0 && cols >= 0 && cols % kBlock == 0, "nvfp4::quantize_matrix: shape [",
             rows, ", ", cols, "]: the last dim must be a multiple of 16");
  QuantizedMatrix q;
  q.rows = rows;
  q.cols = cols;
  q.s_enc = s_enc;
  const int64_t n = rows * cols;
  const int64_t scale_cols = cols / kBlock;
  q.codes.resize(static_cast<size_t>(n));
  q.values.resize(static_cast<size_t>(n));
  q.scales.resize(static_cast<size_t>(rows * scale_cols));
  for (int64_t b = 0; b < rows * scale_cols; ++b) {
    const BlockQuant bq = quantize_n(x + b * kBlock, kBlock, s_enc);
    q.scales[b] = bq.scale_bits;
    std::memcpy(q.codes.data() + b * kBlock, bq.codes, kBlock);
    std::memcpy(q.values.data() + b * kBlock, bq.values, sizeof(bq.values));
  }
  q.scales_swizzled.resize(static_cast<size_t>(swizzled_scales_size(rows, scale_cols)));
  swizzle_scales(q.scales.data(), rows, scale_cols, q.scales_swizzled.data());
  return q;
}

void dequantize_matrix(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t cols,
                       float s_enc, float* y) {
  VQAD_CHECK(rows >= 0 && cols >= 0 && cols % kBlock == 0, "nvfp4::dequantize_matrix: shape [",
             rows, ", ", cols, "]: the last dim must be a multiple of 16");
  const float s_dec = 1.0f / s_enc;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float S = e4m3_decode(scales[i / kBlock]);
    // A zero scale decodes to +0 even when s_dec is inf, as quantize_block does.
    y[i] = S == 0.0f ? 0.0f : (e2m1_decode(codes[i]) * S) * s_dec;
  }
}

}  // namespace vqad::nvfp4
