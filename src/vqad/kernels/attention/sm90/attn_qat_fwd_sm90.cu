// ATTN_QAT_TRAIN forward (spec/attention.md): one-pass flash attention over the
// fake-quantized Q^, K^, V^ with P fake-quantized per 16 keys in registers.
//
// Warp-specialised (sm_90a). A CTA owns 128 query rows of one (batch, head) and has three
// warpgroups:
//   - a producer: one thread issues every load as a TMA copy (tensor maps over the BLHD
//     views, kernels/common/tma.h) into mbarrier-guarded stages: Q once, then K and V
//     tiles of BLOCK_N = 128 keys, each with its own full / empty barrier pair, three
//     stages deep. Its warpgroup gives its registers back (setmaxnreg).
//   - two consumers of 64 query rows each, with 240 registers per thread: S = Q^ K^T as a
//     chain of wgmma m64n128k16 with both operands in shared memory; the running max; then
//     P and P^ per 16-key group in registers, each group's two P.V products (P^ and
//     bf16(P) as the register A operand, V read MN-major) and its bf16(P) row sums (a
//     wgmma m64n8k16 against a block of ones) queued asynchronously while the next
//     groups' exp2 and quantization run (two groups a step with P quantization).
// The consumers meet no CTA-wide barrier: each waits only for its own data and releases
// each stage when its last read of it has finished. They start apart (the second waits
// once, at the start, until the first has queued its first kSkewGroups 16-key groups: a
// quarter of a tile with P quantization, half without) and then run free, so one's
// softmax and P quantization overlap the other's tensor-core work. Without P quantization
// (BF16 mode) the accumulators leave room for the next tile's Q^ K^T to be queued behind
// the current P.V products (kLookahead).
// docs/performance.md has the measured schedules.
//
// Key split of the last wave (dense KV; attention_qat.h, attn_qat_fwd_split.h): the grid is
// 1-D over units, the whole tiles first, then the later and the earlier KV tiles of the last
// split_tiles query tiles as separate CTAs. The later part first runs Q^ K^T over the
// earlier KV tiles for the running max alone (their V stages pass through empty), so every
// P tile is quantized against the maximum the unsplit tile has there; the two parts meet in
// the workspace (split_exchange) and the second to finish stores the tile.
//
// Head dim D = 128 or 64 (template parameter). The tiles are stored as [D / 64][ROWS][64]
// bf16: each 64-channel half of a row is a separate [ROWS][128 B] block in the
// 128-byte-swizzled K-major layout that TMA writes (SWIZZLE_128B) and the wgmma
// descriptors read (8-row atoms of 1024 B); O is a wgmma m64nDk16 accumulator.
//
// Register layout that makes P quantization cheap: in the wgmma S accumulator a quad of 4
// lanes holds one row's 8 keys of an n8 slice (2 each), so two adjacent slices give the
// quad a row's whole 16-key group; the group amax is a max over 4 local values and two
// quad shuffles. The same registers, packed to bf16, are the A fragment of the P.V
// product for that k16 step (the FlashAttention identity), so P and P^ never touch shared
// memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/attention/sm90/attn_qat_fwd_visit.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"
#include "vqad/kernels/common/tma.h"

namespace vqad::kernels::attention {
namespace {

constexpr int kBM = kAttnQatBlockM;
constexpr int kBN = kAttnQatBlockN;
static_assert(kBM == 128 && kBN == 128, "the forward kernel: 128 x 128 tiles");
// Head dims: attn_qat_head_dim_supported (kernel template parameter D), a tile row being
// one or two 64-channel halves of 128 bytes.

// The kernel's parameters: AttnQatFwdParams with each view's pointer and strides apart,
// filled by the launcher after its checks.
struct FwdKernelParams {
  void* o;
  void* o_hp;  // may be null
  BlhdStrides o_stride, o_hp_stride;
  float* m;  // may be null
  float* l;  // may be null
  int heads, len_q, len_kv;
  // Key split (DenseKv only; split_tiles = 0: none). The grid is 1-D over units: [0,
  // tiles - split_tiles) whole tiles, [tiles - split_tiles, tiles) the later KV tiles
  // [split_key_tile, kv_tiles) of the last split_tiles tiles, [tiles, tiles + split_tiles)
  // their earlier KV tiles [0, split_key_tile). Tile t = (b * heads + h) * m_blocks + m.
  int m_blocks, tiles, split_tiles, split_key_tile;
  float* part;      // [split_tiles][2: earlier, later][kBM rows][kPartCols] fp32
  int* part_count;  // [split_tiles] parts finished (zeroed by the launcher)
};

// Schedule (named constants; docs/performance.md has the measured alternatives).
constexpr int kStages = 3;               // K and V stages
constexpr int kThreads = 384;            // producer warpgroup + two consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr int kProducerRegs = 24;        // setmaxnreg: 128 x 24 + 256 x 240 <= 64K
constexpr int kConsumerRegs = 240;
// 16-key groups the first consumer queues before the second one starts (a quarter of a
// tile with P quantization: 1 - 2% faster than half a tile at the 31.2k-token shapes, and
// faster than 1, 3 or 6; BF16 mode keeps half a tile, as measured before;
// docs/performance.md).
template <bool QUANT_P>
constexpr int kSkewGroups = QUANT_P ? 2 : 4;
static_assert(kSkewGroups<true> > 0 && kSkewGroups<true> < kBN / 16 && kSkewGroups<false> > 0 &&
                  kSkewGroups<false> < kBN / 16,
              "skew: 1 to 7 groups");
// 16-key groups per P.V step with P quantization (pv_groups, which checks that its group
// ranges, split at kSkewGroups<true>, are whole steps).
constexpr int kPvStepGroups = 2;
// With P quantization and no O_hp (the forward of a call that needs no gradient) the
// high-precision accumulator's registers are free for BF16 mode's lookahead (the next
// tile's Q^ K^T queued behind the P.V products), but it measured 2 - 5% slower than the
// loop without it (docs/performance.md, "The QAT forward without O_hp").
constexpr bool kLookaheadWithoutHp = false;
constexpr int kStartBarrier = 1;         // named barrier: consumer 1 may start
constexpr int kPartBarrier = 2;          // named barrier: both consumers' partial tile written
// A partial tile's row: acc (D), acch (D), m, l, padded to 16 bytes.
template <int D>
constexpr int kPartCols = 2 * D + 4;
enum class Role : int { kWhole = 0, kEarlier = 1, kLater = 2 };
template <int D>
constexpr uint32_t kTileBytes = 128 * D * 2;  // one Q, K or V tile (128 rows)
// (S, RN(1/S)) for every E4M3 byte: a shared-memory lookup replaces the IEEE reciprocal
// routine per 16-key group. Byte 0 gives (0, inf), the zero block.
constexpr int kScaleTableBytes = 128 * 8;
// bf16 ones for the row-sum wgmma: the 16 x 8 B operand's two core matrices.
constexpr int kOnesBytes = 256;
constexpr int kBarriers = 1 + 4 * kStages;  // Q; full K, full V, empty K, empty V per stage
template <int D>
constexpr int kSmemBytes =
    static_cast<int>((1 + 2 * kStages) * kTileBytes<D>) + kScaleTableBytes + kOnesBytes + 8 * kBarriers + 1024;

using sm90::smem_addr;

// wgmma exists only in the arch-specific sm_90a target; other targets compile a kernel
// that traps (the launcher accepts only sm_90 devices).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VQAD_FWD_SM90A 1
#else
#define VQAD_FWD_SM90A 0
#endif

#if VQAD_FWD_SM90A
// The tiles' wgmma descriptors (128-byte swizzle, 8-row atoms 1024 B apart):
//   K-major (Q, K; k = head dim): leading offset unused (16 B);
//   MN-major (V read as B[key][channel]): the 64-channel halves are the leading offset;
// the ones block of the row-sum wgmma is K-major without swizzle (core matrices 128 B
// apart along K, 256 B along N).
// The operand at tile + off is gmma::desc_at (kernels/common/gmma_desc.h): the tile's fields
// formed once and each k-step's offset added.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, uint32_t off = 0) {
  return gmma::desc_at(tile, 16, 1024, off, gmma::Swizzle::k128B);
}
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, uint32_t off = 0) {
  return gmma::desc_at(tile, kBN * 128, 1024, off, gmma::Swizzle::k128B);
}
__device__ __forceinline__ uint64_t desc_ones(uint32_t addr) { return gmma::desc(addr, 128, 256, gmma::Swizzle::kNone); }

using sm90::fence_proxy_async;
using sm90::flat;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
__device__ __forceinline__ void wgmma_wait0() { sm90::wgmma_wait<0>(); }

// D[64 x 8] += A[64 x 16] . B[16 x 8], A from registers, B K-major from shared memory
// without swizzle (used with a block of bf16 ones: D accumulates the row sums of A).
__device__ __forceinline__ void wgmma_m64n8k16_rs(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
#endif  // VQAD_FWD_SM90A

using sm90::fast_exp2;
using sm90::pack_bf16;
using nvfp4_device::div6;
using nvfp4_device::e2m1_round_unsat;  // nearest E2M1 grid value, ties to even, not saturated
using nvfp4_device::e4m3_bytes2;
using nvfp4_device::e4m3_value;
using nvfp4_device::sat6_bf16x2;

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Scale of one 16-key group of rows g and g + 8: amax = max P = exp2(fma(gm, c, -m)) with gm
// the group's largest raw score (group_max). Exact for finite scores and masked ones
// (-inf -> P = 0): s -> RN(s * c - m) is non-decreasing for c > 0, and so is
// ex2.approx.ftz (checked on every non-NaN float by the GPU test of the device forms), so
// the largest P comes from the largest score. (A score that overflowed to +inf makes the
// row's output NaN either way.) This takes the scale off the exp2 -> amax chain of the
// group's fragments.
// table[b] = (bf16x2 bits of (S, S), RN(1/S)) of E4M3 byte b; S = e4m3(amax / 6).
struct GroupScale {
  uint32_t S0, S1;   // (S, S) as a bf16 pair, rows g and g + 8
  float inv0, inv1;  // RN(1 / S)
};
__device__ __forceinline__ GroupScale group_scale(float gm0, float gm1, float c, float neg0, float neg1,
                                                  const float2* table) {
  const float am0 = fast_exp2(fmaf(gm0, c, neg0));
  const float am1 = fast_exp2(fmaf(gm1, c, neg1));
  const uint32_t sbytes = e4m3_bytes2(div6(am0), div6(am1));
  const float2 s0 = table[sbytes & 0x7F];
  const float2 s1 = table[(sbytes >> 8) & 0x7F];
  return GroupScale{__float_as_uint(s0.x), __float_as_uint(s1.x), s0.y, s1.y};
}

// bf16 fragments of P (pa) and P^ (qa) of one 16-key group, from the S accumulator
// slices sa (keys 0-7) and sb (keys 8-15). P^ = min(e2m1(P / S), 6) * S: the rounding
// stays in fp32, the saturation and the product by S run on bf16 pairs (exact: the
// rounded values are small multiples of a power of two, and the product has at most 6
// significant bits). P >= 0 and finite; with amax <= 6 * 2^-10 the scale S rounds to 0:
// 1/S = inf, every element saturates to 6 (0 * inf = NaN included: min.bf16x2 returns the
// other operand) and 6 * 0 = +0, which is the spec's zero block without a branch.
template <bool QUANT_P>
__device__ __forceinline__ void p_fragments(const float (&sa)[4], const float (&sb)[4], float c, float neg0,
                                            float neg1, const GroupScale& sc, uint32_t (&pa)[4], uint32_t (&qa)[4]) {
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
  if constexpr (QUANT_P) {
    auto q2 = [](float x, float y, float inv, uint32_t S) {
      return mul_bf16x2(sat6_bf16x2(pack_bf16(e2m1_round_unsat(x * inv), e2m1_round_unsat(y * inv))), S);
    };
    qa[0] = q2(pr[0], pr[1], sc.inv0, sc.S0);
    qa[1] = q2(pr[4], pr[5], sc.inv1, sc.S1);
    qa[2] = q2(pr[2], pr[3], sc.inv0, sc.S0);
    qa[3] = q2(pr[6], pr[7], sc.inv1, sc.S1);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) qa[e] = pa[e];
  }
}

#if VQAD_FWD_SM90A
// S = Q^ K^T of one warpgroup (64 rows) against a whole K tile: D / 16 k-steps over the
// head dim, the first overwriting S; WAIT: waited for before returning.
template <int D, bool WAIT>
__device__ __forceinline__ void qk_wgmma(float (&s)[16][4], uint32_t a_base, uint32_t sK) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t koff = (kk & 3) * 32;
    sm90::wgmma_m64n128k16_ss<0>(flat(s), desc_kmajor(a_base, (kk >> 2) * kBM * 128 + koff),
                                 desc_kmajor(sK, (kk >> 2) * kBN * 128 + koff), kk > 0 ? 1 : 0);
  }
  wgmma_commit();
  if constexpr (WAIT) wgmma_wait0();
}

// P, P^ of the 16-key groups [KS0, KS1) of S and their P.V and row-sum wgmmas
// (asynchronous: the tensor cores work on one step while the next step's exp2 and
// quantization run). With P quantization a step is two groups: their two chains of exp2,
// scale and E2M1 rounding interleave, which the warps need (a consumer warp waits on those
// chains' latencies, two warps per scheduler), and their six wgmmas follow one fence. Up
// to 4% less time at D = 128 (the most at 8192 tokens), 2 - 3% at D = 64 than one group a
// step; three or four groups spill at D = 128 (docs/performance.md). Without P
// quantization a step is one group (the BF16 mode's lookahead holds the next S).
// gm: the groups' raw-score maxima (group_max; QUANT_P only).
template <int D, int KS0, int KS1, bool QUANT_P, bool HP, int NG>
__device__ __forceinline__ void pv_groups(const float (&s)[16][4], const float (&gm)[NG][2], float (&acc)[D / 8][4],
                                          float (&acch)[D / 8][4], float (&lacc)[4], const float (&m_run)[2], float c,
                                          uint32_t sV, const float2* table, uint64_t ones_desc) {
  const float neg0 = -m_run[0], neg1 = -m_run[1];
  constexpr int kStep = QUANT_P ? kPvStepGroups : 1;
  static_assert((KS1 - KS0) % kStep == 0, "pv_groups: whole steps");
#pragma unroll
  for (int ks0 = KS0; ks0 < KS1; ks0 += kStep) {
    uint32_t pa[kStep][4], qa[kStep][4];
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      const int ks = ks0 + u;
      GroupScale sc{};
      if constexpr (QUANT_P) sc = group_scale(gm[ks][0], gm[ks][1], c, neg0, neg1, table);
      p_fragments<QUANT_P>(s[2 * ks], s[2 * ks + 1], c, neg0, neg1, sc, pa[u], qa[u]);
    }
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      const uint64_t dv = desc_mn(sV, (ks0 + u) * 16 * 128);
      sm90::wgmma_m64nNk16_rs<D, 1>(flat(acc), qa[u], dv);
      if constexpr (QUANT_P && HP) sm90::wgmma_m64nNk16_rs<D, 1>(flat(acch), pa[u], dv);
      wgmma_m64n8k16_rs(lacc, pa[u], ones_desc);
    }
  }
  wgmma_commit();
}
#endif

// KV-source policies: which rows tile j's keys come from (the producer's TMA boxes) and
// which of them are masked (the consumers).
//
// DenseKv: keys [j * BN, (j + 1) * BN) of K / V; keys past len_kv (last tile only)
// arrive as zeros (TMA) and are masked.
struct DenseKv {
  static constexpr bool kCanIdle = false;
  static constexpr bool kSplit = true;  // 1-D grid of units (FwdKernelParams)
  static constexpr int kBoxRows = kBN;  // one TMA box per 64-channel half
  int len;
  __device__ __forceinline__ static DenseKv make(const FwdKernelParams& p, const AttnQatFwdVisit&, int) {
    return DenseKv{p.len_kv};
  }
  __device__ __forceinline__ int n_tiles() const { return (len + kBN - 1) / kBN; }
  template <int D>
  __device__ __forceinline__ void load(const void* map, uint32_t dst, uint32_t bar, int j, int h, int b) const {
#pragma unroll
    for (int half = 0; half < D / 64; ++half) sm90::tma_load_4d(dst + half * kBN * 128, map, bar, 64 * half, j * kBN, h, b);
  }
  __device__ __forceinline__ bool idle(int) const { return false; }
  __device__ __forceinline__ int mask_info(int j) const { return j; }
  template <int NT>
  __device__ __forceinline__ void mask(float (&s)[NT][4], int j, int t) const {
    if ((j + 1) * kBN > len) {
      const int key_base = j * kBN + 2 * t;
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key_base + i * 8 + (e & 1) >= len) s[i][e] = -INFINITY;
    }
  }
};

// VisitKv (attn_qat_fwd_visit.h): tile j = visit entries 2j and 2j + 1 of this query
// tile's list, each a 64-row block loaded by TMA into one half of the 128-key tile (rows
// 0-63, 64-127 of both channel halves). Rows at and past a block's valid count are
// masked; a missing second entry (2j + 1 past the list) loads rows at len_kv, which TMA
// fills with zeros, and is masked whole.
struct VisitKv {
  static constexpr bool kCanIdle = true;  // see idle()
  static constexpr bool kSplit = false;   // grid (query tiles, heads, batch)
  static constexpr int kBoxRows = kAttnQatVisitBlockRows;
  const int32_t* entries;  // this query tile's list
  int count;
  const int32_t* q_rows;  // valid rows of this query tile's two 64-row blocks, or null
  int len;
  __device__ __forceinline__ int entry(int i) const { return i < count ? __ldg(entries + i) : 0; }
  __device__ __forceinline__ static VisitKv make(const FwdKernelParams& p, const AttnQatFwdVisit& v, int m_block) {
    const int64_t row = (static_cast<int64_t>(blockIdx.z) * p.heads + blockIdx.y) * gridDim.x + m_block;
    return VisitKv{v.entries + row * v.stride, __ldg(v.counts + row),
                   v.q_block_rows != nullptr ? v.q_block_rows + 2 * m_block : nullptr, p.len_kv};
  }
  // At least one tile (an empty list, outside the contract, then reads zeros, fully
  // masked, instead of leaving the consumers waiting).
  __device__ __forceinline__ int n_tiles() const { return max(1, (count + 1) / 2); }
  template <int D>
  __device__ __forceinline__ void load(const void* map, uint32_t dst, uint32_t bar, int j, int h, int b) const {
    static_assert(kBN == kAttnQatVisitTileBlocks * kAttnQatVisitBlockRows, "visit tiles are two 64-row blocks");
#pragma unroll
    for (int slot = 0; slot < kAttnQatVisitTileBlocks; ++slot) {
      const int i = 2 * j + slot;
      const int row = i < count ? (__ldg(entries + i) >> kAttnQatVisitCountBits) * kAttnQatVisitBlockRows : len;
      const uint32_t d = dst + slot * kAttnQatVisitBlockRows * 128;
#pragma unroll
      for (int half = 0; half < D / 64; ++half) sm90::tma_load_4d(d + half * kBN * 128, map, bar, 64 * half, row, h, b);
    }
  }
  // Warpgroup wg's 64 query rows are all padding (a VSA query cube of one physical
  // block): it computes and stores nothing (it still releases every stage).
  __device__ __forceinline__ bool idle(int wg) const { return q_rows != nullptr && __ldg(q_rows + wg) == 0; }
  // Valid keys of tile j's halves, packed (n0 | n1 << 8).
  __device__ __forceinline__ int mask_info(int j) const {
    return (entry(2 * j) & 127) | ((entry(2 * j + 1) & 127) << 8);
  }
  template <int NT>
  __device__ __forceinline__ void mask(float (&s)[NT][4], int info, int t) const {
    const int n0 = info & 255, n1 = info >> 8;
    if (n0 < kAttnQatVisitBlockRows || n1 < kAttnQatVisitBlockRows) {  // uniform per tile
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int n = i < NT / 2 ? n0 : n1;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if ((i % (NT / 2)) * 8 + 2 * t + (e & 1) >= n) s[i][e] = -INFINITY;
      }
    }
  }
};

// Row maxima of this warp's rows g and g + 8 of S (raw dot products; a quad holds a row).
template <int NT>
__device__ __forceinline__ void tile_row_max(const float (&s)[NT][4], float& mx0, float& mx1) {
  mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
    mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}

// Largest raw score of each 16-key group (n8 slices 2 ks, 2 ks + 1) of rows g (gm[ks][0])
// and g + 8 (gm[ks][1]), over the quad; the row max is the max of these (the same value
// as tile_row_max: max is exact).
template <int KS>
__device__ __forceinline__ void group_max(const float (&s)[2 * KS][4], float (&gm)[KS][2]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    float a0 = fmaxf(fmaxf(s[2 * ks][0], s[2 * ks][1]), fmaxf(s[2 * ks + 1][0], s[2 * ks + 1][1]));
    float a1 = fmaxf(fmaxf(s[2 * ks][2], s[2 * ks][3]), fmaxf(s[2 * ks + 1][2], s[2 * ks + 1][3]));
    a0 = fmaxf(a0, __shfl_xor_sync(0xffffffffu, a0, 1));
    a1 = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, 1));
    gm[ks][0] = fmaxf(a0, __shfl_xor_sync(0xffffffffu, a0, 2));
    gm[ks][1] = fmaxf(a1, __shfl_xor_sync(0xffffffffu, a1, 2));
  }
}

// The two parts of a split tile meet here (both consumer warpgroups of each part run it).
// Each thread writes its rows' fp32 state (acc, acch, m, l) to its part's slot, the
// consumers synchronise, one thread counts the part in; the part that counts second reads
// the other's state back (the same rows and columns this thread wrote, so no exchange
// between threads), combines the two in the fixed order earlier, later,
//   m = max(m_e, m_l), acc = acc_e 2^(m_e - m) + acc_l 2^(m_l - m), the same for acch
// (WITH_HP: the QAT kernel that keeps the high-precision accumulator) and l,
// and stores the tile's O, O_hp, m and l as the unsplit epilogue does. The result does not
// depend on which part finished first. (Each column's read, combine and store happen
// together: the stores keep ptxas from hoisting all reads, which would not fit in the
// registers.)
template <int D, bool WITH_HP>
__device__ __forceinline__ void split_exchange(const FwdKernelParams& p, bool later, int slot, int q0, int h, int b,
                                               int warp, int lane, const float (&acc)[D / 8][4],
                                               const float (&acch)[D / 8][4], const float (&m_run)[2], float l0,
                                               float l1, int* s_arrived) {
  constexpr int kC = kPartCols<D>;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = (warp - 4) * 16 + g;  // this thread's rows of the tile: r0, r0 + 8
  float* mine = p.part + (static_cast<int64_t>(slot) * 2 + (later ? 1 : 0)) * kBM * kC;
  const float* other = p.part + (static_cast<int64_t>(slot) * 2 + (later ? 0 : 1)) * kBM * kC;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int d = i * 8 + 2 * t;
    *reinterpret_cast<float2*>(mine + r0 * kC + d) = make_float2(acc[i][0], acc[i][1]);
    *reinterpret_cast<float2*>(mine + (r0 + 8) * kC + d) = make_float2(acc[i][2], acc[i][3]);
    if constexpr (WITH_HP) {
      *reinterpret_cast<float2*>(mine + r0 * kC + D + d) = make_float2(acch[i][0], acch[i][1]);
      *reinterpret_cast<float2*>(mine + (r0 + 8) * kC + D + d) = make_float2(acch[i][2], acch[i][3]);
    }
  }
  if (t == 0) {
    *reinterpret_cast<float2*>(mine + r0 * kC + 2 * D) = make_float2(m_run[0], l0);
    *reinterpret_cast<float2*>(mine + (r0 + 8) * kC + 2 * D) = make_float2(m_run[1], l1);
  }
  __threadfence();  // this thread's state is visible device-wide before the part is counted
  sm90::named_barrier_sync(kPartBarrier, 256);
  if (warp == 4 && lane == 0) *s_arrived = atomicAdd(p.part_count + slot, 1);
  sm90::named_barrier_sync(kPartBarrier, 256);
  if (*s_arrived == 0) return;  // the other part combines
  __threadfence();
  // e = the earlier part's value, l = the later part's: operands chosen by role before any
  // arithmetic, so both parts would compute the same bits.
  const float2 o0 = __ldcg(reinterpret_cast<const float2*>(other + r0 * kC + 2 * D));
  const float2 o1 = __ldcg(reinterpret_cast<const float2*>(other + (r0 + 8) * kC + 2 * D));
  const float me0 = later ? o0.x : m_run[0], ml0 = later ? m_run[0] : o0.x;
  const float me1 = later ? o1.x : m_run[1], ml1 = later ? m_run[1] : o1.x;
  const float m0 = fmaxf(me0, ml0), m1 = fmaxf(me1, ml1);
  const float sc_e[2] = {sm90::fast_exp2(me0 - m0), sm90::fast_exp2(me1 - m1)};
  const float sc_l[2] = {sm90::fast_exp2(ml0 - m0), sm90::fast_exp2(ml1 - m1)};
  const float le0 = later ? o0.y : l0, ll0 = later ? l0 : o0.y;
  const float le1 = later ? o1.y : l1, ll1 = later ? l1 : o1.y;
  const float lc0 = le0 * sc_e[0] + ll0 * sc_l[0];
  const float lc1 = le1 * sc_e[1] + ll1 * sc_l[1];
  const float inv_l0 = 1.0f / lc0, inv_l1 = 1.0f / lc1;
  const auto mix = [&](float mine_v, float other_v, int r) {
    const float e = later ? other_v : mine_v, l = later ? mine_v : other_v;
    return e * sc_e[r] + l * sc_l[r];
  };
  const int row0 = q0 + r0, row1 = row0 + 8;
  const bool ok0 = row0 < p.len_q, ok1 = row1 < p.len_q;
  using bf = __nv_bfloat16;
  bf* o = static_cast<bf*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
  bf* ohp = p.o_hp ? static_cast<bf*>(p.o_hp) + b * p.o_hp_stride.b + h * p.o_hp_stride.h : nullptr;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int d = i * 8 + 2 * t;
    const float2 a0 = __ldcg(reinterpret_cast<const float2*>(other + r0 * kC + d));
    const float2 a1 = __ldcg(reinterpret_cast<const float2*>(other + (r0 + 8) * kC + d));
    const float x0 = mix(acc[i][0], a0.x, 0), x1 = mix(acc[i][1], a0.y, 0);
    const float x2 = mix(acc[i][2], a1.x, 1), x3 = mix(acc[i][3], a1.y, 1);
    if (ok0) *reinterpret_cast<uint32_t*>(o + row0 * p.o_stride.l + d) = pack_bf16(x0 * inv_l0, x1 * inv_l0);
    if (ok1) *reinterpret_cast<uint32_t*>(o + row1 * p.o_stride.l + d) = pack_bf16(x2 * inv_l1, x3 * inv_l1);
    if (ohp != nullptr) {
      float y0 = x0, y1 = x1, y2 = x2, y3 = x3;  // without P quantization O_hp = O
      if constexpr (WITH_HP) {
        const float2 h0 = __ldcg(reinterpret_cast<const float2*>(other + r0 * kC + D + d));
        const float2 h1 = __ldcg(reinterpret_cast<const float2*>(other + (r0 + 8) * kC + D + d));
        y0 = mix(acch[i][0], h0.x, 0), y1 = mix(acch[i][1], h0.y, 0);
        y2 = mix(acch[i][2], h1.x, 1), y3 = mix(acch[i][3], h1.y, 1);
      }
      if (ok0) *reinterpret_cast<uint32_t*>(ohp + row0 * p.o_hp_stride.l + d) = pack_bf16(y0 * inv_l0, y1 * inv_l0);
      if (ok1) *reinterpret_cast<uint32_t*>(ohp + row1 * p.o_hp_stride.l + d) = pack_bf16(y2 * inv_l1, y3 * inv_l1);
    }
  }
  if (t == 0) {
    const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * p.len_q;
    if (p.m != nullptr) {
      if (ok0) p.m[stat + row0] = m0;
      if (ok1) p.m[stat + row1] = m1;
    }
    if (p.l != nullptr) {
      if (ok0) p.l[stat + row0] = lc0;
      if (ok1) p.l[stat + row1] = lc1;
    }
  }
}

template <int D, bool QUANT_P, bool HP, class KV>
__global__ void __launch_bounds__(kThreads, 1)
    attn_qat_fwd_kernel(const FwdKernelParams p, float scale_log2, const AttnQatFwdVisit visit,
                        const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v) {
#if VQAD_FWD_SM90A
  constexpr int kNT = kBN / 8;   // n8 slices of S per warp
  constexpr int kKS = kBN / 16;  // 16-key groups
  constexpr int kDT = D / 8;     // n8 slices of O
  constexpr uint32_t kTile = kTileBytes<D>;
  // BF16 mode: the next tile's Q^ K^T is queued behind the P.V products. With P
  // quantization and O_hp, QAT's two P accumulators at D = 128 leave no registers for the
  // P fragments that the queued products hold; at D = 64 they fit, but the queued form
  // measured 1-1.5% slower (docs/performance.md). Without O_hp: kLookaheadWithoutHp.
  constexpr bool kLookahead = !QUANT_P || (!HP && kLookaheadWithoutHp);
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t base = smem_addr(smem_raw);
  const uint32_t sQ = (base + 1023u) & ~1023u;  // 1024-byte swizzle atoms
  const uint32_t sK0 = sQ + kTile;                // K stage s at sK0 + s * kTile
  const uint32_t sV0 = sK0 + kStages * kTile;
  const uint32_t sTable = sV0 + kStages * kTile;
  const float2* scale_table = reinterpret_cast<const float2*>(smem_raw + (sTable - base));
  const uint32_t sOnes = sTable + kScaleTableBytes;
  const uint32_t sBar = sOnes + kOnesBytes;
  const uint32_t bar_q = sBar;
  const auto full_k = [&](int st) { return sBar + 8u * (1 + st); };
  const auto full_v = [&](int st) { return sBar + 8u * (1 + kStages + st); };
  const auto empty_k = [&](int st) { return sBar + 8u * (1 + 2 * kStages + st); };
  const auto empty_v = [&](int st) { return sBar + 8u * (1 + 3 * kStages + st); };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // warp-uniform as far as ptxas can see (wgmma under a divergent branch is serialized)
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  Role role = Role::kWhole;
  int slot = 0;  // split tiles: index among the split ones
  if constexpr (KV::kSplit) {
    int tile = static_cast<int>(blockIdx.x);
    if (tile >= p.tiles) {
      tile -= p.split_tiles;
      role = Role::kEarlier;
    } else if (tile >= p.tiles - p.split_tiles) {
      role = Role::kLater;
    }
    slot = tile - (p.tiles - p.split_tiles);
    m_block = tile % p.m_blocks;
    h = (tile / p.m_blocks) % p.heads;
    b = tile / (p.m_blocks * p.heads);
  }
  const int q0 = m_block * kBM;
  const KV kv = KV::make(p, visit, m_block);
  const int n_tiles = kv.n_tiles();
  // KV tiles: the later part of a split tile takes the running max alone over [0, j_begin)
  // (K only; each of those tiles' V stage is passed through empty, so that K and V stages
  // keep one index and parity per tile), then every part runs [j_begin, j_end).
  const int j_begin = role == Role::kLater ? p.split_key_tile : 0;
  const int j_end = role == Role::kEarlier ? p.split_key_tile : n_tiles;

  if (tid == 0) {
    sm90::mbar_init(bar_q, 1);
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(full_k(st), 1);
      sm90::mbar_init(full_v(st), 1);
      sm90::mbar_init(empty_k(st), kConsumerWarps);
      sm90::mbar_init(empty_v(st), kConsumerWarps);
    }
    sm90::fence_mbarrier_init();
  }
  if (wg == 1) {
    const int i = tid - 128;
    if (QUANT_P) {
      const float S = e4m3_value(static_cast<uint8_t>(i));
      reinterpret_cast<float2*>(smem_raw + (sTable - base))[i] =
          make_float2(__uint_as_float(pack_bf16(S, S)), __frcp_rn(S));
    }
    if (i < kOnesBytes / 4) reinterpret_cast<uint32_t*>(smem_raw + (sOnes - base))[i] = 0x3F803F80u;
    fence_proxy_async();  // the ones are read by wgmma through a descriptor
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: one thread issues every load ----
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) {
      sm90::tma_prefetch_desc(&tm_q);
      sm90::tma_prefetch_desc(&tm_k);
      sm90::tma_prefetch_desc(&tm_v);
      sm90::mbar_arrive_expect_tx(bar_q, kTile);
#pragma unroll
      for (int half = 0; half < D / 64; ++half) sm90::tma_load_4d(sQ + half * kBM * 128, &tm_q, bar_q, 64 * half, q0, h, b);
#pragma unroll 1
      for (int j = 0; j < j_end; ++j) {
        const int st = j % kStages;
        // (the stage's previous use has ended)
        if (j >= kStages) sm90::mbar_wait(empty_k(st), ((j / kStages) & 1) ^ 1);
        sm90::mbar_arrive_expect_tx(full_k(st), kTile);
        kv.template load<D>(&tm_k, sK0 + st * kTile, full_k(st), j, h, b);
        if (j >= kStages) sm90::mbar_wait(empty_v(st), ((j / kStages) & 1) ^ 1);
        if (j < j_begin) {
          sm90::mbar_arrive(full_v(st));  // the running max alone: no V
          continue;
        }
        sm90::mbar_arrive_expect_tx(full_v(st), kTile);
        kv.template load<D>(&tm_v, sV0 + st * kTile, full_v(st), j, h, b);
      }
    }
    return;
  }

  // ---- consumers: warpgroup cw owns query rows [q0 + 64 cw, q0 + 64 cw + 64) ----
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;
  const int g = lane >> 2, t = lane & 3;
  const auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bar);
  };
  if (KV::kCanIdle && __shfl_sync(0xffffffffu, kv.idle(cw) ? 1 : 0, 0) != 0) {
    // Padding rows only: release every stage after it has been filled (an early
    // arrival would count towards the stage's previous use) and keep the start order.
    if (cw == 0) sm90::named_barrier_arrive(kStartBarrier, 256);
    if (cw == 1) sm90::named_barrier_sync(kStartBarrier, 256);
#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
      const int st = j % kStages;
      const uint32_t parity = (j / kStages) & 1;
      sm90::mbar_wait(full_k(st), parity);
      release(empty_k(st));
      sm90::mbar_wait(full_v(st), parity);
      release(empty_v(st));
    }
    return;
  }
  const uint64_t ones_desc = desc_ones(sOnes);
  const uint32_t a_base = sQ + cw * 64 * 128;

  float acc[kDT][4];
  constexpr bool kHp = QUANT_P && HP;  // a separate high-precision accumulator
  float acch[kHp ? kDT : 1][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  if constexpr (kHp) {
#pragma unroll
    for (int i = 0; i < kDT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acch[i][e] = 0.0f;
  }
  float (&acch_ref)[kDT][4] = *reinterpret_cast<float(*)[kDT][4]>(kHp ? &acch[0][0] : &acc[0][0]);
  float m_run[2] = {-INFINITY, -INFINITY};
  // Row sums of bf16(P) come out of the tensor cores: P times an all-ones n8 tile
  // leaves the row sum in every column ([0] row g, [2] row g + 8), already reduced
  // over the quad and rescaled together with the accumulators.
  float lacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float s[kNT][4];

  sm90::mbar_wait(bar_q, 0);
  // ---- the later part of a split tile: the running max over the earlier KV tiles, as the
  // loop below forms it (those tiles are whole: nothing to mask) ----
#pragma unroll 1
  for (int j = 0; j < j_begin; ++j) {
    const int st = j % kStages;
    const uint32_t parity = (j / kStages) & 1;
    sm90::mbar_wait(full_k(st), parity);
    qk_wgmma<D, true>(s, a_base, sK0 + st * kTile);
    release(empty_k(st));
    sm90::mbar_wait(full_v(st), parity);  // passed through empty
    release(empty_v(st));
    float mx0, mx1;
    tile_row_max(s, mx0, mx1);
    m_run[0] = fmaxf(m_run[0], mx0 * scale_log2);
    m_run[1] = fmaxf(m_run[1], mx1 * scale_log2);
  }
  if (cw == 1) sm90::named_barrier_sync(kStartBarrier, 256);  // kSkewGroups behind consumer 0
  // (every KV policy has n_tiles >= 1, and j_begin < j_end)
  if constexpr (kLookahead) {
    const int st = j_begin % kStages;
    sm90::mbar_wait(full_k(st), (j_begin / kStages) & 1);
    qk_wgmma<D, true>(s, a_base, sK0 + st * kTile);
    release(empty_k(st));
  }
#pragma unroll 1
  for (int j = j_begin; j < j_end; ++j) {
    const int st = j % kStages;
    const uint32_t parity = (j / kStages) & 1;
    const int mi = kv.mask_info(j);
    if constexpr (!kLookahead) {
      sm90::mbar_wait(full_k(st), parity);
      qk_wgmma<D, true>(s, a_base, sK0 + st * kTile);
      release(empty_k(st));
    }
    kv.mask(s, mi, t);
    // ---- running max (rows g and g + 8 of this warp) ----
    // The max is taken on the raw dot products: x -> RN(x * c) is monotonic for c > 0,
    // so RN(max * c) is exactly the max of the scaled scores.
    // With P quantization the maxima of the 16-key groups come first (their scales need
    // them, group_scale) and give the row max.
    float mx0, mx1;
    float gm[QUANT_P ? kKS : 1][2];
    if constexpr (QUANT_P) {
      group_max<kKS>(s, gm);
      mx0 = gm[0][0], mx1 = gm[0][1];
#pragma unroll
      for (int ks = 1; ks < kKS; ++ks) mx0 = fmaxf(mx0, gm[ks][0]), mx1 = fmaxf(mx1, gm[ks][1]);
    } else {
      tile_row_max(s, mx0, mx1);
    }
    mx0 = fmaxf(m_run[0], mx0 * scale_log2);
    mx1 = fmaxf(m_run[1], mx1 * scale_log2);
    const float alpha0 = fast_exp2(m_run[0] - mx0);
    const float alpha1 = fast_exp2(m_run[1] - mx1);
    m_run[0] = mx0;
    m_run[1] = mx1;
    lacc[0] *= alpha0;
    lacc[1] *= alpha0;
    lacc[2] *= alpha1;
    lacc[3] *= alpha1;
    // Once the row maxima settle alpha is exactly 1 for the whole warp; skipping the
    // multiply then changes no bit.
    if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kDT; ++i) {
        acc[i][0] *= alpha0;
        acc[i][1] *= alpha0;
        acc[i][2] *= alpha1;
        acc[i][3] *= alpha1;
        if constexpr (kHp) {
          acch[i][0] *= alpha0;
          acch[i][1] *= alpha0;
          acch[i][2] *= alpha1;
          acch[i][3] *= alpha1;
        }
      }
    }
    // ---- P, P^ and the P.V products, one 16-key group at a time ----
    const uint32_t sV = sV0 + st * kTile;
    sm90::mbar_wait(full_v(st), parity);
    constexpr int kSkew = kSkewGroups<QUANT_P>;
    pv_groups<D, 0, kSkew, QUANT_P, HP>(s, gm, acc, acch_ref, lacc, m_run, scale_log2, sV, scale_table, ones_desc);
    if (cw == 0 && j == j_begin) sm90::named_barrier_arrive(kStartBarrier, 256);
    pv_groups<D, kSkew, kKS, QUANT_P, HP>(s, gm, acc, acch_ref, lacc, m_run, scale_log2, sV, scale_table, ones_desc);
    const bool next = kLookahead && j + 1 < j_end;
    if (next) {
      const int nst = (j + 1) % kStages;
      sm90::mbar_wait(full_k(nst), ((j + 1) / kStages) & 1);
      qk_wgmma<D, false>(s, a_base, sK0 + nst * kTile);
    }
    wgmma_wait0();
    release(empty_v(st));
    if (next) release(empty_k((j + 1) % kStages));
  }

  // ---- epilogue: full row sums, O = acc / l, O_hp = acch / l, m and l ----
  // Every column holds the row sum; the max of two columns (equal values) keeps all
  // four accumulators live, so the row-sum wgmma never sees an undefined accumulator.
  const float l0 = fmaxf(lacc[0], lacc[1]), l1 = fmaxf(lacc[2], lacc[3]);
  if constexpr (KV::kSplit) {
    if (role != Role::kWhole) {
      // A part of a split tile: the first to finish leaves its fp32 state in the
      // workspace; the second combines it with its own and stores the tile.
      __shared__ int s_arrived;
      split_exchange<D, kHp>(p, role == Role::kLater, slot, q0, h, b, warp, lane, acc, acch_ref, m_run, l0, l1,
                                 &s_arrived);
      return;
    }
  }
  const float inv_l0 = 1.0f / l0, inv_l1 = 1.0f / l1;
  const int row0 = q0 + (warp - 4) * 16 + g;
  const int row1 = row0 + 8;
  const bool ok0 = row0 < p.len_q, ok1 = row1 < p.len_q;
  using bf = __nv_bfloat16;
  bf* o = static_cast<bf*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
  bf* ohp = p.o_hp ? static_cast<bf*>(p.o_hp) + b * p.o_hp_stride.b + h * p.o_hp_stride.h : nullptr;
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    const int d = i * 8 + 2 * t;
    if (ok0) *reinterpret_cast<uint32_t*>(o + row0 * p.o_stride.l + d) = pack_bf16(acc[i][0] * inv_l0, acc[i][1] * inv_l0);
    if (ok1) *reinterpret_cast<uint32_t*>(o + row1 * p.o_stride.l + d) = pack_bf16(acc[i][2] * inv_l1, acc[i][3] * inv_l1);
    if (ohp != nullptr) {
      const float* src = kHp ? acch[kHp ? i : 0] : acc[i];
      if (ok0)
        *reinterpret_cast<uint32_t*>(ohp + row0 * p.o_hp_stride.l + d) = pack_bf16(src[0] * inv_l0, src[1] * inv_l0);
      if (ok1)
        *reinterpret_cast<uint32_t*>(ohp + row1 * p.o_hp_stride.l + d) = pack_bf16(src[2] * inv_l1, src[3] * inv_l1);
    }
  }
  if (t == 0) {
    const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * p.len_q;
    if (p.m != nullptr) {
      if (ok0) p.m[stat + row0] = m_run[0];
      if (ok1) p.m[stat + row1] = m_run[1];
    }
    if (p.l != nullptr) {
      if (ok0) p.l[stat + row0] = l0;
      if (ok1) p.l[stat + row1] = l1;
    }
  }
#else
  (void)p, (void)scale_log2, (void)visit, (void)tm_q, (void)tm_k, (void)tm_v;
  __trap();  // launched only on sm_90 devices, from the sm_90a build
#endif
}

constexpr const char* kOp = "attn_qat_fwd";
constexpr const char* kVisitOp = "attn_qat_fwd_visit";

std::string shape_str(const AttnQatFwdParams& p) {
  return attention_shape_str(p.batch, p.heads, p.len_q, p.len_kv, p.head_dim);
}

// The split a launch makes (DenseKv): the plan for this device unless the params force
// one. Forced splits are checked (they come from tests and benchmarks).
struct SplitChoice {
  int tiles = 0, key_tile = 0;
};

int device_sm_count() {
  int device = 0, sms = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

int64_t fwd_query_tiles(const AttnQatFwdParams& p) {
  return static_cast<int64_t>(p.batch) * p.heads * ((p.len_q + kBM - 1) / kBM);
}

SplitChoice split_choice(const char* op, const AttnQatFwdParams& p) {
  const int64_t tiles = fwd_query_tiles(p);
  const int kv_tiles = (p.len_kv + kBN - 1) / kBN;
  SplitChoice c;
  if (p.split_tiles < 0) {
    const AttnQatFwdSplit plan = attn_qat_fwd_split_plan(tiles, kv_tiles, device_sm_count());
    c.tiles = plan.tiles;
    c.key_tile = plan.key_tile;
  } else if (p.split_tiles > 0) {
    VQAD_LAUNCH_CHECK(p.split_tiles <= tiles && tiles <= 0x7fffffff - p.split_tiles, op, shape_str(p),
                      "expected split_tiles <= the ", tiles, " query tiles, found ", p.split_tiles);
    c.tiles = p.split_tiles;
    c.key_tile = p.split_key_tile;
  }
  if (c.tiles > 0 && p.split_key_tile >= 0) c.key_tile = p.split_key_tile;
  if (c.tiles > 0)
    VQAD_LAUNCH_CHECK(c.key_tile >= 1 && c.key_tile < kv_tiles, op, shape_str(p),
                      "expected split_key_tile in [1, ", kv_tiles - 1, "] (the later part's first of ", kv_tiles,
                      " KV tiles), found ", c.key_tile);
  return c;
}

size_t split_part_bytes(int split_tiles, int head_dim) {
  const int cols = head_dim == 64 ? kPartCols<64> : kPartCols<128>;
  return static_cast<size_t>(split_tiles) * 2 * kBM * cols * sizeof(float);
}
size_t split_workspace_bytes(int split_tiles, int head_dim) {
  return split_tiles == 0 ? 0 : split_part_bytes(split_tiles, head_dim) + static_cast<size_t>(split_tiles) * sizeof(int);
}

template <int D, bool QUANT_P, bool HP, class KV>
void launch_impl(const char* op, const AttnQatFwdParams& p, float scale_log2, const AttnQatFwdVisit& visit,
                 cudaStream_t stream) {
  auto kernel = attn_qat_fwd_kernel<D, QUANT_P, HP, KV>;
  // Validated on sm_90 (H100/H200) only: other arches are refused rather than guessed at.
  int device = 0, major = 0, minor = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  VQAD_LAUNCH_CHECK(major == 9 && minor == 0, op, shape_str(p), "no kernel for this device: expected sm_90, found sm_",
                    major, minor);
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) {
    cudaGetLastError();
    launch_fail(op, shape_str(p), "no kernel image for this device in the build (", cudaGetErrorString(err),
                "): expected one for sm_90a");
  }
  CUtensorMap maps[3];
  const BlhdIn* views[3] = {&p.q, &p.k, &p.v};
  const char* names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const std::string why = make_blhd_tensor_map(&maps[i], views[i]->data, views[i]->stride, p.batch,
                                                 i == 0 ? p.len_q : p.len_kv, p.heads, D, i == 0 ? kBM : KV::kBoxRows);
    VQAD_LAUNCH_CHECK(why.empty(), op, shape_str(p), "tensor ", names[i], ": ", why);
  }
  VQAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<D>));
  FwdKernelParams kp{p.o.data, p.o_hp.data, p.o.stride, p.o_hp.stride, p.m, p.l, p.heads, p.len_q, p.len_kv};
  kp.m_blocks = (p.len_q + kBM - 1) / kBM;
  dim3 grid(kp.m_blocks, p.heads, p.batch);
  if constexpr (KV::kSplit) {
    const int64_t tiles = fwd_query_tiles(p);
    VQAD_LAUNCH_CHECK(tiles <= 0x3fffffff, op, shape_str(p), "expected at most 2^30 query tiles, found ", tiles);
    SplitChoice c = split_choice(op, p);
    const size_t need = split_workspace_bytes(c.tiles, D);
    if (c.tiles > 0 && (p.workspace == nullptr || p.workspace_bytes < need)) {
      // A forced split needs its workspace; the planned one is skipped without it.
      VQAD_LAUNCH_CHECK(p.split_tiles < 0, op, shape_str(p), "split_tiles ", p.split_tiles, ": expected a workspace of ",
                        need, " bytes, found ", p.workspace_bytes, " bytes at ", p.workspace);
      c = SplitChoice{};
    }
    if (c.tiles > 0)
      VQAD_LAUNCH_CHECK(reinterpret_cast<uintptr_t>(p.workspace) % 16 == 0, op, shape_str(p),
                        "expected a 16-byte aligned workspace, found address ", p.workspace);
    kp.tiles = static_cast<int>(tiles);
    kp.split_tiles = c.tiles;
    kp.split_key_tile = c.key_tile;
    if (c.tiles > 0) {
      kp.part = static_cast<float*>(p.workspace);
      kp.part_count = reinterpret_cast<int*>(static_cast<uint8_t*>(p.workspace) + split_part_bytes(c.tiles, D));
      VQAD_CUDA_CHECK(cudaMemsetAsync(kp.part_count, 0, static_cast<size_t>(c.tiles) * sizeof(int), stream));
    }
    grid = dim3(static_cast<unsigned>(tiles + c.tiles), 1, 1);
  }
  kernel<<<grid, kThreads, kSmemBytes<D>, stream>>>(kp, scale_log2, visit, maps[0], maps[1], maps[2]);
  VQAD_CUDA_CHECK_LAUNCH("attn_qat_fwd_kernel");
}

// The kernel for the call's mode: P quantization with O_hp (a training call), P
// quantization without it (null o_hp: a call that needs no gradient), or BF16 P.
template <int D, class KV>
void launch_mode(const char* op, const AttnQatFwdParams& p, float scale_log2, const AttnQatFwdVisit& visit,
                 cudaStream_t stream) {
  if (p.quant_p && p.o_hp.data != nullptr)
    launch_impl<D, true, true, KV>(op, p, scale_log2, visit, stream);
  else if (p.quant_p)
    launch_impl<D, true, false, KV>(op, p, scale_log2, visit, stream);
  else
    launch_impl<D, false, false, KV>(op, p, scale_log2, visit, stream);
}

// Checks shared by both KV sources; returns scale * log2(e).
float check_fwd_params(const char* op, const AttnQatFwdParams& p) {
  const auto shape = [&] { return shape_str(p); };
  VQAD_LAUNCH_CHECK(attn_qat_head_dim_supported(p.head_dim), op, shape(), "expected head dim 64 or 128, found ", p.head_dim);
  VQAD_LAUNCH_CHECK(p.batch > 0 && p.heads > 0 && p.len_q > 0 && p.len_kv > 0 && p.heads <= 65535 &&
                        p.batch <= 65535,
                    op, shape(), "unsupported shape: expected positive sizes and B, H <= 65535");
  check_blhd(op, "q", p.q, shape);
  check_blhd(op, "k", p.k, shape);
  check_blhd(op, "v", p.v, shape);
  check_blhd(op, "o", p.o, shape);
  if (p.o_hp.data != nullptr) check_blhd(op, "o_hp", p.o_hp, shape);
  // The kernel takes row maxima before scaling, which needs a positive scale.
  VQAD_LAUNCH_CHECK(p.softmax_scale >= 0.0f && std::isfinite(p.softmax_scale), op, shape(),
                    "expected a finite softmax_scale >= 0 (0: 1/sqrt(D)), found ", p.softmax_scale);
  const float scale = p.softmax_scale != 0.0f ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  return scale * 1.4426950408889634f;
}

}  // namespace

size_t attn_qat_fwd_workspace_bytes(const AttnQatFwdParams& p) {
  const float scale_log2 = check_fwd_params(kOp, p);
  (void)scale_log2;
  return split_workspace_bytes(split_choice(kOp, p).tiles, p.head_dim);
}

void launch_attn_qat_fwd(const AttnQatFwdParams& p, cudaStream_t stream) {
  const float scale_log2 = check_fwd_params(kOp, p);
  const AttnQatFwdVisit none{};
  if (p.head_dim == 64)
    launch_mode<64, DenseKv>(kOp, p, scale_log2, none, stream);
  else
    launch_mode<128, DenseKv>(kOp, p, scale_log2, none, stream);
}

void launch_attn_qat_fwd_visit(const AttnQatFwdParams& p, const AttnQatFwdVisit& visit, cudaStream_t stream) {
  const float scale_log2 = check_fwd_params(kVisitOp, p);
  VQAD_LAUNCH_CHECK(visit.entries != nullptr && visit.counts != nullptr && visit.stride >= 1, kVisitOp, shape_str(p),
                    "expected visit lists (entries, counts, stride >= 1), found entries ", visit.entries,
                    ", counts ", visit.counts, ", stride ", visit.stride);
  VQAD_LAUNCH_CHECK(p.len_kv <= (static_cast<int64_t>(kAttnQatVisitMaxBlock) + 1) * kAttnQatVisitBlockRows, kVisitOp,
                    shape_str(p), "expected at most ", kAttnQatVisitMaxBlock + 1,
                    " 64-row blocks (what a visit entry holds), found len_kv ", p.len_kv);
  VQAD_LAUNCH_CHECK(p.head_dim == kAttnQatVisitHeadDim, kVisitOp, shape_str(p), "expected head dim ",
                    kAttnQatVisitHeadDim, " (the VSA fine stage), found ", p.head_dim);
  launch_mode<kAttnQatVisitHeadDim, VisitKv>(kVisitOp, p, scale_log2, visit, stream);
}

}  // namespace vqad::kernels::attention
