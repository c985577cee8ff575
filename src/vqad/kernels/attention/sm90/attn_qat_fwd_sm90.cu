// ATTN_QAT_TRAIN forward (spec/attention.md): one-pass flash attention over the
// fake-quantized Q^, K^, V^ with P fake-quantized per 16 keys in registers.
//
// Tiling: a CTA owns 128 query rows of one (batch, head): two warpgroups of 64 rows,
// 16 rows per warp. K and V tiles of BLOCK_N = 128 keys stream through shared memory
// with cp.async (three stages on sm_90a, two otherwise), in the 128-byte-swizzled
// layout that both wgmma descriptors and conflict-free ldmatrix accept. On sm_90a,
// S = Q^ K^T is a chain of wgmma m64n128k16 per warpgroup with both operands in shared
// memory, and both P.V products are wgmmas with P^ / bf16(P) as the register A operand
// and V read MN-major from shared memory; they run asynchronously while the next
// 16-key groups' exp2 and quantization execute, and the bf16(P) row sums are a third
// asynchronous wgmma (m64n8k16 against a block of ones). The two warpgroups are
// skewed by half a KV tile (see kSkewGroups): the second one finishes the previous tile's
// keys 64-127 after each barrier, so one warpgroup's softmax and quantization run
// while the other's Q^ K^T occupies the tensor cores; both run the same loop body
// (only where each waits at the barrier differs). Other targets compile the same
// kernel on mma.sync m16n8k16 + ldmatrix (bf16 in, fp32 accumulate either way) but
// the launcher accepts only sm_90 devices until that build is validated on its
// hardware.
//
// Register layout that makes P quantization cheap: in the m16n8 (and wgmma) S
// accumulator a quad of 4 lanes holds one row's 8 keys of an n8 slice (2 each), so two
// adjacent slices give the quad a row's whole 16-key group; the group amax is a max
// over 4 local values and two quad shuffles. The same registers, packed to bf16, are
// the A fragment of the P.V product for that k16 step (the FlashAttention identity),
// so P and P^ never touch shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/attention/sm90/attn_qat_fwd_visit.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/common/sm90_ptx.cuh"

namespace vqad::kernels::attention {
namespace {

constexpr int kD = kAttnQatHeadDim;
constexpr int kBM = kAttnQatBlockM;
constexpr int kWarps = kBM / 16;
constexpr int kThreads = kWarps * 32;
// 8 warps of ~255 registers fill the register file: one 128-row CTA or two 64-row
// CTAs per SM (independent CTAs drift out of phase, overlapping one's softmax with
// the other's MMAs).
constexpr int kCtasPerSm = 128 / kBM;
static_assert(kBM == 64 || kBM == 128, "BLOCK_M must be 64 or 128");
constexpr int kChunksPerRow = kD * 2 / 16;  // 16-byte chunks of one 128-channel bf16 row

// The kernel's parameters: AttnQatFwdParams with each view's pointer and strides apart,
// filled by the launcher after its checks.
struct FwdKernelParams {
  const void* q;
  const void* k;
  const void* v;
  BlhdStrides q_stride, k_stride, v_stride;
  void* o;
  void* o_hp;  // may be null
  BlhdStrides o_stride, o_hp_stride;
  float* m;  // may be null
  float* l;  // may be null
  int batch, heads, len_q, len_kv, head_dim;
  float softmax_scale;
  bool quant_p;
};

// Schedule of the wgmma path (sm_90a), as named constants: the second warpgroup runs
// half a KV tile behind the first: after each barrier it finishes the P.V products of
// keys 64-127 of the previous tile before its own Q^ K^T, so one warpgroup's softmax
// and P quantization overlap the other's tensor-core work instead of both waiting for
// Q^ K^T at the same time. K/V are triple buffered (V of the previous tile stays
// resident). Both warpgroups run one loop body (4.80 vs 5.04 ms at (1,3,31200) on an
// H200 for one loop per warpgroup, which stalls on instruction fetch); the row sums
// of bf16(P) are an asynchronous wgmma m64n8k16 of the P fragments against a tile of
// ones, queued with the P.V products; P^ = e2m1(P / S) * S takes its final product in
// bf16x2 (exact: at most 6 significant bits). docs/performance.md has the measured
// alternatives.
constexpr int kStages = 3;
// 16-key groups the second warpgroup computes before the barrier (the rest after it).
constexpr int kSkewGroups = 4;
static_assert(kSkewGroups > 0 && kSkewGroups < kAttnQatBlockN / 16, "skew: 1 to 7 groups before the barrier");

using sm90::smem_addr;

// Shared-memory tile layout, [2][ROWS][64] bf16: the two 64-channel halves of a
// 128-channel row are stored as separate [ROWS][128 B] blocks, and inside a block the
// 16-byte chunk index is XORed with row % 8. This is the 128-byte-swizzled K-major
// layout wgmma reads through a descriptor (8-row atoms of 1024 B), and it keeps the
// 8 row addresses of every ldmatrix in 8 distinct bank groups.
template <int ROWS>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * ROWS * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) * 16));
}

// wgmma exists only in the arch-specific sm_90a target; other targets (sm_100a,
// sm_120a builds) compile the mma.sync loop of the same kernel.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VQAD_FWD_SM90A 1
#else
#define VQAD_FWD_SM90A 0
#endif

#if VQAD_FWD_SM90A
// wgmma shared-memory descriptor for the layout above (K-major, 128-byte swizzle):
// start address >> 4, leading offset unused (1), stride offset 1024 B between 8-row
// atoms, swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

using sm90::fence_proxy_async;  // cp.async writes -> the async proxy wgmma reads through
using sm90::wgmma_commit;
using sm90::wgmma_fence;
__device__ __forceinline__ void wgmma_wait0() { sm90::wgmma_wait<0>(); }

// D[64 x 128] += A[64 x 16] . B[16 x 128] with A from registers (per warp the
// m16n8k16 A fragment: 16 rows x 16 keys as 4 bf16x2) and B from shared memory in
// the MN-major orientation (B[k][n] = V[key][channel], channels contiguous): 64-channel
// halves are the swizzle atoms' columns (leading offset = one half), 8-key groups
// their rows (stride offset 1024 B).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 128] (+)= A[64 x 16] . B[16 x 128] into the n8 slices [OFF, OFF + 16) of d, both
// operands from shared memory (bf16, fp32 accumulate); scale_d = 0 overwrites D (the
// first k-step). Per warp the accumulator is 16 rows x 128 columns in the same register
// order as 16 m16n8 mma.sync accumulators, d[n8 slice][4].
template <int OFF>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(OFF >= 0 && OFF + 16 <= 16, "slice out of range");
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[OFF + 0][0]), "+f"(d[OFF + 0][1]), "+f"(d[OFF + 0][2]), "+f"(d[OFF + 0][3]),
          "+f"(d[OFF + 1][0]), "+f"(d[OFF + 1][1]), "+f"(d[OFF + 1][2]), "+f"(d[OFF + 1][3]),
          "+f"(d[OFF + 2][0]), "+f"(d[OFF + 2][1]), "+f"(d[OFF + 2][2]), "+f"(d[OFF + 2][3]),
          "+f"(d[OFF + 3][0]), "+f"(d[OFF + 3][1]), "+f"(d[OFF + 3][2]), "+f"(d[OFF + 3][3]),
          "+f"(d[OFF + 4][0]), "+f"(d[OFF + 4][1]), "+f"(d[OFF + 4][2]), "+f"(d[OFF + 4][3]),
          "+f"(d[OFF + 5][0]), "+f"(d[OFF + 5][1]), "+f"(d[OFF + 5][2]), "+f"(d[OFF + 5][3]),
          "+f"(d[OFF + 6][0]), "+f"(d[OFF + 6][1]), "+f"(d[OFF + 6][2]), "+f"(d[OFF + 6][3]),
          "+f"(d[OFF + 7][0]), "+f"(d[OFF + 7][1]), "+f"(d[OFF + 7][2]), "+f"(d[OFF + 7][3]),
          "+f"(d[OFF + 8][0]), "+f"(d[OFF + 8][1]), "+f"(d[OFF + 8][2]), "+f"(d[OFF + 8][3]),
          "+f"(d[OFF + 9][0]), "+f"(d[OFF + 9][1]), "+f"(d[OFF + 9][2]), "+f"(d[OFF + 9][3]),
          "+f"(d[OFF + 10][0]), "+f"(d[OFF + 10][1]), "+f"(d[OFF + 10][2]), "+f"(d[OFF + 10][3]),
          "+f"(d[OFF + 11][0]), "+f"(d[OFF + 11][1]), "+f"(d[OFF + 11][2]), "+f"(d[OFF + 11][3]),
          "+f"(d[OFF + 12][0]), "+f"(d[OFF + 12][1]), "+f"(d[OFF + 12][2]), "+f"(d[OFF + 12][3]),
          "+f"(d[OFF + 13][0]), "+f"(d[OFF + 13][1]), "+f"(d[OFF + 13][2]), "+f"(d[OFF + 13][3]),
          "+f"(d[OFF + 14][0]), "+f"(d[OFF + 14][1]), "+f"(d[OFF + 14][2]), "+f"(d[OFF + 14][3]),
          "+f"(d[OFF + 15][0]), "+f"(d[OFF + 15][1]), "+f"(d[OFF + 15][2]), "+f"(d[OFF + 15][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

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
// Descriptor of a no-swizzle K-major block (core matrices 128 B apart along K, 256 B
// along N): 256 bytes from addr.
__device__ __forceinline__ uint64_t wgmma_desc_plain(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}

// Descriptor of a [2][ROWS][64] tile read MN-major (see wgmma_m64n128k16_rs).
template <int ROWS>
__device__ __forceinline__ uint64_t wgmma_desc_mn(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((ROWS * 128) >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}
#endif  // VQAD_FWD_SM90A

using sm90::cp_async16;
using sm90::cp_async_commit;
using sm90::cp_async_wait;
using sm90::fast_exp2;
using sm90::ldmatrix_x4;
using sm90::ldmatrix_x4_trans;
using sm90::pack_bf16;
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  sm90::mma_bf16_m16n8k16(c, a, b0, b1);
}

using nvfp4_device::div6;

// (S, RN(1/S)) for every E4M3 byte: a shared-memory lookup replaces the IEEE
// reciprocal routine per 16-key group. Byte 0 gives (0, inf), the zero block.
constexpr int kScaleTableBytes = 128 * 8;
// bf16 ones for the row-sum wgmma: the 16 x 8 B operand's two core matrices.
constexpr int kOnesBytes = 256;

using nvfp4_device::e2m1_rne_magnitude;  // nearest E2M1 magnitude, ties to even, saturating at 6
using nvfp4_device::e4m3_bytes2;
using nvfp4_device::e4m3_value;

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// bf16 fragments of P (pa) and P^ (qa) of one 16-key group, from the S accumulator
// slices sa (keys 0-7) and sb (keys 8-15), and the bf16(P) row sums added into lacc.
// table[b] = (bf16x2 bits of (S, S), RN(1/S)) of E4M3 byte b. P >= 0 and finite; with
// amax <= 6 * 2^-10 the scale S rounds to 0: 1/S = inf, every element saturates to 6
// (0 * inf = NaN included) and 6 * 0 = +0, which is the spec's zero block without a
// branch. ROWSUM_MMA: the row sums by mma.sync against ones (the mma.sync loop; the
// wgmma schedule queues them as a wgmma instead).
template <bool QUANT_P, bool ROWSUM_MMA>
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
  if constexpr (ROWSUM_MMA) {
    const uint32_t ones = 0x3F803F80u;  // two bf16 1.0
    mma_bf16(lacc, pa, ones, ones);
  }
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
    const uint32_t S0 = __float_as_uint(s0.x), S1 = __float_as_uint(s1.x);
    qa[0] = mul_bf16x2(pack_bf16(e2m1_rne_magnitude(pr[0] * s0.y), e2m1_rne_magnitude(pr[1] * s0.y)), S0);
    qa[1] = mul_bf16x2(pack_bf16(e2m1_rne_magnitude(pr[4] * s1.y), e2m1_rne_magnitude(pr[5] * s1.y)), S1);
    qa[2] = mul_bf16x2(pack_bf16(e2m1_rne_magnitude(pr[2] * s0.y), e2m1_rne_magnitude(pr[3] * s0.y)), S0);
    qa[3] = mul_bf16x2(pack_bf16(e2m1_rne_magnitude(pr[6] * s1.y), e2m1_rne_magnitude(pr[7] * s1.y)), S1);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) qa[e] = pa[e];
  }
}

#if VQAD_FWD_SM90A
// S = Q^ K^T of one warpgroup (64 rows) against a whole K tile: 8 k-steps over the
// head dim, the first overwriting S; waited for before returning.
template <int BN>
__device__ __forceinline__ void qk_wgmma(float (&s)[16][4], uint32_t a_base, uint32_t sK) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t koff = (kk & 3) * 32;
    wgmma_ss_n128<0>(s, wgmma_desc(a_base + (kk >> 2) * kBM * 128 + koff),
                     wgmma_desc(sK + (kk >> 2) * BN * 128 + koff), kk > 0 ? 1 : 0);
  }
  wgmma_commit();
  wgmma_wait0();
}

// P, P^ of the 16-key groups [KS0, KS1) of S and their P.V and row-sum wgmmas
// (asynchronous: the tensor cores work on one group while the next group's exp2 and
// quantization run).
template <int KS0, int KS1, bool QUANT_P, int BN>
__device__ __forceinline__ void pv_groups(const float (&s)[16][4], float (&acc)[16][4], float (&acch)[16][4],
                                          float (&lacc)[4], const float (&m_run)[2], float c, uint32_t sV,
                                          const float2* table, uint64_t ones_desc) {
  const float neg0 = -m_run[0], neg1 = -m_run[1];
#pragma unroll
  for (int ks = KS0; ks < KS1; ++ks) {
    uint32_t pa[4], qa[4];
    p_fragments<QUANT_P, false>(s[2 * ks], s[2 * ks + 1], c, neg0, neg1, table, lacc, pa, qa);
    wgmma_fence();
    const uint64_t dv = wgmma_desc_mn<BN>(sV + ks * 16 * 128);
    wgmma_m64n128k16_rs(acc, qa, dv);
    if constexpr (QUANT_P) wgmma_m64n128k16_rs(acch, pa, dv);
    wgmma_m64n8k16_rs(lacc, pa, ones_desc);
  }
  wgmma_commit();
}
#endif

struct Tile {
  const __nv_bfloat16* base;  // element (b, 0, h, 0)
  int64_t stride_l;
  int len;
};

// Copies rows [row0, row0 + ROWS) x 128 channels to a swizzled smem tile; rows
// past `len` are zero-filled, so masked keys never feed NaN or garbage into P.V.
template <int ROWS>
__device__ __forceinline__ void load_tile(uint32_t smem, const Tile& t, int row0, int tid) {
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(ROWS % kRowsPerPass == 0, "tile not divisible");
  int64_t stride = t.stride_l;
  // Hides the stride's loop invariance: otherwise the compiler keeps one 64-bit
  // address per chunk live across the whole KV loop and spills.
  asm volatile("" : "+l"(stride));
  const int r0 = tid / kChunksPerRow, c = tid % kChunksPerRow;
  const __nv_bfloat16* src = t.base + static_cast<int64_t>(row0 + r0) * stride + c * 8;
  const uint32_t dst = smem + swz<ROWS>(r0, c);  // (r0 + 16 i) % 8 == r0 % 8: same swizzle every pass
#pragma unroll
  for (int i = 0; i < ROWS / kRowsPerPass; ++i) {
    const bool valid = row0 + r0 + i * kRowsPerPass < t.len;
    cp_async16(dst + i * kRowsPerPass * 128, valid ? src : t.base, valid);
    src += kRowsPerPass * stride;
  }
}


// KV-source policies of the kernel: where tile j's keys come from and which of them
// are masked. Each thread calls load(j) for j = 0, 1, 2, ... in order.
//
// DenseKv: keys [j * BN, (j + 1) * BN) of the contiguous K / V; keys past len_kv
// (last tile only) are zero-filled and masked. This is the dense ATTN_QAT_TRAIN path;
// inlined it is exactly the code the kernel had before the policy existed.
struct DenseKv {
  static constexpr bool kCanIdle = false;  // every warpgroup computes its rows
  Tile tk, tv;
  int len;
  __device__ __forceinline__ static DenseKv make(const FwdKernelParams& p, const AttnQatFwdVisit&, int b, int h,
                                                 int) {
    using bf = __nv_bfloat16;
    return DenseKv{{static_cast<const bf*>(p.k) + b * p.k_stride.b + h * p.k_stride.h, p.k_stride.l, p.len_kv},
                   {static_cast<const bf*>(p.v) + b * p.v_stride.b + h * p.v_stride.h, p.v_stride.l, p.len_kv},
                   p.len_kv};
  }
  template <int BN>
  __device__ __forceinline__ int n_tiles() const {
    return (len + BN - 1) / BN;
  }
  template <int BN>
  __device__ __forceinline__ void load(uint32_t dst, int j, int tid) {
    load_tile<BN>(dst, tk, j * BN, tid);
    load_tile<BN>(dst + BN * kD * 2, tv, j * BN, tid);
  }
  __device__ __forceinline__ int mask_info(int j) const { return j; }
  template <int BN, int NT>
  __device__ __forceinline__ void mask(float (&s)[NT][4], int j, int t) const {
    if ((j + 1) * BN > len) {
      const int key_base = j * BN + 2 * t;
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key_base + i * 8 + (e & 1) >= len) s[i][e] = -INFINITY;
    }
  }
};

// VisitKv (attn_qat_fwd_visit.h): tile j = visit entries 2j and 2j + 1 of this query
// tile's list, each a 64-row block gathered into one half of the 128-key tile (cp.async,
// the same swizzled layout as load_tile); rows at and past a block's valid count, and
// the whole second half when 2j + 1 is past the list, are zero-filled and masked. The
// entries of the next tile to load are prefetched into registers one load ahead, so
// the cp.async issue after each barrier does not wait on the list read.
struct VisitKv {
  static constexpr bool kCanIdle = true;  // see idle()
  const __nv_bfloat16* kb;
  const __nv_bfloat16* vb;
  int64_t ks, vs;          // row strides of K and V
  const int32_t* entries;  // this query tile's list
  int count;
  int pf0, pf1;            // entries of the next tile load() issues
  const int32_t* q_rows;   // valid rows of this query tile's two 64-row blocks, or null
  __device__ __forceinline__ int entry(int i) const { return i < count ? __ldg(entries + i) : 0; }
  __device__ __forceinline__ static VisitKv make(const FwdKernelParams& p, const AttnQatFwdVisit& v, int b, int h,
                                                 int m_block) {
    using bf = __nv_bfloat16;
    const int64_t row = (static_cast<int64_t>(b) * p.heads + h) * gridDim.x + m_block;
    VisitKv kv{static_cast<const bf*>(p.k) + b * p.k_stride.b + h * p.k_stride.h,
               static_cast<const bf*>(p.v) + b * p.v_stride.b + h * p.v_stride.h,
               p.k_stride.l,
               p.v_stride.l,
               v.entries + row * v.stride,
               __ldg(v.counts + row),
               0,
               0,
               v.q_block_rows != nullptr ? v.q_block_rows + 2 * m_block : nullptr};
    kv.pf0 = kv.entry(0);
    kv.pf1 = kv.entry(1);
    return kv;
  }
  template <int BN>
  __device__ __forceinline__ int n_tiles() const {
    return (count + 1) / 2;
  }
  // Warpgroup wg's 64 query rows are all padding (a VSA query cube of one physical
  // block): it skips its MMAs (still loading its share of every tile and meeting every
  // barrier) and stores nothing.
  __device__ __forceinline__ bool idle(int wg) const { return q_rows != nullptr && __ldg(q_rows + wg) == 0; }
  // One 64-row block (entry e; valid rows e & 127, zero-filled past them) into rows
  // [half * 64, half * 64 + 64) of a [2][BN][64] swizzled tile.
  template <int BN>
  __device__ __forceinline__ static void load_block(uint32_t smem, const __nv_bfloat16* base, int64_t stride, int e,
                                                    int half, int tid) {
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    static_assert(kAttnQatVisitBlockRows % kRowsPerPass == 0, "block not divisible");
    asm volatile("" : "+l"(stride));  // as load_tile: keeps the addresses out of the loop's live set
    const int r0 = tid / kChunksPerRow, c = tid % kChunksPerRow;
    const int blk = e >> kAttnQatVisitCountBits, n = e & ((1 << kAttnQatVisitCountBits) - 1);
    const __nv_bfloat16* src = base + (static_cast<int64_t>(blk) * kAttnQatVisitBlockRows + r0) * stride + c * 8;
    const uint32_t dst = smem + swz<BN>(half * kAttnQatVisitBlockRows + r0, c);
#pragma unroll
    for (int i = 0; i < kAttnQatVisitBlockRows / kRowsPerPass; ++i) {
      const bool valid = r0 + i * kRowsPerPass < n;
      cp_async16(dst + i * kRowsPerPass * 128, valid ? src : base, valid);
      src += kRowsPerPass * stride;
    }
  }
  template <int BN>
  __device__ __forceinline__ void load(uint32_t dst, int j, int tid) {
    static_assert(BN == kAttnQatVisitTileBlocks * kAttnQatVisitBlockRows, "visit tiles are two 64-row blocks");
    const int e0 = pf0, e1 = pf1;
    load_block<BN>(dst, kb, ks, e0, 0, tid);
    load_block<BN>(dst, kb, ks, e1, 1, tid);
    load_block<BN>(dst + BN * kD * 2, vb, vs, e0, 0, tid);
    load_block<BN>(dst + BN * kD * 2, vb, vs, e1, 1, tid);
    pf0 = entry(2 * j + 2);
    pf1 = entry(2 * j + 3);
  }
  // Valid keys of tile j's halves, packed (n0 | n1 << 8); read before the Q^ K^T wgmma
  // (the list row is L1-resident) and used after it.
  __device__ __forceinline__ int mask_info(int j) const {
    return (entry(2 * j) & 127) | ((entry(2 * j + 1) & 127) << 8);
  }
  template <int BN, int NT>
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

template <int BN, bool QUANT_P, class KV>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    attn_qat_fwd_kernel(const FwdKernelParams p, float scale_log2, const AttnQatFwdVisit visit) {
  constexpr int kNT = BN / 8;   // n8 tiles of S per warp
  constexpr int kKS = BN / 16;  // k16 steps of P.V
  constexpr int kDT = kD / 8;   // n8 tiles of O
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // 1024-byte alignment: wgmma's swizzle atoms; also lets the k-step offsets be XORed
  // into a per-lane base (below).
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sKV0 = sQ + kBM * kD * 2;
  // (S, 1/S) table after the K/V stages
  float2* scale_table = reinterpret_cast<float2*>(smem_raw + (sKV0 - smem_addr(smem_raw)) + kStages * 2 * BN * kD * 2);
  constexpr uint32_t kTileBytes = BN * kD * 2;  // one K or V tile
  // stage s: K at sKV0 + s * 2 * kTileBytes, V right after it

  const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int q0 = m_block * kBM;

  using bf = __nv_bfloat16;
  const Tile tq{static_cast<const bf*>(p.q) + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.l, p.len_q};
  KV kv = KV::make(p, visit, b, h, m_block);

  if (QUANT_P && tid < 128) {
    const float S = e4m3_value(static_cast<uint8_t>(tid));
    scale_table[tid] = make_float2(__uint_as_float(pack_bf16(S, S)), __frcp_rn(S));
  }
  // bf16 ones after the scale table (row-sum wgmma), visible after the first barrier
  const uint32_t sOnes = smem_addr(scale_table) + kScaleTableBytes;
  if (tid < kOnesBytes / 4) {
    reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(scale_table) + kScaleTableBytes)[tid] = 0x3F803F80u;
  }
#if VQAD_FWD_SM90A
  const uint64_t ones_desc = wgmma_desc_plain(sOnes);
#else
  (void)sOnes;
#endif
  load_tile<kBM>(sQ, tq, q0, tid);
  cp_async_commit();
  kv.template load<BN>(sKV0, 0, tid);
  cp_async_commit();

  // ldmatrix.x4 lane roles: lane supplies the row address of matrix lane/8, row lane%8.
  const int lm = lane >> 3, lr = lane & 7;
  // A fragment of Q (16 rows x 16 channels): matrices (rows 0-7|8-15) x (k 0-7|8-15),
  // ordered r0-7/k0-7, r8-15/k0-7, r0-7/k8-15, r8-15/k8-15.
  // For chunk = 2*kk + c (c in {0,1}) the swizzled offset is
  // (kk / 4) * ROWS*128 + ((row*128 + ((c ^ lr) * 16)) ^ ((kk % 4) * 32)): one XOR and
  // an immediate per step on a per-lane base instead of a register per step.
  const int q_row = warp * 16 + (lm & 1) * 8 + lr;
  const uint32_t q_lane = sQ + swz<kBM>(q_row, lm >> 1);
  // B fragments of K for two n8 tiles (16 keys x 16 channels): keys 0-7 k0-7, keys
  // 0-7 k8-15, keys 8-15 k0-7, keys 8-15 k8-15.
  const uint32_t k_lane = swz<BN>((lm >> 1) * 8 + lr, lm & 1);
  // B fragments of V (transposed load) for two n8 tiles of channels: keys 0-7 d0-7,
  // keys 8-15 d0-7, keys 0-7 d8-15, keys 8-15 d8-15.
  const uint32_t v_lane = swz<BN>((lm & 1) * 8 + lr, lm >> 1);

  float acc[kDT][4];
  float acch[QUANT_P ? kDT : 1][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  if constexpr (QUANT_P) {
#pragma unroll
    for (int i = 0; i < kDT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acch[i][e] = 0.0f;
  }
  float m_run[2] = {-INFINITY, -INFINITY};
  // Row sums of bf16(P) come out of the tensor cores: P times an all-ones n8 tile
  // leaves the row sum in every column ([0] row g, [2] row g + 8), already reduced
  // over the quad and rescaled together with the accumulators.
  float lacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  const int n_tiles = kv.template n_tiles<BN>();
  // sm_90a: the skewed wgmma schedule; other targets: the mma.sync loop below.
  constexpr bool kWgmmaSchedule = VQAD_FWD_SM90A != 0;
  bool idle_wg = false;  // KV::idle: this warpgroup only loads and meets the barriers
  if constexpr (kWgmmaSchedule) {
#if VQAD_FWD_SM90A
    static_assert(BN == 128 && kStages == 3, "skewed schedule: BLOCK_N 128, 3 stages");
    static_assert(kSkewGroups > 0 && kSkewGroups < kKS, "skew: 1 to 7 groups before the barrier");
    // Broadcast from lane 0 so that ptxas sees the warpgroup index as warp-uniform
    // (wgmma in branches on a divergent value would be serialized).
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
    if constexpr (KV::kCanIdle) idle_wg = __shfl_sync(0xffffffffu, kv.idle(wg) ? 1 : 0, 0) != 0;
    const uint32_t a_base = sQ + wg * 64 * 128;
    float (&acch_ref)[16][4] = *reinterpret_cast<float(*)[16][4]>(QUANT_P ? &acch[0][0] : &acc[0][0]);
    float s[kNT][4];
    // QK^T of tile j into s (waited for), tail masking, running max, rescale.
    auto scores = [&](int j, uint32_t sK) {
      const int mi = kv.mask_info(j);
      qk_wgmma<BN>(s, a_base, sK);
      kv.template mask<BN>(s, mi, t);
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
        mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
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
      if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
        for (int i = 0; i < kDT; ++i) {
          acc[i][0] *= alpha0;
          acc[i][1] *= alpha0;
          acc[i][2] *= alpha1;
          acc[i][3] *= alpha1;
          if constexpr (QUANT_P) {
            acch[i][0] *= alpha0;
            acch[i][1] *= alpha0;
            acch[i][2] *= alpha1;
            acch[i][3] *= alpha1;
          }
        }
      }
    };
    // Barrier k: tile k is visible to all, and tile k - 2's stage (every use of it is
    // behind this barrier in both warpgroups) receives tile k + 1.
    auto barrier_and_load = [&](int k) {
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      if (k + 1 < n_tiles) {
        const uint32_t dst = sKV0 + ((k + 1) % 3) * 2 * kTileBytes;
        kv.template load<BN>(dst, k + 1, tid);
      }
      cp_async_commit();
    };
    // One loop body for both warpgroups; only the barrier positions depend on wg.
    if (KV::kCanIdle && idle_wg) {
      // Either warpgroup meets barriers 0 .. n_tiles in this order; an idle one only
      // loads its share of each tile at them.
#pragma unroll 1
      for (int k = 0; k <= n_tiles; ++k) barrier_and_load(k);
    } else {
      if (wg == 1) barrier_and_load(0);
#pragma unroll 1
      for (int j = 0; j < n_tiles; ++j) {
        if (wg == 0) barrier_and_load(j);
        const uint32_t sK = sKV0 + (j % 3) * 2 * kTileBytes;
        scores(j, sK);
        pv_groups<0, kSkewGroups, QUANT_P, BN>(s, acc, acch_ref, lacc, m_run, scale_log2, sK + kTileBytes,
                                               scale_table, ones_desc);
        if (wg == 1) {
          wgmma_wait0();
          barrier_and_load(j + 1);
        }
        pv_groups<kSkewGroups, kKS, QUANT_P, BN>(s, acc, acch_ref, lacc, m_run, scale_log2, sK + kTileBytes,
                                                 scale_table, ones_desc);
        wgmma_wait0();
      }
      if (wg == 0) barrier_and_load(n_tiles);
    }  // not idle
#endif
  } else {
  // mma.sync m16n8k16 + ldmatrix, K/V double buffered (two of the stages).
  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j visible to all; every warp is done with tile j-1's buffer
    if (j + 1 < n_tiles) {
      const uint32_t next = sKV0 + ((j + 1) & 1) * 2 * kTileBytes;
      kv.template load<BN>(next, j + 1, tid);
    }
    cp_async_commit();
    const uint32_t sK = sKV0 + (j & 1) * 2 * kTileBytes;
    const uint32_t k_base = sK + k_lane;
    const uint32_t sV = sK + kTileBytes;
    const uint32_t v_base = sV + v_lane;

    // ---- S = Q^ K^T (fp32) ----
    float s[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(qa, (q_lane ^ ((kk & 3) * 32)) + (kk >> 2) * kBM * 128);
#pragma unroll
      for (int n2 = 0; n2 < kNT / 2; ++n2) {
        uint32_t kb[4];
        ldmatrix_x4(kb, (k_base ^ ((kk & 3) * 32)) + (kk >> 2) * BN * 128 + n2 * 16 * 128);
        mma_bf16(s[2 * n2], qa, kb[0], kb[1]);
        mma_bf16(s[2 * n2 + 1], qa, kb[2], kb[3]);
      }
    }

    // ---- running max (rows g and g + 8 of this warp) ----
    // Keys past the end exist only in the last tile; a warp-uniform branch keeps the
    // per-element compares out of every other tile.
    kv.template mask<BN>(s, kv.mask_info(j), t);
    // The max is taken on the raw dot products: x -> RN(x * c) is monotonic for
    // c > 0, so RN(max * c) is exactly the max of the scaled scores.
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
      mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    mx0 = fmaxf(m_run[0], mx0 * scale_log2);
    mx1 = fmaxf(m_run[1], mx1 * scale_log2);
    // P = exp2(s * c - m') with one FFMA (one rounding fewer than the reference's
    // separate product and difference; P agrees to an ulp).
    const float neg0 = -mx0, neg1 = -mx1;
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
        if constexpr (QUANT_P) {
          acch[i][0] *= alpha0;
          acch[i][1] *= alpha0;
          acch[i][2] *= alpha1;
          acch[i][3] *= alpha1;
        }
      }
    }

    // ---- P, P^ and the two P.V products, one 16-key group at a time ----
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      // this lane's keys of the group: row g -> p[0..3], row g + 8 -> p[4..7]
      uint32_t pa[4], qa[4];
      p_fragments<QUANT_P, true>(s[2 * ks], s[2 * ks + 1], scale_log2, neg0, neg1, scale_table, lacc, pa, qa);
#pragma unroll
      for (int d2 = 0; d2 < kDT / 2; ++d2) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, (v_base ^ ((d2 & 3) * 32)) + (d2 >> 2) * BN * 128 + ks * 16 * 128);
        mma_bf16(acc[2 * d2], qa, vb[0], vb[1]);
        mma_bf16(acc[2 * d2 + 1], qa, vb[2], vb[3]);
        if constexpr (QUANT_P) {
          mma_bf16(acch[2 * d2], pa, vb[0], vb[1]);
          mma_bf16(acch[2 * d2 + 1], pa, vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  }  // schedule

  if (KV::kCanIdle && idle_wg) return;  // padding rows only (no barrier follows)
  // ---- epilogue: full row sums, O = acc / l, O_hp = acch / l, m and l ----
  // Every column holds the row sum; the max of two columns (equal values) keeps all
  // four accumulators live, so the row-sum wgmma never sees an undefined accumulator.
  const float l0 = fmaxf(lacc[0], lacc[1]), l1 = fmaxf(lacc[2], lacc[3]);
  const float inv_l0 = 1.0f / l0, inv_l1 = 1.0f / l1;
  const int row0 = q0 + warp * 16 + g;
  const int row1 = row0 + 8;
  const bool ok0 = row0 < p.len_q, ok1 = row1 < p.len_q;
  bf* o = static_cast<bf*>(p.o) + b * p.o_stride.b + h * p.o_stride.h;
  bf* ohp = p.o_hp ? static_cast<bf*>(p.o_hp) + b * p.o_hp_stride.b + h * p.o_hp_stride.h : nullptr;
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    const int d = i * 8 + 2 * t;
    if (ok0) {
      *reinterpret_cast<uint32_t*>(o + row0 * p.o_stride.l + d) = pack_bf16(acc[i][0] * inv_l0, acc[i][1] * inv_l0);
    }
    if (ok1) {
      *reinterpret_cast<uint32_t*>(o + row1 * p.o_stride.l + d) = pack_bf16(acc[i][2] * inv_l1, acc[i][3] * inv_l1);
    }
    if (ohp != nullptr) {
      const float* src = QUANT_P ? acch[QUANT_P ? i : 0] : acc[i];
      if (ok0) {
        *reinterpret_cast<uint32_t*>(ohp + row0 * p.o_hp_stride.l + d) = pack_bf16(src[0] * inv_l0, src[1] * inv_l0);
      }
      if (ok1) {
        *reinterpret_cast<uint32_t*>(ohp + row1 * p.o_hp_stride.l + d) = pack_bf16(src[2] * inv_l1, src[3] * inv_l1);
      }
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
}

constexpr const char* kOp = "attn_qat_fwd";
constexpr const char* kVisitOp = "attn_qat_fwd_visit";

std::string shape_str(const AttnQatFwdParams& p) {
  return attention_shape_str(p.batch, p.heads, p.len_q, p.len_kv, p.head_dim);
}

template <int BN, bool QUANT_P, class KV>
void launch_impl(const char* op, const AttnQatFwdParams& p, float scale_log2, const AttnQatFwdVisit& visit,
                 cudaStream_t stream) {
  auto kernel = attn_qat_fwd_kernel<BN, QUANT_P, KV>;
  // Q, two K/V stages, the scale table, and room to align the start to 1024 bytes.
  const int smem = (kBM + 2 * kStages * BN) * kD * 2 + kScaleTableBytes + kOnesBytes + 1024;
  // Validated on sm_90 (H100/H200) only; other arches would run the untested
  // mma.sync build of this kernel, so they are refused rather than guessed at.
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
  VQAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const FwdKernelParams kp{p.q.data,    p.k.data,      p.v.data,   p.q.stride, p.k.stride,
                           p.v.stride,  p.o.data,      p.o_hp.data, p.o.stride, p.o_hp.stride,
                           p.m,         p.l,           p.batch,    p.heads,    p.len_q,
                           p.len_kv,    p.head_dim,    p.softmax_scale, p.quant_p};
  const dim3 grid((p.len_q + kBM - 1) / kBM, p.heads, p.batch);
  kernel<<<grid, kThreads, smem, stream>>>(kp, scale_log2, visit);
  VQAD_CUDA_CHECK_LAUNCH("attn_qat_fwd_kernel");
}

// Checks shared by both KV sources; returns scale * log2(e).
float check_fwd_params(const char* op, const AttnQatFwdParams& p) {
  const auto shape = [&] { return shape_str(p); };
  VQAD_LAUNCH_CHECK(p.head_dim == kD, op, shape(), "expected head dim ", kD, ", found ", p.head_dim);
  VQAD_LAUNCH_CHECK(p.batch > 0 && p.heads > 0 && p.len_q > 0 && p.len_kv > 0 && p.heads <= 65535 &&
                        p.batch <= 65535,
                    op, shape(), "unsupported shape: expected positive sizes and B, H <= 65535");
  check_blhd(op, "q", p.q, shape);
  check_blhd(op, "k", p.k, shape);
  check_blhd(op, "v", p.v, shape);
  check_blhd(op, "o", p.o, shape);
  if (p.o_hp.data != nullptr) check_blhd(op, "o_hp", p.o_hp, shape);
  VQAD_LAUNCH_CHECK(!p.quant_p || p.o_hp.data != nullptr, op, shape(),
                    "tensor o_hp: expected a device pointer with quant_p (the backward's delta uses it), found null");
  // The kernel takes row maxima before scaling, which needs a positive scale.
  VQAD_LAUNCH_CHECK(p.softmax_scale >= 0.0f && std::isfinite(p.softmax_scale), op, shape(),
                    "expected a finite softmax_scale >= 0 (0: 1/sqrt(D)), found ", p.softmax_scale);
  const float scale = p.softmax_scale != 0.0f ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  return scale * 1.4426950408889634f;
}

}  // namespace

void launch_attn_qat_fwd(const AttnQatFwdParams& p, cudaStream_t stream) {
  const float scale_log2 = check_fwd_params(kOp, p);
  const AttnQatFwdVisit none{};
  if (p.quant_p)
    launch_impl<kAttnQatBlockN, true, DenseKv>(kOp, p, scale_log2, none, stream);
  else
    launch_impl<kAttnQatBlockN, false, DenseKv>(kOp, p, scale_log2, none, stream);
}

void launch_attn_qat_fwd_visit(const AttnQatFwdParams& p, const AttnQatFwdVisit& visit, cudaStream_t stream) {
  const float scale_log2 = check_fwd_params(kVisitOp, p);
  VQAD_LAUNCH_CHECK(visit.entries != nullptr && visit.counts != nullptr && visit.stride >= 1, kVisitOp, shape_str(p),
                    "expected visit lists (entries, counts, stride >= 1), found entries ", visit.entries,
                    ", counts ", visit.counts, ", stride ", visit.stride);
  VQAD_LAUNCH_CHECK(p.len_kv <= (static_cast<int64_t>(kAttnQatVisitMaxBlock) + 1) * kAttnQatVisitBlockRows, kVisitOp,
                    shape_str(p), "expected at most ", kAttnQatVisitMaxBlock + 1,
                    " 64-row blocks (what a visit entry holds), found len_kv ", p.len_kv);
  if (p.quant_p)
    launch_impl<kAttnQatBlockN, true, VisitKv>(kVisitOp, p, scale_log2, visit, stream);
  else
    launch_impl<kAttnQatBlockN, false, VisitKv>(kVisitOp, p, scale_log2, visit, stream);
}

}  // namespace vqad::kernels::attention
