#include <cuda_bf16.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/fused/fused_block_kernels.h"

namespace vqad::kernels::fused {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxThreads = 1024;
// About this many row chunks (CTAs) over the whole [batch, len] for the column
// reductions: enough CTAs to fill an H200 several times, few partials to add.
constexpr int64_t kTargetChunks = 1024;
constexpr int kReduceTile = 32;

// ---- element access -------------------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to T, as fp32: what the composite's cast to T (and back) gives.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f(from_f<T>(v));
}

// V consecutive elements; V == 8 is one 16-byte access (bf16) or two (fp32).
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&v)[V]) {
  if constexpr (V == 8 && sizeof(T) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f(h[i]);
  } else if constexpr (V == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = to_f(a.x), v[1] = to_f(a.y), v[2] = to_f(a.z), v[3] = to_f(a.w);
    v[4] = to_f(b.x), v[5] = to_f(b.y), v[6] = to_f(b.z), v[7] = to_f(b.w);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = to_f(p[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&v)[V]) {
  if constexpr (V == 8 && sizeof(T) == 2) {
    uint4 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = from_f<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (V == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = from_f<T>(v[i]);
  }
}

// Sum of v over the block, in a fixed order (every thread gets the same bits).
// blockDim.x is a multiple of 32; smem holds 32 * N floats.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* smem) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) smem[i * 32 + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += smem[i * 32 + w];
    v[i] = s;
  }
  __syncthreads();  // smem may be reused right away
}

// Thread threadIdx.x owns the V-wide column vectors j = threadIdx.x + k * blockDim.x,
// k < VPT, of every row it touches.
__device__ __forceinline__ int vec_index(int k) { return threadIdx.x + k * blockDim.x; }

// ---- modulated layer norm -------------------------------------------------------------
template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    modulated_ln_fwd_kernel(const T* __restrict__ x, int64_t len, int cols, BatchVector scale, BatchVector shift,
                            float eps, T* __restrict__ out, float* __restrict__ mean_out,
                            float* __restrict__ rstd_out) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const int64_t b = row / len;
  const int nvec = cols / V;
  const int64_t base = row * cols;
  float v[VPT][V];
  float sum[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
      load_vec<T, V>(x + base + int64_t(j) * V, v[k]);
#pragma unroll
      for (int i = 0; i < V; ++i) sum[0] += v[k][i];
    }
  }
  block_sum<1>(sum, red);
  const float mean = sum[0] / float(cols);
  float sq[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    if (vec_index(k) < nvec) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = v[k][i] - mean;
        sq[0] += d * d;
      }
    }
  }
  block_sum<1>(sq, red);
  const float rstd = rsqrtf(sq[0] / float(cols) + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  const float* sc = scale.data + b * scale.batch_stride;
  const float* sh = shift.data + b * shift.batch_stride;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
      float y[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = j * V + i;
        const float n = __fmul_rn(__fsub_rn(v[k][i], mean), rstd);
        y[i] = __fadd_rn(__fmul_rn(n, __fadd_rn(1.0f, sc[c])), sh[c]);
      }
      store_vec<T, V>(out + base + int64_t(j) * V, y);
    }
  }
}

// CTA (chunk, b) handles rows [chunk * chunk_rows, ...) of batch b and writes its column
// sums to the partials (b * gridDim.x + chunk).
template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    modulated_ln_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, int64_t len, int cols,
                            int64_t chunk_rows, BatchVector scale, const float* __restrict__ mean,
                            const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ part_scale,
                            float* __restrict__ part_shift) {
  __shared__ float red[64];
  const int64_t chunk = blockIdx.x, nchunks = gridDim.x, b = blockIdx.y;
  const int64_t l0 = chunk * chunk_rows;
  const int64_t l1 = l0 + chunk_rows < len ? l0 + chunk_rows : len;
  const int nvec = cols / V;
  const float fcols = float(cols);
  const float inv_cols = 1.0f / fcols;
  const float* sc = scale.data + b * scale.batch_stride;
  float gain[VPT][V], acc_scale[VPT][V], acc_shift[VPT][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc_scale[k][i] = 0.0f;
      acc_shift[k][i] = 0.0f;
      gain[k][i] = j < nvec ? __fadd_rn(1.0f, sc[j * V + i]) : 0.0f;
    }
  }
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t row = b * len + l;
    const int64_t base = row * cols;
    const float mu = mean[row], rs = rstd[row];
    float n[VPT][V], dn[VPT][V];
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = vec_index(k);
      if (j < nvec) {
        float xv[V], gv[V];
        load_vec<T, V>(x + base + int64_t(j) * V, xv);
        load_vec<T, V>(grad + base + int64_t(j) * V, gv);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          n[k][i] = __fmul_rn(__fsub_rn(xv[i], mu), rs);
          dn[k][i] = __fmul_rn(gv[i], gain[k][i]);
          sums[0] += dn[k][i];
          sums[1] += dn[k][i] * n[k][i];
          acc_scale[k][i] += __fmul_rn(gv[i], n[k][i]);
          acc_shift[k][i] += gv[i];
        }
      }
    }
    block_sum<2>(sums, red);
    if (dx != nullptr) {
      // torch's layer-norm input gradient: rstd / C * (C * dn - sum(dn) - n * sum(dn * n)).
      const float term1 = inv_cols * rs;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = vec_index(k);
        if (j < nvec) {
          float y[V];
#pragma unroll
          for (int i = 0; i < V; ++i) y[i] = term1 * (fcols * dn[k][i] - sums[0] - n[k][i] * sums[1]);
          store_vec<T, V>(dx + base + int64_t(j) * V, y);
        }
      }
    }
  }
  const int64_t pbase = (b * nchunks + chunk) * cols;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        if (part_scale != nullptr) part_scale[pbase + j * V + i] = acc_scale[k][i];
        if (part_shift != nullptr) part_shift[pbase + j * V + i] = acc_shift[k][i];
      }
    }
  }
}

// ---- gated residual ---------------------------------------------------------------------
template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    gated_residual_fwd_kernel(const T* __restrict__ x, const T* __restrict__ a, int64_t len, int cols,
                              BatchVector gate, T* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const int64_t base = row * cols;
  const float* g = gate.data + (row / len) * gate.batch_stride;
  const int nvec = cols / V;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
      float xv[V], av[V], y[V];
      load_vec<T, V>(x + base + int64_t(j) * V, xv);
      load_vec<T, V>(a + base + int64_t(j) * V, av);
#pragma unroll
      for (int i = 0; i < V; ++i) y[i] = __fadd_rn(xv[i], __fmul_rn(av[i], g[j * V + i]));
      store_vec<T, V>(out + base + int64_t(j) * V, y);
    }
  }
}

template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    gated_residual_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ a, int64_t len, int cols,
                              int64_t chunk_rows, BatchVector gate, T* __restrict__ da, float* __restrict__ part) {
  const int64_t chunk = blockIdx.x, nchunks = gridDim.x, b = blockIdx.y;
  const int64_t l0 = chunk * chunk_rows;
  const int64_t l1 = l0 + chunk_rows < len ? l0 + chunk_rows : len;
  const int nvec = cols / V;
  const float* gp = gate.data + b * gate.batch_stride;
  float gt[VPT][V], acc[VPT][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc[k][i] = 0.0f;
      gt[k][i] = j < nvec ? gp[j * V + i] : 0.0f;
    }
  }
#pragma unroll 2
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t base = (b * len + l) * cols;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = vec_index(k);
      if (j < nvec) {
        float gv[V];
        load_vec<T, V>(grad + base + int64_t(j) * V, gv);
        if (da != nullptr) {
          float y[V];
#pragma unroll
          for (int i = 0; i < V; ++i) y[i] = __fmul_rn(gv[i], gt[k][i]);
          store_vec<T, V>(da + base + int64_t(j) * V, y);
        }
        if (part != nullptr) {
          float av[V];
          load_vec<T, V>(a + base + int64_t(j) * V, av);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[k][i] += __fmul_rn(gv[i], av[i]);
        }
      }
    }
  }
  if (part == nullptr) return;
  const int64_t pbase = (b * nchunks + chunk) * cols;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
#pragma unroll
      for (int i = 0; i < V; ++i) part[pbase + j * V + i] = acc[k][i];
    }
  }
}

// ---- RMSNorm (+ RoPE) ---------------------------------------------------------------------
// Rotates the pairs (2i, 2i+1) of y in place; column c0 = first column of y.
__device__ __forceinline__ void rope_pair_fwd(float& y0, float& y1, float cs, float sn) {
  const float a = y0, b = y1;
  y0 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
  y1 = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
}

template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_fwd_kernel(const T* __restrict__ x, int64_t len, int cols, const float* __restrict__ weight, float eps,
                        RopeTables rope, T* __restrict__ out, float* __restrict__ rstd_out) {
  static_assert(V % 2 == 0, "RMSNorm kernels work on column pairs");
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const int64_t l = row % len;
  const int nvec = cols / V;
  const int64_t base = row * cols;
  float v[VPT][V];
  float sq[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
      load_vec<T, V>(x + base + int64_t(j) * V, v[k]);
#pragma unroll
      for (int i = 0; i < V; ++i) sq[0] += __fmul_rn(v[k][i], v[k][i]);
    }
  }
  block_sum<1>(sq, red);
  const float r = rsqrtf(__fadd_rn(sq[0] / float(cols), eps));
  if (threadIdx.x == 0) rstd_out[row] = r;
  const int half = int(rope.head_dim / 2);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
      float y[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float nb = round_to<T>(__fmul_rn(v[k][i], r));
        y[i] = round_to<T>(__fmul_rn(nb, round_to<T>(weight[j * V + i])));
      }
      if (rope.cos != nullptr) {
#pragma unroll
        for (int i = 0; i < V; i += 2) {
          const int p = ((j * V + i) % int(rope.head_dim)) / 2;
          rope_pair_fwd(y[i], y[i + 1], rope.cos[l * half + p], rope.sin[l * half + p]);
        }
      }
      store_vec<T, V>(out + base + int64_t(j) * V, y);
    }
  }
}

template <typename T, int V, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, int64_t len, int cols,
                        int64_t chunk_rows, const float* __restrict__ weight, RopeTables rope,
                        const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ part) {
  static_assert(V % 2 == 0, "RMSNorm kernels work on column pairs");
  __shared__ float red[32];
  const int64_t chunk = blockIdx.x, nchunks = gridDim.x, b = blockIdx.y;
  const int64_t l0 = chunk * chunk_rows;
  const int64_t l1 = l0 + chunk_rows < len ? l0 + chunk_rows : len;
  const int nvec = cols / V;
  const float fcols = float(cols);
  const int half = int(rope.head_dim / 2);
  float w[VPT][V], acc[VPT][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc[k][i] = 0.0f;
      w[k][i] = j < nvec ? round_to<T>(weight[j * V + i]) : 0.0f;
    }
  }
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t row = b * len + l;
    const int64_t base = row * cols;
    const float r = rstd[row];
    float xv[VPT][V], dn[VPT][V];
    float s[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = vec_index(k);
      if (j < nvec) {
        float dy[V];
        load_vec<T, V>(x + base + int64_t(j) * V, xv[k]);
        load_vec<T, V>(grad + base + int64_t(j) * V, dy);
        if (rope.cos != nullptr) {
          // Transposed rotation; the gradient of the composite's cast to fp32 rounds to T.
#pragma unroll
          for (int i = 0; i < V; i += 2) {
            const int p = ((j * V + i) % int(rope.head_dim)) / 2;
            const float cs = rope.cos[l * half + p], sn = rope.sin[l * half + p];
            const float g0 = dy[i], g1 = dy[i + 1];
            dy[i] = round_to<T>(__fadd_rn(__fmul_rn(g0, cs), __fmul_rn(g1, sn)));
            dy[i + 1] = round_to<T>(__fadd_rn(__fmul_rn(-g0, sn), __fmul_rn(g1, cs)));
          }
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float nb = round_to<T>(__fmul_rn(xv[k][i], r));
          acc[k][i] += round_to<T>(__fmul_rn(dy[i], nb));
          dn[k][i] = round_to<T>(__fmul_rn(dy[i], w[k][i]));
          s[0] += dn[k][i] * xv[k][i];
        }
      }
    }
    block_sum<1>(s, red);
    if (dx != nullptr) {
      // d/dx of x * rsqrt(mean(x^2) + eps): dn * r - x * r^3 * sum(dn * x) / C.
      const float coef = r * r * r * s[0] / fcols;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int j = vec_index(k);
        if (j < nvec) {
          float y[V];
#pragma unroll
          for (int i = 0; i < V; ++i) y[i] = dn[k][i] * r - xv[k][i] * coef;
          store_vec<T, V>(dx + base + int64_t(j) * V, y);
        }
      }
    }
  }
  if (part == nullptr) return;
  const int64_t pbase = (b * nchunks + chunk) * cols;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int j = vec_index(k);
    if (j < nvec) {
#pragma unroll
      for (int i = 0; i < V; ++i) part[pbase + j * V + i] = acc[k][i];
    }
  }
}

// ---- partial reduction ---------------------------------------------------------------------
// out[b, c] = sum over j < nchunks of part[b, j, c], in a fixed order; optionally rounded
// to bf16 (the composite's bf16 sum).
__global__ void __launch_bounds__(kReduceTile* kReduceTile)
    reduce_partials_kernel(const float* __restrict__ part, int64_t nchunks, int cols, bool round_bf16,
                           float* __restrict__ out) {
  __shared__ float tile[kReduceTile][kReduceTile + 1];
  const int c = blockIdx.x * kReduceTile + threadIdx.x;
  const int64_t b = blockIdx.y;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t j = threadIdx.y; j < nchunks; j += kReduceTile) s += part[(b * nchunks + j) * cols + c];
  }
  tile[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.0f;
    for (int k = 0; k < kReduceTile; ++k) t += tile[k][threadIdx.x];
    out[b * cols + c] = round_bf16 ? round_to<bf16>(t) : t;
  }
}

// ---- host side ---------------------------------------------------------------------------
struct RowConfig {
  int vec = 1, vpt = 1, threads = 32;
};

constexpr int64_t kMaxVectorsPerRow = int64_t(kMaxThreads) * 4;

// Columns per vector: 8 when cols allows it, else 2 (paired kernels) or 1.
int vector_width(int64_t cols, bool paired) { return cols % 8 == 0 ? 8 : (paired ? 2 : 1); }

RowConfig row_config(int64_t cols, bool paired, const char* op) {
  std::string why;
  if (!supports_cols(cols, paired, &why)) throw std::invalid_argument(std::string(op) + ": " + why);
  RowConfig rc;
  rc.vec = vector_width(cols, paired);
  const int64_t nvec = cols / rc.vec;
  rc.vpt = rc.vec != 8 ? 4 : nvec <= kMaxThreads ? 1 : nvec <= 2 * kMaxThreads ? 2 : 4;
  const int64_t per = (nvec + rc.vpt - 1) / rc.vpt;
  rc.threads = int((per + 31) / 32 * 32);
  return rc;
}

void check_shape(const RowShape& s, const char* op) {
  if (s.batch < 0 || s.len < 0 || s.cols <= 0) {
    throw std::invalid_argument(std::string(op) + ": bad shape [" + std::to_string(s.batch) + ", " +
                                std::to_string(s.len) + ", " + std::to_string(s.cols) + "]");
  }
  if (s.batch > 65535 || s.batch * s.len > int64_t(INT32_MAX)) {
    throw std::invalid_argument(std::string(op) + ": shape [" + std::to_string(s.batch) + ", " +
                                std::to_string(s.len) + ", " + std::to_string(s.cols) +
                                "] exceeds the launch limits (batch <= 65535, batch * len < 2^31)");
  }
}

void check_aligned(const void* p, const char* op, const char* what) {
  if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    throw std::invalid_argument(std::string(op) + ": " + what + " is not 16-byte aligned");
  }
}

int64_t chunk_rows(const RowShape& s) {
  const int64_t rows = s.batch * s.len;
  const int64_t r = (rows + kTargetChunks - 1) / kTargetChunks;
  return r < 1 ? 1 : r;
}

void reduce_partials(const float* part, int64_t batch, int64_t nchunks, int64_t cols, bool round_bf16, float* out,
                     cudaStream_t stream, const char* op) {
  const dim3 grid(unsigned((cols + kReduceTile - 1) / kReduceTile), unsigned(batch));
  reduce_partials_kernel<<<grid, dim3(kReduceTile, kReduceTile), 0, stream>>>(part, nchunks, int(cols), round_bf16,
                                                                               out);
  VQAD_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

// Instantiates BODY with T, V and VPT bound to the runtime choice.
#define VQAD_FUSED_DISPATCH_V(rc, FALLBACK_V, ...)      \
  if (rc.vec == 8 && rc.vpt == 1) {                     \
    constexpr int V = 8, VPT = 1;                       \
    __VA_ARGS__;                                        \
  } else if (rc.vec == 8 && rc.vpt == 2) {              \
    constexpr int V = 8, VPT = 2;                       \
    __VA_ARGS__;                                        \
  } else if (rc.vec == 8) {                             \
    constexpr int V = 8, VPT = 4;                       \
    __VA_ARGS__;                                        \
  } else {                                              \
    constexpr int V = FALLBACK_V, VPT = 4;              \
    __VA_ARGS__;                                        \
  }
#define VQAD_FUSED_DISPATCH(type, rc, FALLBACK_V, ...)  \
  do {                                                  \
    if (type == ElemType::kBF16) {                      \
      using T = bf16;                                   \
      VQAD_FUSED_DISPATCH_V(rc, FALLBACK_V, __VA_ARGS__) \
    } else {                                            \
      using T = float;                                  \
      VQAD_FUSED_DISPATCH_V(rc, FALLBACK_V, __VA_ARGS__) \
    }                                                   \
  } while (0)

bool kernels_available(int device, std::string* why) {
  return kernel_family_available("fused block", reinterpret_cast<const void*>(modulated_ln_fwd_kernel<bf16, 8, 1>), device,
                                 why);
}

bool supports_cols(int64_t cols, bool paired, std::string* why) {
  auto refuse = [&](const std::string& m) {
    if (why) *why = m;
    return false;
  };
  if (cols <= 0) return refuse("rows need at least one column, found " + std::to_string(cols));
  if (paired && cols % 2 != 0) {
    return refuse("the kernel works on column pairs and needs an even number of columns, found " +
                  std::to_string(cols));
  }
  const int vec = vector_width(cols, paired);
  if (cols / vec > kMaxVectorsPerRow) {
    return refuse("rows of " + std::to_string(cols) + " columns exceed the kernel limit of " +
                  std::to_string(kMaxVectorsPerRow * vec) + " (" +
                  (vec == 8 ? "largest supported" : "columns not a multiple of 8; up to 32768 when they are") + ")");
  }
  return true;
}

int64_t reduction_chunks(const RowShape& s) {
  if (s.len <= 0) return 0;
  const int64_t r = chunk_rows(s);
  return (s.len + r - 1) / r;
}

size_t partials_floats(const RowShape& s) { return size_t(s.batch) * size_t(reduction_chunks(s)) * size_t(s.cols); }

void launch_modulated_layer_norm_fwd(const void* x, ElemType type, const RowShape& s, BatchVector scale,
                                     BatchVector shift, float eps, void* out, float* mean, float* rstd,
                                     cudaStream_t stream) {
  constexpr const char* op = "modulated_layer_norm forward";
  check_shape(s, op);
  const int64_t rows = s.batch * s.len;
  if (rows == 0) return;
  const RowConfig rc = row_config(s.cols, false, op);
  if (rc.vec == 8) check_aligned(x, op, "x"), check_aligned(out, op, "out");
  const int cols = int(s.cols);
  VQAD_FUSED_DISPATCH(type, rc, 1,
                      modulated_ln_fwd_kernel<T, V, VPT><<<unsigned(rows), rc.threads, 0, stream>>>(
                          static_cast<const T*>(x), s.len, cols, scale, shift, eps, static_cast<T*>(out), mean,
                          rstd));
  VQAD_CUDA_CHECK_LAUNCH("modulated_ln_fwd_kernel");
}

void launch_modulated_layer_norm_bwd(const void* grad, const void* x, ElemType type, const RowShape& s,
                                     BatchVector scale, const float* mean, const float* rstd, void* dx,
                                     float* dscale, float* dshift, float* workspace, cudaStream_t stream) {
  constexpr const char* op = "modulated_layer_norm backward";
  check_shape(s, op);
  const int64_t cols = s.cols;
  if (s.batch * s.len == 0) {
    if (dscale) VQAD_CUDA_CHECK(cudaMemsetAsync(dscale, 0, size_t(s.batch * cols) * sizeof(float), stream));
    if (dshift) VQAD_CUDA_CHECK(cudaMemsetAsync(dshift, 0, size_t(s.batch * cols) * sizeof(float), stream));
    return;
  }
  const RowConfig rc = row_config(cols, false, op);
  if (rc.vec == 8) check_aligned(x, op, "x"), check_aligned(grad, op, "grad"), check_aligned(dx, op, "dx");
  const int64_t nchunks = reduction_chunks(s);
  float* part_scale = dscale ? workspace : nullptr;
  float* part_shift = dshift ? workspace + partials_floats(s) : nullptr;
  const dim3 grid(unsigned(nchunks), unsigned(s.batch));
  VQAD_FUSED_DISPATCH(type, rc, 1,
                      modulated_ln_bwd_kernel<T, V, VPT><<<grid, rc.threads, 0, stream>>>(
                          static_cast<const T*>(grad), static_cast<const T*>(x), s.len, int(cols), chunk_rows(s),
                          scale, mean, rstd, static_cast<T*>(dx), part_scale, part_shift));
  VQAD_CUDA_CHECK_LAUNCH("modulated_ln_bwd_kernel");
  if (dscale) reduce_partials(part_scale, s.batch, nchunks, cols, false, dscale, stream, "reduce dscale");
  if (dshift) reduce_partials(part_shift, s.batch, nchunks, cols, false, dshift, stream, "reduce dshift");
}

void launch_gated_residual_fwd(const void* x, const void* a, ElemType type, const RowShape& s, BatchVector gate,
                               void* out, cudaStream_t stream) {
  constexpr const char* op = "gated_residual forward";
  check_shape(s, op);
  const int64_t rows = s.batch * s.len;
  if (rows == 0) return;
  const RowConfig rc = row_config(s.cols, false, op);
  if (rc.vec == 8) check_aligned(x, op, "x"), check_aligned(a, op, "a"), check_aligned(out, op, "out");
  VQAD_FUSED_DISPATCH(type, rc, 1,
                      gated_residual_fwd_kernel<T, V, VPT><<<unsigned(rows), rc.threads, 0, stream>>>(
                          static_cast<const T*>(x), static_cast<const T*>(a), s.len, int(s.cols), gate,
                          static_cast<T*>(out)));
  VQAD_CUDA_CHECK_LAUNCH("gated_residual_fwd_kernel");
}

void launch_gated_residual_bwd(const void* grad, const void* a, ElemType type, const RowShape& s, BatchVector gate,
                               void* da, float* dgate, float* workspace, cudaStream_t stream) {
  constexpr const char* op = "gated_residual backward";
  check_shape(s, op);
  if (s.batch * s.len == 0) {
    if (dgate) VQAD_CUDA_CHECK(cudaMemsetAsync(dgate, 0, size_t(s.batch * s.cols) * sizeof(float), stream));
    return;
  }
  if (da == nullptr && dgate == nullptr) return;
  const RowConfig rc = row_config(s.cols, false, op);
  if (rc.vec == 8) check_aligned(grad, op, "grad"), check_aligned(a, op, "a"), check_aligned(da, op, "da");
  const int64_t nchunks = reduction_chunks(s);
  float* part = dgate ? workspace : nullptr;
  const dim3 grid(unsigned(nchunks), unsigned(s.batch));
  VQAD_FUSED_DISPATCH(type, rc, 1,
                      gated_residual_bwd_kernel<T, V, VPT><<<grid, rc.threads, 0, stream>>>(
                          static_cast<const T*>(grad), static_cast<const T*>(a), s.len, int(s.cols), chunk_rows(s),
                          gate, static_cast<T*>(da), part));
  VQAD_CUDA_CHECK_LAUNCH("gated_residual_bwd_kernel");
  if (dgate) reduce_partials(part, s.batch, nchunks, s.cols, false, dgate, stream, "reduce dgate");
}

void launch_rms_norm_fwd(const void* x, ElemType type, const RowShape& s, const float* weight, float eps,
                         RopeTables rope, void* out, float* rstd, cudaStream_t stream) {
  constexpr const char* op = "rms_norm forward";
  check_shape(s, op);
  const int64_t rows = s.batch * s.len;
  if (rows == 0) return;
  if (rope.cos != nullptr && (rope.head_dim <= 0 || rope.head_dim % 2 != 0 || s.cols % rope.head_dim != 0)) {
    throw std::invalid_argument(std::string(op) + ": head_dim " + std::to_string(rope.head_dim) +
                                " must be even and divide cols " + std::to_string(s.cols));
  }
  const RowConfig rc = row_config(s.cols, true, op);
  if (rc.vec == 8) check_aligned(x, op, "x"), check_aligned(out, op, "out");
  VQAD_FUSED_DISPATCH(type, rc, 2,
                      rms_norm_fwd_kernel<T, V, VPT><<<unsigned(rows), rc.threads, 0, stream>>>(
                          static_cast<const T*>(x), s.len, int(s.cols), weight, eps, rope, static_cast<T*>(out),
                          rstd));
  VQAD_CUDA_CHECK_LAUNCH("rms_norm_fwd_kernel");
}

void launch_rms_norm_bwd(const void* grad, const void* x, ElemType type, const RowShape& s, const float* weight,
                         RopeTables rope, const float* rstd, void* dx, float* dweight, float* workspace,
                         cudaStream_t stream) {
  constexpr const char* op = "rms_norm backward";
  check_shape(s, op);
  if (s.batch * s.len == 0) {
    if (dweight) VQAD_CUDA_CHECK(cudaMemsetAsync(dweight, 0, size_t(s.cols) * sizeof(float), stream));
    return;
  }
  if (rope.cos != nullptr && (rope.head_dim <= 0 || rope.head_dim % 2 != 0 || s.cols % rope.head_dim != 0)) {
    throw std::invalid_argument(std::string(op) + ": head_dim " + std::to_string(rope.head_dim) +
                                " must be even and divide cols " + std::to_string(s.cols));
  }
  const RowConfig rc = row_config(s.cols, true, op);
  if (rc.vec == 8) check_aligned(x, op, "x"), check_aligned(grad, op, "grad"), check_aligned(dx, op, "dx");
  const int64_t nchunks = reduction_chunks(s);
  float* part = dweight ? workspace : nullptr;
  const dim3 grid(unsigned(nchunks), unsigned(s.batch));
  VQAD_FUSED_DISPATCH(type, rc, 2,
                      rms_norm_bwd_kernel<T, V, VPT><<<grid, rc.threads, 0, stream>>>(
                          static_cast<const T*>(grad), static_cast<const T*>(x), s.len, int(s.cols), chunk_rows(s),
                          weight, rope, rstd, static_cast<T*>(dx), part));
  VQAD_CUDA_CHECK_LAUNCH("rms_norm_bwd_kernel");
  // Every batch's chunks are one list of partials: [1, batch * chunks, cols].
  if (dweight) {
    reduce_partials(part, 1, s.batch * nchunks, s.cols, type == ElemType::kBF16, dweight, stream, "reduce dweight");
  }
}

}  // namespace vqad::kernels::fused
