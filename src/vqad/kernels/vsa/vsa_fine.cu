// VSA fine stage (spec/attention.md "VSA"; numerics/vsa_ref.h step 4) over the tiled
// [B, H, P, D] operands.
//
// Forward by cube shape (vsa_kernels.h vsa_fine_forward_kernel):
//   C128: visit_lists_kernel writes each query cube's visited physical blocks (entries
//         (block << 7) | valid tokens, ascending cube order, empty blocks left out) and
//         the ATTN_QAT_TRAIN wgmma forward runs over them (attention/sm90
//         attn_qat_fwd_visit.h: 128 query rows = the cube's two blocks per CTA, 128-key
//         tiles of two visited blocks, tile_blocks = 2, the dense kernel's pipeline and
//         arithmetic).
//   C64:  the mma.sync kernel below (tile_blocks = 1).
// Backward by cube shape (the backward depends on the forward's tiles only through m
// and l: P is recomputed against the final row max in both backward modes):
//   C128: launch_fine_bwd_wgmma: the visit lists again, the inverse lists expanded to
//         query blocks, and one launch of the ATTN_QAT_TRAIN wgmma backward over them
//         (attn_bwd launch_wgmma_visit_kernels: dK/dV CTA = one KV cube, dQ CTA = one
//         query cube over 128-key pairs of visited blocks; a cube of one physical block
//         splits its list between the CTA's two warpgroups; the streamed operands come by
//         TMA as they are, so the tiled tensors' padding rows must be finite: the tiling
//         writes zeros there, the dO pass zero statistics).
//   C64:  fine_dkdv_kernel and fine_dq_kernel below (mma.sync m16n8k16, bf16 in, fp32
//         accumulate).
//
//   fine_fwd_kernel:  (C64) CTA = one 64-row query block (4 warps x 16 rows) of one (b, h);
//                     it visits the physical 64-key blocks of its query cube's selected
//                     KV cubes in ascending cube order (empty blocks are not in the visit
//                     list, partial ones are masked to -inf), K / V double buffered with
//                     cp.async. Per visited block (kVsaTileBlocksC64 = 1): running max,
//                     P = exp2(s - m), P^ = NVFP4(P) per 16 keys against that max, l from
//                     bf16(P), O += bf16(P^) V, O_hp += bf16(P) V: the dense ATTN_QAT_TRAIN
//                     forward's arithmetic (same exp2, same scale table and rounding).
//                     SAVE = false (a forward that records no graph): O alone, without the
//                     O_hp product and without m and l; O is the same bits.
//   (the row statistics {m, 1/l, delta = rowsum(dO * O_hp)} come from vsa_pipeline.cu's dO pass)
//   fine_dkdv_kernel: (C64) CTA = one 64-key block; loops over the 64-query blocks of the query
//                     cubes that selected its cube (inverse lists, ascending), forming
//                     dK, dV in registers (the dense mma.sync dK/dV step: S^T = K Q^T so a
//                     warp's 16 keys are one P group per query, dkdv_phase1/2).
//   fine_dq_kernel:   (C64) CTA = one 64-row query block; loops over the forward's visit list.
// No atomics; every sum has a fixed order, so results are bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <string>

#include "vqad/core/error.h"
#include "vqad/kernels/attention/sm90/attn_qat_bwd_common.cuh"
#include "vqad/kernels/attention/sm90/attn_qat_fwd_visit.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"
#include "vqad/kernels/vsa/vsa_internal.cuh"
#include "vqad/kernels/vsa/vsa_kernels.h"

namespace vqad::kernels::vsa {
namespace {

using nvfp4_device::div6;
using nvfp4_device::e2m1_rne_magnitude;
using nvfp4_device::e4m3_bytes2;
using nvfp4_device::e4m3_value;
using sm90::cp_async16;
using sm90::cp_async_commit;
using sm90::cp_async_wait;
using sm90::fast_exp2;
using sm90::pack_bf16;
using bf16 = __nv_bfloat16;

constexpr int kD = kVsaHeadDim;
constexpr int kBT = kVsaBlockTokens;
constexpr int kWarps = kBT / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks of one row
constexpr int kTileElems = kBT * kD;   // one 64 x 128 tile
static_assert(kVsaTileBlocksC64 == 1, "fine_fwd_kernel updates the running max once per visited block");
static_assert(kVsaTileBlocksC128 == attention::kAttnQatVisitTileBlocks &&
                  attention::kAttnQatVisitBlockRows == kBT && attention::kAttnQatBlockM == 2 * kBT &&
                  attention::kAttnQatVisitHeadDim == kD,
              "the C128 forward is the attention visit-list kernel: 128 query rows = one cube, 2 blocks per tile");

// Element offset of (row, 16-byte chunk) in a [rows][128] bf16 tile whose chunks are
// XOR-swizzled by row % 8 (conflict-free ldmatrix phases).
__device__ __forceinline__ int swz(int row, int chunk) { return row * kD + ((chunk ^ (row & 7)) << 3); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) { sm90::ldmatrix_x4(r, sm90::smem_addr(p)); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  sm90::ldmatrix_x4_trans(r, sm90::smem_addr(p));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  sm90::mma_bf16_m16n8k16(c, a, b0, b1);
}

// Copies the 64 x 128 tile starting at `src` (contiguous rows of 128) into a swizzled tile.
__device__ __forceinline__ void load_tile64(bf16* dst, const bf16* src, int tid) {
#pragma unroll
  for (int i = tid; i < kBT * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow, ch = i % kChunksPerRow;
    cp_async16(dst + swz(r, ch), src + static_cast<int64_t>(r) * kD + ch * 8, true);
  }
}

// Visit list of one lists row: the physical blocks cube * bpc + s, s < ceil(tokens / 64),
// of the `count` cubes in row[] (ascending, as stored), written to out[] in that order.
// Called by one whole warp; returns the number of blocks (on every lane).
__device__ int build_visit_list(const int32_t* row, int count, const int32_t* cube_tokens, int bpc,
                                int* out, int lane) {
  int total = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + lane;
    int nb = 0, cube = 0;
    if (i < count) {
      cube = row[i];
      nb = (cube_tokens[cube] + kBT - 1) / kBT;
    }
    int incl = nb;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int excl = total + incl - nb;
    for (int s = 0; s < nb; ++s) out[excl + s] = cube * bpc + s;
    total += __shfl_sync(0xffffffffu, incl, 31);
  }
  return total;
}

// C128 forward: the visit list of every (b, h, query cube) row, entries
// attn_qat_visit_entry(block, valid tokens) in visiting order and the count; one warp per row.
__global__ void __launch_bounds__(256) visit_lists_kernel(const int32_t* sel_index, const int32_t* sel_count,
                                                          const int32_t* cube_tokens, const int32_t* block_tokens,
                                                          int bpc, int topk, int64_t rows, int32_t* entries,
                                                          int32_t* counts) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int32_t* r = sel_index + row * topk;
  const int count = sel_count[row];
  int32_t* out = entries + row * static_cast<int64_t>(topk) * bpc;
  int total = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + lane;
    int nb = 0, cube = 0;
    if (i < count) {
      cube = r[i];
      nb = (cube_tokens[cube] + kBT - 1) / kBT;
    }
    int incl = nb;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int excl = total + incl - nb;
    for (int s = 0; s < nb; ++s) {
      const int blk = cube * bpc + s;
      out[excl + s] = attention::attn_qat_visit_entry(blk, block_tokens[blk]);
    }
    total += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) counts[row] = total;
}

struct FineParams {
  const bf16* q;  // tiled [B, H, P, D]
  const bf16* k;
  const bf16* v;
  const bf16* d_o;        // tiled dO (backward)
  const float4* stats;    // [B, H, P] (backward)
  bf16* o;                // forward: O; backward dq kernel: dQ; dkdv kernel: dK
  bf16* o_hp;             // forward: O_hp; dkdv kernel: dV
  float* m;
  float* l;
  const int32_t* list_index;  // [B, H, nc, list_stride]
  const int32_t* list_count;  // [B, H, nc]
  const int32_t* cube_tokens;
  const int32_t* block_tokens;
  int H, P, nc, bpc, list_stride;
  float scale, c;  // c = scale * log2(e)
};

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------
// P^ of one element (as the dense forward): with S = 0 (amax <= 6 * 2^-10) inv = inf and
// every element becomes 6 * 0 = +0, the zero block.
__device__ __forceinline__ float fq_p(float p, float S, float inv) { return e2m1_rne_magnitude(p * inv) * S; }

// bf16 fragments of P (pa) and P^ (qa) of one 16-key group from the S accumulator slices
// sa (keys 0-7) and sb (keys 8-15); the bf16(P) row sums are accumulated into lacc by an
// mma against ones (the dense forward's p_fragments, table = (S, 1/S) per E4M3 byte).
template <bool QUANT_P>
__device__ __forceinline__ void p_fragments(const float (&sa)[4], const float (&sb)[4], float c, float neg0,
                                            float neg1, const float2* table, float (&lacc)[4], uint32_t (&pa)[4],
                                            uint32_t (&qa)[4]) {
  float pr[8];
  pr[0] = fast_exp2(fmaf(sa[0], c, neg0));
  pr[1] = fast_exp2(fmaf(sa[1], c, neg0));
  pr[2] = fast_exp2(fmaf(sb[0], c, neg0));
  pr[3] = fast_exp2(fmaf(sb[1], c, neg0));
  pr[4] = fast_exp2(fmaf(sa[2], c, neg1));
  pr[5] = fast_exp2(fmaf(sa[3], c, neg1));
  pr[6] = fast_exp2(fmaf(sb[2], c, neg1));
  pr[7] = fast_exp2(fmaf(sb[3], c, neg1));
  pa[0] = pack_bf16(pr[0], pr[1]);
  pa[1] = pack_bf16(pr[4], pr[5]);
  pa[2] = pack_bf16(pr[2], pr[3]);
  pa[3] = pack_bf16(pr[6], pr[7]);
  const uint32_t ones = 0x3F803F80u;  // two bf16 1.0
  mma_bf16(lacc, pa, ones, ones);
  if constexpr (QUANT_P) {
    float am0 = fmaxf(fmaxf(pr[0], pr[1]), fmaxf(pr[2], pr[3]));
    float am1 = fmaxf(fmaxf(pr[4], pr[5]), fmaxf(pr[6], pr[7]));
    am0 = fmaxf(am0, __shfl_xor_sync(0xffffffffu, am0, 1));
    am1 = fmaxf(am1, __shfl_xor_sync(0xffffffffu, am1, 1));
    am0 = fmaxf(am0, __shfl_xor_sync(0xffffffffu, am0, 2));
    am1 = fmaxf(am1, __shfl_xor_sync(0xffffffffu, am1, 2));
    const uint32_t sbytes = e4m3_bytes2(div6(am0), div6(am1));
    const float2 s0 = table[sbytes & 0x7F];
    const float2 s1 = table[(sbytes >> 8) & 0x7F];
    qa[0] = pack_bf16(fq_p(pr[0], s0.x, s0.y), fq_p(pr[1], s0.x, s0.y));
    qa[1] = pack_bf16(fq_p(pr[4], s1.x, s1.y), fq_p(pr[5], s1.x, s1.y));
    qa[2] = pack_bf16(fq_p(pr[2], s0.x, s0.y), fq_p(pr[3], s0.x, s0.y));
    qa[3] = pack_bf16(fq_p(pr[6], s1.x, s1.y), fq_p(pr[7], s1.x, s1.y));
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) qa[e] = pa[e];
  }
}

size_t fwd_smem_bytes(int list_cap) {
  return static_cast<size_t>(5 * kTileElems) * sizeof(bf16) + 128 * sizeof(float2) +
         static_cast<size_t>(list_cap) * sizeof(int);
}

// SAVE: O_hp, m and l are written for the backward; without it (null o_hp, m, l) the
// kernel drops the O_hp product (QUANT_P) and writes O alone.
template <bool QUANT_P, bool SAVE>
__global__ void __launch_bounds__(kThreads, 2) fine_fwd_kernel(const FineParams p) {
  constexpr bool kHp = QUANT_P && SAVE;  // a separate O_hp accumulator
  extern __shared__ __align__(128) uint8_t smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [64][128]
  bf16* sK = sQ + kTileElems;                 // [2][64][128]
  bf16* sV = sK + 2 * kTileElems;             // [2][64][128]
  float2* table = reinterpret_cast<float2*>(sV + 2 * kTileElems);  // [128] (S, 1/S)
  int* vis = reinterpret_cast<int*>(table + 128);
  __shared__ int s_nvis;

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  if (p.block_tokens[qb] == 0) return;  // padding block: nothing reads its rows
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t head_off = bh * p.P * kD;
  const int qcube = qb / p.bpc;

  load_tile64(sQ, p.q + head_off + static_cast<int64_t>(qb) * kTileElems, tid);
  cp_async_commit();
  if (tid < 128) {
    const float S = e4m3_value(static_cast<uint8_t>(tid));
    table[tid] = make_float2(S, __frcp_rn(S));
  }
  if (warp == 0) {
    const int64_t row = bh * p.nc + qcube;
    const int n = build_visit_list(p.list_index + row * p.list_stride, p.list_count[row], p.cube_tokens,
                                   p.bpc, vis, lane);
    if (lane == 0) s_nvis = n;
  }
  __syncthreads();
  const int nvis = s_nvis;
  if (nvis > 0) {
    load_tile64(sK, p.k + head_off + static_cast<int64_t>(vis[0]) * kTileElems, tid);
    load_tile64(sV, p.v + head_off + static_cast<int64_t>(vis[0]) * kTileElems, tid);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  uint32_t qf[kD / 16][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) ldsm_x4(qf[kk], sQ + swz(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));

  float acc[16][4], acch[kHp ? 16 : 1][4], lacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll
  for (int n = 0; n < (kHp ? 16 : 1); ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acch[n][e] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of rows g, g + 8 (log2 domain)

  for (int it = 0; it < nvis; ++it) {
    const int stage = it & 1;
    if (it + 1 < nvis) {
      const int64_t off = head_off + static_cast<int64_t>(vis[it + 1]) * kTileElems;
      load_tile64(sK + (stage ^ 1) * kTileElems, p.k + off, tid);
      load_tile64(sV + (stage ^ 1) * kTileElems, p.v + off, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* cK = sK + stage * kTileElems;
    const bf16* cV = sV + stage * kTileElems;
    const int kvalid = p.block_tokens[vis[it]];

    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
        uint32_t bk[4];
        ldsm_x4(bk, cK + swz(nn * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        mma_bf16(s[2 * nn], qf[kk], bk[0], bk[1]);
        mma_bf16(s[2 * nn + 1], qf[kk], bk[2], bk[3]);
      }
    }
    if (kvalid < kBT) {  // partial block: absent keys take no part (P = 0)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (n * 8 + 2 * t4 + e >= kvalid) s[n][e] = s[n][2 + e] = -INFINITY;
        }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0 * p.c), mn1 = fmaxf(m1, mx1 * p.c);
    const float al0 = fast_exp2(m0 - mn0), al1 = fast_exp2(m1 - mn1);  // m = -inf: 0
    m0 = mn0;
    m1 = mn1;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      acc[n][0] *= al0, acc[n][1] *= al0, acc[n][2] *= al1, acc[n][3] *= al1;
      if constexpr (kHp) acch[n][0] *= al0, acch[n][1] *= al0, acch[n][2] *= al1, acch[n][3] *= al1;
    }
    lacc[0] *= al0, lacc[1] *= al0, lacc[2] *= al1, lacc[3] *= al1;

#pragma unroll
    for (int ks = 0; ks < kBT / 16; ++ks) {
      uint32_t pa[4], qa[4];
      p_fragments<QUANT_P>(s[2 * ks], s[2 * ks + 1], p.c, -mn0, -mn1, table, lacc, pa, qa);
#pragma unroll
      for (int dn = 0; dn < kD / 16; ++dn) {
        uint32_t bv[4];
        ldsm_x4_trans(bv, cV + swz(ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dn * 2 + (lane >> 4)));
        mma_bf16(acc[2 * dn], qa, bv[0], bv[1]);
        mma_bf16(acc[2 * dn + 1], qa, bv[2], bv[3]);
        if constexpr (kHp) {
          mma_bf16(acch[2 * dn], pa, bv[0], bv[1]);
          mma_bf16(acch[2 * dn + 1], pa, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // the next prefetch overwrites this stage
  }
  cp_async_wait<0>();  // nothing in flight at exit (an empty visit list leaves the first loads)

  const int r0 = qb * kBT + warp * 16 + g;  // tiled rows of this lane: r0, r0 + 8
  const float l0 = lacc[0], l1 = lacc[2];
  bf16* o_base = p.o + head_off;
  bf16* oh_base = SAVE ? p.o_hp + head_off : nullptr;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int col = n * 8 + 2 * t4;
    const int64_t o0 = static_cast<int64_t>(r0) * kD + col, o1 = o0 + 8 * kD;
    *reinterpret_cast<uint32_t*>(o_base + o0) = pack_bf16(acc[n][0] / l0, acc[n][1] / l0);
    *reinterpret_cast<uint32_t*>(o_base + o1) = pack_bf16(acc[n][2] / l1, acc[n][3] / l1);
    if constexpr (kHp) {
      *reinterpret_cast<uint32_t*>(oh_base + o0) = pack_bf16(acch[n][0] / l0, acch[n][1] / l0);
      *reinterpret_cast<uint32_t*>(oh_base + o1) = pack_bf16(acch[n][2] / l1, acch[n][3] / l1);
    } else if (SAVE && oh_base != o_base) {
      *reinterpret_cast<uint32_t*>(oh_base + o0) = pack_bf16(acc[n][0] / l0, acc[n][1] / l0);
      *reinterpret_cast<uint32_t*>(oh_base + o1) = pack_bf16(acc[n][2] / l1, acc[n][3] / l1);
    }
  }
  if (SAVE && t4 == 0) {
    const int64_t so = bh * p.P + r0;
    p.m[so] = m0;
    p.m[so + 8] = m1;
    p.l[so] = l0;
    p.l[so + 8] = l1;
  }
}

// ---------------------------------------------------------------------------
// Backward: dK, dV per 64-key block
// ---------------------------------------------------------------------------
size_t dkdv_smem_bytes(int list_cap) {
  return static_cast<size_t>(6 * kTileElems) * sizeof(bf16) + 2 * kBT * sizeof(float4) +
         static_cast<size_t>(list_cap) * sizeof(int);
}

template <AttnQatBwdPMode MODE>
__global__ void __launch_bounds__(kThreads, 2) fine_dkdv_kernel(const FineParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + kTileElems;
  bf16* sQ = sV + kTileElems;        // [2][64][128]
  bf16* sdO = sQ + 2 * kTileElems;   // [2][64][128]
  float4* sSt = reinterpret_cast<float4*>(sdO + 2 * kTileElems);  // [2][64]
  int* vis = reinterpret_cast<int*>(sSt + 2 * kBT);
  __shared__ int s_nvis;

  const int kb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvalid = p.block_tokens[kb];
  if (kvalid == 0) return;  // padding block: nothing reads its rows
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t head_off = bh * p.P * kD;
  const int kcube = kb / p.bpc;

  load_tile64(sK, p.k + head_off + static_cast<int64_t>(kb) * kTileElems, tid);
  load_tile64(sV, p.v + head_off + static_cast<int64_t>(kb) * kTileElems, tid);
  if (warp == 0) {
    const int64_t row = bh * p.nc + kcube;
    const int n = build_visit_list(p.list_index + row * p.list_stride, p.list_count[row], p.cube_tokens,
                                   p.bpc, vis, lane);
    if (lane == 0) s_nvis = n;
  }
  __syncthreads();
  const int nvis = s_nvis;
  // The loads' addresses are formed from the thread and (b, h) indices at each call (kept
  // across the loop, they spill).
  const uint32_t bh32 = static_cast<uint32_t>(bh);
  auto load_q_block = [&](int qb, int stage) {
    const int t = static_cast<int>(sm90::tid_x_here());
    const int64_t bh_now = sm90::opaque_here(bh32);
    const int64_t off = bh_now * p.P * kD + static_cast<int64_t>(qb) * kTileElems;  // head_off + tile
    load_tile64(sQ + stage * kTileElems, p.q + off, t);
    load_tile64(sdO + stage * kTileElems, p.d_o + off, t);
    const float4* st = p.stats + bh_now * p.P + static_cast<int64_t>(qb) * kBT;
    for (int i = t; i < kBT; i += kThreads) cp_async16(&sSt[stage * kBT + i], st + i, true);
  };
  if (nvis > 0) load_q_block(vis[0], 0);
  cp_async_commit();

  float dk[16][4], dv[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  const int key0 = warp * 16 + g;  // this lane's keys in the block: key0, key0 + 8
  const bool key_tail = warp * 16 + 16 > kvalid;
  const bool key_ok0 = key0 < kvalid, key_ok1 = key0 + 8 < kvalid;

  for (int it = 0; it < nvis; ++it) {
    // (warp / lane re-derived per iteration: kept across the loop they spill)
    const int tid_h = static_cast<int>(sm90::tid_x_here()), warp_h = tid_h >> 5, lane_h = tid_h & 31;
    const int stage = it & 1;
    if (it + 1 < nvis) {
      load_q_block(vis[it + 1], stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* cQ = sQ + stage * kTileElems;
    const bf16* cdO = sdO + stage * kTileElems;
    const float4* cSt = sSt + stage * kBT;

    float s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4], av[4];
      ldsm_x4(ak, sK + swz(warp_h * 16 + (lane_h & 15), kk * 2 + (lane_h >> 4)));
      ldsm_x4(av, sV + swz(warp_h * 16 + (lane_h & 15), kk * 2 + (lane_h >> 4)));
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
        const int off = swz(nn * 16 + (lane_h & 7) + ((lane_h >> 4) << 3), kk * 2 + ((lane_h >> 3) & 1));
        uint32_t bq[4], bd[4];
        ldsm_x4(bq, cQ + off);
        ldsm_x4(bd, cdO + off);
        mma_bf16(s[2 * nn], ak, bq[0], bq[1]);
        mma_bf16(s[2 * nn + 1], ak, bq[2], bq[3]);
        mma_bf16(dp[2 * nn], av, bd[0], bd[1]);
        mma_bf16(dp[2 * nn + 1], av, bd[2], bd[3]);
      }
    }
    uint32_t ap_all[4][4];
    attn_bwd::dkdv_phase1<MODE>(s, cSt, p.c, key_tail, key_ok0, key_ok1, lane_h, ap_all);
#pragma unroll
    for (int kq = 0; kq < kBT / 16; ++kq) {
      uint32_t ads[4];  // dS^T of the group, formed here so that its s / dp die here
      attn_bwd::dkdv_phase2_group<MODE>(s, dp, cSt, lane_h, kq, ads);
#pragma unroll
      for (int dn = 0; dn < kD / 16; ++dn) {
        const int off = swz(kq * 16 + (lane_h & 7) + (((lane_h >> 3) & 1) << 3), dn * 2 + (lane_h >> 4));
        uint32_t bd[4], bq[4];
        ldsm_x4_trans(bd, cdO + off);
        ldsm_x4_trans(bq, cQ + off);
        mma_bf16(dv[2 * dn], ap_all[kq], bd[0], bd[1]);
        mma_bf16(dv[2 * dn + 1], ap_all[kq], bd[2], bd[3]);
        mma_bf16(dk[2 * dn], ads, bq[0], bq[1]);
        mma_bf16(dk[2 * dn + 1], ads, bq[2], bq[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Every row of the block is written (zeros where no query cube selected it).
  bf16* dk_base = p.o + head_off;
  bf16* dv_base = p.o_hp + head_off;
  const int r0 = kb * kBT + key0;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int col = n * 8 + 2 * t4;
    const int64_t o0 = static_cast<int64_t>(r0) * kD + col, o1 = o0 + 8 * kD;
    *reinterpret_cast<uint32_t*>(dk_base + o0) = pack_bf16(dk[n][0] * p.scale, dk[n][1] * p.scale);
    *reinterpret_cast<uint32_t*>(dv_base + o0) = pack_bf16(dv[n][0], dv[n][1]);
    *reinterpret_cast<uint32_t*>(dk_base + o1) = pack_bf16(dk[n][2] * p.scale, dk[n][3] * p.scale);
    *reinterpret_cast<uint32_t*>(dv_base + o1) = pack_bf16(dv[n][2], dv[n][3]);
  }
}

// ---------------------------------------------------------------------------
// Backward: dQ per 64-query block
// ---------------------------------------------------------------------------
size_t dq_smem_bytes(int list_cap) {
  return static_cast<size_t>(6 * kTileElems) * sizeof(bf16) + static_cast<size_t>(list_cap) * sizeof(int);
}

__global__ void __launch_bounds__(kThreads, 2) fine_dq_kernel(const FineParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + kTileElems;
  bf16* sK = sdO + kTileElems;      // [2][64][128]
  bf16* sV = sK + 2 * kTileElems;   // [2][64][128]
  int* vis = reinterpret_cast<int*>(sV + 2 * kTileElems);
  __shared__ int s_nvis;

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  if (p.block_tokens[qb] == 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t head_off = bh * p.P * kD;
  const int qcube = qb / p.bpc;

  load_tile64(sQ, p.q + head_off + static_cast<int64_t>(qb) * kTileElems, tid);
  load_tile64(sdO, p.d_o + head_off + static_cast<int64_t>(qb) * kTileElems, tid);
  cp_async_commit();
  if (warp == 0) {
    const int64_t row = bh * p.nc + qcube;
    const int n = build_visit_list(p.list_index + row * p.list_stride, p.list_count[row], p.cube_tokens,
                                   p.bpc, vis, lane);
    if (lane == 0) s_nvis = n;
  }
  __syncthreads();
  const int nvis = s_nvis;
  auto load_kv_block = [&](int kb, int stage) {
    const int64_t off = head_off + static_cast<int64_t>(kb) * kTileElems;
    load_tile64(sK + stage * kTileElems, p.k + off, tid);
    load_tile64(sV + stage * kTileElems, p.v + off, tid);
  };
  if (nvis > 0) load_kv_block(vis[0], 0);
  cp_async_commit();

  const int r0 = qb * kBT + warp * 16 + g;  // tiled rows r0, r0 + 8
  const float4 st0 = p.stats[bh * p.P + r0];
  const float4 st1 = p.stats[bh * p.P + r0 + 8];

  cp_async_wait<1>();
  __syncthreads();
  // Q and dO fragments are re-read from shared memory every step (registers go to dQ, S, dP).
  float dq[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;

  for (int it = 0; it < nvis; ++it) {
    const int stage = it & 1;
    if (it + 1 < nvis) {
      load_kv_block(vis[it + 1], stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* cK = sK + stage * kTileElems;
    const bf16* cV = sV + stage * kTileElems;
    const int kvalid = p.block_tokens[vis[it]];

    float s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qf[4], df[4];
      ldsm_x4(qf, sQ + swz(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      ldsm_x4(df, sdO + swz(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
        const int off = swz(nn * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1));
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, cK + off);
        ldsm_x4(bv, cV + off);
        mma_bf16(s[2 * nn], qf, bk[0], bk[1]);
        mma_bf16(s[2 * nn + 1], qf, bk[2], bk[3]);
        mma_bf16(dp[2 * nn], df, bv[0], bv[1]);
        mma_bf16(dp[2 * nn + 1], df, bv[2], bv[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p0 = fast_exp2(fmaf(s[j][e], p.c, -st0.x)) * st0.y;
        float p1 = fast_exp2(fmaf(s[j][2 + e], p.c, -st1.x)) * st1.y;
        if (j * 8 + 2 * t4 + e >= kvalid) p0 = p1 = 0.0f;
        dp[j][e] = p0 * (dp[j][e] - st0.z);
        dp[j][2 + e] = p1 * (dp[j][2 + e] - st1.z);
      }
    }
#pragma unroll
    for (int kq = 0; kq < kBT / 16; ++kq) {
      const uint32_t ads[4] = {pack_bf16(dp[2 * kq][0], dp[2 * kq][1]), pack_bf16(dp[2 * kq][2], dp[2 * kq][3]),
                               pack_bf16(dp[2 * kq + 1][0], dp[2 * kq + 1][1]),
                               pack_bf16(dp[2 * kq + 1][2], dp[2 * kq + 1][3])};
#pragma unroll
      for (int dn = 0; dn < kD / 16; ++dn) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, cK + swz(kq * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dn * 2 + (lane >> 4)));
        mma_bf16(dq[2 * dn], ads, bk[0], bk[1]);
        mma_bf16(dq[2 * dn + 1], ads, bk[2], bk[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  bf16* dq_base = p.o + head_off;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int col = n * 8 + 2 * t4;
    const int64_t o0 = static_cast<int64_t>(r0) * kD + col, o1 = o0 + 8 * kD;
    *reinterpret_cast<uint32_t*>(dq_base + o0) = pack_bf16(dq[n][0] * p.scale, dq[n][1] * p.scale);
    *reinterpret_cast<uint32_t*>(dq_base + o1) = pack_bf16(dq[n][2] * p.scale, dq[n][3] * p.scale);
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------
constexpr float kLog2e = 1.4426950408889634f;

FineParams base_params(const VsaConfig& c) {
  FineParams p{};
  p.cube_tokens = c.tiling.cube_tokens;
  p.block_tokens = c.tiling.block_tokens;
  p.H = c.heads;
  p.P = c.tiling.padded_len;
  p.nc = c.tiling.num_cubes;
  p.bpc = c.tiling.blocks_per_cube;
  p.scale = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(static_cast<float>(kD));
  p.c = p.scale * kLog2e;
  return p;
}

dim3 block_grid(const VsaConfig& c) {
  return dim3(static_cast<unsigned>(c.tiling.num_cubes * c.tiling.blocks_per_cube), static_cast<unsigned>(c.heads),
              static_cast<unsigned>(c.batch));
}

constexpr const char* kFineForwardOp = "vsa fine forward";
constexpr const char* kFineBackwardOp = "vsa fine backward (wgmma)";

}  // namespace

size_t fine_forward_scratch_bytes(const VsaConfig& c) {
  if (vsa_fine_forward_kernel(c.tiling.blocks_per_cube) != VsaFineForward::kWgmmaPairs) return 0;
  const size_t rows = static_cast<size_t>(c.batch) * c.heads * c.tiling.num_cubes;
  const size_t entries = rows * static_cast<size_t>(c.topk) * c.tiling.blocks_per_cube * 4;
  return (entries + 255) / 256 * 256 + (rows * 4 + 255) / 256 * 256;
}

void launch_fine_forward(const VsaConfig& c, const void* tiled_q, const void* tiled_k, const void* tiled_v,
                         const int32_t* sel_index, const int32_t* sel_count, void* o_tiled, void* o_hp_tiled,
                         float* m, float* l, void* scratch, cudaStream_t stream) {
  VQAD_LAUNCH_CHECK(c.head_dim == kD, kFineForwardOp, detail::shape_str(c), "expected head dim ", kD, ", found ",
                    c.head_dim);
  VQAD_LAUNCH_CHECK(tiled_q && tiled_k && tiled_v && sel_index && sel_count && o_tiled, kFineForwardOp,
                    detail::shape_str(c), "expected every operand buffer and o, found a null one");
  // o_hp, m and l: all three (the forward of a training call) or none (O alone).
  const bool save = o_hp_tiled != nullptr;
  VQAD_LAUNCH_CHECK((m != nullptr) == save && (l != nullptr) == save, kFineForwardOp, detail::shape_str(c),
                    "expected o_hp, m and l all set (saved for the backward) or all null (O alone), found o_hp ",
                    o_hp_tiled, ", m ", m, ", l ", l);
  const bool qp = c.quantize && c.quant_p;
  if (vsa_fine_forward_kernel(c.tiling.blocks_per_cube) == VsaFineForward::kWgmmaPairs) {
    VQAD_LAUNCH_CHECK(scratch != nullptr && reinterpret_cast<uintptr_t>(scratch) % 256 == 0, kFineForwardOp,
                      detail::shape_str(c), "expected a 256-byte aligned scratch of ", fine_forward_scratch_bytes(c),
                      " bytes, found address ", scratch);
    VQAD_LAUNCH_CHECK(static_cast<int64_t>(c.tiling.num_cubes) * c.tiling.blocks_per_cube <=
                          static_cast<int64_t>(attention::kAttnQatVisitMaxBlock) + 1,
                      kFineForwardOp, detail::shape_str(c), "expected at most ",
                      attention::kAttnQatVisitMaxBlock + 1, " physical blocks (what a visit entry holds), found ",
                      static_cast<int64_t>(c.tiling.num_cubes) * c.tiling.blocks_per_cube);
    const int64_t rows = static_cast<int64_t>(c.batch) * c.heads * c.tiling.num_cubes;
    const int stride = c.topk * c.tiling.blocks_per_cube;
    int32_t* entries = static_cast<int32_t*>(scratch);
    int32_t* counts = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(scratch) +
                                                 (static_cast<size_t>(rows) * stride * 4 + 255) / 256 * 256);
    VQAD_LAUNCH_CHECK((rows + 7) / 8 <= 0x7fffffff, kFineForwardOp, detail::shape_str(c),
                      "expected at most 2^34 (batch, head, cube) rows, found ", rows);
    visit_lists_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(
        sel_index, sel_count, c.tiling.cube_tokens, c.tiling.block_tokens, c.tiling.blocks_per_cube, c.topk, rows,
        entries, counts);
    VQAD_CUDA_CHECK_LAUNCH("vsa visit_lists_kernel");
    // Tiled [B, H, P, D] as BLHD strides: b = H * P * D, l = D, h = P * D.
    const int64_t P = c.tiling.padded_len;
    const BlhdStrides st{static_cast<int64_t>(c.heads) * P * kD, kD, P * kD, 1};
    attention::AttnQatFwdParams fp{};
    fp.q = BlhdIn{tiled_q, st};
    fp.k = BlhdIn{tiled_k, st};
    fp.v = BlhdIn{tiled_v, st};
    fp.o = BlhdOut{o_tiled, st};
    // one write without P quantization; none without a backward (the kernel without O_hp)
    fp.o_hp = !save || o_hp_tiled == o_tiled ? BlhdOut{} : BlhdOut{o_hp_tiled, st};
    fp.m = m;
    fp.l = l;
    fp.batch = c.batch;
    fp.heads = c.heads;
    fp.len_q = fp.len_kv = static_cast<int>(P);  // one 128-row query tile per cube
    fp.head_dim = kD;
    fp.softmax_scale = c.softmax_scale > 0.0f ? c.softmax_scale : 0.0f;  // 0: 1/sqrt(D), as base_params
    fp.quant_p = qp;
    // q_block_rows: a query cube of one physical block leaves the CTA's second
    // warpgroup idle (its rows are padding and are not written).
    const attention::AttnQatFwdVisit visit{entries, counts, stride, c.tiling.block_tokens};
    try {
      attention::launch_attn_qat_fwd_visit(fp, visit, stream);
    } catch (const vqad::Error&) {
      throw;
    } catch (const std::exception& e) {
      throw vqad::Error(std::string(kFineForwardOp) + " (C128 wgmma): " + e.what() + " (" + detail::shape_str(c) +
                        ")");
    }
    return;
  }
  FineParams p = base_params(c);
  p.q = static_cast<const bf16*>(tiled_q);
  p.k = static_cast<const bf16*>(tiled_k);
  p.v = static_cast<const bf16*>(tiled_v);
  p.o = static_cast<bf16*>(o_tiled);
  p.o_hp = static_cast<bf16*>(o_hp_tiled);
  p.m = m;
  p.l = l;
  p.list_index = sel_index;
  p.list_count = sel_count;
  p.list_stride = c.topk;
  const size_t smem = fwd_smem_bytes(c.topk * c.tiling.blocks_per_cube);
  auto launch = [&](auto kernel) {
    detail::allow_dynamic_smem(kernel, smem, kFineForwardOp, "visit lists", c);
    kernel<<<block_grid(c), kThreads, smem, stream>>>(p);
    VQAD_CUDA_CHECK_LAUNCH("vsa fine_fwd_kernel");
  };
  if (qp && save)
    launch(fine_fwd_kernel<true, true>);
  else if (qp)
    launch(fine_fwd_kernel<true, false>);
  else if (save)
    launch(fine_fwd_kernel<false, true>);
  else
    launch(fine_fwd_kernel<false, false>);
}

namespace detail {

void launch_fine_dkdv(const VsaConfig& c, const void* tiled_q, const void* tiled_k, const void* tiled_v,
                      const void* d_o_tiled, const void* stats, const int32_t* inv_index, const int32_t* inv_count,
                      void* dk_tiled, void* dv_tiled, cudaStream_t stream) {
  FineParams p = base_params(c);
  p.q = static_cast<const bf16*>(tiled_q);
  p.k = static_cast<const bf16*>(tiled_k);
  p.v = static_cast<const bf16*>(tiled_v);
  p.d_o = static_cast<const bf16*>(d_o_tiled);
  p.stats = static_cast<const float4*>(stats);
  p.o = static_cast<bf16*>(dk_tiled);
  p.o_hp = static_cast<bf16*>(dv_tiled);
  p.list_index = inv_index;
  p.list_count = inv_count;
  p.list_stride = c.tiling.num_cubes;
  const size_t smem = dkdv_smem_bytes(c.tiling.num_cubes * c.tiling.blocks_per_cube);
  auto launch = [&](auto kernel) {
    allow_dynamic_smem(kernel, smem, "vsa fine dK/dV", "inverse lists", c);
    kernel<<<block_grid(c), kThreads, smem, stream>>>(p);
    VQAD_CUDA_CHECK_LAUNCH("vsa fine_dkdv_kernel");
  };
  const AttnQatBwdPMode mode = !(c.quantize && c.quant_p) ? AttnQatBwdPMode::kNone
                               : c.bwd_fastvideo          ? AttnQatBwdPMode::kFastVideo
                                                          : AttnQatBwdPMode::kConsistent;
  switch (mode) {
    case AttnQatBwdPMode::kConsistent: launch(fine_dkdv_kernel<AttnQatBwdPMode::kConsistent>); break;
    case AttnQatBwdPMode::kFastVideo: launch(fine_dkdv_kernel<AttnQatBwdPMode::kFastVideo>); break;
    case AttnQatBwdPMode::kNone: launch(fine_dkdv_kernel<AttnQatBwdPMode::kNone>); break;
  }
}

void launch_fine_dq(const VsaConfig& c, const void* tiled_q, const void* tiled_k, const void* tiled_v,
                    const void* d_o_tiled, const void* stats, const int32_t* sel_index, const int32_t* sel_count,
                    void* dq_tiled, cudaStream_t stream) {
  FineParams p = base_params(c);
  p.q = static_cast<const bf16*>(tiled_q);
  p.k = static_cast<const bf16*>(tiled_k);
  p.v = static_cast<const bf16*>(tiled_v);
  p.d_o = static_cast<const bf16*>(d_o_tiled);
  p.stats = static_cast<const float4*>(stats);
  p.o = static_cast<bf16*>(dq_tiled);
  p.list_index = sel_index;
  p.list_count = sel_count;
  p.list_stride = c.topk;
  const size_t smem = dq_smem_bytes(c.topk * c.tiling.blocks_per_cube);
  allow_dynamic_smem(fine_dq_kernel, smem, "vsa fine dQ", "visit lists", c);
  fine_dq_kernel<<<block_grid(c), kThreads, smem, stream>>>(p);
  VQAD_CUDA_CHECK_LAUNCH("vsa fine_dq_kernel");
}

size_t fine_backward_scratch_bytes(const VsaConfig& c) {
  if (vsa_fine_forward_kernel(c.tiling.blocks_per_cube) != VsaFineForward::kWgmmaPairs) return 0;
  const size_t rows = static_cast<size_t>(c.batch) * c.heads * c.tiling.num_cubes;
  const size_t bpc = c.tiling.blocks_per_cube;
  auto a256 = [](size_t x) { return (x + 255) / 256 * 256; };
  return a256(rows * c.topk * bpc * 4) + a256(rows * static_cast<size_t>(c.tiling.num_cubes) * bpc * 4) +
         2 * a256(rows * 4);
}

void launch_fine_bwd_wgmma(const VsaConfig& c, const void* tiled_q, const void* tiled_k, const void* tiled_v,
                           const void* d_o_tiled, const void* stats, const int32_t* sel_index,
                           const int32_t* sel_count, const int32_t* inv_index, const int32_t* inv_count,
                           const FineBwdRaster& out, void* scratch, cudaStream_t stream) {
  VQAD_LAUNCH_CHECK(vsa_fine_forward_kernel(c.tiling.blocks_per_cube) == VsaFineForward::kWgmmaPairs,
                    kFineBackwardOp, shape_str(c), "expected 2 physical blocks per cube, found ",
                    c.tiling.blocks_per_cube);
  VQAD_LAUNCH_CHECK(scratch != nullptr && reinterpret_cast<uintptr_t>(scratch) % 256 == 0, kFineBackwardOp,
                    shape_str(c), "expected a 256-byte aligned scratch of ", fine_backward_scratch_bytes(c),
                    " bytes, found address ", scratch);
  const int64_t rows = static_cast<int64_t>(c.batch) * c.heads * c.tiling.num_cubes;
  const int bpc = c.tiling.blocks_per_cube, nc = c.tiling.num_cubes;
  auto a256 = [](size_t x) { return (x + 255) / 256 * 256; };
  uint8_t* cur = static_cast<uint8_t*>(scratch);
  int32_t* kv_entries = reinterpret_cast<int32_t*>(cur);
  cur += a256(static_cast<size_t>(rows) * c.topk * bpc * 4);
  int32_t* q_entries = reinterpret_cast<int32_t*>(cur);
  cur += a256(static_cast<size_t>(rows) * nc * bpc * 4);
  int32_t* kv_counts = reinterpret_cast<int32_t*>(cur);
  cur += a256(static_cast<size_t>(rows) * 4);
  int32_t* q_counts = reinterpret_cast<int32_t*>(cur);
  VQAD_LAUNCH_CHECK((rows + 7) / 8 <= 0x7fffffff, kFineBackwardOp, shape_str(c),
                    "expected at most 2^34 (batch, head, cube) rows, found ", rows);
  const unsigned grid = static_cast<unsigned>((rows + 7) / 8);
  // The forward's visit lists (dQ) and the inverse lists expanded to query blocks (dK/dV).
  visit_lists_kernel<<<grid, 256, 0, stream>>>(sel_index, sel_count, c.tiling.cube_tokens, c.tiling.block_tokens,
                                               bpc, c.topk, rows, kv_entries, kv_counts);
  VQAD_CUDA_CHECK_LAUNCH("vsa visit_lists_kernel (dQ)");
  visit_lists_kernel<<<grid, 256, 0, stream>>>(inv_index, inv_count, c.tiling.cube_tokens, c.tiling.block_tokens,
                                               bpc, nc, rows, q_entries, q_counts);
  VQAD_CUDA_CHECK_LAUNCH("vsa visit_lists_kernel (dK/dV)");

  const FineParams fp = base_params(c);
  const int64_t P = c.tiling.padded_len;
  const int64_t sb = static_cast<int64_t>(c.heads) * P * kD, sh = P * kD, sl = kD;
  auto in = [&](const void* x) { return attn_bwd::InTensor{static_cast<const bf16*>(x), sb, sl, sh}; };
  attn_bwd::KernelParams kp{};
  kp.B = c.batch;
  kp.H = c.heads;
  kp.D = kD;
  kp.Lq = kp.Lkv = static_cast<int>(P);
  kp.scale = fp.scale;
  kp.c = fp.c;
  kp.q = in(tiled_q);
  kp.k = in(tiled_k);
  kp.v = in(tiled_v);
  kp.dout = in(d_o_tiled);
  kp.ohp = attn_bwd::InTensor{nullptr, 0, 0, 0};
  auto raster = [&](const BlhdOut& x, const char* name) {
    check_blhd(kFineBackwardOp, name, x, [&] { return shape_str(c); });
    return attn_bwd::OutTensor{static_cast<bf16*>(x.data), x.stride.b, x.stride.l, x.stride.h};
  };
  kp.dq = raster(out.dq, "dq");
  kp.dk = raster(out.dk, "dk");
  kp.dv = raster(out.dv, "dv");
  kp.stats = static_cast<float4*>(const_cast<void*>(stats));
  attn_bwd::VisitLists vl{};
  vl.q_entries = q_entries;
  vl.q_counts = q_counts;
  vl.q_stride = nc * bpc;
  vl.kv_entries = kv_entries;
  vl.kv_counts = kv_counts;
  vl.kv_stride = c.topk * bpc;
  vl.key_rows = c.tiling.block_tokens;
  vl.kv_tiles = vl.q_tiles = nc;
  vl.row_to_token = c.tiling.slot_to_token;
  vl.coarse_dq = out.dq_c;
  vl.coarse_dk = out.dk_c;
  vl.coarse_dv = out.dv_c;
  vl.coarse_group_rows = bpc * kBT;
  vl.coarse_groups = nc;
  const AttnQatBwdPMode mode = !(c.quantize && c.quant_p) ? AttnQatBwdPMode::kNone
                               : c.bwd_fastvideo          ? AttnQatBwdPMode::kFastVideo
                                                          : AttnQatBwdPMode::kConsistent;
  int device = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  attn_bwd::launch_wgmma_visit_kernels(kp, vl, mode, device_info(device), stream);
}

}  // namespace detail
}  // namespace vqad::kernels::vsa
