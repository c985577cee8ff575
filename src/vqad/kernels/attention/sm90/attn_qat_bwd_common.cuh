// Device code shared by the ATTN_QAT_TRAIN backward kernels (mma.sync and wgmma
// implementations): kernel parameters, PTX wrappers, the P fake quantization of the dV
// path, and the launch entry points of each implementation.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#include "vqad/kernels/common/launch.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"

namespace vqad::kernels::attn_bwd {

// Head dims: attention::attn_qat_head_dim_supported (template parameter D of the dense
// kernels); the visit-list kernels take 128 (attention::kAttnQatVisitHeadDim).
using attention::attn_qat_head_dim_supported;
using bf16 = __nv_bfloat16;

struct InTensor {
  const bf16* p;
  int64_t sb, sl, sh;
};
struct OutTensor {
  bf16* p;
  int64_t sb, sl, sh;
};

struct KernelParams {
  int B, H, Lq, Lkv;
  int D;  // head dim, attn_qat_head_dim_supported
  float scale, c;  // c = scale * log2(e)
  InTensor q, k, v, dout, ohp;
  const float* m;
  const float* l;
  OutTensor dq, dk, dv;
  float4* stats;  // [B, H, Lq]: {m, 1/l, delta, 0}
  // Ordered dQ accumulation of the wgmma kernels (dq_accum_layout below):
  // fp32 partial sums [groups][B*H][query blocks of 64][8192] (64 x 128 at D = 128;
  // two 64-key parts of 64 x 64 at D = 64) and one
  // counter per (b*h, group, query block).
  float* dq_acc;
  int* dq_sem;
  int dq_groups;
  // Tail split (dkdv_split_plan): CTAs from split_first on cover one key block in
  // split_parts query ranges each and write fp32 partial dK, dV to dkv_part.
  int split_first, split_parts;
  float* dkv_part;
};

// The call's shape for launch errors (kernels/common/launch.h).
inline std::string kernel_shape_str(const KernelParams& kp) {
  return attention_shape_str(kp.B, kp.H, kp.Lq, kp.Lkv, kp.D);
}

// dQ accumulation of the sm_90 backward (spec: deterministic). The dK/dV CTA of
// key block j also forms dQ_i += dS_ij K_j for every query block i and adds it,
// in fp32, to a partial sum in global memory with one bulk reduction per block.
// The additions into one partial sum happen in a fixed order (increasing j, a
// counter per block says whose turn it is), so dQ is bitwise reproducible. The
// key blocks are split over `groups` partial sums (j mod groups) so that the CTAs
// running at the same time on the GPU do not all wait on one chain; a last pass
// adds the groups in order. `groups` depends only on the shape (not the device),
// so results are reproducible across GPUs too.
constexpr int kDqSmsForGrouping = 132;  // the SM count the grouping is tuned for (H100/H200)
constexpr int kDqChainPerWave = 12;     // CTAs of one chain expected to run at once
inline int dq_accum_groups(int64_t batch_heads, int kv_blocks) {
  const int64_t per_head = (kDqSmsForGrouping + batch_heads - 1) / batch_heads;
  const int64_t g = (per_head + kDqChainPerWave - 1) / kDqChainPerWave;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({g, kv_blocks, 16})));
}
inline int dq_query_blocks(int len_q) { return (len_q + 63) / 64; }

// Tail split of the ordered-dQ kernel. Its CTAs (one per key block and batch*head) all
// take the same time, so a last partial wave leaves SMs idle: at (1,3,31200) 732 CTAs
// on 132 SMs end with 72 CTAs running alone. The last `tail` CTAs (the highest key
// blocks) are therefore each split into `parts` CTAs over contiguous query ranges, which
// write fp32 partial dK, dV; dkdv_combine_kernel adds the parts in order. The plan
// depends only on the shape (the SM count is the constant of dq_accum_groups), so
// results are reproducible across GPUs.
struct DkdvSplitPlan {
  int64_t first = 0;  // first split key-block CTA (index in the unsplit order; = all CTAs: none)
  int tail = 0;       // split key-block CTAs
  int parts = 1;      // CTAs per split key block (1: no split)
};
// Query blocks per part at least: with 8, (1,12,8192) split its 108 tail CTAs into 6
// parts of ~21 blocks and got 3% slower; with 32 it is not split.
constexpr int kSplitMinQueryBlocks = 32;
constexpr int kSplitMaxParts = 8;
inline DkdvSplitPlan dkdv_split_plan(int64_t batch_heads, int kv_blocks, int len_q) {
  DkdvSplitPlan plan;
  const int64_t total = batch_heads * kv_blocks;
  plan.first = total;
  const int tail = static_cast<int>(total % kDqSmsForGrouping);
  const int max_parts = std::min(kSplitMaxParts, dq_query_blocks(len_q) / kSplitMinQueryBlocks);
  if (tail == 0 || max_parts < 2) return plan;
  // Tail time in units of one unsplit CTA: ceil(tail * R / SMs) rounds of 1 / R each.
  double best = 1.0;
  for (int r = 2; r <= max_parts; ++r) {
    const double t = static_cast<double>((static_cast<int64_t>(tail) * r + kDqSmsForGrouping - 1) /
                                         kDqSmsForGrouping) / r;
    if (t < best - 1e-9) best = t, plan.parts = r;
  }
  if (plan.parts > 1) {
    plan.tail = tail;
    plan.first = total - tail;
  }
  return plan;
}

// Workspace of the wgmma kernels, in byte offsets from its start: the [B, H, Lq] float4
// row statistics (padded to 256 bytes), the dQ partial sums [groups][B*H][query
// blocks][8192] fp32, their turn counters (padded to 16 bytes) and the tail split's
// fp32 dK / dV parts [tail][parts][2][128 x 128] (at D = 64 the first half of each part
// is used). The mma.sync kernels use the statistics only.
struct WgmmaWorkspace {
  size_t stats = 0;        // bytes of the statistics (unpadded)
  size_t dq_acc = 0, dq_sem = 0, dkv_part = 0, total = 0;  // offsets, total size
  int dq_groups = 1;
  DkdvSplitPlan split;
};
inline WgmmaWorkspace wgmma_workspace(int64_t batch_heads, int len_q, int len_kv) {
  WgmmaWorkspace w;
  const int kv_blocks = (len_kv + 127) / 128;
  w.stats = static_cast<size_t>(batch_heads) * len_q * sizeof(float4);
  w.dq_groups = dq_accum_groups(batch_heads, kv_blocks);
  w.split = dkdv_split_plan(batch_heads, kv_blocks, len_q);
  const size_t dq_blocks = static_cast<size_t>(w.dq_groups) * batch_heads * dq_query_blocks(len_q);
  w.dq_acc = (w.stats + 255) / 256 * 256;
  w.dq_sem = w.dq_acc + dq_blocks * 64 * 128 * sizeof(float);
  w.dkv_part = w.dq_sem + (dq_blocks * sizeof(int) + 15) / 16 * 16;
  w.total = w.dkv_part + static_cast<size_t>(w.split.tail) * w.split.parts * 2 * 128 * 128 * sizeof(float);
  return w;
}

// Host entry points of the two implementations (defined in attn_qat_bwd.cu and
// attn_qat_bwd_wgmma.cu); the row-statistics pre-pass has already run.
void launch_mma_kernels(const KernelParams& kp, AttnQatBwdPMode mode, const DeviceInfo& dev,
                        cudaStream_t stream);
void launch_wgmma_kernels(const KernelParams& kp, AttnQatBwdPMode mode, const DeviceInfo& dev,
                          cudaStream_t stream);
// Visit-list form of the wgmma backward (the recompute form: dK/dV CTAs of 128
// keys, then dQ CTAs of 128 queries, one launch), for the VSA fine stage (kernels/vsa).
// Entries are attn_qat_fwd_visit.h's (block << 7) | valid rows of 64-row blocks.
struct VisitLists {
  // dK/dV CTA = 128-key tile t of (b, h): the 64-row query blocks to visit (ascending),
  // row (b * H + h) * kv_tiles + t; an empty list writes zero dK, dV.
  const int32_t* q_entries;
  const int32_t* q_counts;
  int q_stride;
  // dQ CTA = 128-row query tile t: the visited 64-row KV blocks in the forward's order,
  // two per 128-key step (a last odd one leaves the other half masked).
  const int32_t* kv_entries;
  const int32_t* kv_counts;
  int kv_stride;
  // [Lkv / 64]: valid rows of each 64-row block (all b, h); self-attention over one
  // tiling, so also the query blocks' (a warpgroup of only padding rows idles).
  const int32_t* key_rows;
  int kv_tiles, q_tiles;
  // Optional scatter of the results (the VSA pipeline's untiling; null: dQ, dK, dV go to
  // their rows of p.dq / p.dk / p.dv): row r of (b, h) goes to row row_to_token[r] of
  // p.dq / p.dk / p.dv (-1: not written), and when coarse_* is set, row
  // (b * H + h) * coarse_groups + r / coarse_group_rows of it (fp32 [.., D]) is added to
  // the BF16-rounded result before the final rounding: bf16(bf16(x) + coarse).
  const int32_t* row_to_token;
  const float* coarse_dq;
  const float* coarse_dk;
  const float* coarse_dv;
  int coarse_group_rows, coarse_groups;
};
void launch_wgmma_visit_kernels(const KernelParams& kp, const VisitLists& vl, AttnQatBwdPMode mode,
                                const DeviceInfo& dev, cudaStream_t stream);

// ---------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------
// From kernels/common/sm90_ptx.cuh and nvfp4_math.h (the shared definitions).
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return sm90::smem_addr(p); }
using sm90::cp_async16;
using sm90::cp_async_commit;
using sm90::cp_async_wait;
using sm90::fast_exp2;
using sm90::pack_bf16;
using nvfp4_device::div6;
using nvfp4_device::e2m1_round_nonneg;
using nvfp4_device::e2m1_round_unsat;
using nvfp4_device::e4m3_value;
using nvfp4_device::e4m3x2_bytes;
using nvfp4_device::e4m3x2_values;
using nvfp4_device::scale_reciprocal;

// ---------------------------------------------------------------------------
// P fake quantization on the transposed score tile of one warp.
//
// The warp holds 16 keys (rows) x 64 queries (8 n-tiles of 8 columns) in the
// mma accumulator layout: lane (g = lane/4, t = lane%4) has rows g and g+8 of
// columns 8j + 2t + e. One NVFP4 group of P is one column (16 keys of one query
// row), spread over the 8 lanes with equal t. The 16 column maxima of a lane are
// reduce-scattered over lane bits 4, 8, 16 (each lane ends with 2 finished
// columns), the two scales are computed there, and their E4M3 bytes are
// all-gathered back: 18 shuffles instead of 48 and 2 scale computations per lane
// instead of 16.
//
// x[j][0..3] (rows g, g, g+8, g+8) are quantized to e2m1(x * inv_S) * S * post
// (post = the per-query factor applied after quantization: 1/l in consistent
// mode, 1 in fastvideo mode) and written as the BF16 A fragments of the
// following Pb^T . dO product: a[kq] covers queries 16kq .. 16kq + 15.
// ---------------------------------------------------------------------------
// With a table (kTable): table[b] = (S, 1/S) of the E4M3 byte b (b = 0: (0, 0)) in
// shared memory replaces the per-column E4M3 decode and reciprocal.
// kAddMax: the E2M1 rounding's constant by one add-max (e2m1_round_unsat, then the
// saturation at 6), the same values as e2m1_round_nonneg in one instruction less per element
// (the dense warp-specialised kernel; the visit-list kernels spill with it).
//
// The two halves apart: column16x64_max reduce-scatters the column maxima (z[e] of lane
// (g, t) is the maximum of column 8g + 2t + e; with key_tail, rows g / g + 8 take part only
// where ok0 / ok1); fq_columns16x64_from_max quantizes with those maxima as the group amaxes.
__device__ __forceinline__ void column16x64_max(const float (&x)[8][4], int lane, float (&z)[2],
                                                bool key_tail = false, bool ok0 = true, bool ok1 = true) {
  float v[16];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float lo = x[j][e], hi = x[j][2 + e];
      if (key_tail) {
        lo = ok0 ? lo : -INFINITY;
        hi = ok1 ? hi : -INFINITY;
      }
      v[2 * j + e] = fmaxf(lo, hi);
    }
  }
  const bool h16 = lane & 16, h8 = lane & 8, h4 = lane & 4;
  float u[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float send = h16 ? v[i] : v[i + 8];
    const float keep = h16 ? v[i + 8] : v[i];
    u[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 16));
  }
  float w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = h8 ? u[i] : u[i + 4];
    const float keep = h8 ? u[i + 4] : u[i];
    w[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 8));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = h4 ? w[i] : w[i + 2];
    const float keep = h4 ? w[i + 2] : w[i];
    z[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 4));
  }
}

template <bool kPostMul, bool kTable = false, bool kAddMax = false>
__device__ __forceinline__ void fq_columns16x64_from_max(const float (&x)[8][4], const float (&z)[2],
                                                         const float (&post)[16], int lane, uint32_t (&a)[4][4],
                                                         const float2* table = nullptr) {
  const bool h16 = lane & 16, h8 = lane & 8, h4 = lane & 4;
  // Scales of this lane's two finished columns, as an E4M3 byte pair
  // (amax / 6 in IEEE fp32, then round-to-nearest-even with saturation).
  uint16_t pk;
  if constexpr (kTable) {
    const float hi = div6(z[1]), lo = div6(z[0]);
    pk = e4m3x2_bytes(lo, hi);
  } else {
    const float hi = __fdiv_rn(z[1], 6.0f), lo = __fdiv_rn(z[0], 6.0f);
    pk = e4m3x2_bytes(lo, hi);
  }
  // All-gather the bytes: word k of `words` holds the scales of columns 4k..4k+3.
  const uint32_t mine = pk;
  uint32_t other = __shfl_xor_sync(0xffffffffu, mine, 4);
  const uint32_t w4 = h4 ? (other | (mine << 16)) : (mine | (other << 16));
  other = __shfl_xor_sync(0xffffffffu, w4, 8);
  const uint32_t lo = h8 ? other : w4, hi = h8 ? w4 : other;
  const uint32_t olo = __shfl_xor_sync(0xffffffffu, lo, 16);
  const uint32_t ohi = __shfl_xor_sync(0xffffffffu, hi, 16);
  const uint32_t words[4] = {h16 ? olo : lo, h16 ? ohi : hi, h16 ? lo : olo, h16 ? hi : ohi};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Columns 4k + 2*half (+1) = n-tile j = 2k + half, e = 0 / 1.
      const int j = 2 * k + half;
      float s_e[2], inv_e[2];
      if constexpr (kTable) {
        const float2 t0 = table[(words[k] >> (16 * half)) & 0x7F];
        const float2 t1 = table[(words[k] >> (16 * half + 8)) & 0x7F];
        s_e[0] = t0.x, s_e[1] = t1.x, inv_e[0] = t0.y, inv_e[1] = t1.y;
      } else {
        const float2 s2 = e4m3x2_values(static_cast<uint16_t>(words[k] >> (16 * half)));
        s_e[0] = s2.x, s_e[1] = s2.y;
        inv_e[0] = scale_reciprocal(s2.x), inv_e[1] = scale_reciprocal(s2.y);
      }
      float y[4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float inv = inv_e[e];
        const float out = kPostMul ? s_e[e] * post[2 * j + e] : s_e[e];
        if constexpr (kAddMax) {
          y[e] = fminf(e2m1_round_unsat(x[j][e] * inv), 6.0f) * out;
          y[2 + e] = fminf(e2m1_round_unsat(x[j][2 + e] * inv), 6.0f) * out;
        } else {
          y[e] = e2m1_round_nonneg(x[j][e] * inv) * out;
          y[2 + e] = e2m1_round_nonneg(x[j][2 + e] * inv) * out;
        }
      }
      a[k][half * 2] = pack_bf16(y[0], y[1]);
      a[k][half * 2 + 1] = pack_bf16(y[2], y[3]);
    }
  }
}

template <bool kPostMul, bool kTable = false, bool kAddMax = false>
__device__ __forceinline__ void fq_columns16x64(const float (&x)[8][4], const float (&post)[16],
                                                int lane, uint32_t (&a)[4][4],
                                                const float2* table = nullptr) {
  float z[2];
  column16x64_max(x, lane, z);
  fq_columns16x64_from_max<kPostMul, kTable, kAddMax>(x, z, post, lane, a, table);
}

// dK/dV step, element-wise part, for one warp's 16 keys x 64 queries, in two
// phases so that phase 1 can run while the tensor cores still compute dP^T.
// st: the 64 queries' {m, 1/l, delta} of this query block.
//
// Phase 1: s (raw scores) -> e = exp2(s*c - m) (consistent) or P = e/l (other
// modes), kept for phase 2; a <- BF16 A fragments of Pb^T.
// kRawMax: each group's amax is taken from the raw scores before any exp2, as
// exp2(fma(max s, c, -m)) (times 1/l in fastvideo mode), so the scales wait on the maxima
// and not on the column's exp2s. The same value as the maximum of the group's e (or P):
// s -> RN(s c - m) is non-decreasing for c > 0, so are ex2.approx.ftz (GPU test
// Nvfp4DeviceForms.FastExp2IsMonotoneOverEveryFloat) and e -> RN(e / l); absent keys
// (key_tail) are -inf there, whose exp2 is the 0 they have in the other form.
template <AttnQatBwdPMode MODE, bool kTable = false, bool kAddMax = false, bool kRawMax = false>
__device__ __forceinline__ void dkdv_phase1(float (&s)[8][4], const float4* st, float c,
                                            bool key_tail, bool key_ok0, bool key_ok1, int lane,
                                            uint32_t (&a)[4][4], const float2* table = nullptr) {
  const int t4 = lane & 3;
  constexpr bool kRaw = kRawMax && MODE != AttnQatBwdPMode::kNone;
  float z[2];
  if constexpr (kRaw) {
    column16x64_max(s, lane, z, key_tail, key_ok0, key_ok1);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 ml = *reinterpret_cast<const float2*>(&st[(lane >> 2) * 8 + 2 * t4 + e]);
      z[e] = fast_exp2(fmaf(z[e], c, -ml.x));
      if constexpr (MODE != AttnQatBwdPMode::kConsistent) z[e] *= ml.y;
    }
  }
  float inv_l[16];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 ml = *reinterpret_cast<const float2*>(&st[j * 8 + 2 * t4 + e]);
      inv_l[2 * j + e] = ml.y;
      float e0 = fast_exp2(fmaf(s[j][e], c, -ml.x));
      float e1 = fast_exp2(fmaf(s[j][2 + e], c, -ml.x));
      if (key_tail) {  // absent keys take no part in the tail group's scale
        e0 = key_ok0 ? e0 : 0.0f;
        e1 = key_ok1 ? e1 : 0.0f;
      }
      if constexpr (MODE == AttnQatBwdPMode::kConsistent) {
        s[j][e] = e0;
        s[j][2 + e] = e1;
      } else {
        s[j][e] = e0 * ml.y;
        s[j][2 + e] = e1 * ml.y;
      }
    }
  }
  if constexpr (kRaw) {
    fq_columns16x64_from_max<MODE == AttnQatBwdPMode::kConsistent, kTable, kAddMax>(s, z, inv_l, lane, a,
                                                                                    table);
  } else if constexpr (MODE == AttnQatBwdPMode::kConsistent) {
    fq_columns16x64<true, kTable, kAddMax>(s, inv_l, lane, a, table);
  } else if constexpr (MODE == AttnQatBwdPMode::kFastVideo) {
    fq_columns16x64<false, kTable, kAddMax>(s, inv_l, lane, a, table);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a[j >> 1][(j & 1) * 2] = pack_bf16(s[j][0], s[j][1]);
      a[j >> 1][(j & 1) * 2 + 1] = pack_bf16(s[j][2], s[j][3]);
    }
  }
}

// Phase 2: dS^T = P * (dP^T - delta) as BF16 A fragments (s from phase 1), for the 16
// queries of group kq (columns 2 kq and 2 kq + 1). The mma.sync kernels form each group right
// before its dK product, so s / dp of the group die there (with all four groups formed first
// they spill).
template <AttnQatBwdPMode MODE>
__device__ __forceinline__ void dkdv_phase2_group(const float (&s)[8][4], const float (&dp)[8][4],
                                                  const float4* st, int lane, int kq, uint32_t (&a)[4]) {
  const int t4 = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    const int j = 2 * kq + jj;
    float d[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float4 r = st[j * 8 + 2 * t4 + e];
      const float f = MODE == AttnQatBwdPMode::kConsistent ? r.y : 1.0f;  // e -> P
      d[e] = s[j][e] * f * (dp[j][e] - r.z);
      d[2 + e] = s[j][2 + e] * f * (dp[j][2 + e] - r.z);
    }
    a[jj * 2] = pack_bf16(d[0], d[1]);
    a[jj * 2 + 1] = pack_bf16(d[2], d[3]);
  }
}
// All four groups.
template <AttnQatBwdPMode MODE>
__device__ __forceinline__ void dkdv_phase2(const float (&s)[8][4], const float (&dp)[8][4],
                                            const float4* st, int lane, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int kq = 0; kq < 4; ++kq) dkdv_phase2_group<MODE>(s, dp, st, lane, kq, a[kq]);
}

}  // namespace vqad::kernels::attn_bwd
