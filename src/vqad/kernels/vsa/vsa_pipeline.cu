// VSA pipeline (numerics/vsa_ref.h steps 1-5 and the backward): tiling gather with the
// NVFP4 fake quantization of the fine-stage operands and, in the same pass, the coarse
// pooling (tile_pool_kernel; the backward's dO tiling with d out_c), coarse scores /
// softmax / out_c, top-k / top-p selection, the inverse lists, the gated combine and
// the coarse backward, plus the orchestration of vsa_forward / vsa_backward.
//
// The small stages are plain fp32 CUDA code that follows the reference's summation
// orders (sums over slots in slot order, dot products over d in order, row sums of the
// softmax in index order, IEEE-rounded mul / add / div intrinsics so nvcc cannot contract
// them), which keeps the coarse scores, and so the selection, equal to the reference's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "vqad/core/error.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/vsa/vsa_internal.cuh"
#include "vqad/kernels/vsa/vsa_kernels.h"

namespace vqad::kernels::vsa {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kD = kVsaHeadDim;
constexpr int kBT = kVsaBlockTokens;

// --- NVFP4 fake quantization of 16 channels (launch_fake_quant_qkv's arithmetic) ---------
using nvfp4_device::e2m1_rne_magnitude;
using nvfp4_device::e4m3_rn_satfinite;
__device__ __forceinline__ void fake_quantize16(float* x) {
  float amax = 0.0f;
  bool has_nan = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    has_nan |= (x[i] != x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  const float S = e4m3_rn_satfinite(__fdiv_rn(amax, 6.0f));
  const float inv = __frcp_rn(S);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = copysignf(e2m1_rne_magnitude(fabsf(x[i]) * inv) * S, x[i]);
    x[i] = has_nan ? __int_as_float(0x7fc00000) : (S == 0.0f ? 0.0f : y);
  }
}

__device__ __forceinline__ void unpack8(const uint4& v, float* x) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float* y) {
  uint4 out;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
  return out;
}
__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// Eight consecutive fp32 values from a 32-byte aligned address (two 16-byte loads).
__device__ __forceinline__ void load8f(const float* p, float* x) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// Tiling and coarse pooling in one pass over a raster tensor, one block of kD threads per
// (cube, h, b). The cube's slots (raster rows through slot_to_token; zeros for padding)
// are read once, 16 channels per thread and step, and written to the contiguous tiled
// output (NVFP4 fake quantization per 16 channels when `quantize`, bit-exact with
// launch_fake_quant_qkv). With pooling they also go to shared memory, and thread d then
// sums channel d over the cube's valid slots (the first cube_tokens[cube]) in slot order,
// an fp32 chain with IEEE add (the reference's order):
//   Pool::kMean    pool = bf16(sum / count) of src (the coarse means q_c, k_c, v_c);
//   Pool::kMulSum  pool = the sum of src * mul (fp32; d out_c = pool of dO * gate).
enum class Pool { kNone, kMean, kMulSum };
template <Pool POOL>
__global__ void __launch_bounds__(kD) tile_pool_kernel(const bf16* src, int64_t sb, int64_t sl, int64_t sh,
                                                       const bf16* mul, int64_t mb, int64_t ml, int64_t mh, bf16* dst,
                                                       const int32_t* slot_to_token, const int32_t* cube_tokens, int H,
                                                       int P, int nc, int cube_slots, bool quantize, float* pool) {
  extern __shared__ uint4 s_rows[];  // kMean: [cube_slots][kD] src; kMulSum: then [cube_slots][kD] mul
  constexpr int kGroups = kD / 16;   // 16-channel groups per row
  const int cube = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  const int32_t* slots = slot_to_token + static_cast<int64_t>(cube) * cube_slots;
  bf16* out = dst + (bh * P + static_cast<int64_t>(cube) * cube_slots) * kD;
  for (int gi = t; gi < cube_slots * kGroups; gi += kD) {
    const int r = gi / kGroups, cg = gi % kGroups;
    const int tok = __ldg(slots + r);
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (tok >= 0) {
      const bf16* sp = src + b * sb + static_cast<int64_t>(tok) * sl + h * sh + cg * 16;
      lo = __ldg(reinterpret_cast<const uint4*>(sp));
      hi = __ldg(reinterpret_cast<const uint4*>(sp + 8));
    }
    if constexpr (POOL != Pool::kNone) {
      s_rows[gi * 2] = lo;
      s_rows[gi * 2 + 1] = hi;
    }
    if constexpr (POOL == Pool::kMulSum) {
      uint4 mlo = make_uint4(0, 0, 0, 0), mhi = mlo;
      if (tok >= 0) {
        const bf16* mp = mul + b * mb + static_cast<int64_t>(tok) * ml + h * mh + cg * 16;
        mlo = __ldg(reinterpret_cast<const uint4*>(mp));
        mhi = __ldg(reinterpret_cast<const uint4*>(mp + 8));
      }
      s_rows[(cube_slots * kGroups + gi) * 2] = mlo;
      s_rows[(cube_slots * kGroups + gi) * 2 + 1] = mhi;
    }
    if (quantize && tok >= 0) {
      float x[16];
      unpack8(lo, x);
      unpack8(hi, x + 8);
      fake_quantize16(x);
      lo = pack8(x);
      hi = pack8(x + 8);
    }
    uint4* d = reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * kD + cg * 16);
    d[0] = lo;
    d[1] = hi;
  }
  if constexpr (POOL != Pool::kNone) {
    __syncthreads();
    const bf16* rows = reinterpret_cast<const bf16*>(s_rows);
    const bf16* mrows = rows + static_cast<int64_t>(cube_slots) * kD;
    const int n = cube_tokens[cube];
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float x = __bfloat162float(rows[i * kD + t]);
      if constexpr (POOL == Pool::kMean) {
        sum = __fadd_rn(sum, x);
      } else {
        sum = __fadd_rn(sum, __fmul_rn(x, __bfloat162float(mrows[i * kD + t])));
      }
    }
    pool[(bh * nc + cube) * kD + t] = POOL == Pool::kMean ? bf16r(__fdiv_rn(sum, static_cast<float>(n))) : sum;
  }
}

// The coarse stage's cube-by-cube dot products: R rows a_r (query-cube rows, staged in
// shared memory) against the rows j = j0 + threadIdx.x of b [nc, D] (global), each dot an
// fp32 chain over d in order with IEEE-rounded mul and add (the reference's order, so the
// scores and the selection stay equal to it). The rows of b pass through shared memory 32
// channels at a time, transposed, so that the loads are coalesced and consecutive threads
// read consecutive banks; R rows per block read b once for all of them. Every thread of the
// block calls it (it synchronizes); s_a must be written before the call.
constexpr int kCoarseThreads = 256;
constexpr int kCoarseChunk = 32;
constexpr int kCoarseRows = 4;  // query-cube rows per block
template <int R>
__device__ __forceinline__ void coarse_dots(const float (*s_a)[kD], const float* b, int nc, int j0,
                                            float (*s_b)[kCoarseThreads + 1], float (&dot)[R]) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < R; ++r) dot[r] = 0.0f;
  for (int c0 = 0; c0 < kD; c0 += kCoarseChunk) {
    __syncthreads();  // the previous chunk is consumed (and s_a written, on the first)
    for (int e = tid; e < kCoarseThreads * kCoarseChunk; e += kCoarseThreads) {
      const int jr = e / kCoarseChunk, c = e % kCoarseChunk, j = j0 + jr;
      s_b[c][jr] = j < nc ? b[static_cast<int64_t>(j) * kD + c0 + c] : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kCoarseChunk; ++c) {
      const float x = s_b[c][tid];
#pragma unroll
      for (int r = 0; r < R; ++r) dot[r] = __fadd_rn(dot[r], __fmul_rn(s_a[r][c0 + c], x));
    }
  }
}

// Loads rows i0 .. i0 + R - 1 of src [nc, D] into s_a (zeros past nc).
template <int R>
__device__ __forceinline__ void load_coarse_rows(const float* src, int i0, int nc, float (*s_a)[kD]) {
  for (int e = threadIdx.x; e < R * kD; e += blockDim.x) {
    const int r = e / kD, d = e % kD;
    s_a[r][d] = i0 + r < nc ? src[static_cast<int64_t>(i0 + r) * kD + d] : 0.0f;
  }
}

// Block-wide max of one value per row (R rows), every thread gets the results.
template <int R>
__device__ __forceinline__ void block_row_max(float (&v)[R], float (*s_red)[kCoarseThreads / 32], float* out) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[r] = fmaxf(v[r], __shfl_xor_sync(0xffffffffu, v[r], off));
    if ((tid & 31) == 0) s_red[r][tid >> 5] = v[r];
  }
  __syncthreads();
  if (tid < R) {
    float m = -INFINITY;
    for (int w = 0; w < kCoarseThreads / 32; ++w) m = fmaxf(m, s_red[tid][w]);
    out[tid] = m;
  }
  __syncthreads();
}

// Scores and softmax of R query cube rows, one block per (b, h, R rows). The row of
// `probs` holds the exponentials before the division (each thread reads back only its own
// entries, the row sums run after a barrier in index order).
template <int R>
__global__ void __launch_bounds__(kCoarseThreads) coarse_scores_kernel(const float* q_c, const float* k_c,
                                                                       float* scores, float* probs, int H, int nc,
                                                                       float scale) {
  __shared__ float s_b[kCoarseChunk][kCoarseThreads + 1];
  __shared__ float s_a[R][kD];
  __shared__ float s_red[R][kCoarseThreads / 32];
  __shared__ float s_max[R], s_sum[R];
  const int i0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int rows = min(R, nc - i0);
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  load_coarse_rows<R>(q_c + bh * nc * kD, i0, nc, s_a);
  const float* kb = k_c + bh * nc * kD;
  float* srow = scores + (bh * nc + i0) * nc;
  float* prow = probs + (bh * nc + i0) * nc;
  float mx[R];
#pragma unroll
  for (int r = 0; r < R; ++r) mx[r] = -INFINITY;
  for (int j0 = 0; j0 < nc; j0 += kCoarseThreads) {
    float dot[R];
    coarse_dots<R>(s_a, kb, nc, j0, s_b, dot);
    const int j = j0 + tid;
    if (j < nc) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const float sc = __fmul_rn(dot[r], scale);
        srow[static_cast<int64_t>(r) * nc + j] = sc;
        prow[static_cast<int64_t>(r) * nc + j] = sc;
        mx[r] = fmaxf(mx[r], sc);
      }
    }
  }
  block_row_max<R>(mx, s_red, s_max);
  for (int r = 0; r < rows; ++r)
    for (int j = tid; j < nc; j += kCoarseThreads) {
      float* p = prow + static_cast<int64_t>(r) * nc + j;
      *p = expf(__fsub_rn(*p, s_max[r]));
    }
  __syncthreads();
  if (tid < rows) {
    const float* p = prow + static_cast<int64_t>(tid) * nc;
    float sum = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nc; ++j) sum = __fadd_rn(sum, p[j]);
    s_sum[tid] = sum;
  }
  __syncthreads();
  for (int r = 0; r < rows; ++r)
    for (int j = tid; j < nc; j += kCoarseThreads) {
      float* p = prow + static_cast<int64_t>(r) * nc + j;
      *p = __fdiv_rn(*p, s_sum[r]);
    }
}

// out_c = bf16(probs . v_c), one thread per (b, h, i, d), sum over j in order.
__global__ void coarse_out_kernel(const float* probs, const float* v_c, float* out_c, int H, int nc) {
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x;
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  const float* prow = probs + (bh * nc + i) * nc;
  const float* vb = v_c + bh * nc * kD + d;
  float acc = 0.0f;
#pragma unroll 8
  for (int j = 0; j < nc; ++j) acc = __fadd_rn(acc, __fmul_rn(prow[j], vb[static_cast<int64_t>(j) * kD]));
  out_c[(bh * nc + i) * kD + d] = bf16r(acc);
}

// Selection of one query cube row, one block per (b, h, i). rank_j counts the cubes
// ahead of j (higher score, or equal score and lower index); top-k takes rank < topk,
// top-p (only with top_p < 1) the first n ranks whose probabilities, summed in rank
// order in fp32, reach top_p, 1 <= n <= topk. The list is written in ascending cube index, -1 past the count.
__global__ void select_kernel(const float* scores, const float* probs, int32_t* sel_index, int32_t* sel_count,
                              int H, int nc, int topk, bool top_p_mode, float top_p) {
  extern __shared__ int sh_sel[];
  float* s_row = reinterpret_cast<float*>(sh_sel);  // [nc]
  int* s_rank = sh_sel + nc;                        // [nc]
  int* s_sorted = sh_sel + 2 * nc;                  // [nc]
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int64_t row = (static_cast<int64_t>(b) * H + h) * nc + i;
  for (int j = tid; j < nc; j += blockDim.x) {
    const float x = scores[row * nc + j];
    s_row[j] = x != x ? -INFINITY : x;  // NaN ranks as -inf, as the reference
  }
  __syncthreads();
  for (int j = tid; j < nc; j += blockDim.x) {
    const float sj = s_row[j];
    int r = 0;
    for (int k = 0; k < nc; ++k) {
      const float sk = s_row[k];
      r += (sk > sj || (sk == sj && k < j)) ? 1 : 0;
    }
    s_rank[j] = r;
    s_sorted[r] = j;
  }
  __syncthreads();
  __shared__ int s_n;
  __shared__ int s_warp[32];
  if (tid == 0) {
    int n = topk;
    if (top_p_mode) {
      const float* prow = probs + row * nc;
      float cum = 0.0f;
      n = 0;
      for (int r = 0; r < topk; ++r) {
        cum = __fadd_rn(cum, prow[s_sorted[r]]);
        n = r + 1;
        if (cum >= top_p) break;
      }
      n = n < 1 ? 1 : n;
    }
    s_n = n;
  }
  __syncthreads();
  // The selected cubes (rank < n) in ascending index: each chunk of blockDim.x cubes is
  // compacted by warp ballots and the counts of the warps before.
  const int n = s_n, lane = tid & 31, warp = tid >> 5, warps = blockDim.x / 32;
  int32_t* out = sel_index + row * topk;
  int base = 0;
  for (int j0 = 0; j0 < nc; j0 += blockDim.x) {
    const int j = j0 + tid;
    const bool sel = j < nc && s_rank[j] < n;
    const unsigned bits = __ballot_sync(0xffffffffu, sel);
    if (lane == 0) s_warp[warp] = __popc(bits);
    __syncthreads();
    int off = base, total = 0;
    for (int w = 0; w < warps; ++w) {
      off += w < warp ? s_warp[w] : 0;
      total += s_warp[w];
    }
    if (sel) out[off + __popc(bits & ((1u << lane) - 1u))] = j;
    __syncthreads();
    base += total;
  }
  for (int e = base + tid; e < topk; e += blockDim.x) out[e] = -1;
  if (tid == 0) sel_count[row] = base;
}

// Transposed selection mask: mask_t[b, h, kv, qc] = 1 for every selected (qc, kv); the
// mask is zeroed before. Row = (b * H + h) * nc + qc.
__global__ void mask_kernel(const int32_t* sel_index, const int32_t* sel_count, uint8_t* mask_t, int64_t rows,
                            int nc, int topk) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int64_t bh = row / nc;
  const int qc = static_cast<int>(row % nc);
  const int n = sel_count[row];
  for (int e = threadIdx.x; e < n; e += blockDim.x)
    mask_t[(bh * nc + sel_index[row * topk + e]) * nc + qc] = 1;
}

// Inverse lists, one warp per (b, h, kv cube): the query cubes that selected it,
// ascending (ballot + prefix count over 32 query cubes at a time).
__global__ void inverse_kernel(const uint8_t* mask_t, int32_t* inv_index, int32_t* inv_count, int64_t rows, int nc) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);  // bh * nc + kv
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const uint8_t* mrow = mask_t + row * nc;
  int32_t* out = inv_index + row * nc;
  int cnt = 0;
  for (int base = 0; base < nc; base += 32) {
    const int qc = base + lane;
    const bool sel = qc < nc && mrow[qc] != 0;
    const unsigned bits = __ballot_sync(0xffffffffu, sel);
    if (sel) out[cnt + __popc(bits & ((1u << lane) - 1u))] = qc;
    cnt += __popc(bits);
  }
  if (lane == 0) inv_count[row] = cnt;
}

// out = bf16(out_c * gate + o_fine), one thread per (b, token, h, 8 channels).
__global__ void combine_kernel(const bf16* o_fine, const float* out_c, const bf16* gate, int64_t gb, int64_t gl,
                               int64_t gh, bf16* o, int64_t ob, int64_t ol, int64_t oh, const int32_t* token_to_slot,
                               int L, int H, int P, int nc, int cube_slots, int64_t total) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ch = static_cast<int>(idx % (kD / 8));
    int64_t rest = idx / (kD / 8);
    const int h = static_cast<int>(rest % H);
    rest /= H;
    const int tok = static_cast<int>(rest % L);
    const int64_t b = rest / L;
    const int slot = token_to_slot[tok];
    const int cube = slot / cube_slots;
    const int64_t bh = b * H + h;
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(o_fine + (bh * P + slot) * kD + ch * 8), f);
    if (gate != nullptr) {
      float gv[8];
      unpack8(__ldg(reinterpret_cast<const uint4*>(gate + b * gb + static_cast<int64_t>(tok) * gl + h * gh + ch * 8)),
              gv);
      float oc[8];
      load8f(out_c + (bh * nc + cube) * kD + ch * 8, oc);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = __fadd_rn(__fmul_rn(oc[e], gv[e]), f[e]);
    }
    *reinterpret_cast<uint4*>(o + b * ob + static_cast<int64_t>(tok) * ol + h * oh + ch * 8) = pack8(f);
  }
}

// Coarse backward of R query cube rows, one block per (b, h, R rows):
// dprobs_ij = d_outc_i . v_c_j; ds_ij = probs_ij * (dprobs_ij - sum_k probs_ik dprobs_ik) * scale.
// The row of dscores holds dprobs until the last step (each thread rewrites its own entries).
template <int R>
__global__ void __launch_bounds__(kCoarseThreads) coarse_dscores_kernel(const float* d_outc, const float* v_c,
                                                                        const float* probs, float* dscores, int H,
                                                                        int nc, float scale) {
  __shared__ float s_b[kCoarseChunk][kCoarseThreads + 1];
  __shared__ float s_a[R][kD];
  __shared__ float s_dot[R];
  const int i0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int rows = min(R, nc - i0);
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  load_coarse_rows<R>(d_outc + bh * nc * kD, i0, nc, s_a);
  const float* vb = v_c + bh * nc * kD;
  const float* prow = probs + (bh * nc + i0) * nc;
  float* drow = dscores + (bh * nc + i0) * nc;
  for (int j0 = 0; j0 < nc; j0 += kCoarseThreads) {
    float dot[R];
    coarse_dots<R>(s_a, vb, nc, j0, s_b, dot);
    const int j = j0 + tid;
    if (j < nc) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        drow[static_cast<int64_t>(r) * nc + j] = dot[r];
      }
    }
  }
  __syncthreads();
  if (tid < rows) {
    const float* p = prow + static_cast<int64_t>(tid) * nc;
    const float* dp = drow + static_cast<int64_t>(tid) * nc;
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nc; ++j) acc = __fadd_rn(acc, __fmul_rn(p[j], dp[j]));
    s_dot[tid] = acc;
  }
  __syncthreads();
  for (int r = 0; r < rows; ++r)
    for (int j = tid; j < nc; j += kCoarseThreads) {
      const int64_t o = static_cast<int64_t>(r) * nc + j;
      drow[o] = __fmul_rn(__fmul_rn(prow[o], __fsub_rn(drow[o], s_dot[r])), scale);
    }
}

// Cube-mean gradients, one thread per (b, h, cube c, d) (ds holds the scale), written
// divided by the cube's token count (what each of its tokens receives):
// dq_c[c] = sum_j ds[c][j] k_c[j] / n_c; dk_c[c] = sum_i ds[i][c] q_c[i] / n_c;
// dv_c[c] = sum_i probs[i][c] d_outc[i] / n_c.
// The block first stages row c of ds and column c of ds and probs in shared memory
// (3 * nc floats, loaded in parallel; the column reads are strided).
__global__ void __launch_bounds__(kD) coarse_dqkv_kernel(const float* dscores, const float* probs, const float* q_c,
                                                         const float* k_c, const float* d_outc,
                                                         const int32_t* cube_tokens, float* dq_c, float* dk_c,
                                                         float* dv_c, int H, int nc) {
  extern __shared__ float s_vec[];  // [3][nc]: ds[c][j], ds[j][c], probs[j][c]
  const int cidx = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x;
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  const float* ds = dscores + bh * nc * nc;
  const float* pr = probs + bh * nc * nc;
  for (int j = d; j < nc; j += kD) {
    s_vec[j] = ds[static_cast<int64_t>(cidx) * nc + j];
    s_vec[nc + j] = ds[static_cast<int64_t>(j) * nc + cidx];
    s_vec[2 * nc + j] = pr[static_cast<int64_t>(j) * nc + cidx];
  }
  __syncthreads();
  const float* qb = q_c + bh * nc * kD + d;
  const float* kb = k_c + bh * nc * kD + d;
  const float* gb = d_outc + bh * nc * kD + d;
  float aq = 0.0f, ak = 0.0f, av = 0.0f;
#pragma unroll 4
  for (int j = 0; j < nc; ++j) {
    const int64_t jr = static_cast<int64_t>(j) * kD;
    aq = __fadd_rn(aq, __fmul_rn(s_vec[j], kb[jr]));
    ak = __fadd_rn(ak, __fmul_rn(s_vec[nc + j], qb[jr]));
    av = __fadd_rn(av, __fmul_rn(s_vec[2 * nc + j], gb[jr]));
  }
  const int64_t o = (bh * nc + cidx) * kD + d;
  const float cnt = static_cast<float>(cube_tokens[cidx]);
  dq_c[o] = __fdiv_rn(aq, cnt);
  dk_c[o] = __fdiv_rn(ak, cnt);
  dv_c[o] = __fdiv_rn(av, cnt);
}

// Raster gradients, one thread per (b, token, h, 8 channels):
// dX = bf16(dX_fine[slot] + dX_c[cube]) for X = q, k, v, dX_c already divided by the
// cube's count (no coarse term with a zero gate); dgate = bf16(d_o * out_c[cube]).
struct UntileArgs {
  const bf16* dq_f;
  const bf16* dk_f;
  const bf16* dv_f;
  const float* dq_c;
  const float* dk_c;
  const float* dv_c;  // null: zero gate (no coarse term)
  const bf16* d_o;
  int64_t db_, dl_, dh_;
  const float* out_c;
  bf16* dq;
  bf16* dk;
  bf16* dv;
  bf16* dgate;  // may be null
  int64_t qb_, ql_, qh_, kb_, kl_, kh_, vb_, vl_, vh_, gb_, gl_, gh_;
  const int32_t* token_to_slot;
  int L, H, P, nc, cube_slots;
  int64_t total;
};

__global__ void untile_grads_kernel(const UntileArgs a) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < a.total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ch = static_cast<int>(idx % (kD / 8));
    int64_t rest = idx / (kD / 8);
    const int h = static_cast<int>(rest % a.H);
    rest /= a.H;
    const int tok = static_cast<int>(rest % a.L);
    const int64_t b = rest / a.L;
    const int slot = a.token_to_slot[tok];
    const int cube = slot / a.cube_slots;
    const int64_t bh = b * a.H + h;
    const int64_t trow = (bh * a.P + slot) * kD + ch * 8;
    const int64_t crow = (bh * a.nc + cube) * kD + ch * 8;
    const bf16* fine[3] = {a.dq_f, a.dk_f, a.dv_f};
    const float* coarse[3] = {a.dq_c, a.dk_c, a.dv_c};
    bf16* outs[3] = {a.dq, a.dk, a.dv};
    const int64_t ob[3] = {a.qb_, a.kb_, a.vb_}, ol[3] = {a.ql_, a.kl_, a.vl_}, oh[3] = {a.qh_, a.kh_, a.vh_};
#pragma unroll
    for (int x = 0; x < 3; ++x) {
      float f[8];
      unpack8(*reinterpret_cast<const uint4*>(fine[x] + trow), f);
      if (a.dv_c != nullptr) {
        float cr[8];
        load8f(coarse[x] + crow, cr);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __fadd_rn(f[e], cr[e]);
      }
      *reinterpret_cast<uint4*>(outs[x] + b * ob[x] + static_cast<int64_t>(tok) * ol[x] + h * oh[x] + ch * 8) =
          pack8(f);
    }
    if (a.dgate != nullptr) {
      float g[8];
      unpack8(__ldg(reinterpret_cast<const uint4*>(a.d_o + b * a.db_ + static_cast<int64_t>(tok) * a.dl_ + h * a.dh_ +
                                                   ch * 8)),
              g);
      float oc[8];
      load8f(a.out_c + crow, oc);
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = __fmul_rn(g[e], oc[e]);
      *reinterpret_cast<uint4*>(a.dgate + b * a.gb_ + static_cast<int64_t>(tok) * a.gl_ + h * a.gh_ + ch * 8) =
          pack8(g);
    }
  }
}

// ---------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------
size_t align256(size_t x) { return (x + 255) / 256 * 256; }

struct Sizes {
  int64_t bh, P, nc, L;
  size_t tiled_bf16, tiled_rows, coarse, square;
};
Sizes sizes_of(const VsaConfig& c) {
  Sizes s{};
  s.bh = static_cast<int64_t>(c.batch) * c.heads;
  s.P = c.tiling.padded_len;
  s.nc = c.tiling.num_cubes;
  s.L = c.tiling.len;
  s.tiled_bf16 = static_cast<size_t>(s.bh) * s.P * kD * 2;
  s.tiled_rows = static_cast<size_t>(s.bh) * s.P;
  s.coarse = static_cast<size_t>(s.bh) * s.nc * kD * 4;
  s.square = static_cast<size_t>(s.bh) * s.nc * s.nc;
  return s;
}

unsigned grid_for(int64_t total, int threads) {
  int64_t g = (total + threads - 1) / threads;
  if (g > 65535LL * 64) g = 65535LL * 64;  // grid-stride beyond this
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

float resolved_scale(const VsaConfig& c) {
  return c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(static_cast<float>(kD));
}

constexpr const char* kTileOp = "vsa tile";
constexpr const char* kForwardOp = "vsa forward";
constexpr const char* kBackwardOp = "vsa backward";

// A raster BLHD operand (check_blhd of the launch convention).
template <class View>  // BlhdIn or BlhdOut
void check_raster(const char* op, const char* name, const View& t, const VsaConfig& c) {
  check_blhd(op, name, t, [&] { return detail::shape_str(c); });
}

void check_config(const char* op, const VsaConfig& c) {
  const TilingDev& t = c.tiling;
  VQAD_LAUNCH_CHECK(c.head_dim == kD, op, detail::shape_str(c), "expected head dim ", kD, ", found ", c.head_dim);
  VQAD_LAUNCH_CHECK(c.batch >= 1 && c.heads >= 1 && c.batch <= 65535 && c.heads <= 65535, op, detail::shape_str(c),
                    "expected batch and heads in [1, 65535], found B=", c.batch, " H=", c.heads);
  VQAD_LAUNCH_CHECK(t.len >= 1 && t.num_cubes >= 1 && t.blocks_per_cube >= 1 &&
                        t.padded_len == t.num_cubes * t.blocks_per_cube * kBT,
                    op, detail::shape_str(c),
                    "expected a tiling with len, cubes, blocks per cube >= 1 and padded_len = cubes * blocks per "
                    "cube * ", kBT, ", found len ", t.len, ", ", t.num_cubes, " cubes, ", t.blocks_per_cube,
                    " blocks per cube, padded_len ", t.padded_len);
  VQAD_LAUNCH_CHECK(t.num_cubes * t.blocks_per_cube <= 0x7fffffff / kBT, op, detail::shape_str(c),
                    "expected at most ", 0x7fffffff / kBT, " physical blocks, found ",
                    static_cast<int64_t>(t.num_cubes) * t.blocks_per_cube);
  VQAD_LAUNCH_CHECK(t.slot_to_token && t.token_to_slot && t.cube_tokens && t.block_tokens, op, detail::shape_str(c),
                    "expected the tiling tables on the device, found a null table");
  VQAD_LAUNCH_CHECK(c.topk >= 1 && c.topk <= t.num_cubes, op, detail::shape_str(c), "expected topk in [1, ",
                    t.num_cubes, "], found ", c.topk);
  VQAD_LAUNCH_CHECK(static_cast<int64_t>(c.batch) * c.heads * t.num_cubes <= 0x7fffffff, op, detail::shape_str(c),
                    "expected at most 2^31 - 1 (batch, head, cube) rows, found ",
                    static_cast<int64_t>(c.batch) * c.heads * t.num_cubes);
}

template <typename T>
T* carve(uint8_t*& cur, size_t bytes) {
  T* p = reinterpret_cast<T*>(cur);
  cur += align256(bytes);
  return p;
}

}  // namespace

namespace detail {
std::string shape_str(const VsaConfig& c) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) + " D=" + std::to_string(c.head_dim) +
         " grid " + std::to_string(c.grid_t) + "x" + std::to_string(c.grid_h) + "x" + std::to_string(c.grid_w) +
         " L=" + std::to_string(c.tiling.len) + " cubes=" + std::to_string(c.tiling.num_cubes) +
         " padded_len=" + std::to_string(c.tiling.padded_len) + " topk=" + std::to_string(c.topk);
}
}  // namespace detail

namespace {
// tile_pool_kernel over every (cube, h, b) of c; mul and pool as the kernel's POOL needs.
template <Pool POOL>
void launch_tile_pool(const VsaConfig& c, BlhdIn src, BlhdIn mul, void* dst_tiled, bool quantize, float* pool,
                      cudaStream_t stream) {
  check_raster(kTileOp, "tile source", src, c);
  if constexpr (POOL == Pool::kMulSum) check_raster(kTileOp, "pooling factor", mul, c);
  VQAD_LAUNCH_CHECK(dst_tiled != nullptr && reinterpret_cast<uintptr_t>(dst_tiled) % 16 == 0, kTileOp,
                    detail::shape_str(c), "expected a 16-byte aligned destination, found address ", dst_tiled);
  VQAD_LAUNCH_CHECK(POOL == Pool::kNone || pool != nullptr, kTileOp, detail::shape_str(c),
                    "expected a pooling output, found null");
  const int cube_slots = c.tiling.blocks_per_cube * kBT;
  const size_t smem = POOL == Pool::kNone     ? 0
                      : POOL == Pool::kMean   ? static_cast<size_t>(cube_slots) * kD * 2
                                              : static_cast<size_t>(cube_slots) * kD * 4;
  VQAD_LAUNCH_CHECK(smem <= 96 * 1024, kTileOp, detail::shape_str(c), "expected at most 96 KiB of shared memory, "
                    "found ", smem, " bytes for ", cube_slots, " slots per cube");
  if (smem > 48 * 1024)
    VQAD_CUDA_CHECK(cudaFuncSetAttribute(tile_pool_kernel<POOL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(c.tiling.num_cubes), static_cast<unsigned>(c.heads),
                  static_cast<unsigned>(c.batch));
  tile_pool_kernel<POOL><<<grid, kD, smem, stream>>>(
      static_cast<const bf16*>(src.data), src.stride.b, src.stride.l, src.stride.h, static_cast<const bf16*>(mul.data),
      mul.stride.b, mul.stride.l, mul.stride.h, static_cast<bf16*>(dst_tiled), c.tiling.slot_to_token,
      c.tiling.cube_tokens, c.heads, c.tiling.padded_len, c.tiling.num_cubes, cube_slots, quantize, pool);
  VQAD_CUDA_CHECK_LAUNCH("vsa tile_pool_kernel");
}
}  // namespace

void launch_tile(const VsaConfig& c, BlhdIn src, void* dst_tiled, bool quantize, cudaStream_t stream) {
  launch_tile_pool<Pool::kNone>(c, src, BlhdIn{}, dst_tiled, quantize, nullptr, stream);
}

size_t vsa_forward_workspace_bytes(const VsaConfig& c) {
  const Sizes s = sizes_of(c);
  return align256(s.tiled_bf16) + align256(s.square * 4) + align256(fine_forward_scratch_bytes(c));
}

void vsa_forward(const VsaConfig& c, const VsaForwardArgs& a, cudaStream_t stream) {
  check_config(kForwardOp, c);
  check_raster(kForwardOp, "q", a.q, c);
  check_raster(kForwardOp, "k", a.k, c);
  check_raster(kForwardOp, "v", a.v, c);
  if (a.gate.data != nullptr) check_raster(kForwardOp, "gate", a.gate, c);
  check_raster(kForwardOp, "o", a.o, c);
  VQAD_LAUNCH_CHECK(a.tiled_q && a.tiled_k && a.tiled_v && a.o_fine_hp && a.m && a.l && a.sel_index &&
                        a.sel_count && a.q_c && a.k_c && a.v_c && a.probs && a.out_c,
                    kForwardOp, detail::shape_str(c), "expected every saved buffer, found a null one");
  VQAD_LAUNCH_CHECK(a.workspace != nullptr && reinterpret_cast<uintptr_t>(a.workspace) % 256 == 0, kForwardOp,
                    detail::shape_str(c), "expected a 256-byte aligned workspace of ", vsa_forward_workspace_bytes(c),
                    " bytes, found address ", a.workspace);
  const Sizes s = sizes_of(c);
  uint8_t* cur = static_cast<uint8_t*>(a.workspace);
  void* o_fine = carve<uint8_t>(cur, s.tiled_bf16);
  float* scores = carve<float>(cur, s.square * 4);
  void* fine_scratch = carve<uint8_t>(cur, fine_forward_scratch_bytes(c));
  const int H = c.heads, nc = c.tiling.num_cubes;
  const int cube_slots = c.tiling.blocks_per_cube * kBT;
  const dim3 cube_grid(static_cast<unsigned>(nc), static_cast<unsigned>(H), static_cast<unsigned>(c.batch));

  // 1. tiling (+ fake quant of the fine-stage operands) and, in the same pass, the cube
  // means of the unquantized inputs (the coarse stage's)
  launch_tile_pool<Pool::kMean>(c, a.q, BlhdIn{}, a.tiled_q, c.quantize, a.q_c, stream);
  launch_tile_pool<Pool::kMean>(c, a.k, BlhdIn{}, a.tiled_k, c.quantize, a.k_c, stream);
  launch_tile_pool<Pool::kMean>(c, a.v, BlhdIn{}, a.tiled_v, c.quantize && c.quant_v, a.v_c, stream);
  // 2. coarse stage
  const dim3 row_grid(static_cast<unsigned>((nc + kCoarseRows - 1) / kCoarseRows), static_cast<unsigned>(H),
                      static_cast<unsigned>(c.batch));
  coarse_scores_kernel<kCoarseRows><<<row_grid, kCoarseThreads, 0, stream>>>(a.q_c, a.k_c, scores, a.probs, H, nc,
                                                                              resolved_scale(c));
  VQAD_CUDA_CHECK_LAUNCH("vsa coarse_scores_kernel");
  coarse_out_kernel<<<cube_grid, kD, 0, stream>>>(a.probs, a.v_c, a.out_c, H, nc);
  VQAD_CUDA_CHECK_LAUNCH("vsa coarse_out_kernel");
  // 3. selection
  {
    const size_t smem = static_cast<size_t>(nc) * 12;
    VQAD_LAUNCH_CHECK(smem <= 48 * 1024, kForwardOp, detail::shape_str(c), "selection: expected at most 48 KiB of "
                      "shared memory, found ", smem, " bytes for ", nc, " cubes");
    select_kernel<<<cube_grid, 256, smem, stream>>>(scores, a.probs, a.sel_index, a.sel_count, H, nc, c.topk,
                                                    c.top_p_mode && c.top_p < 1.0f, c.top_p);
    VQAD_CUDA_CHECK_LAUNCH("vsa select_kernel");
  }
  // 4. fine stage (o_fine: quantized-P path; o_fine_hp saved)
  launch_fine_forward(c, a.tiled_q, a.tiled_k, a.tiled_v, a.sel_index, a.sel_count, o_fine, a.o_fine_hp, a.m, a.l,
                      fine_scratch, stream);
  // 5. out = bf16(out_c * gate + o_fine)
  const int64_t total = static_cast<int64_t>(c.batch) * c.tiling.len * H * (kD / 8);
  combine_kernel<<<grid_for(total, 256), 256, 0, stream>>>(
      static_cast<const bf16*>(o_fine), a.out_c, static_cast<const bf16*>(a.gate.data), a.gate.stride.b, a.gate.stride.l,
      a.gate.stride.h, static_cast<bf16*>(a.o.data), a.o.stride.b, a.o.stride.l, a.o.stride.h, c.tiling.token_to_slot, c.tiling.len, H,
      c.tiling.padded_len, nc, cube_slots, total);
  VQAD_CUDA_CHECK_LAUNCH("vsa combine_kernel");
}

size_t vsa_backward_workspace_bytes(const VsaConfig& c) {
  const Sizes s = sizes_of(c);
  return 4 * align256(s.tiled_bf16) + align256(s.tiled_rows * 16) + align256(s.square) + align256(s.square * 4) +
         align256(static_cast<size_t>(s.bh) * s.nc * 4) + 4 * align256(s.coarse) + align256(s.square * 4) +
         align256(detail::fine_backward_scratch_bytes(c));
}

void vsa_backward(const VsaConfig& c, const VsaBackwardArgs& a, cudaStream_t stream) {
  check_config(kBackwardOp, c);
  check_raster(kBackwardOp, "d_o", a.d_o, c);
  if (a.gate.data != nullptr) check_raster(kBackwardOp, "gate", a.gate, c);
  check_raster(kBackwardOp, "dq", a.dq, c);
  check_raster(kBackwardOp, "dk", a.dk, c);
  check_raster(kBackwardOp, "dv", a.dv, c);
  if (a.dgate.data != nullptr) check_raster(kBackwardOp, "dgate", a.dgate, c);
  VQAD_LAUNCH_CHECK(a.tiled_q && a.tiled_k && a.tiled_v && a.o_fine_hp && a.m && a.l && a.sel_index &&
                        a.sel_count && a.q_c && a.k_c && a.v_c && a.probs && a.out_c,
                    kBackwardOp, detail::shape_str(c), "expected every saved buffer, found a null one");
  VQAD_LAUNCH_CHECK(a.workspace != nullptr && reinterpret_cast<uintptr_t>(a.workspace) % 256 == 0, kBackwardOp,
                    detail::shape_str(c), "expected a 256-byte aligned workspace of ",
                    vsa_backward_workspace_bytes(c), " bytes, found address ", a.workspace);
  const Sizes s = sizes_of(c);
  uint8_t* cur = static_cast<uint8_t*>(a.workspace);
  void* d_o_t = carve<uint8_t>(cur, s.tiled_bf16);
  void* dq_f = carve<uint8_t>(cur, s.tiled_bf16);
  void* dk_f = carve<uint8_t>(cur, s.tiled_bf16);
  void* dv_f = carve<uint8_t>(cur, s.tiled_bf16);
  void* stats = carve<uint8_t>(cur, s.tiled_rows * 16);
  uint8_t* mask = carve<uint8_t>(cur, s.square);
  int32_t* inv_index = carve<int32_t>(cur, s.square * 4);
  int32_t* inv_count = carve<int32_t>(cur, static_cast<size_t>(s.bh) * s.nc * 4);
  float* d_outc = carve<float>(cur, s.coarse);
  float* dq_c = carve<float>(cur, s.coarse);
  float* dk_c = carve<float>(cur, s.coarse);
  float* dv_c = carve<float>(cur, s.coarse);
  float* dscores = carve<float>(cur, s.square * 4);
  void* fine_scratch = carve<uint8_t>(cur, detail::fine_backward_scratch_bytes(c));
  const int H = c.heads, nc = c.tiling.num_cubes;
  const int cube_slots = c.tiling.blocks_per_cube * kBT;
  const dim3 cube_grid(static_cast<unsigned>(nc), static_cast<unsigned>(H), static_cast<unsigned>(c.batch));

  // Fine stage: dO tiled, row statistics, the inverse lists, dQ over the lists and dK / dV
  // over the inverse lists (C128: one wgmma launch; C64: the mma.sync kernels).
  const bool wgmma_bwd = vsa_fine_forward_kernel(c.tiling.blocks_per_cube) == VsaFineForward::kWgmmaPairs;
  // dO tiled; with a gate, d out_c (the pool of dO * gate) in the same pass.
  const bool has_gate = a.gate.data != nullptr;
  if (has_gate) {
    launch_tile_pool<Pool::kMulSum>(c, a.d_o, a.gate, d_o_t, false, d_outc, stream);
  } else {
    launch_tile(c, a.d_o, d_o_t, false, stream);
  }
  detail::launch_fine_stats(c, d_o_t, a.o_fine_hp, a.m, a.l, stats, stream);
  if (!wgmma_bwd) {
    detail::launch_fine_dq(c, a.tiled_q, a.tiled_k, a.tiled_v, d_o_t, stats, a.sel_index, a.sel_count, dq_f,
                           stream);
  }
  VQAD_CUDA_CHECK(cudaMemsetAsync(mask, 0, s.square, stream));
  {
    const int64_t rows = s.bh * s.nc;
    const dim3 block(32, 8);
    mask_kernel<<<static_cast<unsigned>((rows + 7) / 8), block, 0, stream>>>(a.sel_index, a.sel_count, mask, rows, nc,
                                                                          c.topk);
    VQAD_CUDA_CHECK_LAUNCH("vsa mask_kernel");
    inverse_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(mask, inv_index, inv_count, rows, nc);
    VQAD_CUDA_CHECK_LAUNCH("vsa inverse_kernel");
  }
  if (wgmma_bwd) {
    detail::launch_fine_bwd_wgmma(c, a.tiled_q, a.tiled_k, a.tiled_v, d_o_t, stats, a.sel_index, a.sel_count,
                                  inv_index, inv_count, dq_f, dk_f, dv_f, fine_scratch, stream);
  } else {
    detail::launch_fine_dkdv(c, a.tiled_q, a.tiled_k, a.tiled_v, d_o_t, stats, inv_index, inv_count, dk_f, dv_f,
                             stream);
  }

  // Coarse stage (only with a gate: a zero gate gives out_c no gradient); d out_c above.
  if (has_gate) {
    const dim3 row_grid(static_cast<unsigned>((nc + kCoarseRows - 1) / kCoarseRows), static_cast<unsigned>(H),
                        static_cast<unsigned>(c.batch));
    coarse_dscores_kernel<kCoarseRows><<<row_grid, kCoarseThreads, 0, stream>>>(d_outc, a.v_c, a.probs, dscores, H,
                                                                                nc, resolved_scale(c));
    VQAD_CUDA_CHECK_LAUNCH("vsa coarse_dscores_kernel");
    const size_t vec_smem = static_cast<size_t>(nc) * 3 * sizeof(float);
    VQAD_LAUNCH_CHECK(vec_smem <= 48 * 1024, kBackwardOp, detail::shape_str(c), "coarse gradients: expected at most "
                      "48 KiB of shared memory, found ", vec_smem, " bytes for ", nc, " cubes");
    coarse_dqkv_kernel<<<cube_grid, kD, vec_smem, stream>>>(dscores, a.probs, a.q_c, a.k_c, d_outc,
                                                            c.tiling.cube_tokens, dq_c, dk_c, dv_c, H, nc);
    VQAD_CUDA_CHECK_LAUNCH("vsa coarse_dqkv_kernel");
  }

  UntileArgs u{};
  u.dq_f = static_cast<const bf16*>(dq_f);
  u.dk_f = static_cast<const bf16*>(dk_f);
  u.dv_f = static_cast<const bf16*>(dv_f);
  u.dq_c = has_gate ? dq_c : nullptr;
  u.dk_c = has_gate ? dk_c : nullptr;
  u.dv_c = has_gate ? dv_c : nullptr;
  u.d_o = static_cast<const bf16*>(a.d_o.data);
  u.db_ = a.d_o.stride.b, u.dl_ = a.d_o.stride.l, u.dh_ = a.d_o.stride.h;
  u.out_c = a.out_c;
  u.dq = static_cast<bf16*>(a.dq.data);
  u.dk = static_cast<bf16*>(a.dk.data);
  u.dv = static_cast<bf16*>(a.dv.data);
  u.dgate = static_cast<bf16*>(a.dgate.data);
  u.qb_ = a.dq.stride.b, u.ql_ = a.dq.stride.l, u.qh_ = a.dq.stride.h;
  u.kb_ = a.dk.stride.b, u.kl_ = a.dk.stride.l, u.kh_ = a.dk.stride.h;
  u.vb_ = a.dv.stride.b, u.vl_ = a.dv.stride.l, u.vh_ = a.dv.stride.h;
  u.gb_ = a.dgate.stride.b, u.gl_ = a.dgate.stride.l, u.gh_ = a.dgate.stride.h;
  u.token_to_slot = c.tiling.token_to_slot;
  u.L = c.tiling.len;
  u.H = H;
  u.P = c.tiling.padded_len;
  u.nc = nc;
  u.cube_slots = cube_slots;
  u.total = static_cast<int64_t>(c.batch) * c.tiling.len * H * (kD / 8);
  untile_grads_kernel<<<grid_for(u.total, 256), 256, 0, stream>>>(u);
  VQAD_CUDA_CHECK_LAUNCH("vsa untile_grads_kernel");
}

}  // namespace vqad::kernels::vsa
