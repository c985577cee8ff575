// VSA pipeline (numerics/vsa_ref.h steps 1-5 and the backward): tiling gather with the
// NVFP4 fake quantization of the fine-stage operands and, in the same pass, the coarse
// pooling (tile_pool_kernel; the backward's dO pass also writes d out_c, the fine stage's
// row statistics and dgate), the coarse forward in one kernel (scores, softmax, out_c and
// the top-k / top-p selection), the inverse lists, the gated combine, the coarse backward
// and the C64 untiling, plus the orchestration of vsa_forward / vsa_backward (the C128
// backward's untiling is the visit kernel's epilogue).
//
// The forward's small stages are plain fp32 CUDA code that follows the reference's
// summation orders (sums over slots in slot order, dot products over d in order, row sums
// of the softmax in index order, IEEE-rounded mul / add / div intrinsics so nvcc cannot
// contract them), which keeps the coarse means and scores, and so the selection, equal to
// the reference's; out_c and the backward's coarse sums use FMA chains in fixed orders
// (compared with the reference by tolerance).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "vqad/core/error.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"
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
//   Pool::kMulSum  pool = the sum of src * mul (fp32; d out_c = pool of dO * gate; the
//                  backward's, compared with the reference by tolerance: each thread sums
//                  the products of its rows, r = its row group mod 16, and thread d adds
//                  the 16 partial sums in order, a fixed order without staging the rows).
// The backward's dO pass (STATS) also writes, per tiled row, the fine stage's statistics
// {m, 1/l, delta = rowsum(dO * O_hp), 0} (zeros for padding rows; delta summed as one warp
// of 4 channels per lane and a butterfly from lane distance 16 down, the order of the
// dense kernel's statistics), and, when dgate is set, dgate = bf16(dO * out_c[cube]) in
// raster order.
enum class Pool { kNone, kMean, kMulSum };
constexpr int kTileGroups = kD / 16;               // 16-channel groups per row (a thread's piece)
constexpr int kTileRowGroups = kD / kTileGroups;  // rows per step of a block of kD threads
static_assert(kTileGroups == 8 && 32 % kTileGroups == 0,
              "tile_pool_kernel: a row is 8 consecutive lanes (the statistics' butterfly maps lane distances "
              "16, 8, 4 onto them)");
struct TileArgs {
  const bf16* src;
  int64_t sb, sl, sh;
  const bf16* mul;  // kMulSum
  int64_t mb, ml, mh;
  bf16* dst;
  const int32_t* slot_to_token;
  const int32_t* cube_tokens;
  int H, P, nc, cube_slots;
  bool quantize;
  float* pool;  // kMean / kMulSum
  // STATS only
  const bf16* o_hp;  // tiled
  const float* m;
  const float* l;
  float4* stats;
  const float* out_c;  // with dgate
  bf16* dgate;         // may be null
  int64_t gb, gl, gh;
};
template <Pool POOL, bool STATS>
__global__ void __launch_bounds__(kD) tile_pool_kernel(const TileArgs a) {
  extern __shared__ uint4 s_rows[];  // kMean: [cube_slots][kD] src; kMulSum: [kTileRowGroups][kD] fp32 partial sums
  constexpr int kGroups = kTileGroups;
  const int cube = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
  const int64_t bh = static_cast<int64_t>(b) * a.H + h;
  const int32_t* slots = a.slot_to_token + static_cast<int64_t>(cube) * a.cube_slots;
  const int64_t row0 = bh * a.P + static_cast<int64_t>(cube) * a.cube_slots;
  bf16* out = a.dst + row0 * kD;
  // cube_slots * kGroups is a multiple of kD, so every thread runs the same steps (the
  // statistics' shuffles need whole warps)
  float part_sum[POOL == Pool::kMulSum ? 16 : 1];
#pragma unroll
  for (int i = 0; i < (POOL == Pool::kMulSum ? 16 : 1); ++i) part_sum[i] = 0.0f;
#pragma unroll 2
  for (int gi = t; gi < a.cube_slots * kGroups; gi += kD) {
    const int r = gi / kGroups, cg = gi % kGroups;
    const int tok = __ldg(slots + r);
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (tok >= 0) {
      const bf16* sp = a.src + b * a.sb + static_cast<int64_t>(tok) * a.sl + h * a.sh + cg * 16;
      lo = __ldg(reinterpret_cast<const uint4*>(sp));
      hi = __ldg(reinterpret_cast<const uint4*>(sp + 8));
    }
    if constexpr (POOL == Pool::kMean) {
      s_rows[gi * 2] = lo;
      s_rows[gi * 2 + 1] = hi;
    }
    if constexpr (POOL == Pool::kMulSum) {
      if (tok >= 0) {  // padding rows add nothing
        const bf16* mp = a.mul + b * a.mb + static_cast<int64_t>(tok) * a.ml + h * a.mh + cg * 16;
        float x[16], y[16];
        unpack8(lo, x);
        unpack8(hi, x + 8);
        unpack8(__ldg(reinterpret_cast<const uint4*>(mp)), y);
        unpack8(__ldg(reinterpret_cast<const uint4*>(mp + 8)), y + 8);
#pragma unroll
        for (int i = 0; i < 16; ++i) part_sum[i] = __fadd_rn(part_sum[i], __fmul_rn(x[i], y[i]));
      }
    }
    if constexpr (STATS) {
      float x[16], o[16];
      unpack8(lo, x);
      unpack8(hi, x + 8);
      const int64_t row = row0 + r;
      if (tok >= 0) {
        const uint4* op = reinterpret_cast<const uint4*>(a.o_hp + row * kD + cg * 16);
        unpack8(__ldg(op), o);
        unpack8(__ldg(op + 1), o + 8);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = 0.0f;
      }
      float part[4];  // the dense statistics' lanes cg * 4 + s, 4 channels each
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc = fmaf(x[s * 4 + i], o[s * 4 + i], acc);
        part[s] = acc;
      }
      // lane distances 16, 8, 4 are row threads cg ^ 4, 2, 1; distances 2, 1 are within
#pragma unroll
      for (int off = 4; off > 0; off >>= 1)
#pragma unroll
        for (int s = 0; s < 4; ++s) part[s] += __shfl_xor_sync(0xffffffffu, part[s], off);
      const float delta = (part[0] + part[2]) + (part[1] + part[3]);
      if (cg == 0)
        a.stats[row] = tok >= 0 ? make_float4(a.m[row], 1.0f / a.l[row], delta, 0.0f) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (a.dgate != nullptr && tok >= 0) {
        const float* oc = a.out_c + (bh * a.nc + cube) * kD + cg * 16;
        float g[16];
        load8f(oc, g);
        load8f(oc + 8, g + 8);
#pragma unroll
        for (int i = 0; i < 16; ++i) g[i] = __fmul_rn(x[i], g[i]);
        uint4* gp = reinterpret_cast<uint4*>(a.dgate + b * a.gb + static_cast<int64_t>(tok) * a.gl + h * a.gh + cg * 16);
        gp[0] = pack8(g);
        gp[1] = pack8(g + 8);
      }
    }
    if (a.quantize && tok >= 0) {
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
  if constexpr (POOL == Pool::kMean) {
    __syncthreads();
    const bf16* rows = reinterpret_cast<const bf16*>(s_rows);
    const int n = a.cube_tokens[cube];
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum = __fadd_rn(sum, __bfloat162float(rows[i * kD + t]));
    a.pool[(bh * a.nc + cube) * kD + t] = bf16r(__fdiv_rn(sum, static_cast<float>(n)));
  }
  if constexpr (POOL == Pool::kMulSum) {
    float* s_part = reinterpret_cast<float*>(s_rows);  // [kTileRowGroups][kD]
    const int rg = t / kGroups, cg = t % kGroups;
#pragma unroll
    for (int i = 0; i < 16; ++i) s_part[rg * kD + cg * 16 + i] = part_sum[i];
    __syncthreads();
    float sum = 0.0f;
#pragma unroll
    for (int g = 0; g < kTileRowGroups; ++g) sum = __fadd_rn(sum, s_part[g * kD + t]);
    a.pool[(bh * a.nc + cube) * kD + t] = sum;
  }
}

using sm90::cp_async16;
using sm90::cp_async_commit;
using sm90::cp_async_wait;

// One step of a two-buffer cp.async pipeline (each stage one commit group): issues the
// next stage when there is one, waits for the current one and synchronizes the block.
template <class StageNext>
__device__ __forceinline__ void cp_async_pipeline_step(bool has_next, StageNext&& stage_next) {
  if (has_next) {
    stage_next();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// The coarse stage's cube-by-cube dot products: R rows a_r (query-cube rows, staged in
// shared memory) against row j = j0 + threadIdx.x of b [nc, D] (global), each dot an fp32
// chain over d in order with IEEE-rounded mul and add (the reference's order, so the
// scores and the selection stay equal to it). The block's rows of b pass through shared
// memory kDotChunk channels at a time by cp.async (coalesced 64-byte row pieces, two
// buffers: the next chunk loads while this one is used), rows kDotStride floats apart so
// that each thread's float4 reads of its own row are conflict-free; the a_r are broadcast
// float4 reads. Warps whose rows all lie past nc skip the products (their dots are not
// used). Every thread of the block calls it (it synchronizes); s_a must be written and
// synchronized before the call; s_b holds 2 * kDotStageFloats.
constexpr int kCoarseThreads = 256;
constexpr int kCoarseRows = 4;  // query-cube rows per block
constexpr int kDotChunk = 16, kDotStride = kDotChunk + 4;
constexpr int kDotStageFloats = kCoarseThreads * kDotStride;
static_assert(kD % kDotChunk == 0 && kDotChunk % 4 == 0 && kCoarseThreads % kD == 0 &&
                  (kCoarseRows * kD) % kCoarseThreads == 0,
              "coarse kernels: chunks of 16-byte pieces, whole rows of d per thread group");
template <int R>
__device__ __forceinline__ void coarse_dots(const float (*s_a)[kD], const float* b, int nc, int j0, float* s_b,
                                            float (&dot)[R]) {
  const int tid = threadIdx.x;
  constexpr int kPieces = kDotChunk / 4;  // 16-byte pieces per row and chunk, as many per thread
  auto stage = [&](int buf, int c0) {
    float* dst = s_b + buf * kDotStageFloats;
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int e = tid + i * kCoarseThreads, row = e / kPieces, piece = e % kPieces;
      if (j0 + row < nc)
        cp_async16(dst + row * kDotStride + piece * 4, b + static_cast<int64_t>(j0 + row) * kD + c0 + piece * 4, true);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int r = 0; r < R; ++r) dot[r] = 0.0f;
  const bool active = j0 + (tid & ~31) < nc;
  constexpr int kChunks = kD / kDotChunk;
  stage(0, 0);
  for (int c = 0; c < kChunks; ++c) {
    cp_async_pipeline_step(c + 1 < kChunks, [&] { stage((c + 1) & 1, (c + 1) * kDotChunk); });  // chunk c is in
    if (active) {
      const float* row = s_b + (c & 1) * kDotStageFloats + tid * kDotStride;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(row + 4 * i);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float4 a = *reinterpret_cast<const float4*>(&s_a[r][c * kDotChunk + 4 * i]);
          dot[r] = __fadd_rn(dot[r], __fmul_rn(a.x, x.x));
          dot[r] = __fadd_rn(dot[r], __fmul_rn(a.y, x.y));
          dot[r] = __fadd_rn(dot[r], __fmul_rn(a.z, x.z));
          dot[r] = __fadd_rn(dot[r], __fmul_rn(a.w, x.w));
        }
      }
    }
    __syncthreads();  // buffer c & 1 is free for chunk c + 2
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

// Dynamic shared memory of the coarse row kernels (floats): a staging area (the two
// buffers of coarse_dots, then coarse_forward_kernel's two v_c buffers, then its
// 3 * R * nc selection ints) and two [R][nc] rows (scores / dprobs and probs).
constexpr int kCoarseVRows = 32;  // v_c rows per out_c step (coarse_forward_kernel)
constexpr int kCoarseVLoads = kCoarseVRows * kD / 4 / kCoarseThreads;  // 16-byte pieces per thread and step
static_assert(kCoarseVLoads * kCoarseThreads * 4 == kCoarseVRows * kD, "coarse v_c steps of whole pieces per thread");
__host__ __device__ constexpr int coarse_stage_floats(int R, int nc) {
  constexpr int kFixed = 2 * kDotStageFloats > 2 * kCoarseVRows * kD ? 2 * kDotStageFloats : 2 * kCoarseVRows * kD;
  return kFixed > 3 * R * nc ? kFixed : 3 * R * nc;
}
constexpr size_t coarse_smem_bytes(int R, int nc) {
  return (static_cast<size_t>((coarse_stage_floats(R, nc) + 3) / 4 * 4) + 2 * static_cast<size_t>(R) * nc) * 4;
}
// coarse_dscores_kernel: the two buffers of coarse_dots and the [R][nc] dprobs and probs.
constexpr size_t dscores_smem_bytes(int R, int nc) {
  return (2 * static_cast<size_t>(kDotStageFloats) + 2 * static_cast<size_t>(R) * nc) * 4;
}

// Orderable key of a score: larger float, larger key; NaN ranks as -inf and -0 as +0 (the
// reference's comparisons).
__device__ __forceinline__ uint32_t score_key(float x) {
  x = x != x ? -INFINITY : (x == 0.0f ? 0.0f : x);
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Selection of one query cube row by one warp (the reference's rule): rank_j counts the
// cubes ahead of j (higher score, or equal score and lower index); top-k takes rank < topk,
// top-p (only with top_p < 1) the first n ranks whose probabilities, summed in rank order
// in fp32, reach top_p, 1 <= n <= topk. The list is written in ascending cube index, -1
// past the count. Without comparing every pair: the key T of rank topk - 1 is found bit by
// bit (the largest T with at least topk keys >= T), the candidates are the keys above T
// and the first (topk - #above) keys equal to T in index order, which are exactly the
// ranks < topk; top-p ranks the candidates among themselves (s_sorted) and keeps the
// first n. s_key, s_cand and s_sorted hold nc entries (warp-private).
// Out of line: inlined into coarse_forward_kernel, ptxas spills 8 bytes there.
__device__ __noinline__ void select_row_warp(const float* s_score, const float* s_prob, uint32_t* s_key, int* s_cand,
                                int* s_sorted, int nc, int topk, bool top_p_mode, float top_p, int32_t* out,
                                int32_t* count) {
  const int lane = threadIdx.x & 31;
  for (int j = lane; j < nc; j += 32) s_key[j] = score_key(s_score[j]);
  __syncwarp();
  uint32_t t = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t cand = t | (1u << bit);
    int n = 0;
    for (int j = lane; j < nc; j += 32) n += s_key[j] >= cand ? 1 : 0;
    if (__reduce_add_sync(0xffffffffu, n) >= topk) t = cand;
  }
  int above = 0;
  for (int j = lane; j < nc; j += 32) above += s_key[j] > t ? 1 : 0;
  above = __reduce_add_sync(0xffffffffu, above);
  // Candidates in ascending index: keys above T, and keys equal to T while the equal ones
  // seen so far (index order) are fewer than topk - above.
  int taken_eq = 0, ncand = 0;
  for (int j0 = 0; j0 < nc; j0 += 32) {
    const int j = j0 + lane;
    const uint32_t key = j < nc ? s_key[j] : 0u;
    const unsigned eq = __ballot_sync(0xffffffffu, j < nc && key == t);
    const bool is_cand = j < nc && (key > t || (key == t && taken_eq + __popc(eq & ((1u << lane) - 1u)) < topk - above));
    const unsigned cb = __ballot_sync(0xffffffffu, is_cand);
    if (is_cand) s_cand[ncand + __popc(cb & ((1u << lane) - 1u))] = j;
    ncand += __popc(cb);
    taken_eq += __popc(eq);
  }
  __syncwarp();
  int n = topk;  // ncand == topk
  if (top_p_mode) {
    // rank of each candidate among the candidates = its rank in the row
    for (int e = lane; e < ncand; e += 32) {
      const int j = s_cand[e];
      const uint32_t kj = s_key[j];
      int r = 0;
      for (int f = 0; f < ncand; ++f) {
        const int i = s_cand[f];
        const uint32_t ki = s_key[i];
        r += (ki > kj || (ki == kj && i < j)) ? 1 : 0;
      }
      s_sorted[r] = j;
    }
    __syncwarp();
    if (lane == 0) {
      float cum = 0.0f;
      n = 0;
      for (int r = 0; r < ncand; ++r) {
        cum = __fadd_rn(cum, s_prob[s_sorted[r]]);
        n = r + 1;
        if (cum >= top_p) break;
      }
      n = n < 1 ? 1 : n;
    }
    n = __shfl_sync(0xffffffffu, n, 0);
    // The kept candidates (ranks < n) get a key no score has (0xffffffff would be a NaN,
    // which ranks as -inf); the list keeps the candidates' ascending order.
    for (int r = lane; r < n; r += 32) s_key[s_sorted[r]] = 0xffffffffu;
    __syncwarp();
    int written = 0;
    for (int e0 = 0; e0 < ncand; e0 += 32) {
      const int e = e0 + lane;
      const int j = e < ncand ? s_cand[e] : 0;
      const bool kept = e < ncand && s_key[j] == 0xffffffffu;
      const unsigned kb = __ballot_sync(0xffffffffu, kept);
      if (kept) out[written + __popc(kb & ((1u << lane) - 1u))] = j;
      written += __popc(kb);
    }
    for (int e = written + lane; e < topk; e += 32) out[e] = -1;
    if (lane == 0) *count = written;
    return;
  }
  for (int e = lane; e < topk; e += 32) out[e] = e < ncand ? s_cand[e] : -1;
  if (lane == 0) *count = ncand;
}

// The whole coarse forward of R query cube rows, one block per (b, h, R rows): scores,
// softmax (probs written), out_c = bf16(probs . v_c) and the selection. Dynamic shared
// memory: coarse_smem_bytes(R, nc).
template <int R>
__global__ void __launch_bounds__(kCoarseThreads) coarse_forward_kernel(const float* q_c, const float* k_c,
                                                                        const float* v_c, float* probs,
                                                                        float* out_c, int32_t* sel_index,
                                                                        int32_t* sel_count, int H, int nc, float scale,
                                                                        int topk, bool top_p_mode, float top_p) {
  static_assert(R <= kCoarseThreads / 32, "coarse_forward_kernel: one warp per row in the selection");
  extern __shared__ float4 s_dyn4[];
  float* s_stage = reinterpret_cast<float*>(s_dyn4);
  float* s_row = s_stage + (coarse_stage_floats(R, nc) + 3) / 4 * 4;  // [R][nc] scores
  float* s_p = s_row + R * nc;                                        // [R][nc] exps, then probs
  __shared__ __align__(16) float s_a[R][kD];
  __shared__ float s_red[R][kCoarseThreads / 32];
  __shared__ float s_max[R], s_sum[R];
  const int i0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int rows = min(R, nc - i0);
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  load_coarse_rows<R>(q_c + bh * nc * kD, i0, nc, s_a);
  __syncthreads();
  const float* kb = k_c + bh * nc * kD;
  float mx[R];
#pragma unroll
  for (int r = 0; r < R; ++r) mx[r] = -INFINITY;
  for (int j0 = 0; j0 < nc; j0 += kCoarseThreads) {
    float dot[R];
    coarse_dots<R>(s_a, kb, nc, j0, s_stage, dot);
    const int j = j0 + tid;
    if (j < nc) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const float sc = __fmul_rn(dot[r], scale);
        s_row[r * nc + j] = sc;
        mx[r] = fmaxf(mx[r], sc);
      }
    }
  }
  // v_c rows for out_c by cp.async, kCoarseVRows per step into two buffers of the staging
  // area (free after the dots' last barrier); the first step loads during the softmax.
  const float* vb = v_c + bh * nc * kD;
  auto stage_v = [&](int buf, int j0) {
    const int n4 = min(kCoarseVRows, nc - j0) * (kD / 4);
    float* dst = s_stage + buf * kCoarseVRows * kD;
    const float* src = vb + static_cast<int64_t>(j0) * kD;
#pragma unroll
    for (int i = 0; i < kCoarseVLoads; ++i) {
      const int e = tid + i * kCoarseThreads;
      if (e < n4) cp_async16(dst + e * 4, src + e * 4, true);
    }
    cp_async_commit();
  };
  stage_v(0, 0);
  block_row_max<R>(mx, s_red, s_max);
  for (int r = 0; r < rows; ++r)
    for (int j = tid; j < nc; j += kCoarseThreads) s_p[r * nc + j] = expf(__fsub_rn(s_row[r * nc + j], s_max[r]));
  __syncthreads();
  if (tid < rows) {
    const float* p = s_p + tid * nc;
    float sum = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nc; ++j) sum = __fadd_rn(sum, p[j]);
    s_sum[tid] = sum;
  }
  __syncthreads();
  float* prow = probs + (bh * nc + i0) * nc;
  for (int r = 0; r < rows; ++r)
    for (int j = tid; j < nc; j += kCoarseThreads) {
      const float pv = __fdiv_rn(s_p[r * nc + j], s_sum[r]);
      s_p[r * nc + j] = pv;
      prow[static_cast<int64_t>(r) * nc + j] = pv;
    }
  // out_c = bf16(probs . v_c), an fp32 FMA chain over j in order per (row, d) (compared
  // with the reference, which rounds each product, by tolerance).
  constexpr int kRowStep = kCoarseThreads / kD, kRowsPerThread = R / kRowStep;
  const int d = tid % kD, r_first = tid / kD;
  float acc[kRowsPerThread];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) acc[k] = 0.0f;
  for (int step = 0, j0 = 0; j0 < nc; ++step, j0 += kCoarseVRows) {
    const int n = min(kCoarseVRows, nc - j0);
    // step's rows are in (and, first step, probs complete)
    cp_async_pipeline_step(j0 + kCoarseVRows < nc, [&] { stage_v((step + 1) & 1, j0 + kCoarseVRows); });
    const float* vrows = s_stage + (step & 1) * kCoarseVRows * kD;
    for (int jj = 0; jj < n; ++jj) {
      const float x = vrows[jj * kD + d];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k)
        acc[k] = fmaf(s_p[(r_first + k * kRowStep) * nc + j0 + jj], x, acc[k]);
    }
    __syncthreads();  // buffer step & 1 is free for step + 2
  }
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int r = r_first + k * kRowStep;
    if (r < rows) out_c[(bh * nc + i0 + r) * kD + d] = bf16r(acc[k]);
  }
  // Selection, one warp per row; warp w's nc-entry key / candidate / sorted arrays.
  const int warp = tid >> 5;
  if (warp < rows) {
    uint32_t* s_key = reinterpret_cast<uint32_t*>(s_stage) + warp * 3 * nc;
    int* s_cand = reinterpret_cast<int*>(s_key + nc);
    const int64_t row = bh * nc + i0 + warp;
    select_row_warp(s_row + warp * nc, s_p + warp * nc, s_key, s_cand, s_cand + nc, nc, topk, top_p_mode, top_p,
                    sel_index + row * topk, sel_count + row);
  }
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
// The rows of probs and dprobs stay in shared memory (dscores_smem_bytes).
// (At least 3 blocks per SM: without the bound ptxas stops at 64 registers and spills.)
template <int R>
__global__ void __launch_bounds__(kCoarseThreads, 3) coarse_dscores_kernel(const float* d_outc, const float* v_c,
                                                                        const float* probs, float* dscores, int H,
                                                                        int nc, float scale) {
  extern __shared__ float4 s_dyn4[];
  float* s_stage = reinterpret_cast<float*>(s_dyn4);  // coarse_dots' buffers
  float* s_dp = s_stage + 2 * kDotStageFloats;        // [R][nc] dprobs
  float* s_p = s_dp + R * nc;                         // [R][nc] probs
  __shared__ __align__(16) float s_a[R][kD];
  __shared__ float s_dot[R];
  const int i0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int rows = min(R, nc - i0);
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  load_coarse_rows<R>(d_outc + bh * nc * kD, i0, nc, s_a);
  const float* vb = v_c + bh * nc * kD;
  const float* prow = probs + (bh * nc + i0) * nc;
  float* drow = dscores + (bh * nc + i0) * nc;
  for (int e = tid; e < rows * nc; e += kCoarseThreads) s_p[e] = __ldg(prow + e);
  __syncthreads();
  for (int j0 = 0; j0 < nc; j0 += kCoarseThreads) {
    float dot[R];
    coarse_dots<R>(s_a, vb, nc, j0, s_stage, dot);
    const int j = j0 + tid;
    if (j < nc) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        s_dp[r * nc + j] = dot[r];
      }
    }
  }
  __syncthreads();
  if (tid < rows) {
    const float* p = s_p + tid * nc;
    const float* dp = s_dp + tid * nc;
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nc; ++j) acc = __fadd_rn(acc, __fmul_rn(p[j], dp[j]));
    s_dot[tid] = acc;
  }
  __syncthreads();
  for (int e = tid; e < rows * nc; e += kCoarseThreads)
    drow[e] = __fmul_rn(__fmul_rn(s_p[e], __fsub_rn(s_dp[e], s_dot[e / nc])), scale);
}

// Cube-mean gradients of kDqkvCubes cubes c per block (b, h, c0 ..), written divided by
// the cube's token count (what each of its tokens receives; ds holds the scale):
// dq_c[c] = sum_j ds[c][j] k_c[j] / n_c; dk_c[c] = sum_i ds[i][c] q_c[i] / n_c;
// dv_c[c] = sum_i probs[i][c] d_outc[i] / n_c (fp32 FMA chains over j in order; the
// backward is compared with the reference by tolerance, only the forward bit for bit).
// Thread = (channel pair, cube group): 2 channels x kDqkvGroupCubes cubes x 3 gradients
// of chains, so that every shared-memory read feeds several FMAs. Per chunk of
// kDqkvChunk rows j, two buffers each: the rows of k_c, q_c and d_outc by cp.async, and
// the factors ds[c][j], ds[j][c], probs[j][c] of the block's cubes ([3][kDqkvChunk]
// [kDqkvCubes], the cubes innermost: a group's factors are float4 broadcasts) through
// registers, loaded one chunk ahead. The shared memory does not depend on nc.
constexpr int kDqkvCubes = 16, kDqkvGroupCubes = 4, kDqkvThreads = (kD / 2) * (kDqkvCubes / kDqkvGroupCubes);
constexpr int kDqkvChunk = 16;
constexpr int kDqkvChunkFloats = 3 * kDqkvChunk * kD;  // one rows buffer: k_c, q_c, d_outc rows
constexpr int kDqkvLoads = kDqkvChunkFloats / 4 / kDqkvThreads;
constexpr int kDqkvFactorFloats = 3 * kDqkvChunk * kDqkvCubes;  // one factors buffer
static_assert(kDqkvLoads * kDqkvThreads * 4 == kDqkvChunkFloats && (kD / 2) % 32 == 0 && kDqkvGroupCubes % 4 == 0,
              "coarse_dqkv_kernel: whole 16-byte pieces per thread, one cube group per warp");
static_assert(kDqkvChunk * kDqkvCubes == kDqkvThreads, "coarse_dqkv_kernel: one factor of each kind per thread");
constexpr size_t kDqkvSmemBytes = (2 * static_cast<size_t>(kDqkvChunkFloats) + 2 * kDqkvFactorFloats) * 4;
__global__ void __launch_bounds__(kDqkvThreads) coarse_dqkv_kernel(const float* dscores, const float* probs,
                                                                   const float* q_c, const float* k_c,
                                                                   const float* d_outc, const int32_t* cube_tokens,
                                                                   float* dq_c, float* dk_c, float* dv_c, int H,
                                                                   int nc) {
  extern __shared__ float4 s_dyn4[];
  float* s_rows = reinterpret_cast<float*>(s_dyn4);      // [2][3][kDqkvChunk][kD]: k_c, q_c, d_outc
  float* s_fac = s_rows + 2 * kDqkvChunkFloats;          // [2][3][kDqkvChunk][kDqkvCubes]
  const int c0 = blockIdx.x * kDqkvCubes, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int ncubes = min(kDqkvCubes, nc - c0);
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  const float* ds = dscores + bh * nc * nc;
  const float* pr = probs + bh * nc * nc;
  const float* kb = k_c + bh * nc * kD;
  const float* qb = q_c + bh * nc * kD;
  const float* gb = d_outc + bh * nc * kD;
  auto stage_rows = [&](int buf, int j0) {
    const int n4 = min(kDqkvChunk, nc - j0) * (kD / 4);
#pragma unroll
    for (int i = 0; i < kDqkvLoads; ++i) {
      const int e = tid + i * kDqkvThreads, m = e / (kDqkvChunk * kD / 4), o = e % (kDqkvChunk * kD / 4);
      if (o < n4)
        cp_async16(s_rows + buf * kDqkvChunkFloats + (m * kDqkvChunk * kD / 4 + o) * 4,
                   (m == 0 ? kb : m == 1 ? qb : gb) + static_cast<int64_t>(j0) * kD + o * 4, true);
    }
    cp_async_commit();
  };
  // This thread's factors of chunk j0 (zero past nc and past the block's cubes): ds[c][j]
  // with consecutive threads on consecutive j, ds[j][c] and probs[j][c] on consecutive c.
  float f_row = 0.0f, f_col = 0.0f, f_prob = 0.0f;
  auto load_factors = [&](int j0) {
    {
      const int u = tid / kDqkvChunk, jj = tid % kDqkvChunk;
      f_row = u < ncubes && j0 + jj < nc ? __ldg(ds + static_cast<int64_t>(c0 + u) * nc + j0 + jj) : 0.0f;
    }
    const int jj = tid / kDqkvCubes, u = tid % kDqkvCubes;
    const bool ok = u < ncubes && j0 + jj < nc;
    f_col = ok ? __ldg(ds + static_cast<int64_t>(j0 + jj) * nc + c0 + u) : 0.0f;
    f_prob = ok ? __ldg(pr + static_cast<int64_t>(j0 + jj) * nc + c0 + u) : 0.0f;
  };
  auto store_factors = [&](int buf) {
    float* f = s_fac + buf * kDqkvFactorFloats;
    f[(tid % kDqkvChunk) * kDqkvCubes + tid / kDqkvChunk] = f_row;
    f[kDqkvChunk * kDqkvCubes + tid] = f_col;
    f[2 * kDqkvChunk * kDqkvCubes + tid] = f_prob;
  };
  stage_rows(0, 0);
  load_factors(0);
  store_factors(0);
  if (kDqkvChunk < nc) load_factors(kDqkvChunk);
  const int d = 2 * (tid % (kD / 2)), grp = tid / (kD / 2);  // channels d, d + 1; cubes grp * kDqkvGroupCubes ..
  float aq[kDqkvGroupCubes][2], ak[kDqkvGroupCubes][2], av[kDqkvGroupCubes][2];
#pragma unroll
  for (int u = 0; u < kDqkvGroupCubes; ++u)
#pragma unroll
    for (int x = 0; x < 2; ++x) aq[u][x] = ak[u][x] = av[u][x] = 0.0f;
  for (int step = 0, j0 = 0; j0 < nc; ++step, j0 += kDqkvChunk) {
    const int n = min(kDqkvChunk, nc - j0);
    // this chunk's rows and factors are in (the factors were stored before the last
    // barrier); the next chunk's rows are loading
    cp_async_pipeline_step(j0 + kDqkvChunk < nc, [&] { stage_rows((step + 1) & 1, j0 + kDqkvChunk); });
    if (j0 + kDqkvChunk < nc) {
      // buffer (step + 1) & 1 was last read in step - 1, before its closing barrier
      store_factors((step + 1) & 1);
      if (j0 + 2 * kDqkvChunk < nc) load_factors(j0 + 2 * kDqkvChunk);
    }
    const float* rows = s_rows + (step & 1) * kDqkvChunkFloats;
    const float* fac = s_fac + (step & 1) * kDqkvFactorFloats;
#pragma unroll 2
    for (int jj = 0; jj < n; ++jj) {
      const float2 kx = *reinterpret_cast<const float2*>(rows + jj * kD + d);
      const float2 qx = *reinterpret_cast<const float2*>(rows + (kDqkvChunk + jj) * kD + d);
      const float2 gx = *reinterpret_cast<const float2*>(rows + (2 * kDqkvChunk + jj) * kD + d);
#pragma unroll
      for (int q4 = 0; q4 < kDqkvGroupCubes / 4; ++q4) {
        const int off = jj * kDqkvCubes + grp * kDqkvGroupCubes + q4 * 4;
        const float4 fq = *reinterpret_cast<const float4*>(fac + off);
        const float4 fk = *reinterpret_cast<const float4*>(fac + kDqkvChunk * kDqkvCubes + off);
        const float4 fv = *reinterpret_cast<const float4*>(fac + 2 * kDqkvChunk * kDqkvCubes + off);
        const float vq[4] = {fq.x, fq.y, fq.z, fq.w}, vk[4] = {fk.x, fk.y, fk.z, fk.w}, vv[4] = {fv.x, fv.y, fv.z, fv.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float* q2 = aq[q4 * 4 + u];
          float* k2 = ak[q4 * 4 + u];
          float* v2 = av[q4 * 4 + u];
          q2[0] = fmaf(vq[u], kx.x, q2[0]), q2[1] = fmaf(vq[u], kx.y, q2[1]);
          k2[0] = fmaf(vk[u], qx.x, k2[0]), k2[1] = fmaf(vk[u], qx.y, k2[1]);
          v2[0] = fmaf(vv[u], gx.x, v2[0]), v2[1] = fmaf(vv[u], gx.y, v2[1]);
        }
      }
    }
    __syncthreads();  // buffers step & 1 are free for step + 2
  }
#pragma unroll
  for (int u = 0; u < kDqkvGroupCubes; ++u) {
    const int cu = grp * kDqkvGroupCubes + u;
    if (cu >= ncubes) continue;
    const int64_t o = (bh * nc + c0 + cu) * kD + d;
    const float cnt = static_cast<float>(cube_tokens[c0 + cu]);
    *reinterpret_cast<float2*>(dq_c + o) = make_float2(__fdiv_rn(aq[u][0], cnt), __fdiv_rn(aq[u][1], cnt));
    *reinterpret_cast<float2*>(dk_c + o) = make_float2(__fdiv_rn(ak[u][0], cnt), __fdiv_rn(ak[u][1], cnt));
    *reinterpret_cast<float2*>(dv_c + o) = make_float2(__fdiv_rn(av[u][0], cnt), __fdiv_rn(av[u][1], cnt));
  }
}

// Raster gradients, one thread per (b, token, h, 8 channels):
// dX = bf16(dX_fine[slot] + dX_c[cube]) for X = q, k, v, dX_c already divided by the
// cube's count (no coarse term with a zero gate). (dgate comes from the dO pass.)
struct UntileArgs {
  const bf16* dq_f;
  const bf16* dk_f;
  const bf16* dv_f;
  const float* dq_c;
  const float* dk_c;
  const float* dv_c;  // null: zero gate (no coarse term)
  bf16* dq;
  bf16* dk;
  bf16* dv;
  int64_t qb_, ql_, qh_, kb_, kl_, kh_, vb_, vl_, vh_;
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
// What the backward's dO pass adds (tile_pool_kernel STATS): the row statistics from the
// forward's O_hp (tiled), m and l, and dgate (data may be null) from out_c.
struct DoPassExtras {
  const void* o_hp = nullptr;
  const float* m = nullptr;
  const float* l = nullptr;
  void* stats = nullptr;
  const float* out_c = nullptr;
  BlhdOut dgate;
};
// tile_pool_kernel over every (cube, h, b) of c; mul and pool as the kernel's POOL needs,
// extras with STATS.
template <Pool POOL, bool STATS = false>
void launch_tile_pool(const VsaConfig& c, BlhdIn src, BlhdIn mul, void* dst_tiled, bool quantize, float* pool,
                      cudaStream_t stream, const DoPassExtras& extras = {}) {
  check_raster(kTileOp, "tile source", src, c);
  if constexpr (POOL == Pool::kMulSum) check_raster(kTileOp, "pooling factor", mul, c);
  VQAD_LAUNCH_CHECK(dst_tiled != nullptr && reinterpret_cast<uintptr_t>(dst_tiled) % 16 == 0, kTileOp,
                    detail::shape_str(c), "expected a 16-byte aligned destination, found address ", dst_tiled);
  VQAD_LAUNCH_CHECK(POOL == Pool::kNone || pool != nullptr, kTileOp, detail::shape_str(c),
                    "expected a pooling output, found null");
  if constexpr (STATS) {
    VQAD_LAUNCH_CHECK(extras.o_hp && extras.m && extras.l && extras.stats, kTileOp, detail::shape_str(c),
                      "expected O_hp, m, l and the statistics buffer, found a null one");
    if (extras.dgate.data != nullptr) {
      check_raster(kTileOp, "dgate", extras.dgate, c);
      VQAD_LAUNCH_CHECK(extras.out_c != nullptr, kTileOp, detail::shape_str(c), "expected out_c with dgate, found null");
    }
  }
  const int cube_slots = c.tiling.blocks_per_cube * kBT;
  const size_t smem = POOL == Pool::kNone     ? 0
                      : POOL == Pool::kMean   ? static_cast<size_t>(cube_slots) * kD * 2
                                              : static_cast<size_t>(kTileRowGroups) * kD * 4;
  VQAD_LAUNCH_CHECK(smem <= 96 * 1024, kTileOp, detail::shape_str(c), "expected at most 96 KiB of shared memory, "
                    "found ", smem, " bytes for ", cube_slots, " slots per cube");
  detail::allow_dynamic_smem(tile_pool_kernel<POOL, STATS>, smem, kTileOp, "tiling", c);
  const dim3 grid(static_cast<unsigned>(c.tiling.num_cubes), static_cast<unsigned>(c.heads),
                  static_cast<unsigned>(c.batch));
  TileArgs t{};
  t.src = static_cast<const bf16*>(src.data);
  t.sb = src.stride.b, t.sl = src.stride.l, t.sh = src.stride.h;
  t.mul = static_cast<const bf16*>(mul.data);
  t.mb = mul.stride.b, t.ml = mul.stride.l, t.mh = mul.stride.h;
  t.dst = static_cast<bf16*>(dst_tiled);
  t.slot_to_token = c.tiling.slot_to_token;
  t.cube_tokens = c.tiling.cube_tokens;
  t.H = c.heads, t.P = c.tiling.padded_len, t.nc = c.tiling.num_cubes, t.cube_slots = cube_slots;
  t.quantize = quantize;
  t.pool = pool;
  t.o_hp = static_cast<const bf16*>(extras.o_hp);
  t.m = extras.m, t.l = extras.l;
  t.stats = static_cast<float4*>(extras.stats);
  t.out_c = extras.out_c;
  t.dgate = static_cast<bf16*>(extras.dgate.data);
  t.gb = extras.dgate.stride.b, t.gl = extras.dgate.stride.l, t.gh = extras.dgate.stride.h;
  tile_pool_kernel<POOL, STATS><<<grid, kD, smem, stream>>>(t);
  VQAD_CUDA_CHECK_LAUNCH("vsa tile_pool_kernel");
}
}  // namespace

void launch_tile(const VsaConfig& c, BlhdIn src, void* dst_tiled, bool quantize, cudaStream_t stream) {
  launch_tile_pool<Pool::kNone>(c, src, BlhdIn{}, dst_tiled, quantize, nullptr, stream);
}

namespace {
// The fine output gets its own buffer on the quantized-P path and when nothing is saved;
// without P quantization, in a forward that saves, it is o_fine_hp itself.
bool own_fine_output(const VsaConfig& c, bool saves) { return (c.quantize && c.quant_p) || !saves; }
}  // namespace

size_t vsa_forward_workspace_bytes(const VsaConfig& c, bool saves) {
  const Sizes s = sizes_of(c);
  return (own_fine_output(c, saves) ? align256(s.tiled_bf16) : 0) + align256(fine_forward_scratch_bytes(c));
}

void vsa_forward(const VsaConfig& c, const VsaForwardArgs& a, cudaStream_t stream) {
  check_config(kForwardOp, c);
  check_raster(kForwardOp, "q", a.q, c);
  check_raster(kForwardOp, "k", a.k, c);
  check_raster(kForwardOp, "v", a.v, c);
  if (a.gate.data != nullptr) check_raster(kForwardOp, "gate", a.gate, c);
  check_raster(kForwardOp, "o", a.o, c);
  VQAD_LAUNCH_CHECK(a.tiled_q && a.tiled_k && a.tiled_v && a.sel_index && a.sel_count && a.q_c && a.k_c && a.v_c &&
                        a.probs && a.out_c,
                    kForwardOp, detail::shape_str(c), "expected every stage buffer, found a null one");
  const bool saves = a.o_fine_hp != nullptr;
  VQAD_LAUNCH_CHECK((a.m != nullptr) == saves && (a.l != nullptr) == saves, kForwardOp, detail::shape_str(c),
                    "expected o_fine_hp, m and l all set (saved for the backward) or all null (a forward "
                    "without a backward), found o_fine_hp ", a.o_fine_hp, ", m ", a.m, ", l ", a.l);
  VQAD_LAUNCH_CHECK(a.workspace != nullptr && reinterpret_cast<uintptr_t>(a.workspace) % 256 == 0, kForwardOp,
                    detail::shape_str(c), "expected a 256-byte aligned workspace of ",
                    vsa_forward_workspace_bytes(c, saves), " bytes, found address ", a.workspace);
  const Sizes s = sizes_of(c);
  uint8_t* cur = static_cast<uint8_t*>(a.workspace);
  void* o_fine = own_fine_output(c, saves) ? carve<uint8_t>(cur, s.tiled_bf16) : a.o_fine_hp;
  void* fine_scratch = carve<uint8_t>(cur, fine_forward_scratch_bytes(c));
  const int H = c.heads, nc = c.tiling.num_cubes;
  const int cube_slots = c.tiling.blocks_per_cube * kBT;

  // 1. tiling (+ fake quant of the fine-stage operands) and, in the same pass, the cube
  // means of the unquantized inputs (the coarse stage's)
  launch_tile_pool<Pool::kMean>(c, a.q, BlhdIn{}, a.tiled_q, c.quantize, a.q_c, stream);
  launch_tile_pool<Pool::kMean>(c, a.k, BlhdIn{}, a.tiled_k, c.quantize, a.k_c, stream);
  launch_tile_pool<Pool::kMean>(c, a.v, BlhdIn{}, a.tiled_v, c.quantize && c.quant_v, a.v_c, stream);
  // 2. coarse stage and 3. selection, one kernel
  const dim3 row_grid(static_cast<unsigned>((nc + kCoarseRows - 1) / kCoarseRows), static_cast<unsigned>(H),
                      static_cast<unsigned>(c.batch));
  {
    const size_t smem = coarse_smem_bytes(kCoarseRows, nc);
    detail::allow_dynamic_smem(coarse_forward_kernel<kCoarseRows>, smem, kForwardOp, "coarse stage", c);
    coarse_forward_kernel<kCoarseRows><<<row_grid, kCoarseThreads, smem, stream>>>(
        a.q_c, a.k_c, a.v_c, a.probs, a.out_c, a.sel_index, a.sel_count, H, nc, resolved_scale(c), c.topk,
        c.top_p_mode && c.top_p < 1.0f, c.top_p);
    VQAD_CUDA_CHECK_LAUNCH("vsa coarse_forward_kernel");
  }
  // 4. fine stage (o_fine: quantized-P path; o_fine_hp, m, l saved, or none of them)
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

// Fine dQ, dK, dV in tiled form (the C64 kernels' outputs, untiled afterwards); the C128
// backward writes the raster outputs itself.
bool tiled_fine_grads(const VsaConfig& c) {
  return vsa_fine_forward_kernel(c.tiling.blocks_per_cube) != VsaFineForward::kWgmmaPairs;
}

size_t vsa_backward_workspace_bytes(const VsaConfig& c) {
  const Sizes s = sizes_of(c);
  return (tiled_fine_grads(c) ? 4 : 1) * align256(s.tiled_bf16) + align256(s.tiled_rows * 16) + align256(s.square) +
         align256(s.square * 4) + align256(static_cast<size_t>(s.bh) * s.nc * 4) + 4 * align256(s.coarse) +
         align256(s.square * 4) + align256(detail::fine_backward_scratch_bytes(c));
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
  const bool tiled_grads = tiled_fine_grads(c);
  uint8_t* cur = static_cast<uint8_t*>(a.workspace);
  void* d_o_t = carve<uint8_t>(cur, s.tiled_bf16);
  void* dq_f = tiled_grads ? carve<uint8_t>(cur, s.tiled_bf16) : nullptr;
  void* dk_f = tiled_grads ? carve<uint8_t>(cur, s.tiled_bf16) : nullptr;
  void* dv_f = tiled_grads ? carve<uint8_t>(cur, s.tiled_bf16) : nullptr;
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

  // dO tiled and, in the same pass, the row statistics, dgate and, with a gate, d out_c
  // (the pool of dO * gate).
  const bool has_gate = a.gate.data != nullptr;
  DoPassExtras extras;
  extras.o_hp = a.o_fine_hp;
  extras.m = a.m;
  extras.l = a.l;
  extras.stats = stats;
  extras.out_c = a.out_c;
  extras.dgate = a.dgate;
  if (has_gate) {
    launch_tile_pool<Pool::kMulSum, true>(c, a.d_o, a.gate, d_o_t, false, d_outc, stream, extras);
  } else {
    launch_tile_pool<Pool::kNone, true>(c, a.d_o, BlhdIn{}, d_o_t, false, nullptr, stream, extras);
  }

  // Coarse stage (only with a gate: a zero gate gives out_c no gradient): the cube-mean
  // gradients, which the fine stage's output step adds.
  if (has_gate) {
    const dim3 row_grid(static_cast<unsigned>((nc + kCoarseRows - 1) / kCoarseRows), static_cast<unsigned>(H),
                        static_cast<unsigned>(c.batch));
    const size_t smem = dscores_smem_bytes(kCoarseRows, nc);
    detail::allow_dynamic_smem(coarse_dscores_kernel<kCoarseRows>, smem, kBackwardOp, "coarse gradients", c);
    coarse_dscores_kernel<kCoarseRows><<<row_grid, kCoarseThreads, smem, stream>>>(d_outc, a.v_c, a.probs, dscores, H,
                                                                                   nc, resolved_scale(c));
    VQAD_CUDA_CHECK_LAUNCH("vsa coarse_dscores_kernel");
    detail::allow_dynamic_smem(coarse_dqkv_kernel, kDqkvSmemBytes, kBackwardOp, "coarse gradients", c);
    const dim3 dqkv_grid(static_cast<unsigned>((nc + kDqkvCubes - 1) / kDqkvCubes), static_cast<unsigned>(H),
                         static_cast<unsigned>(c.batch));
    coarse_dqkv_kernel<<<dqkv_grid, kDqkvThreads, kDqkvSmemBytes, stream>>>(dscores, a.probs, a.q_c, a.k_c, d_outc,
                                                                      c.tiling.cube_tokens, dq_c, dk_c, dv_c, H, nc);
    VQAD_CUDA_CHECK_LAUNCH("vsa coarse_dqkv_kernel");
  }

  // Fine stage: dQ over the lists and dK / dV over the inverse lists (C128: one wgmma
  // launch that also adds the coarse terms and writes raster rows; C64: the mma.sync
  // kernels, then the untiling).
  if (tiled_grads) {
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
  if (!tiled_grads) {
    detail::FineBwdRaster out;
    out.dq = a.dq;
    out.dk = a.dk;
    out.dv = a.dv;
    if (has_gate) out.dq_c = dq_c, out.dk_c = dk_c, out.dv_c = dv_c;
    detail::launch_fine_bwd_wgmma(c, a.tiled_q, a.tiled_k, a.tiled_v, d_o_t, stats, a.sel_index, a.sel_count,
                                  inv_index, inv_count, out, fine_scratch, stream);
    return;
  }
  detail::launch_fine_dkdv(c, a.tiled_q, a.tiled_k, a.tiled_v, d_o_t, stats, inv_index, inv_count, dk_f, dv_f,
                           stream);

  UntileArgs u{};
  u.dq_f = static_cast<const bf16*>(dq_f);
  u.dk_f = static_cast<const bf16*>(dk_f);
  u.dv_f = static_cast<const bf16*>(dv_f);
  u.dq_c = has_gate ? dq_c : nullptr;
  u.dk_c = has_gate ? dk_c : nullptr;
  u.dv_c = has_gate ? dv_c : nullptr;
  u.dq = static_cast<bf16*>(a.dq.data);
  u.dk = static_cast<bf16*>(a.dk.data);
  u.dv = static_cast<bf16*>(a.dv.data);
  u.qb_ = a.dq.stride.b, u.ql_ = a.dq.stride.l, u.qh_ = a.dq.stride.h;
  u.kb_ = a.dk.stride.b, u.kl_ = a.dk.stride.l, u.kh_ = a.dk.stride.h;
  u.vb_ = a.dv.stride.b, u.vl_ = a.dv.stride.l, u.vh_ = a.dv.stride.h;
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
