// NVFP4 CUDA kernels. Work split: one thread per 16-element block (two 16-byte
// loads for BF16, four for FP32), kB blocks per thread and loop iteration with
// all loads of an iteration issued before any arithmetic, so that enough bytes
// are in flight to keep HBM busy; consecutive threads take consecutive blocks,
// grid-stride over the flat block index with a grid sized to the SM count and
// the kernel's occupancy. The arithmetic is common/nvfp4_math.h, the code the CPU
// tests check against the scalar reference: per block the E4M3 scale (the
// hardware cvt.rn.satfinite.e4m3x2 on sm_89+, equal to e4m3_encode_nonneg for
// every non-negative float) and, from a 128-entry table in shared memory, its
// value S and 1 / (S * s_dec); per element a handful of fp32 operations (E2M1
// rounding by one magic-constant add, see e2m1_round_magnitude), BF16 outputs
// packed two at a time. NaN and all-zero blocks take the general per-element
// path (out of line). quantize+pack gathers the scale bytes of four blocks with
// two warp shuffles and writes them (linear and 128x4-swizzled, 32-bit offsets
// when they fit) as 32-bit words; for BF16 inputs each code comes out of the
// magic-constant add as a byte (e2m1_code_byte), and the bytes and the BF16 sign
// bits are placed into nibbles with byte permutes (pack8_bf16).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "vqad/core/error.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"

namespace vqad::kernels::nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kBlk = 16;  // elements per scale block
// 16-element blocks per thread and loop iteration (measured on an H200 at the
// Wan shapes: fake-quant is fastest with 4, quantize+pack with 1; docs/performance.md).
constexpr int kFqBlocks = 4;  // for BF16 inputs; FP32 blocks are twice the bytes
template <typename TIn>
__host__ __device__ constexpr int fq_blocks() {
  return sizeof(TIn) == 2 ? kFqBlocks : kFqBlocks / 2;
}
constexpr int kQBlocks = 1;
constexpr int kAmaxBlocks = 4;

// Leading dims of a view after dropping size-1 dims and merging dims that are
// contiguous with each other; a flat row index maps to an element offset.
struct RowMap {
  int nlead = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

__device__ __forceinline__ int64_t row_offset(const RowMap& m, int64_t row) {
  if (m.nlead == 1) return row * m.strides[0];
  int64_t off = 0;
  for (int d = m.nlead - 1; d >= 0; --d) {
    const int64_t s = m.sizes[d];
    off += (row % s) * m.strides[d];
    row /= s;
  }
  return off;
}

// Flat block index -> (row, block column); 32-bit fast path when it fits.
struct BlockIndex {
  FastDiv div32;
  int64_t blocks_per_row = 1;
  int64_t total = 0;  // number of 16-element blocks
  bool use32 = true;
  bool swz32 = false;  // quantize: use32 and the swizzled scale buffer has < 2^32 bytes
};

__device__ __forceinline__ void split_block(const BlockIndex& bi, int64_t blk, int64_t& row, int64_t& kb) {
  if (bi.use32) {
    const uint32_t r = bi.div32.div(static_cast<uint32_t>(blk));
    row = r;
    kb = blk - static_cast<int64_t>(r) * bi.blocks_per_row;
  } else {
    row = blk / bi.blocks_per_row;
    kb = blk - row * bi.blocks_per_row;
  }
}

// Element offset of block `blk` in a view; kDense: rows are back to back.
template <bool kDense>
__device__ __forceinline__ int64_t block_offset(const RowMap& m, const BlockIndex& bi, int64_t blk) {
  if (kDense) return blk * kBlk;
  int64_t row, kb;
  split_block(bi, blk, row, kb);
  return row_offset(m, row) + kb * kBlk;
}

// --- loads and stores of one 16-element block --------------------------------------------
// Raw block: BF16 as 8 words of two elements, FP32 as 16 words.
template <typename T>
struct RawBlock;
template <>
struct RawBlock<uint16_t> {
  uint32_t w[8];
  __device__ __forceinline__ float at(int i) const {
    return u2f((i & 1) ? (w[i >> 1] & 0xFFFF0000u) : (w[i >> 1] << 16));
  }
  // |element i| (sign cleared) and the element's sign bit at bit 31.
  __device__ __forceinline__ float abs_at(int i) const {
    const uint32_t a = w[i >> 1] & 0x7FFF7FFFu;
    return u2f((i & 1) ? (a & 0xFFFF0000u) : (a << 16));
  }
  __device__ __forceinline__ uint32_t sign_at(int i) const {
    return (i & 1) ? (w[i >> 1] & 0x80000000u) : ((w[i >> 1] << 16) & 0x80000000u);
  }
};
template <>
struct RawBlock<float> {
  uint32_t w[16];
  __device__ __forceinline__ float at(int i) const { return u2f(w[i]); }
  __device__ __forceinline__ float abs_at(int i) const { return u2f(w[i] & kAbsMask); }
  __device__ __forceinline__ uint32_t sign_at(int i) const { return w[i] & 0x80000000u; }
};

template <bool kVec>
__device__ __forceinline__ void load_block(const uint16_t* __restrict__ p, RawBlock<uint16_t>& r) {
  if (kVec) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      r.w[i] = static_cast<uint32_t>(__ldg(p + 2 * i)) | (static_cast<uint32_t>(__ldg(p + 2 * i + 1)) << 16);
    }
  }
}
template <bool kVec>
__device__ __forceinline__ void load_block(const float* __restrict__ p, RawBlock<float>& r) {
  if (kVec) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(p) + q);
      r.w[4 * q] = a.x; r.w[4 * q + 1] = a.y; r.w[4 * q + 2] = a.z; r.w[4 * q + 3] = a.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) r.w[i] = f2u(__ldg(p + i));
  }
}

// max |x| of the block as fp32 bits (NaN above +inf, so it propagates).
__device__ __forceinline__ uint32_t vmax_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return __vmaxu2(a, b);
#endif
}
__device__ __forceinline__ uint32_t block_amax_bits(const RawBlock<uint16_t>& r) {
  uint32_t m = r.w[0] & 0x7FFF7FFFu;
#pragma unroll
  for (int i = 1; i < 8; ++i) m = vmax_u16x2(m, r.w[i] & 0x7FFF7FFFu);
  return max(m << 16, m & 0xFFFF0000u);
}
__device__ __forceinline__ uint32_t block_amax_bits(const RawBlock<float>& r) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = max(m, r.w[i] & kAbsMask);
  return m;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <bool kVec>
__device__ __forceinline__ void store_block(uint16_t* __restrict__ p, const float (&v)[kBlk]) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
  if (kVec) {
    reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      p[2 * i] = static_cast<uint16_t>(w[i]);
      p[2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
    }
  }
}
template <bool kVec>
__device__ __forceinline__ void store_block(float* __restrict__ p, const float (&v)[kBlk]) {
  if (kVec) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      reinterpret_cast<float4*>(p)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kBlk; ++i) p[i] = v[i];
  }
}

__device__ __forceinline__ float resolve_scale(const EncodeScale& s) {
  return s.amax_device ? encode_scale_from_amax(*s.amax_device) : s.value;
}

// --- the block scale ------------------------------------------------------------------------
// E4M3 byte of v >= 0 (+inf included; NaN is handled by the caller).
__device__ __forceinline__ uint32_t e4m3_encode_fast(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return nvfp4_device::e4m3_byte(v);
#else
  return e4m3_encode_nonneg(v);
#endif
}

// {S, 1 / (S * s_dec)} for every E4M3 byte 0..127, built by each CTA at start.
struct ScaleTable {
  float2 e[128];
};

__device__ __forceinline__ void fill_scale_table(ScaleTable& t, float s_dec) {
  for (int i = threadIdx.x; i < 128; i += blockDim.x) {
    const float S = e4m3_decode(static_cast<uint32_t>(i));
    t.e[i] = make_float2(S, div_rn(1.0f, mul_rn(S, s_dec)));
  }
  __syncthreads();
}

// block_scale() of nvfp4_math.h, with S and inv from the table. `special`: a NaN or
// all-zero block, which takes the general path.
struct FastScale {
  uint32_t bits;
  float S, inv;
  bool special;
};

__device__ __forceinline__ FastScale fast_block_scale(uint32_t amax_abs_bits, float s_enc, const ScaleTable& t) {
  FastScale f;
  const float scaled = mul_rn(div_rn(u2f(amax_abs_bits), 6.0f), s_enc);
  const bool nan = bits_are_nan(amax_abs_bits) || scaled != scaled;
  f.bits = nan ? 0x7Fu : e4m3_encode_fast(scaled);
  const float2 e = t.e[f.bits];
  f.S = e.x;
  f.inv = e.y;
  f.special = nan || f.S == 0.0f;
  return f;
}

// --- per-block work -----------------------------------------------------------------------
// General path (NaN or zero blocks, rare): the reference-shaped element_code /
// code_value, out of line so that the hot loop stays small. Writes the block.
template <bool kVec, typename TIn, typename TOut>
__device__ __noinline__ void fake_quantize_block_general(RawBlock<TIn> r, float s_enc, float s_dec, TOut* dst) {
  const BlockScale b = block_scale(block_amax_bits(r), s_enc, s_dec);
  float out[kBlk];
#pragma unroll
  for (int i = 0; i < kBlk; ++i) out[i] = code_value(element_code(r.at(i), b), b);
  store_block<kVec>(dst, out);
}

template <bool kVec, bool kUnitDec, typename TIn, typename TOut>
__device__ __forceinline__ void fake_quantize_block(const RawBlock<TIn>& r, float s_enc, float s_dec,
                                                    const ScaleTable& t, TOut* dst) {
  const FastScale f = fast_block_scale(block_amax_bits(r), s_enc, t);
  if (f.special) {
    fake_quantize_block_general<kVec>(r, s_enc, s_dec, dst);
    return;
  }
  float out[kBlk];
#pragma unroll
  for (int i = 0; i < kBlk; ++i) {
    // element_value_regular, with |x| and the sign taken from the raw bits.
    const float q = e2m1_round_magnitude(mul_rn(r.abs_at(i), f.inv));
    float m = mul_rn(q, f.S);
    if (!kUnitDec) m = mul_rn(m, s_dec);
    out[i] = u2f(f2u(m) | r.sign_at(i));
  }
  store_block<kVec>(dst, out);
}

// Packed codes of a block (element 2i in the low nibble of byte i): general path.
template <typename TIn>
__device__ __noinline__ uint2 quantize_block_general(RawBlock<TIn> r, float s_enc, float s_dec) {
  const BlockScale b = block_scale(block_amax_bits(r), s_enc, s_dec);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < kBlk; ++i) {
    const uint32_t code = element_code(r.at(i), b);
    if (i < 8) lo |= code << (4 * i);
    else hi |= code << (4 * (i - 8));
  }
  return make_uint2(lo, hi);
}

template <typename TIn>
__device__ __forceinline__ uint2 quantize_block_regular(const RawBlock<TIn>& r, float inv) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < kBlk; ++i) {
    const uint32_t code = e2m1_code_magnitude(mul_rn(r.abs_at(i), inv)) | (r.sign_at(i) >> 28);
    if (i < 8) lo |= code << (4 * i);
    else hi |= code << (4 * (i - 8));
  }
  return make_uint2(lo, hi);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

using nvfp4_device::e2m1_code_byte;  // the code of |x * inv| in the low byte

// Eight codes (elements of words w[0..3], element 2i in the low nibble of byte i):
// code bytes gathered with byte permutes, signs taken from the BF16 high bytes.
__device__ __forceinline__ uint32_t pack8_bf16(const uint32_t* w, float inv) {
  uint32_t t[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = e2m1_code_byte(u2f(w[i] << 16), inv);
    t[2 * i + 1] = e2m1_code_byte(u2f(w[i] & 0xFFFF0000u), inv);
  }
  const uint32_t even = prmt(prmt(t[0], t[2], 0x0040u), prmt(t[4], t[6], 0x0040u), 0x5410u);
  const uint32_t odd = prmt(prmt(t[1], t[3], 0x0040u), prmt(t[5], t[7], 0x0040u), 0x5410u);
  const uint32_t h01 = prmt(w[0], w[1], 0x7351u), h23 = prmt(w[2], w[3], 0x7351u);
  const uint32_t s_even = prmt(h01, h23, 0x5410u);  // byte i: high byte of element 2i
  const uint32_t s_odd = prmt(h01, h23, 0x7632u);   // byte i: high byte of element 2i + 1
  return ((odd << 4) + even) | (s_odd & 0x80808080u) | ((s_even >> 4) & 0x08080808u);
}

__device__ __forceinline__ uint2 quantize_block_regular(const RawBlock<uint16_t>& r, float inv) {
  return make_uint2(pack8_bf16(r.w, inv), pack8_bf16(r.w + 4, inv));
}

// --- kernels ---------------------------------------------------------------------------
// A CTA-uniform `tile` walks the flat block index; thread t of the CTA takes blocks
// tile + j * kThreads + t, j < kB: a warp's loads for one j are 32 consecutive blocks,
// and all threads of a CTA run the same number of iterations (warp shuffles are safe).

template <typename TIn, typename TOut, bool kVec, bool kDense, bool kUnitDec>
__device__ __forceinline__ void fake_quantize_loop(const TIn* __restrict__ x, TOut* __restrict__ y,
                                                   const RowMap& xm, const RowMap& ym, const BlockIndex& bi,
                                                   float s_enc, float s_dec, const ScaleTable& t) {
  constexpr int kB = fq_blocks<TIn>();
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kB;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kThreads * kB; tile < bi.total; tile += step) {
    RawBlock<TIn> r[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int64_t blk = tile + j * kThreads + threadIdx.x;
      if (blk < bi.total) load_block<kVec>(x + block_offset<kDense>(xm, bi, blk), r[j]);
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int64_t blk = tile + j * kThreads + threadIdx.x;
      if (blk < bi.total) {
        fake_quantize_block<kVec, kUnitDec>(r[j], s_enc, s_dec, t, y + block_offset<kDense>(ym, bi, blk));
      }
    }
  }
}

template <typename TIn, typename TOut, bool kVec, bool kDense>
__global__ void __launch_bounds__(kThreads)
    fake_quantize_kernel(const TIn* __restrict__ x, TOut* __restrict__ y, RowMap xm, RowMap ym, BlockIndex bi,
                         EncodeScale sc) {
  __shared__ ScaleTable table;
  const float s_enc = resolve_scale(sc);
  const float s_dec = div_rn(1.0f, s_enc);
  fill_scale_table(table, s_dec);
  if (s_dec == 1.0f) {
    fake_quantize_loop<TIn, TOut, kVec, kDense, true>(x, y, xm, ym, bi, s_enc, s_dec, table);
  } else {
    fake_quantize_loop<TIn, TOut, kVec, kDense, false>(x, y, xm, ym, bi, s_enc, s_dec, table);
  }
}

__device__ __forceinline__ int64_t swizzled_offset(int64_t row, int64_t k, int64_t col_tiles) {
  return ((row >> 7) * col_tiles + (k >> 2)) * 512 + (row & 31) * 16 + ((row & 127) >> 5) * 4 + (k & 3);
}

// Byte offset of the swizzled scale of block blk (row, k).
__device__ __forceinline__ int64_t swizzled_block_offset(const BlockIndex& bi, int64_t blk, int64_t col_tiles) {
  if (bi.swz32) {
    const uint32_t b = static_cast<uint32_t>(blk);
    const uint32_t row = bi.div32.div(b);
    const uint32_t k = b - row * static_cast<uint32_t>(bi.blocks_per_row);
    return ((row >> 7) * static_cast<uint32_t>(col_tiles) + (k >> 2)) * 512u + (row & 31u) * 16u +
           ((row >> 5) & 3u) * 4u + (k & 3u);
  }
  int64_t row, k;
  split_block(bi, blk, row, k);
  return swizzled_offset(row, k, col_tiles);
}

// kGroup4: blocks_per_row % 4 == 0 and 4-byte aligned scale outputs, so the scale
// bytes of blocks 4g..4g+3 (one row, k = 4t..4t+3) are 4 contiguous bytes in both
// layouts and are written as one word by lane 4g of the warp.
template <typename TIn, bool kVec, bool kDense, bool kGroup4>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const TIn* __restrict__ x, RowMap xm, BlockIndex bi, EncodeScale sc,
                    uint8_t* __restrict__ packed, bool packed8, uint8_t* __restrict__ scales,
                    uint8_t* __restrict__ swizzled) {
  constexpr int kB = kQBlocks;
  __shared__ ScaleTable table;
  const float s_enc = resolve_scale(sc);
  const float s_dec = div_rn(1.0f, s_enc);
  fill_scale_table(table, s_dec);
  const int64_t col_tiles = (bi.blocks_per_row + 3) / 4;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kB;
  const int lane = threadIdx.x & 31;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kThreads * kB; tile < bi.total; tile += step) {
    RawBlock<TIn> r[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int64_t blk = tile + j * kThreads + threadIdx.x;
      if (blk < bi.total) load_block<kVec>(x + block_offset<kDense>(xm, bi, blk), r[j]);
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int64_t blk = tile + j * kThreads + threadIdx.x;
      const bool active = blk < bi.total;
      uint32_t bits = 0;
      if (active) {
        const FastScale f = fast_block_scale(block_amax_bits(r[j]), s_enc, table);
        bits = f.bits;
        if (packed) {
          const uint2 c = f.special ? quantize_block_general(r[j], s_enc, s_dec) : quantize_block_regular(r[j], f.inv);
          if (packed8) {
            reinterpret_cast<uint2*>(packed)[blk] = c;
          } else {
            reinterpret_cast<uint32_t*>(packed)[2 * blk] = c.x;
            reinterpret_cast<uint32_t*>(packed)[2 * blk + 1] = c.y;
          }
        }
      }
      if (kGroup4) {
        // Lane l collects the bytes of blocks l..l+3 (all lanes take part).
        bits |= __shfl_down_sync(0xFFFFFFFFu, bits, 1) << 8;
        bits |= __shfl_down_sync(0xFFFFFFFFu, bits, 2) << 16;
        if (active && (lane & 3) == 0) {
          if (scales) *reinterpret_cast<uint32_t*>(scales + blk) = bits;
          if (swizzled) *reinterpret_cast<uint32_t*>(swizzled + swizzled_block_offset(bi, blk, col_tiles)) = bits;
        }
      } else if (active) {
        if (scales) scales[blk] = static_cast<uint8_t>(bits);
        if (swizzled) swizzled[swizzled_block_offset(bi, blk, col_tiles)] = static_cast<uint8_t>(bits);
      }
    }
  }
}

template <typename TOut, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales, bool swizzled,
                      TOut* __restrict__ y, RowMap ym, BlockIndex bi, EncodeScale sc) {
  const float s_enc = resolve_scale(sc);
  const float s_dec = div_rn(1.0f, s_enc);
  const int64_t col_tiles = (bi.blocks_per_row + 3) / 4;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; blk < bi.total; blk += step) {
    int64_t row, k;
    split_block(bi, blk, row, k);
    const uint32_t lo = __ldg(reinterpret_cast<const uint32_t*>(packed) + 2 * blk);
    const uint32_t hi = __ldg(reinterpret_cast<const uint32_t*>(packed) + 2 * blk + 1);
    BlockScale b;
    b.bits = __ldg(scales + (swizzled ? swizzled_offset(row, k, col_tiles) : blk));
    b.S = e4m3_decode(b.bits);
    b.s_dec = s_dec;
    b.nan = b.S != b.S;
    b.zero = b.S == 0.0f;
    b.inv = 0.0f;
    float out[kBlk];
#pragma unroll
    for (int i = 0; i < kBlk; ++i) out[i] = code_value(((i < 8 ? lo : hi) >> (4 * (i & 7))) & 0xFu, b);
    store_block<kVec>(y + row_offset(ym, row) + k * kBlk, out);
  }
}

template <typename TIn, bool kVec, bool kDense>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const TIn* __restrict__ x, RowMap xm, BlockIndex bi, uint32_t* __restrict__ out) {
  constexpr int kB = kAmaxBlocks;
  __shared__ uint32_t warp_max[kThreads / 32];
  uint32_t m = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kB;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kThreads * kB; tile < bi.total; tile += step) {
    RawBlock<TIn> r[kB];
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int64_t blk = tile + j * kThreads + threadIdx.x;
      if (blk < bi.total) load_block<kVec>(x + block_offset<kDense>(xm, bi, blk), r[j]);
    }
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      if (tile + j * kThreads + threadIdx.x < bi.total) m = max(m, block_amax_bits(r[j]));
    }
  }
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if (threadIdx.x == 0 && m != 0) atomicMax(out, m);
  }
}

// --- host side ---------------------------------------------------------------------------

size_t elem_size(DType d) { return d == DType::kBF16 ? 2 : 4; }

void check_view(const TensorView& v, const char* op, const char* what) {
  VQAD_CHECK(v.ndim >= 1 && v.ndim <= kMaxDims, "nvfp4 ", op, ": ", what, " has ", v.ndim,
             " dims, expected 1..", kMaxDims);
  VQAD_CHECK(v.data != nullptr || v.rows() * v.cols() == 0, "nvfp4 ", op, ": ", what,
             " is a null pointer");
  for (int d = 0; d < v.ndim; ++d) {
    VQAD_CHECK(v.sizes[d] >= 0, "nvfp4 ", op, ": ", what, " ", v.shape_str(), " has a negative size");
  }
  VQAD_CHECK(v.cols() % 16 == 0, "nvfp4 ", op, ": ", what, " ", v.shape_str(),
             ": the last dim (", v.cols(), ") must be a multiple of 16 (one scale per 16 elements)");
  VQAD_CHECK(v.strides[v.ndim - 1] == 1 || v.cols() <= 1, "nvfp4 ", op, ": ", what, " ",
             v.shape_str(), ": the last dim must be contiguous (stride 1), found stride ",
             v.strides[v.ndim - 1]);
}

// Canonical leading dims, merged only where every view allows it, so that all
// views share one flat row index.
void row_maps(const TensorView* const* views, int n, RowMap* maps) {
  const int nlead = views[0]->ndim - 1;
  for (int i = 0; i < n; ++i) maps[i] = RowMap{};
  for (int d = 0; d < nlead; ++d) {
    if (views[0]->sizes[d] == 1) continue;
    const bool first = maps[0].nlead == 0;
    bool merge = !first;
    for (int i = 0; i < n && merge; ++i) {
      const RowMap& m = maps[i];
      merge = m.strides[m.nlead - 1] == views[i]->strides[d] * views[i]->sizes[d];
    }
    for (int i = 0; i < n; ++i) {
      RowMap& m = maps[i];
      if (merge) {
        m.sizes[m.nlead - 1] *= views[i]->sizes[d];
        m.strides[m.nlead - 1] = views[i]->strides[d];
      } else {
        m.sizes[m.nlead] = views[i]->sizes[d];
        m.strides[m.nlead] = views[i]->strides[d];
        ++m.nlead;
      }
    }
  }
}

bool aligned16(const TensorView& v) {
  const size_t es = elem_size(v.dtype);
  if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0) return false;
  for (int d = 0; d + 1 < v.ndim; ++d) {
    if (v.sizes[d] > 1 && (static_cast<size_t>(v.strides[d]) * es) % 16 != 0) return false;
  }
  return true;
}

BlockIndex block_index(int64_t rows, int64_t cols) {
  BlockIndex bi;
  bi.blocks_per_row = cols / kBlk;
  bi.total = rows * bi.blocks_per_row;
  bi.use32 = bi.total < (int64_t{1} << 32) && bi.blocks_per_row < (int64_t{1} << 31);
  if (bi.use32 && bi.blocks_per_row > 0) bi.div32 = FastDiv(static_cast<uint32_t>(bi.blocks_per_row));
  return bi;
}

// Rows back to back in memory (one leading dim of stride cols, or none).
bool dense_rows(const RowMap& m, int64_t cols) { return m.nlead == 0 || (m.nlead == 1 && m.strides[0] == cols); }

// Grid for a grid-stride kernel: as many CTAs as fit on the device at once
// (occupancy of this kernel times the SM count), fewer if there is less work.
// The occupancy is looked up once per kernel and device.
int resident_ctas(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({kernel, dev});
  if (it != cache.end()) return it->second;
  int sms = 0, per_sm = 0;
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess) {
    // No kernel image for this device: let the launch fail and check_launch say why.
    (void)cudaGetLastError();
    return sms > 0 ? sms : 1;
  }
  const int ctas = sms * (per_sm > 0 ? per_sm : 1);
  cache.emplace(std::make_pair(kernel, dev), ctas);
  return ctas;
}

template <typename Kernel>
int grid_for(Kernel kernel, int64_t threads_wanted) {
  const int64_t want = (threads_wanted + kThreads - 1) / kThreads;
  const int64_t cap = resident_ctas(reinterpret_cast<const void*>(kernel));
  return static_cast<int>(want < cap ? (want > 0 ? want : 1) : cap);
}

void check_launch(const char* op, const TensorView& v) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  int dev = -1, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  fail("nvfp4 ", op, " on ", v.shape_str(), ", device ", dev, " (sm_", major, minor,
       "): launch failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
       " (the kernels are built for sm_90a, sm_100a and sm_120a)");
}

}  // namespace

const char* dtype_name(DType d) { return d == DType::kBF16 ? "bf16" : "f32"; }

int64_t TensorView::rows() const {
  int64_t r = 1;
  for (int d = 0; d + 1 < ndim; ++d) r *= sizes[d];
  return r;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << sizes[d];
  os << "] " << dtype_name(dtype);
  return os.str();
}

TensorView dense_view(void* data, DType dtype, int64_t rows, int64_t cols) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = 2;
  v.sizes[0] = rows;
  v.sizes[1] = cols;
  v.strides[0] = cols;
  v.strides[1] = 1;
  return v;
}

int64_t swizzled_size(int64_t rows, int64_t scale_cols) {
  return (rows + 127) / 128 * 128 * ((scale_cols + 3) / 4 * 4);
}

namespace {
template <typename T, bool kVec, bool kDense>
void amax_typed(const TensorView& x, const RowMap& xm, const BlockIndex& bi, uint32_t* out, cudaStream_t stream) {
  auto kernel = amax_kernel<T, kVec, kDense>;
  const int grid = grid_for(kernel, (bi.total + kAmaxBlocks - 1) / kAmaxBlocks);
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x.data), xm, bi, out);
}

template <typename T>
void amax_dispatch(const TensorView& x, const RowMap& xm, const BlockIndex& bi, bool vec, bool dense,
                   uint32_t* out, cudaStream_t stream) {
  if (!vec) amax_typed<T, false, false>(x, xm, bi, out, stream);
  else if (dense) amax_typed<T, true, true>(x, xm, bi, out, stream);
  else amax_typed<T, true, false>(x, xm, bi, out, stream);
}
}  // namespace

void launch_amax(const TensorView& x, float* amax_out, cudaStream_t stream) {
  check_view(x, "amax", "input");
  VQAD_CHECK(amax_out != nullptr, "nvfp4 amax: output is a null pointer");
  VQAD_CUDA_CHECK(cudaMemsetAsync(amax_out, 0, sizeof(float), stream));
  const BlockIndex bi = block_index(x.rows(), x.cols());
  if (bi.total == 0) return;
  const TensorView* views[1] = {&x};
  RowMap xm;
  row_maps(views, 1, &xm);
  const bool vec = aligned16(x), dense = dense_rows(xm, x.cols());
  uint32_t* out = reinterpret_cast<uint32_t*>(amax_out);
  if (x.dtype == DType::kBF16) amax_dispatch<uint16_t>(x, xm, bi, vec, dense, out, stream);
  else amax_dispatch<float>(x, xm, bi, vec, dense, out, stream);
  check_launch("amax", x);
}

namespace {
template <typename TIn, typename TOut, bool kVec, bool kDense>
void fake_quantize_launch(const TensorView& x, const TensorView& y, const RowMap& xm, const RowMap& ym,
                          const BlockIndex& bi, EncodeScale sc, cudaStream_t stream) {
  auto kernel = fake_quantize_kernel<TIn, TOut, kVec, kDense>;
  const int grid = grid_for(kernel, (bi.total + fq_blocks<TIn>() - 1) / fq_blocks<TIn>());
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const TIn*>(x.data), static_cast<TOut*>(y.data), xm, ym, bi,
                                        sc);
}

template <typename TIn, typename TOut>
void fake_quantize_typed(const TensorView& x, const TensorView& y, const RowMap& xm, const RowMap& ym,
                         const BlockIndex& bi, EncodeScale sc, bool vec, bool dense, cudaStream_t stream) {
  if (!vec) fake_quantize_launch<TIn, TOut, false, false>(x, y, xm, ym, bi, sc, stream);
  else if (dense) fake_quantize_launch<TIn, TOut, true, true>(x, y, xm, ym, bi, sc, stream);
  else fake_quantize_launch<TIn, TOut, true, false>(x, y, xm, ym, bi, sc, stream);
}
}  // namespace

void launch_fake_quantize(const TensorView& x, const TensorView& y, EncodeScale scale,
                          cudaStream_t stream) {
  check_view(x, "fake_quantize", "input");
  check_view(y, "fake_quantize", "output");
  VQAD_CHECK(x.ndim == y.ndim, "nvfp4 fake_quantize: input ", x.shape_str(), " and output ",
             y.shape_str(), " differ in rank");
  for (int d = 0; d < x.ndim; ++d) {
    VQAD_CHECK(x.sizes[d] == y.sizes[d], "nvfp4 fake_quantize: input ", x.shape_str(),
               " and output ", y.shape_str(), " differ in shape");
  }
  const BlockIndex bi = block_index(x.rows(), x.cols());
  if (bi.total == 0) return;
  const TensorView* views[2] = {&x, &y};
  RowMap maps[2];
  row_maps(views, 2, maps);
  const bool vec = aligned16(x) && aligned16(y);
  const bool dense = dense_rows(maps[0], x.cols()) && dense_rows(maps[1], y.cols());
  const bool in_bf16 = x.dtype == DType::kBF16, out_bf16 = y.dtype == DType::kBF16;
  if (in_bf16 && out_bf16) {
    fake_quantize_typed<uint16_t, uint16_t>(x, y, maps[0], maps[1], bi, scale, vec, dense, stream);
  } else if (in_bf16) {
    fake_quantize_typed<uint16_t, float>(x, y, maps[0], maps[1], bi, scale, vec, dense, stream);
  } else if (out_bf16) {
    fake_quantize_typed<float, uint16_t>(x, y, maps[0], maps[1], bi, scale, vec, dense, stream);
  } else {
    fake_quantize_typed<float, float>(x, y, maps[0], maps[1], bi, scale, vec, dense, stream);
  }
  check_launch("fake_quantize", x);
}

namespace {
template <typename TIn, bool kVec, bool kDense, bool kGroup4>
void quantize_launch(const TensorView& x, const RowMap& xm, const BlockIndex& bi, EncodeScale sc,
                     const QuantizeOutputs& out, cudaStream_t stream) {
  auto kernel = quantize_kernel<TIn, kVec, kDense, kGroup4>;
  const int grid = grid_for(kernel, (bi.total + kQBlocks - 1) / kQBlocks);
  const bool packed8 = reinterpret_cast<uintptr_t>(out.packed_codes) % 8 == 0;
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const TIn*>(x.data), xm, bi, sc, out.packed_codes, packed8,
                                        out.scales_linear, out.scales_swizzled);
}

template <typename TIn, bool kGroup4>
void quantize_group(const TensorView& x, const RowMap& xm, const BlockIndex& bi, EncodeScale sc,
                    const QuantizeOutputs& out, bool vec, bool dense, cudaStream_t stream) {
  if (!vec) quantize_launch<TIn, false, false, kGroup4>(x, xm, bi, sc, out, stream);
  else if (dense) quantize_launch<TIn, true, true, kGroup4>(x, xm, bi, sc, out, stream);
  else quantize_launch<TIn, true, false, kGroup4>(x, xm, bi, sc, out, stream);
}

template <typename TIn>
void quantize_typed(const TensorView& x, const RowMap& xm, const BlockIndex& bi, EncodeScale sc,
                    const QuantizeOutputs& out, bool vec, bool dense, cudaStream_t stream) {
  const bool group4 = bi.blocks_per_row % 4 == 0 && reinterpret_cast<uintptr_t>(out.scales_linear) % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(out.scales_swizzled) % 4 == 0;
  if (group4) quantize_group<TIn, true>(x, xm, bi, sc, out, vec, dense, stream);
  else quantize_group<TIn, false>(x, xm, bi, sc, out, vec, dense, stream);
}
}  // namespace

void launch_quantize(const TensorView& x, EncodeScale scale, const QuantizeOutputs& out,
                     cudaStream_t stream) {
  check_view(x, "quantize", "input");
  VQAD_CHECK(reinterpret_cast<uintptr_t>(out.packed_codes) % 4 == 0,
             "nvfp4 quantize: packed codes output must be 4-byte aligned");
  const int64_t rows = x.rows(), cols = x.cols(), scale_cols = cols / 16;
  if (out.scales_swizzled) {
    // Pad bytes must read as zero scales; the kernel writes only real entries. With
    // scale_cols % 4 == 0 the only pad is in the last 128-row band of tiles, which
    // is the tail of the buffer; otherwise every tile has pad columns.
    const int64_t sz = swizzled_size(rows, scale_cols);
    if (sz != rows * scale_cols) {
      const int64_t band = ((scale_cols + 3) / 4) * 512;
      const int64_t from = (scale_cols % 4 == 0) ? sz - band : 0;
      VQAD_CUDA_CHECK(cudaMemsetAsync(out.scales_swizzled + from, 0, sz - from, stream));
    }
  }
  BlockIndex bi = block_index(rows, cols);
  if (bi.total == 0) return;
  bi.swz32 = bi.use32 && swizzled_size(rows, scale_cols) < (int64_t{1} << 32);
  const TensorView* views[1] = {&x};
  RowMap xm;
  row_maps(views, 1, &xm);
  const bool vec = aligned16(x), dense = dense_rows(xm, cols);
  if (x.dtype == DType::kBF16) quantize_typed<uint16_t>(x, xm, bi, scale, out, vec, dense, stream);
  else quantize_typed<float>(x, xm, bi, scale, out, vec, dense, stream);
  check_launch("quantize", x);
}

void launch_dequantize(const uint8_t* packed_codes, const uint8_t* scales, bool scales_swizzled,
                       EncodeScale scale, const TensorView& y, cudaStream_t stream) {
  check_view(y, "dequantize", "output");
  const BlockIndex bi = block_index(y.rows(), y.cols());
  if (bi.total == 0) return;
  VQAD_CHECK(packed_codes && scales, "nvfp4 dequantize: null codes or scales for output ",
             y.shape_str());
  VQAD_CHECK(reinterpret_cast<uintptr_t>(packed_codes) % 4 == 0,
             "nvfp4 dequantize: packed codes must be 4-byte aligned");
  const TensorView* views[1] = {&y};
  RowMap ym;
  row_maps(views, 1, &ym);
  const bool vec = aligned16(y);
  if (y.dtype == DType::kBF16) {
    auto* p = static_cast<uint16_t*>(y.data);
    if (vec) {
      auto kernel = dequantize_kernel<uint16_t, true>;
      kernel<<<grid_for(kernel, bi.total), kThreads, 0, stream>>>(packed_codes, scales, scales_swizzled, p, ym, bi,
                                                                  scale);
    } else {
      auto kernel = dequantize_kernel<uint16_t, false>;
      kernel<<<grid_for(kernel, bi.total), kThreads, 0, stream>>>(packed_codes, scales, scales_swizzled, p, ym, bi,
                                                                  scale);
    }
  } else {
    auto* p = static_cast<float*>(y.data);
    if (vec) {
      auto kernel = dequantize_kernel<float, true>;
      kernel<<<grid_for(kernel, bi.total), kThreads, 0, stream>>>(packed_codes, scales, scales_swizzled, p, ym, bi,
                                                                  scale);
    } else {
      auto kernel = dequantize_kernel<float, false>;
      kernel<<<grid_for(kernel, bi.total), kThreads, 0, stream>>>(packed_codes, scales, scales_swizzled, p, ym, bi,
                                                                  scale);
    }
  }
  check_launch("dequantize", y);
}

}  // namespace vqad::kernels::nvfp4
