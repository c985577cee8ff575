// NVFP4 scalar reference (spec/nvfp4.md, bit for bit).
//
// An NVFP4 tensor is split into blocks of 16 consecutive elements along the
// quantization axis. Each block stores one FP8 E4M3 scale S and sixteen 4-bit
// E2M1 codes; an optional FP32 per-tensor encode scale s_enc (decode 1/s_enc)
// extends the range:
//     y_i = e2m1(code_i) * S * (1 / s_enc)
// The functions here are the obviously-correct scalar definition that every
// fast path (CUDA kernels, attention, linears, export) is tested against. They
// are constexpr-free plain functions usable from host code; kernels keep their
// own fast versions and are compared with these on the golden vectors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vqad::nvfp4 {

inline constexpr int kBlock = 16;              // elements per scale block
inline constexpr float kE4M3Max = 448.0f;      // largest finite E4M3 (e4m3fn)
inline constexpr float kE2M1Max = 6.0f;        // largest E2M1 magnitude
inline constexpr float kGlobalAmaxTarget = 2688.0f;  // 448 * 6
inline constexpr uint8_t kE4M3NaN = 0x7F;

// --- scalar formats ----------------------------------------------------------
// E2M1: codes 0..7 -> {0, .5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign.
float e2m1_decode(uint8_t code);
// Round |a| (a >= 0, finite or +inf) to the nearest E2M1 magnitude code 0..7,
// ties to the even code, saturating at 6. NaN maps to 7 (callers mark NaN blocks).
uint8_t e2m1_encode_magnitude(float a);

// E4M3 (e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no Inf; 0x7F/0xFF NaN.
float e4m3_decode(uint8_t bits);
// Round-to-nearest-even, saturating to +-448 (Inf too); NaN -> 0x7F.
uint8_t e4m3_encode_rn_satfinite(float v);

// --- scale modes -----------------------------------------------------------------
enum class ScaleMode { kUnit, kDynamic, kStatic };
const char* scale_mode_name(ScaleMode m);
// Parses "unit" | "dynamic" | "static"; throws vqad::Error naming `what` otherwise.
ScaleMode parse_scale_mode(const char* s, const char* what);
// s_enc = 2688 / max(amax, 1e-12), in fp32 (dynamic and static modes).
float encode_scale_from_amax(float amax);

// --- one block of 16 ---------------------------------------------------------------
struct BlockQuant {
  uint8_t scale_bits;      // E4M3 byte of S
  uint8_t codes[kBlock];   // E2M1 code, bit 3 = sign
  float values[kBlock];    // dequantized values (fp32)
};
// Quantizes x[0..15] with encode scale s_enc exactly as spec/nvfp4.md. If any
// element is NaN every value is NaN (scale byte 0x7F).
BlockQuant quantize_block(const float* x, float s_enc);

// --- whole rows --------------------------------------------------------------------
// Fake-quantizes `n` contiguous floats (n a multiple of 16) block by block:
// y = dequantize(quantize(x)). y may alias x.
void fake_quantize(const float* x, float* y, size_t n, float s_enc);
// Fake quantization of a partial block: only the first `valid` (1..16) elements
// take part (the rest act as absent, they do not influence the scale); writes
// `valid` outputs. Used for masked tails, e.g. attention P beyond the key length.
void fake_quantize_partial_block(const float* x, float* y, int valid, float s_enc);

// amax = max |x_i| over n floats (NaN propagates).
float amax(const float* x, size_t n);

}  // namespace vqad::nvfp4
