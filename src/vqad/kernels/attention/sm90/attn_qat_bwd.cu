// ATTN_QAT_TRAIN backward (spec/attention.md): the row-statistics pre-pass, the
// mma.sync m16n8k16 kernels (any sm_90+ device) and the public launcher, which
// picks these or the wgmma kernels of attn_qat_bwd_wgmma.cu.
//
// Three kernels, no atomics (bitwise reproducible):
//   stats_kernel: per query row {m, 1/l, delta = rowsum(dO * O_hp)}.
//   dkdv_kernel:  CTA = 16*NW keys (one warp per 16 keys), loops over all
//                 query blocks. It works on the transposed scores S^T = K Q^T so
//                 that a warp's 16 keys are exactly one NVFP4 group of P along a
//                 query row (see fq_columns16x64), and P^T / dS^T are already in
//                 the A-operand layout of dV += Pb^T dO and dK += dS^T Q.
//   dq_kernel:    CTA = 16*NW queries, loops over all key blocks.
// Shared tiles: cp.async double buffering, rows of D (64 or 128) bf16 whose 16-byte chunks
// are XOR-swizzled by (row & 7) so that every ldmatrix phase is conflict-free.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "vqad/core/error.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#include "vqad/kernels/attention/sm90/attn_qat_bwd_common.cuh"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/common/launch.h"

namespace vqad::kernels {
namespace attn_bwd {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Element offset of (row, 16-byte chunk) in a tile of rows of D bf16.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Loads ROWS x D bf16 rows [row0, row0 + ROWS) of (b, h) into a swizzled tile;
// rows at or beyond `len` are zero-filled.
template <int ROWS, int NT, int D>
__device__ __forceinline__ void load_tile(bf16* dst, const InTensor& t, int b, int h, int row0,
                                          int len, int tid) {
  constexpr int kChunksPerRow = D / 8;
  const bf16* base = t.p + b * t.sb + h * t.sh;
#pragma unroll
  for (int i = tid; i < ROWS * kChunksPerRow; i += NT) {
    const int r = i / kChunksPerRow, ch = i % kChunksPerRow;
    const int gr = row0 + r;
    const bool ok = gr < len;
    cp_async16(dst + swz<D>(r, ch), base + static_cast<int64_t>(ok ? gr : 0) * t.sl + ch * 8, ok);
  }
}

// ---------------------------------------------------------------------------
// Row statistics pre-pass: one warp per query row, D / 32 channels per lane.
// ---------------------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(256) stats_kernel(const KernelParams p) {
  constexpr int kPerLane = D / 32;
  using Vec = typename std::conditional<kPerLane == 4, uint2, uint32_t>::type;
  static_assert(kPerLane == 2 || kPerLane == 4, "stats_kernel: D is 64 or 128");
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t total = static_cast<int64_t>(p.B) * p.H * p.Lq;
  if (row >= total) return;
  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  const bf16* dop = p.dout.p + b * p.dout.sb + static_cast<int64_t>(i) * p.dout.sl + h * p.dout.sh;
  const bf16* ohp = p.ohp.p + b * p.ohp.sb + static_cast<int64_t>(i) * p.ohp.sl + h * p.ohp.sh;
  const Vec dv = *reinterpret_cast<const Vec*>(dop + lane * kPerLane);
  const Vec ov = *reinterpret_cast<const Vec*>(ohp + lane * kPerLane);
  const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&dv);
  const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&ov);
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < kPerLane / 2; ++e) {
    const float2 df = __bfloat1622float2(d2[e]);
    const float2 of = __bfloat1622float2(o2[e]);
    acc = fmaf(df.x, of.x, acc);
    acc = fmaf(df.y, of.y, acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    // Row statistics are [B, H, Lq] contiguous, the same flat index as `row`
    // after reordering (b, h, i).
    const int64_t idx = (static_cast<int64_t>(b) * p.H + h) * p.Lq + i;
    p.stats[idx] = make_float4(p.m[idx], 1.0f / p.l[idx], acc, 0.0f);
  }
}

// ---------------------------------------------------------------------------
// dK, dV
// ---------------------------------------------------------------------------
template <int NW, int BQ, int D>
constexpr size_t dkdv_smem_bytes() {
  return (2 * (NW * 16) * D + 2 * 2 * BQ * D) * sizeof(bf16) + 2 * BQ * sizeof(float4);
}

template <int NW, int BQ, AttnQatBwdPMode MODE, int D>
__global__ void __launch_bounds__(NW * 32, 1) dkdv_kernel(const KernelParams p) {
  constexpr int kD = D;
  constexpr int BN = NW * 16;
  constexpr int NT = NW * 32;
  constexpr int QT = BQ / 8;  // n-tiles of 8 queries
  extern __shared__ __align__(128) uint8_t smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + BN * kD;
  bf16* sQ = sV + BN * kD;      // [2][BQ][kD]
  bf16* sdO = sQ + 2 * BQ * kD;  // [2][BQ][kD]
  float4* sSt = reinterpret_cast<float4*>(sdO + 2 * BQ * kD);  // [2][BQ]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y, kv0 = blockIdx.x * BN;

  load_tile<BN, NT, kD>(sK, p.k, b, h, kv0, p.Lkv, tid);
  load_tile<BN, NT, kD>(sV, p.v, b, h, kv0, p.Lkv, tid);
  // The loads' addresses are formed from the thread and block indices at each call (kept
  // across the loop, they spill).
  auto load_q_block = [&](int qb, int stage) {
    const int q0 = qb * BQ;
    const int t = static_cast<int>(sm90::tid_x_here());
    const int b_now = static_cast<int>(sm90::opaque_here(b)), h_now = static_cast<int>(sm90::opaque_here(h));
    load_tile<BQ, NT, kD>(sQ + stage * BQ * kD, p.q, b_now, h_now, q0, p.Lq, t);
    load_tile<BQ, NT, kD>(sdO + stage * BQ * kD, p.dout, b_now, h_now, q0, p.Lq, t);
    const float4* st_bh = p.stats + (static_cast<int64_t>(b_now) * p.H + h_now) * p.Lq;
    for (int i = t; i < BQ; i += NT) {
      const bool ok = q0 + i < p.Lq;
      cp_async16(&sSt[stage * BQ + i], st_bh + (ok ? q0 + i : 0), ok);
    }
  };
  load_q_block(0, 0);
  cp_async_commit();

  float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  const int key_row0 = kv0 + warp * 16 + g;  // this lane's keys: key_row0, key_row0 + 8
  const bool key_tail = kv0 + warp * 16 + 16 > p.Lkv;
  const bool key_ok0 = key_row0 < p.Lkv, key_ok1 = key_row0 + 8 < p.Lkv;
  const int nq = (p.Lq + BQ - 1) / BQ;

  for (int qb = 0; qb < nq; ++qb) {
    // (warp / lane re-derived per iteration: kept across the loop they spill)
    const int tid_h = static_cast<int>(sm90::tid_x_here()), warp_h = tid_h >> 5, lane_h = tid_h & 31;
    const int stage = qb & 1;
    if (qb + 1 < nq) {
      load_q_block(qb + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* cQ = sQ + stage * BQ * kD;
    const bf16* cdO = sdO + stage * BQ * kD;
    const float4* cSt = sSt + stage * BQ;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BQ queries.
    float s[QT][4], dp[QT][4];
#pragma unroll
    for (int n = 0; n < QT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4], av[4];
      ldsm_x4(ak, sK + swz<kD>(warp_h * 16 + (lane_h & 15), kk * 2 + (lane_h >> 4)));
      ldsm_x4(av, sV + swz<kD>(warp_h * 16 + (lane_h & 15), kk * 2 + (lane_h >> 4)));
#pragma unroll
      for (int nn = 0; nn < BQ / 16; ++nn) {
        const int off = swz<kD>(nn * 16 + (lane_h & 7) + ((lane_h >> 4) << 3), kk * 2 + ((lane_h >> 3) & 1));
        uint32_t bq[4], bd[4];
        ldsm_x4(bq, cQ + off);
        ldsm_x4(bd, cdO + off);
        mma_bf16(s[2 * nn], ak, bq[0], bq[1]);
        mma_bf16(s[2 * nn + 1], ak, bq[2], bq[3]);
        mma_bf16(dp[2 * nn], av, bd[0], bd[1]);
        mma_bf16(dp[2 * nn + 1], av, bd[2], bd[3]);
      }
    }

    static_assert(BQ == 64, "dkdv_phase1/2 work on 16 keys x 64 queries per warp");
    uint32_t ap_all[4][4];
    dkdv_phase1<MODE>(s, cSt, p.c, key_tail, key_ok0, key_ok1, lane_h, ap_all);

    // dV += Pb^T dO and dK += dS^T Q (k = queries); dS^T of each 16-query group is formed
    // right before its products (dkdv_phase2_group), so that its s / dp die there.
#pragma unroll
    for (int kq = 0; kq < BQ / 16; ++kq) {
      const uint32_t(&ap)[4] = ap_all[kq];
      uint32_t ads[4];
      dkdv_phase2_group<MODE>(s, dp, cSt, lane_h, kq, ads);
#pragma unroll
      for (int dn = 0; dn < kD / 16; ++dn) {
        const int off = swz<kD>(kq * 16 + (lane_h & 7) + (((lane_h >> 3) & 1) << 3), dn * 2 + (lane_h >> 4));
        uint32_t bd[4], bq[4];
        ldsm_x4_trans(bd, cdO + off);
        ldsm_x4_trans(bq, cQ + off);
        mma_bf16(dv[2 * dn], ap, bd[0], bd[1]);
        mma_bf16(dv[2 * dn + 1], ap, bd[2], bd[3]);
        mma_bf16(dk[2 * dn], ads, bq[0], bq[1]);
        mma_bf16(dk[2 * dn + 1], ads, bq[2], bq[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }

  bf16* dk_base = p.dk.p + b * p.dk.sb + h * p.dk.sh;
  bf16* dv_base = p.dv.p + b * p.dv.sb + h * p.dv.sh;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    const int col = n * 8 + 2 * t4;
    if (key_ok0) {
      const int64_t o = static_cast<int64_t>(key_row0) * p.dk.sl + col;
      const int64_t ov = static_cast<int64_t>(key_row0) * p.dv.sl + col;
      *reinterpret_cast<uint32_t*>(dk_base + o) = pack_bf16(dk[n][0] * p.scale, dk[n][1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_base + ov) = pack_bf16(dv[n][0], dv[n][1]);
    }
    if (key_ok1) {
      const int64_t o = static_cast<int64_t>(key_row0 + 8) * p.dk.sl + col;
      const int64_t ov = static_cast<int64_t>(key_row0 + 8) * p.dv.sl + col;
      *reinterpret_cast<uint32_t*>(dk_base + o) = pack_bf16(dk[n][2] * p.scale, dk[n][3] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_base + ov) = pack_bf16(dv[n][2], dv[n][3]);
    }
  }
}

// ---------------------------------------------------------------------------
// dQ
// ---------------------------------------------------------------------------
template <int NW, int BKV, int D>
constexpr size_t dq_smem_bytes() {
  return (2 * (NW * 16) * D + 2 * 2 * BKV * D) * sizeof(bf16);
}

template <int NW, int BKV, int D>
__global__ void __launch_bounds__(NW * 32, 1) dq_kernel(const KernelParams p) {
  constexpr int kD = D;
  constexpr int BM = NW * 16;
  constexpr int NT = NW * 32;
  constexpr int KT = BKV / 8;  // n-tiles of 8 keys
  extern __shared__ __align__(128) uint8_t smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + BM * kD;
  bf16* sK = sdO + BM * kD;       // [2][BKV][kD]
  bf16* sV = sK + 2 * BKV * kD;   // [2][BKV][kD]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BM;

  load_tile<BM, NT, kD>(sQ, p.q, b, h, q0, p.Lq, tid);
  load_tile<BM, NT, kD>(sdO, p.dout, b, h, q0, p.Lq, tid);
  cp_async_commit();
  auto load_kv_block = [&](int kb, int stage) {
    load_tile<BKV, NT, kD>(sK + stage * BKV * kD, p.k, b, h, kb * BKV, p.Lkv, tid);
    load_tile<BKV, NT, kD>(sV + stage * BKV * kD, p.v, b, h, kb * BKV, p.Lkv, tid);
  };
  load_kv_block(0, 0);
  cp_async_commit();

  const int row0 = q0 + warp * 16 + g;  // this lane's queries: row0, row0 + 8
  const float4* st_bh = p.stats + (static_cast<int64_t>(b) * p.H + h) * p.Lq;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4 st0 = row0 < p.Lq ? st_bh[row0] : zero4;
  const float4 st1 = row0 + 8 < p.Lq ? st_bh[row0 + 8] : zero4;

  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[kD / 16][4], df[kD / 16][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    ldsm_x4(qf[kk], sQ + swz<kD>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    ldsm_x4(df[kk], sdO + swz<kD>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
  }

  float dq[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;

  const int nk = (p.Lkv + BKV - 1) / BKV;
  for (int kb = 0; kb < nk; ++kb) {
    const int stage = kb & 1;
    if (kb + 1 < nk) {
      load_kv_block(kb + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* cK = sK + stage * BKV * kD;
    const bf16* cV = sV + stage * BKV * kD;

    float s[KT][4], dp[KT][4];
#pragma unroll
    for (int n = 0; n < KT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BKV / 16; ++nn) {
        const int off = swz<kD>(nn * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1));
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, cK + off);
        ldsm_x4(bv, cV + off);
        mma_bf16(s[2 * nn], qf[kk], bk[0], bk[1]);
        mma_bf16(s[2 * nn + 1], qf[kk], bk[2], bk[3]);
        mma_bf16(dp[2 * nn], df[kk], bv[0], bv[1]);
        mma_bf16(dp[2 * nn + 1], df[kk], bv[2], bv[3]);
      }
    }

    const bool key_tail = kb * BKV + BKV > p.Lkv;
#pragma unroll
    for (int j = 0; j < KT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p0 = fast_exp2(fmaf(s[j][e], p.c, -st0.x)) * st0.y;
        float p1 = fast_exp2(fmaf(s[j][2 + e], p.c, -st1.x)) * st1.y;
        if (key_tail && kb * BKV + j * 8 + 2 * t4 + e >= p.Lkv) p0 = p1 = 0.0f;
        dp[j][e] = p0 * (dp[j][e] - st0.z);
        dp[j][2 + e] = p1 * (dp[j][2 + e] - st1.z);
      }
    }

    // dQ += dS K (k = keys).
#pragma unroll
    for (int kq = 0; kq < BKV / 16; ++kq) {
      const uint32_t ads[4] = {pack_bf16(dp[2 * kq][0], dp[2 * kq][1]),
                               pack_bf16(dp[2 * kq][2], dp[2 * kq][3]),
                               pack_bf16(dp[2 * kq + 1][0], dp[2 * kq + 1][1]),
                               pack_bf16(dp[2 * kq + 1][2], dp[2 * kq + 1][3])};
#pragma unroll
      for (int dn = 0; dn < kD / 16; ++dn) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, cK + swz<kD>(kq * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                   dn * 2 + (lane >> 4)));
        mma_bf16(dq[2 * dn], ads, bk[0], bk[1]);
        mma_bf16(dq[2 * dn + 1], ads, bk[2], bk[3]);
      }
    }
    __syncthreads();
  }

  bf16* dq_base = p.dq.p + b * p.dq.sb + h * p.dq.sh;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    const int col = n * 8 + 2 * t4;
    if (row0 < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row0) * p.dq.sl + col) =
          pack_bf16(dq[n][0] * p.scale, dq[n][1] * p.scale);
    if (row0 + 8 < p.Lq)
      *reinterpret_cast<uint32_t*>(dq_base + static_cast<int64_t>(row0 + 8) * p.dq.sl + col) =
          pack_bf16(dq[n][2] * p.scale, dq[n][3] * p.scale);
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------
constexpr int kDkdvWarps = kAttnQatBwdKeysPerCta / 16;
constexpr int kDkdvQueryTile = 64;
constexpr int kDqWarps = kAttnQatBwdQueriesPerCta / 16;
constexpr int kDqKeyTile = 64;

constexpr const char* kOp = "attn_qat_bwd";

std::string shape_str(const AttnQatBwdParams& p) {
  return attention_shape_str(p.batch, p.heads, p.len_q, p.len_kv, p.head_dim);
}

// cudaGetDeviceProperties costs far more than a backward launch at small
// shapes, so the properties are looked up once per device.
DeviceInfo cached_device_info() {
  int device = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return device_info(device);
  std::call_once(once[device], [&] { cache[device] = device_info(device); });
  return cache[device];
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const DeviceInfo& dev, const KernelParams& kp) {
  VQAD_LAUNCH_CHECK(bytes <= dev.smem_optin_bytes, kOp, kernel_shape_str(kp), "expected ", bytes,
                    " bytes of shared memory per block, found ", dev.smem_optin_bytes, " on the device");
  VQAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

}  // namespace

namespace {
template <int D>
void launch_mma_kernels_d(const KernelParams& kp, AttnQatBwdPMode mode, const DeviceInfo& dev,
                          cudaStream_t stream) {
  {
    constexpr size_t smem = dkdv_smem_bytes<kDkdvWarps, kDkdvQueryTile, D>();
    const dim3 grid((kp.Lkv + kAttnQatBwdKeysPerCta - 1) / kAttnQatBwdKeysPerCta, kp.H, kp.B);
    auto launch = [&](auto kernel) {
      set_smem(kernel, smem, dev, kp);
      kernel<<<grid, kDkdvWarps * 32, smem, stream>>>(kp);
    };
    switch (mode) {
      case AttnQatBwdPMode::kConsistent:
        launch(dkdv_kernel<kDkdvWarps, kDkdvQueryTile, AttnQatBwdPMode::kConsistent, D>);
        break;
      case AttnQatBwdPMode::kFastVideo:
        launch(dkdv_kernel<kDkdvWarps, kDkdvQueryTile, AttnQatBwdPMode::kFastVideo, D>);
        break;
      case AttnQatBwdPMode::kNone:
        launch(dkdv_kernel<kDkdvWarps, kDkdvQueryTile, AttnQatBwdPMode::kNone, D>);
        break;
    }
    VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd dkdv_kernel");
  }
  {
    constexpr size_t smem = dq_smem_bytes<kDqWarps, kDqKeyTile, D>();
    const dim3 grid((kp.Lq + kAttnQatBwdQueriesPerCta - 1) / kAttnQatBwdQueriesPerCta, kp.H, kp.B);
    auto kernel = dq_kernel<kDqWarps, kDqKeyTile, D>;
    set_smem(kernel, smem, dev, kp);
    kernel<<<grid, kDqWarps * 32, smem, stream>>>(kp);
    VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd dq_kernel");
  }
}
}  // namespace

void launch_mma_kernels(const KernelParams& kp, AttnQatBwdPMode mode, const DeviceInfo& dev,
                        cudaStream_t stream) {
  if (kp.D == 64)
    launch_mma_kernels_d<64>(kp, mode, dev, stream);
  else
    launch_mma_kernels_d<128>(kp, mode, dev, stream);
}

}  // namespace attn_bwd

const char* attn_qat_bwd_p_mode_name(AttnQatBwdPMode m) {
  switch (m) {
    case AttnQatBwdPMode::kConsistent: return "consistent";
    case AttnQatBwdPMode::kFastVideo: return "fastvideo";
    case AttnQatBwdPMode::kNone: return "none";
  }
  return "?";
}

const char* attn_qat_bwd_impl_name(AttnQatBwdImpl i) {
  switch (i) {
    case AttnQatBwdImpl::kAuto: return "auto";
    case AttnQatBwdImpl::kMmaSync: return "mma.sync";
    case AttnQatBwdImpl::kWgmma: return "wgmma";
  }
  return "?";
}

size_t attn_qat_bwd_workspace_bytes(const AttnQatBwdParams& p) {
  // The mma.sync kernels use the statistics only; the wgmma kernels also the dQ
  // partial sums and the split parts (kAuto decides by device, so those are always
  // counted).
  const attn_bwd::WgmmaWorkspace w =
      attn_bwd::wgmma_workspace(static_cast<int64_t>(p.batch) * p.heads, p.len_q, p.len_kv);
  return p.impl == AttnQatBwdImpl::kMmaSync ? w.stats : w.total;
}

void launch_attn_qat_bwd(const AttnQatBwdParams& p, cudaStream_t stream) {
  using namespace attn_bwd;
  const auto shape = [&] { return shape_str(p); };
  VQAD_LAUNCH_CHECK(attn_qat_head_dim_supported(p.head_dim), kOp, shape(), "expected head dim 64 or 128, found ", p.head_dim);
  VQAD_LAUNCH_CHECK(p.batch >= 1 && p.heads >= 1 && p.len_q >= 1 && p.len_kv >= 1, kOp, shape(),
                    "unsupported shape: expected batch, heads and lengths >= 1");
  VQAD_LAUNCH_CHECK(p.batch <= 65535 && p.heads <= 65535, kOp, shape(),
                    "unsupported shape: expected batch and heads <= 65535 (grid limits)");
  VQAD_LAUNCH_CHECK(p.softmax_scale >= 0.0f && std::isfinite(p.softmax_scale), kOp, shape(),
                    "expected a finite softmax_scale >= 0 (0: 1/sqrt(D)), found ", p.softmax_scale);
  VQAD_LAUNCH_CHECK(p.p_mode == AttnQatBwdPMode::kConsistent || p.p_mode == AttnQatBwdPMode::kFastVideo ||
                        p.p_mode == AttnQatBwdPMode::kNone,
                    kOp, shape(), "expected p_mode consistent, fastvideo or none, found ", static_cast<int>(p.p_mode));
  VQAD_LAUNCH_CHECK(p.impl == AttnQatBwdImpl::kAuto || p.impl == AttnQatBwdImpl::kMmaSync ||
                        p.impl == AttnQatBwdImpl::kWgmma,
                    kOp, shape(), "expected impl auto, mma.sync or wgmma, found ", static_cast<int>(p.impl));
  check_blhd(kOp, "q_hat", p.q_hat, shape);
  check_blhd(kOp, "k_hat", p.k_hat, shape);
  check_blhd(kOp, "v_hat", p.v_hat, shape);
  check_blhd(kOp, "d_out", p.d_out, shape);
  check_blhd(kOp, "o_hp", p.o_hp, shape);
  check_blhd(kOp, "d_q", p.d_q, shape);
  check_blhd(kOp, "d_k", p.d_k, shape);
  check_blhd(kOp, "d_v", p.d_v, shape);
  VQAD_LAUNCH_CHECK(p.m != nullptr && p.l != nullptr, kOp, shape(),
                    "expected the saved row statistics m and l, found m ", p.m, ", l ", p.l);
  VQAD_LAUNCH_CHECK(p.workspace != nullptr && reinterpret_cast<uintptr_t>(p.workspace) % 16 == 0, kOp, shape(),
                    "expected a workspace of ", attn_qat_bwd_workspace_bytes(p),
                    " bytes, 16-byte aligned, found address ", p.workspace);

  const DeviceInfo dev = cached_device_info();
  VQAD_LAUNCH_CHECK(dev.sm_major >= 9, kOp, shape(), "no kernel for this device: expected sm_90 or newer, found sm_",
                    dev.arch());
  const AttnQatBwdImpl impl =
      p.impl != AttnQatBwdImpl::kAuto
          ? p.impl
          : (dev.arch() == 90 ? AttnQatBwdImpl::kWgmma : AttnQatBwdImpl::kMmaSync);
  VQAD_LAUNCH_CHECK(impl != AttnQatBwdImpl::kWgmma || dev.arch() == 90, kOp, shape(),
                    "the wgmma kernels need sm_90, found sm_", dev.arch());

  KernelParams kp{};
  kp.B = p.batch;
  kp.H = p.heads;
  kp.Lq = p.len_q;
  kp.Lkv = p.len_kv;
  kp.D = p.head_dim;
  kp.scale = p.softmax_scale > 0.0f ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  kp.c = kp.scale * kLog2e;
  auto in = [](const BlhdIn& t) {
    return InTensor{static_cast<const bf16*>(t.data), t.stride.b, t.stride.l, t.stride.h};
  };
  auto out = [](const BlhdOut& t) {
    return OutTensor{static_cast<bf16*>(t.data), t.stride.b, t.stride.l, t.stride.h};
  };
  kp.q = in(p.q_hat);
  kp.k = in(p.k_hat);
  kp.v = in(p.v_hat);
  kp.dout = in(p.d_out);
  kp.ohp = in(p.o_hp);
  kp.m = p.m;
  kp.l = p.l;
  kp.dq = out(p.d_q);
  kp.dk = out(p.d_k);
  kp.dv = out(p.d_v);
  kp.stats = static_cast<float4*>(p.workspace);
  if (impl == AttnQatBwdImpl::kWgmma) {
    const WgmmaWorkspace w =
        wgmma_workspace(static_cast<int64_t>(p.batch) * p.heads, p.len_q, p.len_kv);
    uint8_t* base = static_cast<uint8_t*>(p.workspace);
    kp.dq_groups = w.dq_groups;
    kp.dq_acc = reinterpret_cast<float*>(base + w.dq_acc);
    kp.dq_sem = reinterpret_cast<int*>(base + w.dq_sem);
    kp.dkv_part = reinterpret_cast<float*>(base + w.dkv_part);
    // split_first / split_parts are set by the wgmma launcher (it can switch the split off).
  }

  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.len_q;
  VQAD_LAUNCH_CHECK((rows + 7) / 8 <= 0x7fffffff, kOp, shape(), "expected at most 2^34 query rows, found ", rows);
  if (p.head_dim == 64)
    stats_kernel<64><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(kp);
  else
    stats_kernel<128><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(kp);
  VQAD_CUDA_CHECK_LAUNCH("attn_qat_bwd stats_kernel");

  if (impl == AttnQatBwdImpl::kWgmma) {
    launch_wgmma_kernels(kp, p.p_mode, dev, stream);
  } else {
    launch_mma_kernels(kp, p.p_mode, dev, stream);
  }
}

}  // namespace vqad::kernels
