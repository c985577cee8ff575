// NVFP4 scalar reference (spec/nvfp4.md, bit for bit).
//
// An NVFP4 tensor is split into blocks of 16 consecutive elements along the
// quantization axis. Each block stores one FP8 E4M3 scale S and sixteen 4-bit
// E2M1 codes; an optional FP32 per-tensor encode scale s_enc (decode 1/s_enc)
// extends the range:
//     y_i = e2m1(code_i) * S * (1 / s_enc)
// The functions here are the obviously-correct scalar definition that every
// fast path (CUDA kernels, attention, linears, export) is tested against. They
// are plain host functions; kernels keep their own fast versions and are
// compared with these on the golden vectors and on random inputs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vqad::nvfp4 {

inline constexpr int kBlock = 16;              // elements per scale block
inline constexpr float kE4M3Max = 448.0f;      // largest finite E4M3 (e4m3fn)
inline constexpr float kE2M1Max = 6.0f;        // largest E2M1 magnitude
inline constexpr float kGlobalAmaxTarget = 2688.0f;  // 448 * 6
inline constexpr float kAmaxFloor = 1e-12f;    // dynamic/static: s_enc = 2688 / max(amax, floor)
inline constexpr uint8_t kE4M3NaN = 0x7F;
// Swizzled scale tiles: 128 rows x 4 scale columns = 512 bytes.
inline constexpr int64_t kSwizzleRows = 128;
inline constexpr int64_t kSwizzleCols = 4;

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
// s_enc = 2688 / max(amax, 1e-12) (dynamic and static modes), evaluated in fp32
// as (1 / max(amax, 1e-12)) * 2688 -- reciprocal then multiply, the rounding
// the golden vectors pin down. A NaN
// amax gives a NaN s_enc, so a tensor holding NaN quantizes to NaN everywhere
// instead of being silently rescaled.
float encode_scale_from_amax(float amax);

// --- one block of 16 ---------------------------------------------------------------
struct BlockQuant {
  uint8_t scale_bits;      // E4M3 byte of S
  uint8_t codes[kBlock];   // E2M1 code, bit 3 = sign
  float values[kBlock];    // dequantized values (fp32)
};
// Quantizes x[0..15] with encode scale s_enc exactly as spec/nvfp4.md.
// NaN blocks (any element NaN, or a NaN scale): scale byte 0x7F, code
// 7 | sign for every element, every value NaN. Zero-scale blocks: codes 0,
// values +0.
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

// --- packing (export) ----------------------------------------------------------------
// Byte i holds code 2i in the low nibble and code 2i+1 in the high nibble; n even.
void pack_codes(const uint8_t* codes, size_t n, uint8_t* packed);
void unpack_codes(const uint8_t* packed, size_t n, uint8_t* codes);
std::vector<uint8_t> pack_codes(const std::vector<uint8_t>& codes);
std::vector<uint8_t> unpack_codes(const std::vector<uint8_t>& packed);

// --- 128x4 swizzled scale layout (cuBLASLt / CUTLASS / flashinfer FP4 GEMMs) ------------
// For a [rows, scale_cols] linear scale matrix (scale_cols = K / 16) the swizzled
// buffer has round_up(rows, 128) * round_up(scale_cols, 4) bytes; pad bytes are 0.
int64_t swizzled_scales_size(int64_t rows, int64_t scale_cols);
int64_t swizzled_scale_offset(int64_t row, int64_t scale_col, int64_t scale_cols);
// Writes the whole swizzled buffer (pad included) from the linear layout.
void swizzle_scales(const uint8_t* linear, int64_t rows, int64_t scale_cols, uint8_t* swizzled);
// Reads the real (non-pad) entries back into the linear layout.
void unswizzle_scales(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* linear);

// --- matrices [rows, cols], quantized along cols -----------------------------------------
struct QuantizedMatrix {
  int64_t rows = 0, cols = 0;
  float s_enc = 1.0f;
  std::vector<uint8_t> codes;            // rows * cols, one code per element
  std::vector<uint8_t> scales;           // rows * cols / 16, linear layout
  std::vector<uint8_t> scales_swizzled;  // swizzled_scales_size(rows, cols / 16)
  std::vector<float> values;             // rows * cols, dequantized (fp32)
  std::vector<uint8_t> packed_codes() const { return pack_codes(codes); }
};
// cols must be a multiple of 16 (else vqad::Error naming the shape).
QuantizedMatrix quantize_matrix(const float* x, int64_t rows, int64_t cols, float s_enc);
// y = (e2m1(code) * S) * (1 / s_enc) from one-code-per-element codes and linear
// scales; a zero scale gives +0 (as quantize_block does, even when 1 / s_enc is inf).
void dequantize_matrix(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t cols,
                       float s_enc, float* y);

}  // namespace vqad::nvfp4
