// NVFP4 CUDA kernels. Work split: two threads per 16-element block, eight
// elements each (one 16-byte load for BF16, two for FP32), the block amax
// combined with one shuffle. Memory bound: no shared memory, grid-stride loops
// over a flat index of 8-element chunks. The arithmetic is nvfp4_math.h, the
// same code the CPU tests check against the scalar reference.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"
#include "vqad/kernels/nvfp4/nvfp4_math.h"

namespace vqad::kernels::nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 8;  // elements per thread

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

// Flat chunk index -> (row, first column); 32-bit fast path when it fits.
struct ChunkIndex {
  FastDiv div32;
  int64_t chunks_per_row = 1;
  bool use32 = true;
};

__device__ __forceinline__ void split_chunk(const ChunkIndex& ci, int64_t t, int64_t& row,
                                            int64_t& col) {
  if (ci.use32) {
    const uint32_t r = ci.div32.div(static_cast<uint32_t>(t));
    row = r;
    col = (t - static_cast<int64_t>(r) * ci.chunks_per_row) * kChunk;
  } else {
    row = t / ci.chunks_per_row;
    col = (t - row * ci.chunks_per_row) * kChunk;
  }
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t b) { return u2f(b << 16); }

template <typename T, bool kVec>
__device__ __forceinline__ void load8(const T* p, float (&v)[kChunk]);

template <>
__device__ __forceinline__ void load8<uint16_t, true>(const uint16_t* p, float (&v)[kChunk]) {
  const uint4 w = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = u2f(words[i] << 16);
    v[2 * i + 1] = u2f(words[i] & 0xFFFF0000u);
  }
}
template <>
__device__ __forceinline__ void load8<uint16_t, false>(const uint16_t* p, float (&v)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = bf16_bits_to_float(__ldg(p + i));
}
template <>
__device__ __forceinline__ void load8<float, true>(const float* p, float (&v)[kChunk]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <>
__device__ __forceinline__ void load8<float, false>(const float* p, float (&v)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = __ldg(p + i);
}

__device__ __forceinline__ uint32_t bf16_rn_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

template <typename T, bool kVec>
__device__ __forceinline__ void store8(T* p, const float (&v)[kChunk]);

template <>
__device__ __forceinline__ void store8<uint16_t, true>(uint16_t* p, const float (&v)[kChunk]) {
  uint4 w;
  w.x = bf16_rn_bits(v[0]) | (bf16_rn_bits(v[1]) << 16);
  w.y = bf16_rn_bits(v[2]) | (bf16_rn_bits(v[3]) << 16);
  w.z = bf16_rn_bits(v[4]) | (bf16_rn_bits(v[5]) << 16);
  w.w = bf16_rn_bits(v[6]) | (bf16_rn_bits(v[7]) << 16);
  *reinterpret_cast<uint4*>(p) = w;
}
template <>
__device__ __forceinline__ void store8<uint16_t, false>(uint16_t* p, const float (&v)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) p[i] = static_cast<uint16_t>(bf16_rn_bits(v[i]));
}
template <>
__device__ __forceinline__ void store8<float, true>(float* p, const float (&v)[kChunk]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <>
__device__ __forceinline__ void store8<float, false>(float* p, const float (&v)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) p[i] = v[i];
}

__device__ __forceinline__ float resolve_scale(const EncodeScale& s) {
  return s.amax_device ? encode_scale_from_amax(*s.amax_device) : s.value;
}

__device__ __forceinline__ uint32_t chunk_amax_bits(const float (&v)[kChunk]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) m = max(m, abs_bits(v[i]));
  return m;
}

// --- kernels ---------------------------------------------------------------------------
// Loops run over block-uniform bases so both threads of a 16-block (t, t^1) are
// always in the same iteration and the full-warp shuffle is well defined.

template <typename TIn, typename TOut, bool kVec>
__global__ void __launch_bounds__(kThreads)
    fake_quantize_kernel(const TIn* __restrict__ x, TOut* __restrict__ y, RowMap xm, RowMap ym,
                         ChunkIndex ci, int64_t total, EncodeScale sc) {
  const float s_enc = resolve_scale(sc);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < total; base += step) {
    const int64_t t = base + threadIdx.x;
    const bool active = t < total;
    float v[kChunk];
    int64_t row = 0, col = 0;
    uint32_t m = 0;
    if (active) {
      split_chunk(ci, t, row, col);
      load8<TIn, kVec>(x + row_offset(xm, row) + col, v);
      m = chunk_amax_bits(v);
    }
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    if (active) {
      const BlockScale b = block_scale(m, s_enc);
      float out[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) out[i] = code_value(element_code(v[i], b), b);
      store8<TOut, kVec>(y + row_offset(ym, row) + col, out);
    }
  }
}

template <typename TIn, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const TIn* __restrict__ x, RowMap xm, ChunkIndex ci, int64_t total,
                    EncodeScale sc, uint8_t* __restrict__ packed, uint8_t* __restrict__ scales,
                    uint8_t* __restrict__ swizzled, int64_t scale_cols) {
  const float s_enc = resolve_scale(sc);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t col_tiles = (scale_cols + 3) / 4;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < total; base += step) {
    const int64_t t = base + threadIdx.x;
    const bool active = t < total;
    float v[kChunk];
    int64_t row = 0, col = 0;
    uint32_t m = 0;
    if (active) {
      split_chunk(ci, t, row, col);
      load8<TIn, kVec>(x + row_offset(xm, row) + col, v);
      m = chunk_amax_bits(v);
    }
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    if (active) {
      const BlockScale b = block_scale(m, s_enc);
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) word |= element_code(v[i], b) << (4 * i);
      if (packed) reinterpret_cast<uint32_t*>(packed)[t] = word;
      if ((t & 1) == 0) {
        const int64_t k = col / 16;
        if (scales) scales[t >> 1] = static_cast<uint8_t>(b.bits);
        if (swizzled) {
          const int64_t off = ((row / 128) * col_tiles + k / 4) * 512 + (row % 32) * 16 +
                              ((row % 128) / 32) * 4 + k % 4;
          swizzled[off] = static_cast<uint8_t>(b.bits);
        }
      }
    }
  }
}

template <typename TOut, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales,
                      bool swizzled, int64_t scale_cols, TOut* __restrict__ y, RowMap ym,
                      ChunkIndex ci, int64_t total, EncodeScale sc) {
  const float s_enc = resolve_scale(sc);
  const float s_dec = div_rn(1.0f, s_enc);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t col_tiles = (scale_cols + 3) / 4;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < total;
       t += step) {
    int64_t row, col;
    split_chunk(ci, t, row, col);
    const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed) + t);
    const int64_t k = col / 16;
    const int64_t soff = swizzled ? ((row / 128) * col_tiles + k / 4) * 512 + (row % 32) * 16 +
                                        ((row % 128) / 32) * 4 + k % 4
                                  : (t >> 1);
    BlockScale b;
    b.bits = __ldg(scales + soff);
    b.S = e4m3_decode(b.bits);
    b.s_dec = s_dec;
    b.nan = b.S != b.S;
    b.zero = b.S == 0.0f;
    b.inv = 0.0f;
    float out[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) out[i] = code_value((word >> (4 * i)) & 0xFu, b);
    store8<TOut, kVec>(y + row_offset(ym, row) + col, out);
  }
}

template <typename TIn, bool kVec>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const TIn* __restrict__ x, RowMap xm, ChunkIndex ci, int64_t total,
                uint32_t* __restrict__ out) {
  __shared__ uint32_t warp_max[kThreads / 32];
  uint32_t m = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < total;
       t += step) {
    int64_t row, col;
    split_chunk(ci, t, row, col);
    float v[kChunk];
    load8<TIn, kVec>(x + row_offset(xm, row) + col, v);
    m = max(m, chunk_amax_bits(v));
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

ChunkIndex chunk_index(int64_t cols, int64_t total) {
  ChunkIndex ci;
  ci.chunks_per_row = cols / kChunk;
  ci.use32 = total < (int64_t{1} << 32) && ci.chunks_per_row < (int64_t{1} << 31);
  if (ci.use32) ci.div32 = FastDiv(static_cast<uint32_t>(ci.chunks_per_row));
  return ci;
}

int grid_for(int64_t total) {
  int dev = 0, sms = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&dev));
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t want = (total + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * (2048 / kThreads);
  return static_cast<int>(want < cap ? want : cap);
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

void launch_amax(const TensorView& x, float* amax_out, cudaStream_t stream) {
  check_view(x, "amax", "input");
  VQAD_CHECK(amax_out != nullptr, "nvfp4 amax: output is a null pointer");
  VQAD_CUDA_CHECK(cudaMemsetAsync(amax_out, 0, sizeof(float), stream));
  const int64_t total = x.rows() * x.cols() / kChunk;
  if (total == 0) return;
  const TensorView* views[1] = {&x};
  RowMap xm;
  row_maps(views, 1, &xm);
  const ChunkIndex ci = chunk_index(x.cols(), total);
  const int grid = grid_for(total);
  uint32_t* out = reinterpret_cast<uint32_t*>(amax_out);
  const bool vec = aligned16(x);
  if (x.dtype == DType::kBF16) {
    const auto* p = static_cast<const uint16_t*>(x.data);
    if (vec) amax_kernel<uint16_t, true><<<grid, kThreads, 0, stream>>>(p, xm, ci, total, out);
    else amax_kernel<uint16_t, false><<<grid, kThreads, 0, stream>>>(p, xm, ci, total, out);
  } else {
    const auto* p = static_cast<const float*>(x.data);
    if (vec) amax_kernel<float, true><<<grid, kThreads, 0, stream>>>(p, xm, ci, total, out);
    else amax_kernel<float, false><<<grid, kThreads, 0, stream>>>(p, xm, ci, total, out);
  }
  check_launch("amax", x);
}

namespace {
template <typename TIn, typename TOut>
void fake_quantize_typed(const TensorView& x, const TensorView& y, const RowMap& xm,
                         const RowMap& ym, const ChunkIndex& ci, int64_t total, EncodeScale sc,
                         bool vec, cudaStream_t stream) {
  const int grid = grid_for(total);
  const auto* px = static_cast<const TIn*>(x.data);
  auto* py = static_cast<TOut*>(y.data);
  if (vec) {
    fake_quantize_kernel<TIn, TOut, true><<<grid, kThreads, 0, stream>>>(px, py, xm, ym, ci, total, sc);
  } else {
    fake_quantize_kernel<TIn, TOut, false><<<grid, kThreads, 0, stream>>>(px, py, xm, ym, ci, total, sc);
  }
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
  const int64_t total = x.rows() * x.cols() / kChunk;
  if (total == 0) return;
  const TensorView* views[2] = {&x, &y};
  RowMap maps[2];
  row_maps(views, 2, maps);
  const ChunkIndex ci = chunk_index(x.cols(), total);
  const bool vec = aligned16(x) && aligned16(y);
  const bool in_bf16 = x.dtype == DType::kBF16, out_bf16 = y.dtype == DType::kBF16;
  if (in_bf16 && out_bf16) {
    fake_quantize_typed<uint16_t, uint16_t>(x, y, maps[0], maps[1], ci, total, scale, vec, stream);
  } else if (in_bf16) {
    fake_quantize_typed<uint16_t, float>(x, y, maps[0], maps[1], ci, total, scale, vec, stream);
  } else if (out_bf16) {
    fake_quantize_typed<float, uint16_t>(x, y, maps[0], maps[1], ci, total, scale, vec, stream);
  } else {
    fake_quantize_typed<float, float>(x, y, maps[0], maps[1], ci, total, scale, vec, stream);
  }
  check_launch("fake_quantize", x);
}

void launch_quantize(const TensorView& x, EncodeScale scale, const QuantizeOutputs& out,
                     cudaStream_t stream) {
  check_view(x, "quantize", "input");
  VQAD_CHECK(reinterpret_cast<uintptr_t>(out.packed_codes) % 4 == 0,
             "nvfp4 quantize: packed codes output must be 4-byte aligned");
  const int64_t rows = x.rows(), cols = x.cols(), scale_cols = cols / 16;
  const int64_t total = rows * cols / kChunk;
  if (out.scales_swizzled) {
    const int64_t sz = swizzled_size(rows, scale_cols);
    // Pad bytes must read as zero scales; the kernel writes only real entries.
    if (sz != rows * scale_cols) VQAD_CUDA_CHECK(cudaMemsetAsync(out.scales_swizzled, 0, sz, stream));
  }
  if (total == 0) return;
  const TensorView* views[1] = {&x};
  RowMap xm;
  row_maps(views, 1, &xm);
  const ChunkIndex ci = chunk_index(cols, total);
  const int grid = grid_for(total);
  const bool vec = aligned16(x);
  if (x.dtype == DType::kBF16) {
    const auto* p = static_cast<const uint16_t*>(x.data);
    if (vec) {
      quantize_kernel<uint16_t, true><<<grid, kThreads, 0, stream>>>(
          p, xm, ci, total, scale, out.packed_codes, out.scales_linear, out.scales_swizzled, scale_cols);
    } else {
      quantize_kernel<uint16_t, false><<<grid, kThreads, 0, stream>>>(
          p, xm, ci, total, scale, out.packed_codes, out.scales_linear, out.scales_swizzled, scale_cols);
    }
  } else {
    const auto* p = static_cast<const float*>(x.data);
    if (vec) {
      quantize_kernel<float, true><<<grid, kThreads, 0, stream>>>(
          p, xm, ci, total, scale, out.packed_codes, out.scales_linear, out.scales_swizzled, scale_cols);
    } else {
      quantize_kernel<float, false><<<grid, kThreads, 0, stream>>>(
          p, xm, ci, total, scale, out.packed_codes, out.scales_linear, out.scales_swizzled, scale_cols);
    }
  }
  check_launch("quantize", x);
}

void launch_dequantize(const uint8_t* packed_codes, const uint8_t* scales, bool scales_swizzled,
                       EncodeScale scale, const TensorView& y, cudaStream_t stream) {
  check_view(y, "dequantize", "output");
  const int64_t rows = y.rows(), cols = y.cols(), scale_cols = cols / 16;
  const int64_t total = rows * cols / kChunk;
  if (total == 0) return;
  VQAD_CHECK(packed_codes && scales, "nvfp4 dequantize: null codes or scales for output ",
             y.shape_str());
  VQAD_CHECK(reinterpret_cast<uintptr_t>(packed_codes) % 4 == 0,
             "nvfp4 dequantize: packed codes must be 4-byte aligned");
  const TensorView* views[1] = {&y};
  RowMap ym;
  row_maps(views, 1, &ym);
  const ChunkIndex ci = chunk_index(cols, total);
  const int grid = grid_for(total);
  const bool vec = aligned16(y);
  if (y.dtype == DType::kBF16) {
    auto* p = static_cast<uint16_t*>(y.data);
    if (vec) {
      dequantize_kernel<uint16_t, true><<<grid, kThreads, 0, stream>>>(
          packed_codes, scales, scales_swizzled, scale_cols, p, ym, ci, total, scale);
    } else {
      dequantize_kernel<uint16_t, false><<<grid, kThreads, 0, stream>>>(
          packed_codes, scales, scales_swizzled, scale_cols, p, ym, ci, total, scale);
    }
  } else {
    auto* p = static_cast<float*>(y.data);
    if (vec) {
      dequantize_kernel<float, true><<<grid, kThreads, 0, stream>>>(
          packed_codes, scales, scales_swizzled, scale_cols, p, ym, ci, total, scale);
    } else {
      dequantize_kernel<float, false><<<grid, kThreads, 0, stream>>>(
          packed_codes, scales, scales_swizzled, scale_cols, p, ym, ci, total, scale);
    }
  }
  check_launch("dequantize", y);
}

}  // namespace vqad::kernels::nvfp4
