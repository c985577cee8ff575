// ATTN_QAT_TRAIN backward on sm_90a with warpgroup MMA (wgmma): the same steps
// and numerics as the mma.sync kernels in attn_qat_bwd.cu, with the GEMMs issued
// as wgmma.mma_async from 128B-swizzled shared-memory tiles, so a B tile is read
// once per 64 rows instead of once per 16 (the mma.sync kernels are bound by
// ldmatrix traffic).
//
// Dense (dkdvq_ws_kernel): CTA = a producer warpgroup (TMA loads, the dQ chain) and 2
// consumer warpgroups x 64 keys; per query block of 64:
//   S^T = K Q^T, dP^T = V dO^T   (m64n64k16, A = K/V tile, B = Q/dO tile, both K-major)
//   P fake quantization in registers (dkdv_phase1/2, shared with mma.sync)
//   dV += Pb^T dO, dK += dS^T Q  (m64nDk16, A from registers, B = dO/Q tile N-major)
//   dQ_i partial = dS K_j        (the consumer warps store dS^T to shared
//     memory; at D = 128 warpgroup w computes head-dim half w over all 128 keys, at
//     D = 64 all 64 columns over its own 64 keys (two parts, added by the finalize
//     pass), m64n64k16 with A = dS^T read transposed; the fp32 partial goes to global
//     memory by one bulk reduction per block, in a fixed order: see dq_accum_groups in
//     attn_qat_bwd_common.cuh; dq_finalize_kernel adds the groups). 5 GEMMs.
// The CTAs of a last partial wave are split over query ranges (dkdv_split_plan,
// dkdv_combine_kernel). docs/performance.md has the measured forms (on an H100 at
// (1,3,31200), consistent mode: 10.68 ms with two warpgroups that load by cp.async and
// run the dQ chain themselves, 9.0 ms warp-specialised).
// Visit lists (launch_wgmma_visit_kernels, the VSA fine stage): the recompute form
// (7 GEMMs). dK/dV CTAs as above over a list of query blocks (no dQ partials), then
// dQ CTAs of 2 warpgroups x 64 queries; per tile of 128 keys (two visited 64-row
// blocks): S = Q K^T, dP = dO V^T (m64n128k16), dQ += dS K (m64n128k16, B = K tile
// N-major); one launch (fused_visit_kernel), dK/dV CTAs first. Their streamed operands
// come by TMA into mbarrier stages that the later warpgroup refills, so the two
// warpgroups never wait for each other (VisitStages; 17% faster than cp.async with a CTA
// barrier per step at the Wan grid, docs/performance.md). With VisitLists::row_to_token the
// epilogues scatter the rows to their raster positions and add a per-tile coarse row (the
// VSA untiling); the rows and the coarse rows come by cp.async with the prologue's loads,
// so the epilogue reads only shared memory. A tile of one 64-row block (VSA's partial
// border cubes, a quarter of the tiles at the Wan grid) would leave one warpgroup idle;
// there both warpgroups take the block and split its list, and one hands its sums to the
// other at the end (SPLIT bodies: 5% less backward time at the Wan grid,
// docs/performance.md).
//
// Head dim D = 128 or 64 for the dense kernels (template parameter), 128 for the visit
// lists. Shared tiles hold rows of D bf16 as 64-column halves ([half][row][64]),
// each row 128 bytes with its 16-byte chunks XOR-swizzled by (row & 7): the
// canonical 128B-swizzle layout of wgmma, both as a K-major operand (k = head
// dim) and as an N-major one (n = head dim, k = rows).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vqad/core/error.h"
#include "vqad/kernels/attention/sm90/attn_qat_bwd_common.cuh"
#include "vqad/kernels/attention/sm90/attn_qat_fwd_visit.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/launch.h"
#include "vqad/kernels/common/tma.h"

namespace vqad::kernels::attn_bwd {
namespace {

using attention::kAttnQatVisitBlockRows;
using attention::kAttnQatVisitCountBits;
// The visit-list kernels' head dim.
constexpr int kVisitD = attention::kAttnQatVisitHeadDim;

// wgmma exists only in the arch-specific sm_90a target; the kernels are empty elsewhere
// (the launchers refuse other devices).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VQAD_BWD_SM90A 1
#endif

#ifdef VQAD_BWD_SM90A
constexpr int kRowBytes = 128;  // one 64-column half of a row

// Byte offset of (row, 16-byte chunk 0..15 along D) in a swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128(int row, int chunk, int rows) {
  return (chunk >> 3) * rows * kRowBytes + row * kRowBytes + (((chunk & 7) ^ (row & 7)) << 4);
}

template <int ROWS, int NT, int D>
__device__ __forceinline__ void load_tile_sw128(uint8_t* dst, const InTensor& t, int b, int h,
                                                int row0, int len, int tid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const bf16* base = t.p + b * t.sb + h * t.sh;
#pragma unroll
  for (int i = tid; i < ROWS * kChunks; i += NT) {
    const int r = i / kChunks, ch = i % kChunks;
    const int gr = row0 + r;
    const bool ok = gr < len;
    cp_async16(dst + sw128(r, ch, ROWS), base + static_cast<int64_t>(ok ? gr : 0) * t.sl + ch * 8, ok);
  }
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle, of the operand at tile + off
// (bytes; tiles 1024-byte aligned): gmma::desc_at, the tile's fields formed once and the
// offset added (kernels/common/gmma_desc.h).
__device__ __forceinline__ uint64_t gmma_desc(uint32_t tile, uint32_t lbo, uint32_t sbo, uint32_t off = 0) {
  return gmma::desc_at(tile, lbo, sbo, off, gmma::Swizzle::k128B);
}
// K-major operand: rows [row0, row0 + 64) (or the N rows of B), k-step kk of 16
// head-dim columns. Rows of one 8-row core group are 128 B apart, groups 1024 B.
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int rows, int row0, int kk) {
  return gmma_desc(tile, 16, 1024, (kk >> 2) * rows * kRowBytes + row0 * kRowBytes + (kk & 3) * 32);
}
// N-major B operand (n = the D head-dim columns, k = 16 tile rows from krow0):
// 64-column halves `rows * 128` bytes apart (LBO; D = 64 has one), 8-row groups 1024 B (SBO).
__device__ __forceinline__ uint64_t desc_nmajor(uint32_t tile, int rows, int krow0) {
  return gmma_desc(tile, rows * kRowBytes, 1024, krow0 * kRowBytes);
}

// wgmma, fences and bulk copies: kernels/common/sm90_ptx.cuh.
using sm90::bulk_commit;
using sm90::bulk_reduce_add;
using sm90::bulk_store;
using sm90::bulk_wait_all;
using sm90::fence_proxy_async;
using sm90::fence_regs;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
using sm90::wgmma_m64n128k16_rs;
using sm90::wgmma_m64n128k16_ss;
using sm90::wgmma_m64n64k16_ss;
using sm90::wgmma_m64nNk16_rs;
using sm90::wgmma_wait;
// Back-off of the turn wait (32, 128 and 512 ns measured the same at (1,3,31200)).
constexpr unsigned kTurnSleepNs = 32;
// Turn counter of one dQ block: wait until it equals `turn`, then (after our
// reduction has completed) advance it.
__device__ __forceinline__ void sem_wait_eq(const int* sem, int turn) {
  int v;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
    if (v == turn) break;
    __nanosleep(kTurnSleepNs);
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // generic -> async proxy
}
__device__ __forceinline__ void sem_advance(int* sem) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // async -> generic proxy
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
using sm90::named_barrier_sync;
#endif  // VQAD_BWD_SM90A

using sm90::flat;

constexpr int kThreads = 256;  // the visit kernels: two warpgroups
constexpr int kKeysPerCta = 128;
constexpr int kQueryTile = 64;
constexpr int kQueriesPerCta = 128;
// Stages of the visit bodies' streamed tiles: block i+1 is loaded while block i is computed.
constexpr int kStages = 2;

// (S, 1/S) per E4M3 scale byte in shared memory (dK/dV kernel, P quantization).
constexpr size_t kScaleTableBytes = 128 * sizeof(float2);
// With the ordered dQ: + dS^T tile (128 keys x 64 queries, bf16) + the fp32 dQ
// partial of one query block staged for the bulk reduction: 64 x 128 at D = 128 (each
// warpgroup one 64-column half over all 128 keys), two 64 x 64 parts at D = 64 (each
// warpgroup all 64 columns over its own 64 keys; dq_finalize_kernel adds the parts).
constexpr size_t kDsTileBytes = kKeysPerCta * kQueryTile * 2;
constexpr int kDqStageFloats = kQueryTile * 128;
constexpr size_t kDqStageBytes = kDqStageFloats * sizeof(float);

// The warp-specialised dense kernel (dkdvq_ws_kernel): a producer warpgroup and two
// consumer warpgroups; Q / dO / statistics stages; registers per thread after setmaxnreg
// (128 x 24 + 256 x 240 <= 64K).
constexpr int kWsThreads = 384;
constexpr int kWsStages = 2;
constexpr int kConsumerWarpsWs = 8;
constexpr int kWsProducerRegs = 24;
constexpr int kWsConsumerRegs = 240;
// Byte offsets of its shared memory from a 1024-aligned base.
template <int D>
struct WsSmem {
  static constexpr int kTileK = kKeysPerCta * D * 2, kTileQ = kQueryTile * D * 2;
  static constexpr int kK = 0, kV = kTileK;
  static constexpr int kQ = 2 * kTileK;  // stage s: Q at kQ + s * 2 * kTileQ, dO after it
  static constexpr int kSt = kQ + kWsStages * 2 * kTileQ;  // [kWsStages][64] float4
  static constexpr int kScale = kSt + kWsStages * kQueryTile * 16;
  static constexpr int kDs = kScale + static_cast<int>(kScaleTableBytes);  // [2][128 keys][64 queries] bf16
  static constexpr int kDq = kDs + 2 * static_cast<int>(kDsTileBytes);     // fp32 staging of one block
  static constexpr int kBar = kDq + static_cast<int>(kDqStageBytes);
  // mbarriers: K/V, full[kWsStages], empty[kWsStages], dQ staged, dQ staging free
  static constexpr int kBars = 1 + 2 * kWsStages + 2;
  static constexpr int kBytes = kBar + 8 * kBars;
  static_assert(kDs % 1024 == 0, "dS^T tiles: 1024-byte aligned (128-byte swizzle)");
};

// Keys per tile of the visit-list dQ kernel: two visited 64-row blocks.
constexpr int kDqKeyTile = 2 * kQueryTile;

// ---------------------------------------------------------------------------
// Visit-list bodies (fused_visit_kernel): TMA stages, warpgroups that never meet
// ---------------------------------------------------------------------------
// Both bodies stream one operand pair per step (dK/dV: a visited query block's Q, dO and
// row statistics; dQ: a pair of visited key blocks' K and V) through kStages stages that
// one thread fills by TMA (tensor maps over the tiled tensors; rows past a block's valid
// count are loaded as they are, which the VSA tiling keeps at zero, and masked). The two
// warpgroups work on disjoint rows (keys or queries) and share only these stages: the
// warpgroup that finishes with a stage second refills it (a shared counter per stage), so
// after the prologue neither waits for the other.
struct VisitStages {
  uint32_t bar_full;  // kStages mbarriers
  int* refill;        // kStages counters
  // The warpgroup's release of stage st after step i (all its warps done with it; the
  // caller's named barrier): the second arrival refills it with step i + kStages.
  template <class Issue>
  __device__ __forceinline__ void release(int st, int i, int steps, bool leader, Issue&& issue) const {
    if (!leader) return;
    __threadfence_block();
    if (atomicAdd(&refill[st], 1) == 1) {
      refill[st] = 0;
      if (i + kStages < steps) issue(i + kStages);
    }
  }
  // Thread 0, before the barrier that publishes them.
  __device__ __forceinline__ void init() const {
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(bar_full + 8 * st, 1);
      refill[st] = 0;
    }
    sm90::fence_mbarrier_init();
  }
  __device__ __forceinline__ void wait(int i) const {
    sm90::mbar_wait(bar_full + 8 * (i % kStages), (i / kStages) & 1);
  }
};
// Byte offsets of the visit bodies' shared memory from a 1024-aligned base.
struct VisitDkdvSmem {
  static constexpr int kTileK = kKeysPerCta * kVisitD * 2, kTileQ = kQueryTile * kVisitD * 2;
  static constexpr int kK = 0, kV = kTileK;
  static constexpr int kQ = 2 * kTileK;  // stage s: Q at kQ + s * 2 * kTileQ, dO after it
  static constexpr int kSt = kQ + kStages * 2 * kTileQ;  // [kStages][64] float4
  static constexpr int kScale = kSt + kStages * kQueryTile * 16;
  static constexpr int kBar = kScale + static_cast<int>(kScaleTableBytes);
  // the scattered epilogue's rows: [kKeysPerCta] raster rows, then the dK and dV coarse rows
  static constexpr int kEpi = kBar + 16 * kStages;
  static constexpr int kBytes = kEpi + kKeysPerCta * 4 + 2 * kVisitD * 4;
};
// SPLIT dK/dV (a key tile of one 64-row block): 64-row K and V tiles and stages of two
// query blocks (Q, dO of slot 0, then of slot 1; statistics [kStages][2][64]).
struct VisitDkdvSplitSmem {
  static constexpr int kTileK = kQueryTile * kVisitD * 2, kTileQ = kQueryTile * kVisitD * 2;
  static constexpr int kK = 0, kV = kTileK;
  static constexpr int kQ = 2 * kTileK;  // stage s, slot w: Q at kQ + (2 s + w) * 2 * kTileQ, dO after it
  static constexpr int kSt = kQ + kStages * 2 * 2 * kTileQ;
  static constexpr int kScale = kSt + kStages * 2 * kQueryTile * 16;
  static constexpr int kBar = kScale + static_cast<int>(kScaleTableBytes);
  static constexpr int kEpi = kBar + 16 * kStages;
  static constexpr int kBytes = kEpi + kKeysPerCta * 4 + 2 * kVisitD * 4;
};
// warpgroup 1's hand-over of its dK, dV sums fits in the stages
static_assert(VisitDkdvSplitSmem::kSt - VisitDkdvSplitSmem::kQ >= 2 * 16 * 128 * 16, "split hand-over space");
struct VisitDqSmem {
  static constexpr int kTileQ = kQueriesPerCta * kVisitD * 2, kTileK = kDqKeyTile * kVisitD * 2;
  static constexpr int kQ = 0, kdO = kTileQ;
  static constexpr int kK = 2 * kTileQ;  // stage s: K at kK + s * 2 * kTileK, V after it
  static constexpr int kBar = kK + kStages * 2 * kTileK;
  static constexpr int kEpi = kBar + 16 * kStages;  // [kQueriesPerCta] raster rows, the dQ coarse row
  static constexpr int kBytes = kEpi + kQueriesPerCta * 4 + kVisitD * 4;
};
static_assert(VisitDkdvSmem::kEpi % 16 == 0 && VisitDkdvSplitSmem::kEpi % 16 == 0 && VisitDqSmem::kEpi % 16 == 0,
              "16-byte cp.async rows");
static_assert(kKeysPerCta == kQueriesPerCta, "a visit CTA's rows are one coarse group (VisitLists::coarse_group_rows)");
// The scattered epilogue's rows (VisitLists::row_to_token) and the coarse rows of the CTA's
// tile (coarse0, coarse1; null: none) by cp.async into the body's kEpi area, in the body's
// prologue group: 16-byte chunks, threads 0 .. 31 the raster rows, then 32 per coarse row.
__device__ __forceinline__ void load_scatter_rows(const KernelParams& p, const VisitLists* vl, int b, int h, int tile,
                                                  int rows, const float* coarse0, const float* coarse1,
                                                  uint8_t* epi, int tid) {
  if (vl->row_to_token == nullptr) return;
  constexpr int kRowChunks = kKeysPerCta / 4, kCoarseChunks = kVisitD / 4;
  const int row0 = tile * kKeysPerCta;
  if (tid < kRowChunks) {
    const bool ok = row0 + tid * 4 < rows;
    cp_async16(epi + tid * 16, vl->row_to_token + (ok ? row0 + tid * 4 : 0), ok);
  } else if (tid < kRowChunks + 2 * kCoarseChunks) {
    const int k = (tid - kRowChunks) / kCoarseChunks, c = (tid - kRowChunks) % kCoarseChunks;
    const float* src = k == 0 ? coarse0 : coarse1;
    if (src != nullptr) {
      const int64_t group = (static_cast<int64_t>(b) * p.H + h) * vl->coarse_groups + tile;
      cp_async16(epi + kKeysPerCta * 4 + (k * kCoarseChunks + c) * 16, src + group * kVisitD + c * 4, true);
    }
  }
}
constexpr size_t kVisitSmem =
    1024 + std::max({VisitDkdvSmem::kBytes, VisitDkdvSplitSmem::kBytes, VisitDqSmem::kBytes});

// Per query block (per warpgroup, 64 keys):
//   S^T, dP^T issued as two groups; phase 1 (exp2 + P quantization) overlaps
//   dP^T; dV issued; phase 2 (dS) overlaps dV; dK issued.
#ifdef VQAD_BWD_SM90A
// dK (times the softmax scale) and dV of this lane's two keys as BF16 rows.
template <int D>
__device__ __forceinline__ void store_dkdv(const KernelParams& p, int b, int h, const float (&dk)[D / 8][4],
                                           const float (&dv)[D / 8][4], int key_row0, bool key_ok0, bool key_ok1,
                                           int t4) {
  bf16* dk_base = p.dk.p + b * p.dk.sb + h * p.dk.sh;
  bf16* dv_base = p.dv.p + b * p.dv.sb + h * p.dv.sh;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + 2 * t4;
    if (key_ok0) {
      *reinterpret_cast<uint32_t*>(dk_base + static_cast<int64_t>(key_row0) * p.dk.sl + col) =
          pack_bf16(dk[n][0] * p.scale, dk[n][1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_base + static_cast<int64_t>(key_row0) * p.dv.sl + col) =
          pack_bf16(dv[n][0], dv[n][1]);
    }
    if (key_ok1) {
      *reinterpret_cast<uint32_t*>(dk_base + static_cast<int64_t>(key_row0 + 8) * p.dk.sl + col) =
          pack_bf16(dk[n][2] * p.scale, dk[n][3] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_base + static_cast<int64_t>(key_row0 + 8) * p.dv.sl + col) =
          pack_bf16(dv[n][2], dv[n][3]);
    }
  }
}

// The visit kernels' scattered epilogue (VisitLists::row_to_token): a lane's rows r0
// (when ok0) and r0 + 8 (when ok1) of acc * mul, two channels per 8-column group, to
// their raster rows of o (s_rows: the raster rows of the CTA's tile, r0 - tile_row0
// indexed), plus the tile's coarse row s_coarse when set (see VisitLists).
__device__ __forceinline__ void store_rows_scattered(const OutTensor& o, const int32_t* s_rows,
                                                     const float* s_coarse, int b, int h, int r_local, bool ok0,
                                                     bool ok1, const float (&acc)[kVisitD / 8][4], float mul,
                                                     int t4) {
  const int tok0 = ok0 ? s_rows[r_local] : -1;
  const int tok1 = ok1 ? s_rows[r_local + 8] : -1;
  bf16* base = o.p + b * o.sb + h * o.sh;
  auto bf16r = [](float x) { return __bfloat162float(__float2bfloat16_rn(x)); };
#pragma unroll
  for (int n = 0; n < kVisitD / 8; ++n) {
    const int col = n * 8 + 2 * t4;
    float2 cc = make_float2(0.0f, 0.0f);
    if (s_coarse != nullptr) cc = *reinterpret_cast<const float2*>(s_coarse + col);
    if (tok0 >= 0) {
      float x = acc[n][0] * mul, y = acc[n][1] * mul;
      if (s_coarse != nullptr) x = __fadd_rn(bf16r(x), cc.x), y = __fadd_rn(bf16r(y), cc.y);
      *reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(tok0) * o.sl + col) = pack_bf16(x, y);
    }
    if (tok1 >= 0) {
      float x = acc[n][2] * mul, y = acc[n][3] * mul;
      if (s_coarse != nullptr) x = __fadd_rn(bf16r(x), cc.x), y = __fadd_rn(bf16r(y), cc.y);
      *reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(tok1) * o.sl + col) = pack_bf16(x, y);
    }
  }
}

// dkdvq_ws_kernel: query blocks [q_begin, q_end) of key block kv_block (q_end < 0: all),
// keys < Lkv, and the ordered dQ partials; with part_out (tail split) dK and dV go there
// as fp32 [2][128 keys][D]. Three warpgroups. Warpgroup 0 is the producer: one thread loads K and V once and each query block's Q, dO and row
// statistics by TMA into kWsStages mbarrier-guarded stages; a second thread runs the dQ
// chain (waits until the consumers have staged block i's partial, waits for its turn,
// hands the staging to the bulk engine, frees it once read, advances the turn counter
// once the reduction is complete); the warpgroup gives its registers to the consumers
// (setmaxnreg). Warpgroups 1 and 2 are the consumers (64 keys each): S^T, dP^T issued as
// two groups; phase 1 (exp2 + P quantization) overlaps dP^T; dV issued; phase 2 (dS)
// overlaps dV; dK issued; dS^T to shared memory; dQ. They meet once per block, for the
// dS^T exchange (double-buffered, so a consumer that runs ahead never overwrites the
// tile the other one still reads); neither waits on a global turn counter or issues a
// load. (Against two warpgroups that did both: 16% less time, docs/performance.md.)

template <AttnQatBwdPMode MODE, int D, bool kKeyTail>
__device__ __forceinline__ void dkdv_ws_body(const KernelParams& p, const CUtensorMap* tm_q, const CUtensorMap* tm_do,
                                             const CUtensorMap* tm_st, const CUtensorMap* tm_k,
                                             const CUtensorMap* tm_v, uint8_t* smem, int b, int h, int kv_block,
                                             int q_begin, int q_end, float* part_out) {
  using L = WsSmem<D>;
  constexpr int kD = D;
  constexpr uint32_t kStageTx = 2 * L::kTileQ + kQueryTile * sizeof(float4);
  const uint32_t base = smem_u32(smem);
  const uint32_t bar_kv = base + L::kBar;
  const auto bar_full = [&](int st) { return base + L::kBar + 8u * (1 + st); };
  const auto bar_empty = [&](int st) { return base + L::kBar + 8u * (1 + kWsStages + st); };
  const uint32_t bar_dq_full = base + L::kBar + 8u * (1 + 2 * kWsStages);
  const uint32_t bar_dq_empty = bar_dq_full + 8u;
  float2* sScale = reinterpret_cast<float2*>(smem + L::kScale);
  float4* sdQ = reinterpret_cast<float4*>(smem + L::kDq);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // warp-uniform as far as ptxas can see (wgmma under a divergent branch is serialized)
  const int wgi = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int kv0 = kv_block * kKeysPerCta;
  const int nq = (p.Lq + kQueryTile - 1) / kQueryTile;
  if (q_end < 0) q_end = nq;
  const int steps = q_end - q_begin;

  if (tid == 0) {
    sm90::mbar_init(bar_kv, 1);
    for (int st = 0; st < kWsStages; ++st) {
      sm90::mbar_init(bar_full(st), 1);
      sm90::mbar_init(bar_empty(st), kConsumerWarpsWs);
    }
    sm90::mbar_init(bar_dq_full, kConsumerWarpsWs);
    sm90::mbar_init(bar_dq_empty, 1);
    sm90::fence_mbarrier_init();
  }
  if (tid < 128) {
    const float S = e4m3_value(static_cast<uint8_t>(tid));
    sScale[tid] = make_float2(S, tid == 0 ? 0.0f : __frcp_rn(S));
  }
  __syncthreads();  // barriers and the scale table are ready; no CTA-wide barrier after this

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kWsProducerRegs>();
    if (tid == 0) {
      // ---- loads ----
      sm90::tma_prefetch_desc(tm_q);
      sm90::tma_prefetch_desc(tm_do);
      sm90::tma_prefetch_desc(tm_st);
      sm90::mbar_arrive_expect_tx(bar_kv, 2 * L::kTileK);
#pragma unroll
      for (int hf = 0; hf < kD / 64; ++hf)
#pragma unroll
        for (int r = 0; r < kKeysPerCta; r += kQueryTile) {
          const uint32_t off = hf * kKeysPerCta * kRowBytes + r * kRowBytes;
          sm90::tma_load_4d(base + L::kK + off, tm_k, bar_kv, 64 * hf, kv0 + r, h, b);
          sm90::tma_load_4d(base + L::kV + off, tm_v, bar_kv, 64 * hf, kv0 + r, h, b);
        }
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        const int st = i % kWsStages;
        if (i >= kWsStages) sm90::mbar_wait(bar_empty(st), ((i / kWsStages) & 1) ^ 1);
        const int q0 = (q_begin + i) * kQueryTile;
        const uint32_t bar = bar_full(st), dst = base + L::kQ + st * 2 * L::kTileQ;
        sm90::mbar_arrive_expect_tx(bar, kStageTx);
#pragma unroll
        for (int hf = 0; hf < kD / 64; ++hf) {
          sm90::tma_load_4d(dst + hf * kQueryTile * kRowBytes, tm_q, bar, 64 * hf, q0, h, b);
          sm90::tma_load_4d(dst + L::kTileQ + hf * kQueryTile * kRowBytes, tm_do, bar, 64 * hf, q0, h, b);
        }
        sm90::tma_load_3d(base + L::kSt + st * kQueryTile * 16, tm_st, bar, 0, q0, b * p.H + h);
      }
    } else if (tid == 32) {
      // ---- the ordered dQ chain of this CTA (see dq_accum_groups) ----
      const int64_t bh = static_cast<int64_t>(b) * p.H + h;
      const int grp = kv_block % p.dq_groups, turn = kv_block / p.dq_groups;
      float* dq_part = p.dq_acc + (static_cast<int64_t>(grp) * p.B * p.H + bh) * nq * kDqStageFloats;
      int* dq_turn = p.dq_sem + (bh * p.dq_groups + grp) * nq;
#pragma unroll 1
      for (int i = 0; i < steps; ++i) {
        const int qb = q_begin + i;
        sm90::mbar_wait(bar_dq_full, i & 1);  // the consumers have staged block qb
        sem_wait_eq(dq_turn + qb, turn);
        float* dst = dq_part + static_cast<int64_t>(qb) * kDqStageFloats;
        if (turn == 0)
          bulk_store(dst, base + L::kDq, static_cast<int>(kDqStageBytes));
        else
          bulk_reduce_add(dst, base + L::kDq, static_cast<int>(kDqStageBytes));
        bulk_commit();
        sm90::bulk_wait_read_all();
        sm90::mbar_arrive(bar_dq_empty);  // the staging may be rewritten
        bulk_wait_all();
        sem_advance(dq_turn + qb);
      }
    }
    return;
  }

  // ---- consumers: warpgroup cw owns keys [kv0 + 64 cw, kv0 + 64 cw + 64) ----
  sm90::setmaxnreg_inc<kWsConsumerRegs>();
  const int cw = wgi - 1, wq = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(bar);
  };

  float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  const int key_row0 = kv0 + cw * 64 + wq * 16 + g;  // this lane's keys: key_row0, +8
  // (kKeyTail: the CTA's 128 keys end past Lkv; the other CTAs' loop has no key masking)
  const bool key_tail = kKeyTail && kv0 + cw * 64 + wq * 16 + 16 > p.Lkv;
  const bool key_ok0 = key_row0 < p.Lkv, key_ok1 = key_row0 + 8 < p.Lkv;
  const uint32_t aK = base + L::kK, aV = base + L::kV;
  sm90::mbar_wait(bar_kv, 0);

#pragma unroll 1
  for (int i = 0; i < steps; ++i) {
    const int st = i % kWsStages;
    sm90::mbar_wait(bar_full(st), (i / kWsStages) & 1);
    const uint32_t aQ = base + L::kQ + st * 2 * L::kTileQ, adO = aQ + L::kTileQ;
    const float4* cSt = reinterpret_cast<const float4*>(smem + L::kSt) + st * kQueryTile;
    uint8_t* sdS = smem + L::kDs + (i & 1) * kDsTileBytes;

    float s[8][4], dp[8][4];
    uint32_t ap[4][4], ads[4][4];  // BF16 A fragments of dV and dK
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      wgmma_m64n64k16_ss<0>(flat(s), desc_kmajor(aK, kKeysPerCta, cw * 64, kk), desc_kmajor(aQ, kQueryTile, 0, kk),
                            kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      wgmma_m64n64k16_ss<0>(flat(dp), desc_kmajor(aV, kKeysPerCta, cw * 64, kk),
                            desc_kmajor(adO, kQueryTile, 0, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<1>();  // S^T done; dP^T may still run
    fence_regs(flat(s));

    dkdv_phase1<MODE, true, true, true>(s, cSt, p.c, key_tail, key_ok0, key_ok1, lane, ap, sScale);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < 4; ++kq)
      wgmma_m64nNk16_rs<kD, 1>(flat(dv), ap[kq], desc_nmajor(adO, kQueryTile, kq * 16));
    wgmma_commit();
    wgmma_wait<1>();  // dP^T done; dV may still run
    fence_regs(flat(dp));

    dkdv_phase2<MODE>(s, dp, cSt, lane, ads);
    {
      // dS^T of this warp's 16 keys -> the shared tile (rows = keys, 128-byte swizzled
      // like the operand tiles), the A operand of dQ += dS K. The row is recomputed from
      // the thread index here (a value kept across the loop spills at the consumers'
      // 240 registers).
      const uint32_t tid_now = sm90::tid_x_here();
      const uint32_t ct = tid_now - 128;  // = 128 cw + 32 wq + lane
      uint8_t* row = sdS + ((ct >> 5) * 16 + ((ct >> 2) & 7)) * kRowBytes;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int off = ((j ^ g) << 4) + t4 * 4;
        *reinterpret_cast<uint32_t*>(row + off) = ads[j >> 1][(j & 1) * 2];
        *reinterpret_cast<uint32_t*>(row + 8 * kRowBytes + off) = ads[j >> 1][(j & 1) * 2 + 1];
      }
      fence_proxy_async();
    }
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < 4; ++kq)
      wgmma_m64nNk16_rs<kD, 1>(flat(dk), ads[kq], desc_nmajor(aQ, kQueryTile, kq * 16));
    wgmma_commit();
    {
      // D = 128: dQ[64 queries x head-dim half cw] = dS (all 128 keys of the CTA) K.
      // D = 64: dQ part cw [64 queries x 64] = dS K over the warpgroup's own 64 keys.
      // A is the dS^T tile read transposed (M = queries contiguous), B the K tile (half).
      // Staging layout (fp32, 16-byte units): [cw][n-tile j][warp][lane] holds the
      // lane's (row g, cols 8j+2t4, +1) and (row g+8, same cols) of its warp's 16 rows
      // (cols within half cw at D = 128, of part cw at D = 64); conflict-free stores,
      // and dq_finalize_kernel knows the mapping. The staging is free once the dQ
      // thread's bulk engine has read the previous block's.
      named_barrier_sync(1, 2 * 128);  // both consumers' dS^T rows are in place
      float dq[32];
      constexpr int kDqSteps = kD == 128 ? kKeysPerCta / 16 : 64 / 16;
      const int kk0 = kD == 128 ? 0 : cw * kDqSteps;
      const uint32_t adS = smem_u32(sdS), aKh = aK + (kD == 128 ? cw * kKeysPerCta * kRowBytes : 0);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kDqSteps; ++j) {
        const int kk = kk0 + j;
        wgmma_m64n64k16_ss<1, 1>(dq, gmma_desc(adS, kQueryTile * kRowBytes, 1024, kk * 16 * kRowBytes),
                                 gmma_desc(aKh, kKeysPerCta * kRowBytes, 1024, kk * 16 * kRowBytes), j > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(flat(dv));
      fence_regs(flat(dk));
      fence_regs(dq);
      release(bar_empty(st));  // this warp is done with block i's Q, dO and statistics
      if (i > 0) sm90::mbar_wait(bar_dq_empty, (i - 1) & 1);
      // (the thread's staging slot re-read from the thread index, as the dS^T row)
      const uint32_t tid_now = sm90::tid_x_here();
      const uint32_t ct = tid_now - 128;  // = 128 cw + 32 wq + lane
      float4* slot = sdQ + (ct >> 7) * 8 * 128 + (ct & 127);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        slot[j * 128] = make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
      fence_proxy_async();  // generic writes -> the bulk engine
      release(bar_dq_full);
    }
  }

  if (part_out != nullptr) {  // tail split: fp32 partials, added by dkdv_combine_kernel
    const int r0 = cw * 64 + wq * 16 + g;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int col = n * 8 + 2 * t4;
      *reinterpret_cast<float2*>(part_out + r0 * kD + col) = make_float2(dk[n][0], dk[n][1]);
      *reinterpret_cast<float2*>(part_out + (r0 + 8) * kD + col) = make_float2(dk[n][2], dk[n][3]);
      float* pv = part_out + kKeysPerCta * kD;
      *reinterpret_cast<float2*>(pv + r0 * kD + col) = make_float2(dv[n][0], dv[n][1]);
      *reinterpret_cast<float2*>(pv + (r0 + 8) * kD + col) = make_float2(dv[n][2], dv[n][3]);
    }
    return;
  }
  store_dkdv<kD>(p, b, h, dk, dv, key_row0, key_ok0, key_ok1, t4);
}

#endif  // VQAD_BWD_SM90A

#ifdef VQAD_BWD_SM90A

// dK, dV of key tile kv_block over vl's list of query blocks (step i visits block
// q_entries[i] >> 7), the valid keys of each warpgroup's 64 from vl.key_rows; dQ is left
// to dq_visit_body (the recompute form). Per step and warpgroup: S^T, dP^T issued as two
// groups; phase 1 (exp2 + P quantization) overlaps dP^T; dV issued; phase 2 (dS)
// overlaps dV; dK issued.
// SPLIT (a key tile of one 64-row block, VSA's partial cubes, where the second
// warpgroup's keys are all padding): both warpgroups take the same 64 keys and split the
// list, warpgroup w visiting entries [w * half, w * half + half), half = ceil(n / 2); a
// stage then holds two query blocks (VisitDkdvSplitSmem), and at the end warpgroup 1
// hands its dK, dV sums to warpgroup 0 through shared memory, which adds them to its own
// (a fixed order) and stores the rows. Without it the tile's second warpgroup would idle
// while the first visits the whole list.
// (The per-step chain is written out as in dkdv_ws_body: routed through one shared helper,
// ptxas allocated both kernels' registers differently and spilled 4 - 16 bytes.)
template <AttnQatBwdPMode MODE, bool SPLIT>
__device__ __forceinline__ void dkdv_visit_body(const KernelParams& p, const CUtensorMap* tm_q,
                                                const CUtensorMap* tm_do, const CUtensorMap* tm_st, uint8_t* smem,
                                                int b, int h, int kv_block, const VisitLists* vl) {
  using L = std::conditional_t<SPLIT, VisitDkdvSplitSmem, VisitDkdvSmem>;
  constexpr int kD = kVisitD;
  constexpr int kSlots = SPLIT ? 2 : 1;  // query blocks per stage
  constexpr int kKeyRows = SPLIT ? kQueryTile : kKeysPerCta;  // rows of the K / V tiles
  constexpr uint32_t kSlotTx = 2 * L::kTileQ + kQueryTile * sizeof(float4);
  uint8_t* sK = smem + L::kK;
  uint8_t* sV = smem + L::kV;
  const float4* sSt = reinterpret_cast<const float4*>(smem + L::kSt);
  float2* sScale = reinterpret_cast<float2*>(smem + L::kScale);
  const uint32_t base = smem_u32(smem);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const int kv0 = kv_block * kKeysPerCta;
  const int64_t list_row = (static_cast<int64_t>(b) * p.H + h) * vl->kv_tiles + kv_block;
  const int32_t* qlist = vl->q_entries + list_row * vl->q_stride;
  const int count = __ldg(vl->q_counts + list_row);
  const int half = SPLIT ? (count + 1) / 2 : count;
  const int steps = half;  // SPLIT: joint steps, slot w = entry w * half + i

  const VisitStages stages{base + L::kBar, reinterpret_cast<int*>(smem + L::kBar + 8 * kStages)};
  auto issue = [&](int i) {
    const int st = i % kStages;
    const uint32_t bar = stages.bar_full + 8 * st;
    const int slots = SPLIT && half + i >= count ? 1 : kSlots;
    sm90::mbar_arrive_expect_tx(bar, slots * kSlotTx);
    for (int slot = 0; slot < slots; ++slot) {
      const uint32_t dst = base + L::kQ + (st * kSlots + slot) * 2 * L::kTileQ;
      const int row0 = (__ldg(qlist + slot * half + i) >> kAttnQatVisitCountBits) * kQueryTile;
#pragma unroll
      for (int hf = 0; hf < kD / 64; ++hf) {
        sm90::tma_load_4d(dst + hf * kQueryTile * kRowBytes, tm_q, bar, 64 * hf, row0, h, b);
        sm90::tma_load_4d(dst + L::kTileQ + hf * kQueryTile * kRowBytes, tm_do, bar, 64 * hf, row0, h, b);
      }
      sm90::tma_load_3d(base + L::kSt + (st * kSlots + slot) * kQueryTile * 16, tm_st, bar, 0, row0, b * p.H + h);
    }
  };
  if (tid == 0) {
    stages.init();
    for (int i = 0; i < kStages && i < steps; ++i) issue(i);
  }
  load_tile_sw128<kKeyRows, kThreads, kD>(sK, p.k, b, h, kv0, p.Lkv, tid);
  load_tile_sw128<kKeyRows, kThreads, kD>(sV, p.v, b, h, kv0, p.Lkv, tid);
  load_scatter_rows(p, vl, b, h, kv_block, p.Lkv, vl->coarse_dk, vl->coarse_dv, smem + L::kEpi, tid);
  cp_async_commit();
  if (tid < 128) {
    const float S = e4m3_value(static_cast<uint8_t>(tid));
    sScale[tid] = make_float2(S, tid == 0 ? 0.0f : __frcp_rn(S));
  }
  cp_async_wait<0>();
  fence_proxy_async();  // cp.async data -> visible to the wgmma (async proxy)
  __syncthreads();      // K, V, the scale table and the barriers are ready

  float dk[16][4], dv[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  const int key_wg = SPLIT ? 0 : wg;  // the warpgroup's 64 rows of the K / V tiles
  const int key_row0 = kv0 + key_wg * 64 + wq * 16 + g;  // this lane's keys: key_row0, +8
  // Valid keys of this warpgroup's 64 rows: [kv0 + key_wg * 64, key_end).
  const int key_end = kv0 + key_wg * 64 + __ldg(vl->key_rows + kv_block * 2 + key_wg);
  const bool key_tail = kv0 + key_wg * 64 + wq * 16 + 16 > key_end;
  const bool key_ok0 = key_row0 < key_end, key_ok1 = key_row0 + 8 < key_end;
  // A warpgroup whose 64 keys are all padding (a KV cube of one physical block) only
  // takes part in the stage hand-over (broadcast: warp-uniform).
  const bool idle = !SPLIT && __shfl_sync(0xffffffffu, key_end == kv0 + wg * 64 ? 1 : 0, 0) != 0;
  const uint32_t aK = smem_u32(sK), aV = smem_u32(sV);
  const bool leader = (tid & 127) == 0;

  for (int i = 0; i < steps; ++i) {
    const int st = i % kStages;
    stages.wait(i);
    // SPLIT: warpgroup 1 has no entry in the last joint step of an odd count
    const bool work = SPLIT ? (wg == 0 || half + i < count) : !idle;
    if (work) {
      const int slot = SPLIT ? wg : 0;
      const uint32_t aQ = base + L::kQ + (st * kSlots + slot) * 2 * L::kTileQ, adO = aQ + L::kTileQ;
      const float4* cSt = sSt + (st * kSlots + slot) * kQueryTile;
      float s[8][4], dp[8][4];
      uint32_t ap[4][4], ads[4][4];  // BF16 A fragments of dV and dK
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        wgmma_m64n64k16_ss<0>(flat(s), desc_kmajor(aK, kKeyRows, key_wg * 64, kk),
                              desc_kmajor(aQ, kQueryTile, 0, kk), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        wgmma_m64n64k16_ss<0>(flat(dp), desc_kmajor(aV, kKeyRows, key_wg * 64, kk),
                              desc_kmajor(adO, kQueryTile, 0, kk), kk > 0);
      wgmma_commit();
      wgmma_wait<1>();  // S^T done; dP^T may still run
      fence_regs(flat(s));
      dkdv_phase1<MODE, true, false, true>(s, cSt, p.c, key_tail, key_ok0, key_ok1, lane, ap, sScale);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 4; ++kq)
        wgmma_m64n128k16_rs<1>(flat(dv), ap[kq], desc_nmajor(adO, kQueryTile, kq * 16));
      wgmma_commit();
      wgmma_wait<1>();  // dP^T done; dV may still run
      fence_regs(flat(dp));
      dkdv_phase2<MODE>(s, dp, cSt, lane, ads);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 4; ++kq)
        wgmma_m64n128k16_rs<1>(flat(dk), ads[kq], desc_nmajor(aQ, kQueryTile, kq * 16));
      wgmma_commit();
      // Leaving dK in flight into the next step makes ptxas serialize every wgmma
      // (C7515); the other warpgroup keeps the tensor cores busy instead.
      wgmma_wait<0>();
      fence_regs(flat(dv));
      fence_regs(flat(dk));
    }
    named_barrier_sync(2 + wg, 128);  // every warp of this warpgroup is done with stage st
    stages.release(st, i, steps, leader, issue);
  }

  if constexpr (SPLIT) {
    // Warpgroup 1's sums to shared memory (the stages are free once both warpgroups are
    // past their last step), float4 k of thread t at (k * 128 + t) * 16: conflict-free.
    __syncthreads();
    float4* hand = reinterpret_cast<float4*>(smem + L::kQ);
    const int t = tid & 127;
    if (wg == 1) {
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        hand[n * 128 + t] = make_float4(dk[n][0], dk[n][1], dk[n][2], dk[n][3]);
        hand[(16 + n) * 128 + t] = make_float4(dv[n][0], dv[n][1], dv[n][2], dv[n][3]);
      }
    }
    __syncthreads();
    if (wg == 1) return;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float4 a = hand[n * 128 + t], c = hand[(16 + n) * 128 + t];
      dk[n][0] += a.x, dk[n][1] += a.y, dk[n][2] += a.z, dk[n][3] += a.w;
      dv[n][0] += c.x, dv[n][1] += c.y, dv[n][2] += c.z, dv[n][3] += c.w;
    }
  }

  if (vl->row_to_token != nullptr) {
    const int32_t* s_rows = reinterpret_cast<const int32_t*>(smem + L::kEpi);
    const float* s_coarse = reinterpret_cast<const float*>(smem + L::kEpi + kKeysPerCta * 4);
    const bool coarse = vl->coarse_dk != nullptr;
    store_rows_scattered(p.dk, s_rows, coarse ? s_coarse : nullptr, b, h, key_row0 - kv0, key_ok0, key_ok1, dk,
                         p.scale, t4);
    store_rows_scattered(p.dv, s_rows, coarse ? s_coarse + kD : nullptr, b, h, key_row0 - kv0, key_ok0, key_ok1, dv,
                         1.0f, t4);
  } else {
    store_dkdv<kD>(p, b, h, dk, dv, key_row0, key_ok0, key_ok1, t4);
  }
}

// dQ of query tile q_block over the visit list of vl (the recompute form), per tile of
// KT keys (per warpgroup, 64 queries): S and dP issued as two groups; exp2 overlaps dP;
// dQ issued. Without SPLIT the key tiles are pairs of 64-row blocks of this query tile's
// list (KT = 128), gathered into the tile's halves (rows past a block's valid count
// masked; a missing second block is loaded past the tensor's end: zeros, masked whole).
// SPLIT (a query tile of one 64-row block, VSA's partial cubes): both warpgroups take the
// same 64 queries and split the list, warpgroup w visiting entries [w * half, w * half +
// half), half = ceil(n / 2), one block per step (KT = 64; a stage holds both warpgroups'
// blocks); warpgroup 1 hands its dQ sums to warpgroup 0, which adds them to its own (a
// fixed order) and stores the rows.
template <bool SPLIT>
__device__ __forceinline__ void dq_visit_body(const KernelParams& p, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                              uint8_t* smem, int b, int h, int q_block, const VisitLists* vl) {
  using L = VisitDqSmem;
  constexpr int kD = kVisitD;
  constexpr int KT = SPLIT ? kAttnQatVisitBlockRows : kDqKeyTile;
  constexpr int kBlockSlices = kAttnQatVisitBlockRows / 8;  // n8 slices of S per visited block
  // bytes of one warpgroup's K and V blocks in a SPLIT stage
  constexpr uint32_t kSplitSlot = 2 * kAttnQatVisitBlockRows * kD * 2;
  static_assert(kSplitSlot == L::kTileK, "a SPLIT stage (2 * kTileK) holds two blocks' K and V");
  uint8_t* sQ = smem + L::kQ;
  uint8_t* sdO = smem + L::kdO;
  const uint32_t base = smem_u32(smem);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const int q0 = q_block * kQueriesPerCta;
  const int64_t list_row = (static_cast<int64_t>(b) * p.H + h) * vl->q_tiles + q_block;
  const int32_t* klist = vl->kv_entries + list_row * vl->kv_stride;
  const int kcount = __ldg(vl->kv_counts + list_row);
  auto kentry = [&](int i) { return i < kcount ? __ldg(klist + i) : 0; };
  const int half = (kcount + 1) / 2;
  const int steps = half;  // SPLIT: joint steps, warpgroup w's entry w * half + kb; else pairs 2 kb, 2 kb + 1

  const VisitStages stages{base + L::kBar, reinterpret_cast<int*>(smem + L::kBar + 8 * kStages)};
  auto issue = [&](int kb) {
    const int st = kb % kStages;
    const uint32_t bar = stages.bar_full + 8 * st, dst = base + L::kK + st * 2 * L::kTileK;
    if constexpr (SPLIT) {
      const int slots = half + kb < kcount ? 2 : 1;
      sm90::mbar_arrive_expect_tx(bar, slots * kSplitSlot);
      for (int slot = 0; slot < slots; ++slot) {
        const int row = (__ldg(klist + slot * half + kb) >> kAttnQatVisitCountBits) * kAttnQatVisitBlockRows;
        const uint32_t d = dst + slot * kSplitSlot;
#pragma unroll
        for (int hf = 0; hf < kD / 64; ++hf) {
          sm90::tma_load_4d(d + hf * KT * kRowBytes, tm_k, bar, 64 * hf, row, h, b);
          sm90::tma_load_4d(d + kSplitSlot / 2 + hf * KT * kRowBytes, tm_v, bar, 64 * hf, row, h, b);
        }
      }
    } else {
      sm90::mbar_arrive_expect_tx(bar, 2 * L::kTileK);
#pragma unroll
      for (int slot = 0; slot < 2; ++slot) {
        const int i = 2 * kb + slot;
        const int row = i < kcount ? (__ldg(klist + i) >> kAttnQatVisitCountBits) * kAttnQatVisitBlockRows : p.Lkv;
        const uint32_t d = dst + slot * kAttnQatVisitBlockRows * kRowBytes;
#pragma unroll
        for (int hf = 0; hf < kD / 64; ++hf) {
          sm90::tma_load_4d(d + hf * KT * kRowBytes, tm_k, bar, 64 * hf, row, h, b);
          sm90::tma_load_4d(d + L::kTileK + hf * KT * kRowBytes, tm_v, bar, 64 * hf, row, h, b);
        }
      }
    }
  };
  if (tid == 0) {
    stages.init();
    for (int kb = 0; kb < kStages && kb < steps; ++kb) issue(kb);
  }
  load_tile_sw128<kQueriesPerCta, kThreads, kD>(sQ, p.q, b, h, q0, p.Lq, tid);
  load_tile_sw128<kQueriesPerCta, kThreads, kD>(sdO, p.dout, b, h, q0, p.Lq, tid);
  load_scatter_rows(p, vl, b, h, q_block, p.Lq, vl->coarse_dq, nullptr, smem + L::kEpi, tid);
  cp_async_commit();

  const int q_wg = SPLIT ? 0 : wg;  // the warpgroup's 64 rows of the query tile
  const int row0 = q0 + q_wg * 64 + wq * 16 + g;  // this lane's queries: row0, row0 + 8
  const float4* st_bh = p.stats + (static_cast<int64_t>(b) * p.H + h) * p.Lq;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4 st0 = row0 < p.Lq ? st_bh[row0] : zero4;
  const float4 st1 = row0 + 8 < p.Lq ? st_bh[row0 + 8] : zero4;
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // Q, dO and the barriers are ready

  float dq[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;

  const uint32_t aQ = smem_u32(sQ), adO = smem_u32(sdO);
  // A warpgroup whose 64 queries are all padding (a query cube of one physical block)
  // only takes part in the stage hand-over; its dQ rows are 0.
  const bool idle = !SPLIT && __shfl_sync(0xffffffffu, __ldg(vl->key_rows + q_block * 2 + wg) == 0 ? 1 : 0, 0) != 0;
  const bool leader = (tid & 127) == 0;
  for (int kb = 0; kb < steps; ++kb) {
    const int st = kb % kStages;
    stages.wait(kb);
    // SPLIT: warpgroup 1 has no entry in the last joint step of an odd count
    const bool work = SPLIT ? (wg == 0 || half + kb < kcount) : !idle;
    if (work) {
      const uint32_t aK = base + L::kK + st * 2 * L::kTileK + (SPLIT ? wg * kSplitSlot : 0);
      const uint32_t aV = aK + (SPLIT ? kSplitSlot / 2 : L::kTileK);
      float s[KT / 8][4], dp[KT / 8][4];
      uint32_t ads[KT / 16][4];  // BF16 A fragments of dQ += dS K
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        if constexpr (SPLIT)
          wgmma_m64n64k16_ss<0>(flat(s), desc_kmajor(aQ, kQueriesPerCta, q_wg * 64, kk), desc_kmajor(aK, KT, 0, kk),
                                kk > 0);
        else
          wgmma_m64n128k16_ss<0>(flat(s), desc_kmajor(aQ, kQueriesPerCta, q_wg * 64, kk),
                                 desc_kmajor(aK, KT, 0, kk), kk > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        if constexpr (SPLIT)
          wgmma_m64n64k16_ss<0>(flat(dp), desc_kmajor(adO, kQueriesPerCta, q_wg * 64, kk),
                                desc_kmajor(aV, KT, 0, kk), kk > 0);
        else
          wgmma_m64n128k16_ss<0>(flat(dp), desc_kmajor(adO, kQueriesPerCta, q_wg * 64, kk),
                                 desc_kmajor(aV, KT, 0, kk), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // S done; dP may still run
      fence_regs(flat(s));

      // Keys of the tile: [0, key_n0) valid in the first block, [64, 64 + key_n1) in the
      // second (SPLIT: one block, the warpgroup's entry).
      const int key_n0 = SPLIT ? kentry(wg * half + kb) & 127 : kentry(2 * kb) & 127;
      const int key_n1 = SPLIT ? kAttnQatVisitBlockRows : kentry(2 * kb + 1) & 127;
      const bool key_tail = key_n0 < kQueryTile || key_n1 < kQueryTile;
      float pr[KT / 8][4];  // P (kept apart from the accumulator registers of S)
#pragma unroll
      for (int j = 0; j < KT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float p0 = fast_exp2(fmaf(s[j][e], p.c, -st0.x)) * st0.y;
          float p1 = fast_exp2(fmaf(s[j][2 + e], p.c, -st1.x)) * st1.y;
          const bool hi = j >= kBlockSlices;  // second 64-row block of the tile
          if (key_tail && (j % kBlockSlices) * 8 + 2 * t4 + e >= (hi ? key_n1 : key_n0)) p0 = p1 = 0.0f;
          pr[j][e] = p0;
          pr[j][2 + e] = p1;
        }
      }
      wgmma_wait<0>();  // dP done
      fence_regs(flat(dp));
#pragma unroll
      for (int j = 0; j < KT / 8; ++j) {
        ads[j >> 1][(j & 1) * 2] = pack_bf16(pr[j][0] * (dp[j][0] - st0.z), pr[j][1] * (dp[j][1] - st0.z));
        ads[j >> 1][(j & 1) * 2 + 1] = pack_bf16(pr[j][2] * (dp[j][2] - st1.z), pr[j][3] * (dp[j][3] - st1.z));
      }
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < KT / 16; ++kq)
        wgmma_m64n128k16_rs<1>(flat(dq), ads[kq], desc_nmajor(aK, KT, kq * 16));
      wgmma_commit();
      wgmma_wait<0>();  // see dkdv_visit_body
      fence_regs(flat(dq));
    }
    named_barrier_sync(2 + wg, 128);  // every warp of this warpgroup is done with stage st
    stages.release(st, kb, steps, leader, issue);
  }

  if constexpr (SPLIT) {
    // Warpgroup 1's sums to shared memory (the stages are free once both warpgroups are
    // past their last step), float4 n of thread t at (n * 128 + t) * 16: conflict-free.
    __syncthreads();
    float4* hand = reinterpret_cast<float4*>(smem + L::kK);
    const int t = tid & 127;
    if (wg == 1) {
#pragma unroll
      for (int n = 0; n < 16; ++n) hand[n * 128 + t] = make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]);
    }
    __syncthreads();
    if (wg == 1) return;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float4 a = hand[n * 128 + t];
      dq[n][0] += a.x, dq[n][1] += a.y, dq[n][2] += a.z, dq[n][3] += a.w;
    }
  }

  if (vl->row_to_token != nullptr) {
    const int32_t* s_rows = reinterpret_cast<const int32_t*>(smem + L::kEpi);
    const float* s_coarse = reinterpret_cast<const float*>(smem + L::kEpi + kQueriesPerCta * 4);
    store_rows_scattered(p.dq, s_rows, vl->coarse_dq != nullptr ? s_coarse : nullptr, b, h, row0 - q0, row0 < p.Lq,
                         row0 + 8 < p.Lq, dq, p.scale, t4);
    return;
  }
  bf16* dq_base = p.dq.p + b * p.dq.sb + h * p.dq.sh;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int col = n * 8 + 2 * t4;
    if (row0 < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row0) * p.dq.sl + col) =
          pack_bf16(dq[n][0] * p.scale, dq[n][1] * p.scale);
    if (row0 + 8 < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row0 + 8) * p.dq.sl + col) =
          pack_bf16(dq[n][2] * p.scale, dq[n][3] * p.scale);
  }
}
#endif  // VQAD_BWD_SM90A


// Dynamic shared memory is only guaranteed 16-byte aligned; the swizzle needs 1024.
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

// The visit-list backward (launch_wgmma_visit_kernels) in one launch: dK/dV CTAs over
// their query-block lists first (the longer ones), then dQ CTAs over their key-block
// lists, which fill the SMs that the last dK/dV wave leaves idle.
template <AttnQatBwdPMode MODE>
__global__ void __launch_bounds__(kThreads, 1)
    fused_visit_kernel(const KernelParams p, const __grid_constant__ VisitLists vl,
                       const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                       const __grid_constant__ CUtensorMap tm_st, const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v) {
#ifdef VQAD_BWD_SM90A
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const int64_t dkdv_ctas = static_cast<int64_t>(p.B) * p.H * vl.kv_tiles;
  int64_t idx = blockIdx.x;
  if (idx < dkdv_ctas) {
    const int blk = static_cast<int>(idx % vl.kv_tiles);
    idx /= vl.kv_tiles;
    const int bb = static_cast<int>(idx / p.H), hh = static_cast<int>(idx % p.H);
    if (__ldg(vl.key_rows + 2 * blk + 1) == 0 && __ldg(vl.key_rows + 2 * blk) > 0)
      dkdv_visit_body<MODE, true>(p, &tm_q, &tm_do, &tm_st, smem, bb, hh, blk, &vl);
    else
      dkdv_visit_body<MODE, false>(p, &tm_q, &tm_do, &tm_st, smem, bb, hh, blk, &vl);
  } else {
    idx -= dkdv_ctas;
    const int blk = static_cast<int>(idx % vl.q_tiles);
    idx /= vl.q_tiles;
    const int bb = static_cast<int>(idx / p.H), hh = static_cast<int>(idx % p.H);
    if (__ldg(vl.key_rows + 2 * blk + 1) == 0 && __ldg(vl.key_rows + 2 * blk) > 0)
      dq_visit_body<true>(p, &tm_k, &tm_v, smem, bb, hh, blk, &vl);
    else
      dq_visit_body<false>(p, &tm_k, &tm_v, smem, bb, hh, blk, &vl);
  }
#else
  (void)tm_q, (void)tm_do, (void)tm_st, (void)tm_k, (void)tm_v;
#endif
}

// dK, dV and the ordered dQ partials in one warp-specialised kernel (dkdv_ws_body).
// CTA order: batch*head fastest, so the CTAs that run at the same time spread over every head's
// chains, and a CTA's predecessor in its chain (key block - groups) always has a
// lower index (it started earlier: no CTA waits on one that cannot run).
template <AttnQatBwdPMode MODE, int D>
__global__ void __launch_bounds__(kWsThreads, 1)
    dkdvq_ws_kernel(const KernelParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_st,
                    const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#ifdef VQAD_BWD_SM90A
  extern __shared__ uint8_t smem_raw[];
  const int bh_count = p.B * p.H;
  int64_t idx = blockIdx.x;
  int q_begin = 0, q_end = -1;
  float* part_out = nullptr;
  if (idx >= p.split_first) {  // tail split: unit u (an unsplit CTA index), part r
    const int64_t t = idx - p.split_first, u = t / p.split_parts;
    const int r = static_cast<int>(t % p.split_parts);
    const int nq = (p.Lq + kQueryTile - 1) / kQueryTile;
    q_begin = static_cast<int>(static_cast<int64_t>(nq) * r / p.split_parts);
    q_end = static_cast<int>(static_cast<int64_t>(nq) * (r + 1) / p.split_parts);
    part_out = p.dkv_part + (u * p.split_parts + r) * (2 * kKeysPerCta * D);
    idx = p.split_first + u;
  }
  const int bh = static_cast<int>(idx % bh_count);
  const int kv_block = static_cast<int>(idx / bh_count);
  if ((kv_block + 1) * kKeysPerCta > p.Lkv)
    dkdv_ws_body<MODE, D, true>(p, &tm_q, &tm_do, &tm_st, &tm_k, &tm_v, aligned_smem(smem_raw), bh / p.H, bh % p.H,
                                kv_block, q_begin, q_end, part_out);
  else
    dkdv_ws_body<MODE, D, false>(p, &tm_q, &tm_do, &tm_st, &tm_k, &tm_v, aligned_smem(smem_raw), bh / p.H, bh % p.H,
                                 kv_block, q_begin, q_end, part_out);
#else
  (void)tm_q, (void)tm_do, (void)tm_st, (void)tm_k, (void)tm_v;
#endif
}

// dK = scale * (part_0 + part_1 + ...), dV = part_0 + part_1 + ... in part order for
// the split key blocks, as BF16 BLHD. One CTA per split key block.
template <int D>
__global__ void __launch_bounds__(256) dkdv_combine_kernel(const KernelParams p) {
  constexpr int kD = D;
  const int64_t u = blockIdx.x, idx = p.split_first + u;
  const int bh_count = p.B * p.H;
  const int bh = static_cast<int>(idx % bh_count), kv_block = static_cast<int>(idx / bh_count);
  const int b = bh / p.H, h = bh % p.H;
  const float* part = p.dkv_part + u * p.split_parts * (2 * kKeysPerCta * kD);
  for (int e = threadIdx.x; e < 2 * kKeysPerCta * kD / 2; e += blockDim.x) {
    const int pos = 2 * e;  // [tensor][key][col], pairs of columns
    float2 acc = *reinterpret_cast<const float2*>(part + pos);
    for (int r = 1; r < p.split_parts; ++r) {
      const float2 x = *reinterpret_cast<const float2*>(part + r * (2 * kKeysPerCta * kD) + pos);
      acc.x += x.x, acc.y += x.y;
    }
    const int tensor = pos / (kKeysPerCta * kD), key = (pos / kD) % kKeysPerCta, col = pos % kD;
    const int row = kv_block * kKeysPerCta + key;
    if (row >= p.Lkv) continue;
    if (tensor == 0) {
      *reinterpret_cast<uint32_t*>(p.dk.p + b * p.dk.sb + h * p.dk.sh +
                                   static_cast<int64_t>(row) * p.dk.sl + col) =
          pack_bf16(acc.x * p.scale, acc.y * p.scale);
    } else {
      *reinterpret_cast<uint32_t*>(p.dv.p + b * p.dv.sb + h * p.dv.sh +
                                   static_cast<int64_t>(row) * p.dv.sl + col) = pack_bf16(acc.x, acc.y);
    }
  }
}

// dQ = scale * (partial_0 + partial_1 + ...) in group order, as BF16 BLHD.
// One CTA per (b*h, query block of 64); thread t handles staging units t, t+256, ...
// At D = 64 a partial is two 64-key parts (unit u and u + 1024), added part 0 first.
template <int D>
__global__ void __launch_bounds__(256) dq_finalize_kernel(const KernelParams p, int nq) {
  constexpr int kUnits = kQueryTile * D / 4;  // float4 units of one block's dQ
  constexpr int kParts = kDqStageFloats / (kQueryTile * D);
  static_assert(kParts * kQueryTile * D == kDqStageFloats, "staging: 64 x 128 floats");
  const int qb = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.H, h = bh % p.H;
  const int64_t group_stride = static_cast<int64_t>(p.B) * p.H * nq * kDqStageFloats;
  const float4* part = reinterpret_cast<const float4*>(
      p.dq_acc + (static_cast<int64_t>(bh) * nq + qb) * kDqStageFloats);
  bf16* dq_base = p.dq.p + b * p.dq.sb + h * p.dq.sh;
  for (int u = threadIdx.x; u < kUnits; u += blockDim.x) {
    float4 acc = part[u];
    for (int gi = 0; gi < p.dq_groups; ++gi) {
#pragma unroll
      for (int r = 0; r < kParts; ++r) {
        if (gi == 0 && r == 0) continue;
        const float4 x = part[gi * group_stride / 4 + r * kUnits + u];
        acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
      }
    }
    // Unit u = [wg][j][warp][lane] (see dkdv_ws_body); wg is the column half at D = 128.
    const int lane = u & 31, wq = (u >> 5) & 3, j = (u >> 7) & 7, wg = u >> 10;
    const int row = qb * kQueryTile + wq * 16 + (lane >> 2);
    const int col = wg * 64 + j * 8 + 2 * (lane & 3);
    if (row < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row) * p.dq.sl + col) =
          pack_bf16(acc.x * p.scale, acc.y * p.scale);
    if (row + 8 < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row + 8) * p.dq.sl + col) =
          pack_bf16(acc.z * p.scale, acc.w * p.scale);
  }
}

constexpr const char* kOp = "attn_qat_bwd (wgmma)";
constexpr const char* kVisitOp = "attn_qat_bwd (wgmma, visit lists)";

template <typename Kernel>
void set_smem(const char* op, Kernel kernel, size_t bytes, const DeviceInfo& dev, const KernelParams& kp) {
  VQAD_LAUNCH_CHECK(bytes <= dev.smem_optin_bytes, op, kernel_shape_str(kp), "expected ", bytes,
                    " bytes of shared memory per block, found ", dev.smem_optin_bytes, " on the device");
  VQAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

// TMA tensor maps of both sm_90 backward forms: 64-row boxes of Q, dO, the row
// statistics, K and V (in that order; 64 channels, 128-byte swizzle for the BF16 views).
void make_tensor_maps(const KernelParams& kp, const char* op, CUtensorMap (&maps)[5]) {
  const InTensor* views[4] = {&kp.q, &kp.dout, &kp.k, &kp.v};
  const char* names[4] = {"q", "d_out", "k", "v"};
  const int lens[4] = {kp.Lq, kp.Lq, kp.Lkv, kp.Lkv};
  for (int i = 0; i < 4; ++i) {
    const InTensor& t = *views[i];
    const std::string why = make_blhd_tensor_map(&maps[i < 2 ? i : i + 1], t.p, BlhdStrides{t.sb, t.sl, t.sh, 1},
                                                 kp.B, lens[i], kp.H, kp.D, kQueryTile);
    VQAD_LAUNCH_CHECK(why.empty(), op, kernel_shape_str(kp), "tensor ", names[i], ": ", why);
  }
  const std::string why =
      make_f32x4_rows_tensor_map(&maps[2], kp.stats, kp.Lq, static_cast<int>(static_cast<int64_t>(kp.B) * kp.H),
                                 kQueryTile);
  VQAD_LAUNCH_CHECK(why.empty(), op, kernel_shape_str(kp), "workspace (row statistics): ", why);
}

}  // namespace

void launch_wgmma_kernels(const KernelParams& kp, AttnQatBwdPMode mode, const DeviceInfo& dev,
                          cudaStream_t stream) {
  const auto shape = [&] { return kernel_shape_str(kp); };
  VQAD_LAUNCH_CHECK(dev.arch() == 90, kOp, shape(), "no kernel for this device: expected sm_90 (built for sm_90a), "
                    "found sm_", dev.arch());
  const int kv_blocks = (kp.Lkv + kKeysPerCta - 1) / kKeysPerCta;
  const int nq = dq_query_blocks(kp.Lq);
  const int64_t bh = static_cast<int64_t>(kp.B) * kp.H;
  VQAD_LAUNCH_CHECK(kp.dq_acc != nullptr && kp.dq_sem != nullptr && kp.dq_groups == dq_accum_groups(bh, kv_blocks),
                    kOp, shape(), "expected the dQ accumulation workspace of ", dq_accum_groups(bh, kv_blocks),
                    " groups, found ", kp.dq_groups, " groups at ", kp.dq_acc);
  const DkdvSplitPlan plan = dkdv_split_plan(bh, kv_blocks, kp.Lq);
  VQAD_LAUNCH_CHECK(plan.tail == 0 || kp.dkv_part != nullptr, kOp, shape(),
                    "expected the tail-split workspace, found null");
  const int64_t ctas = bh * kv_blocks + static_cast<int64_t>(plan.tail) * (plan.parts - 1);
  VQAD_LAUNCH_CHECK(ctas <= 0x7fffffff && bh <= 65535, kOp, shape(),
                    "expected batch * heads <= 65535 and batch * heads * key blocks <= 2^31 - 1 (grid limits), "
                    "found ", bh, " and ", ctas);
  KernelParams kq = kp;
  kq.split_first = static_cast<int>(plan.first);
  kq.split_parts = plan.parts;
  VQAD_LAUNCH_CHECK(attn_qat_head_dim_supported(kp.D), kOp, shape(), "expected head dim 64 or 128, found ", kp.D);
  VQAD_CUDA_CHECK(cudaMemsetAsync(kp.dq_sem, 0,
                                  static_cast<size_t>(kp.dq_groups) * bh * nq * sizeof(int), stream));
  CUtensorMap maps[5];
  make_tensor_maps(kp, kOp, maps);
  auto run = [&](auto d) {
    constexpr int D = decltype(d)::value;
    constexpr size_t smem = 1024 + WsSmem<D>::kBytes;
    auto launch = [&](auto kernel) {
      set_smem(kOp, kernel, smem, dev, kp);
      kernel<<<static_cast<unsigned>(ctas), kWsThreads, smem, stream>>>(kq, maps[0], maps[1], maps[2], maps[3],
                                                                        maps[4]);
    };
    switch (mode) {
      case AttnQatBwdPMode::kConsistent: launch(dkdvq_ws_kernel<AttnQatBwdPMode::kConsistent, D>); break;
      case AttnQatBwdPMode::kFastVideo: launch(dkdvq_ws_kernel<AttnQatBwdPMode::kFastVideo, D>); break;
      case AttnQatBwdPMode::kNone: launch(dkdvq_ws_kernel<AttnQatBwdPMode::kNone, D>); break;
    }
    VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd dkdvq_ws_kernel");
    if (plan.tail > 0) {
      dkdv_combine_kernel<D><<<static_cast<unsigned>(plan.tail), 256, 0, stream>>>(kq);
      VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd dkdv_combine_kernel");
    }
    dq_finalize_kernel<D><<<dim3(nq, static_cast<unsigned>(bh)), 256, 0, stream>>>(kp, nq);
    VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd dq_finalize_kernel");
  };
  if (kp.D == 64)
    run(std::integral_constant<int, 64>{});
  else
    run(std::integral_constant<int, 128>{});
}

void launch_wgmma_visit_kernels(const KernelParams& kp, const VisitLists& vl, AttnQatBwdPMode mode,
                                const DeviceInfo& dev, cudaStream_t stream) {
  const auto shape = [&] { return kernel_shape_str(kp); };
  VQAD_LAUNCH_CHECK(dev.arch() == 90, kVisitOp, shape(),
                    "no kernel for this device: expected sm_90 (built for sm_90a), found sm_", dev.arch());
  const int kv_tiles = (kp.Lkv + kKeysPerCta - 1) / kKeysPerCta;
  const int q_tiles = (kp.Lq + kQueriesPerCta - 1) / kQueriesPerCta;
  VQAD_LAUNCH_CHECK(vl.q_entries && vl.q_counts && vl.kv_entries && vl.kv_counts && vl.key_rows && vl.q_stride >= 1 &&
                        vl.kv_stride >= 1 && vl.kv_tiles == kv_tiles && vl.q_tiles == q_tiles,
                    kVisitOp, shape(), "expected all lists and ", kv_tiles, " key tiles, ", q_tiles,
                    " query tiles, found ", vl.kv_tiles, " key tiles, ", vl.q_tiles,
                    " query tiles (a null list or a stride < 1 is also refused)");
  const bool coarse = vl.coarse_dq || vl.coarse_dk || vl.coarse_dv;
  VQAD_LAUNCH_CHECK(!coarse || (vl.row_to_token && vl.coarse_dq && vl.coarse_dk && vl.coarse_dv &&
                                vl.coarse_group_rows == kKeysPerCta && vl.coarse_groups == kv_tiles),
                    kVisitOp, shape(), "coarse terms: expected the row scatter, all three coarse tensors and a group "
                    "per key tile (", kKeysPerCta, " rows x ", kv_tiles, "), found groups of ", vl.coarse_group_rows, " rows x ", vl.coarse_groups,
                    (vl.row_to_token ? "" : " without a scatter"));
  const int64_t ctas = static_cast<int64_t>(kp.B) * kp.H * (kv_tiles + q_tiles);
  VQAD_LAUNCH_CHECK(ctas <= 0x7fffffff, kVisitOp, shape(), "expected at most 2^31 - 1 CTAs, found ", ctas);
  VQAD_LAUNCH_CHECK(kp.D == kVisitD, kVisitOp, shape(), "expected head dim ", kVisitD, ", found ", kp.D);
  CUtensorMap maps[5];
  make_tensor_maps(kp, kVisitOp, maps);
  const size_t smem = kVisitSmem;
  auto launch = [&](auto kernel) {
    set_smem(kVisitOp, kernel, smem, dev, kp);
    kernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(kp, vl, maps[0], maps[1], maps[2], maps[3],
                                                                     maps[4]);
  };
  switch (mode) {
    case AttnQatBwdPMode::kConsistent: launch(fused_visit_kernel<AttnQatBwdPMode::kConsistent>); break;
    case AttnQatBwdPMode::kFastVideo: launch(fused_visit_kernel<AttnQatBwdPMode::kFastVideo>); break;
    case AttnQatBwdPMode::kNone: launch(fused_visit_kernel<AttnQatBwdPMode::kNone>); break;
  }
  VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd fused_visit_kernel");
}

}  // namespace vqad::kernels::attn_bwd
