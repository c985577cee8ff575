// ATTN_QAT_TRAIN backward on Hopper (spec/attention.md, "ATTN_QAT_TRAIN backward").
//
// Plain C++ launch header (no torch). Inputs are the forward's fake-quantized
// operands Q^, K^, V^ (BF16), the incoming gradient dO (BF16), the saved
// high-precision output O_hp (BF16) and the saved row statistics m, l (FP32,
// [B, H, Lq] contiguous; m is the log2-domain row max of s = c * Q^.K^T and l
// the row sum of bf16(P) relative to it). Outputs dQ, dK, dV are BF16.
//
// Work split (deterministic: bitwise reproducible run to run, no floating-point atomics):
//   1. a row pre-pass: delta_i = rowsum(dO_i * O_hp_i), packed with m_i and 1/l_i;
//   2. sm_90 (wgmma): one CTA per block of 128 keys loops over every query block of
//      64 and forms dK, dV and dS_ij K_j; the dQ contributions go to fp32 partial
//      sums in the workspace by bulk reductions taken in a fixed order (a turn
//      counter per query block), and a last pass adds the partial sums in order
//      and writes dQ (5 GEMMs); the CTAs of a last partial wave are split over
//      query ranges (fp32 partial dK / dV added in order by a combine pass);
//   3. other archs, or impl = kMmaSync (mma.sync): a separate dQ pass per block of
//      128 queries recomputes S and dP (7 GEMMs); the visit-list form of the wgmma
//      kernels (the VSA fine stage) has the same recompute structure.
// The P groups of the dV path are the 16-key groups of each query row starting
// at key 0 (a tail group uses only its valid keys), independent of any BLOCK_N.
//
// Layout: BLHD views (kernels/common/launch.h) with element strides for b, l, h; the
// head dim (D = 64 or 128) is contiguous; every row start must be 16-byte aligned.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "vqad/kernels/common/launch.h"

namespace vqad::kernels {

// How the P used for dV (Pb) is formed.
enum class AttnQatBwdPMode {
  kConsistent,  // Pb = FQ(exp2(s - m)) / l   (spec default)
  kFastVideo,   // Pb = FQ(exp2(s - m) / l)   (FastVideo parity)
  kNone,        // Pb = P (quant_p = false: plain flash backward)
};
const char* attn_qat_bwd_p_mode_name(AttnQatBwdPMode m);

// Which kernels run. Both give the same numerics (same tiles, same P groups,
// fp32 accumulation); kAuto takes wgmma on sm_90 and mma.sync on other archs.
enum class AttnQatBwdImpl { kAuto, kMmaSync, kWgmma };
const char* attn_qat_bwd_impl_name(AttnQatBwdImpl i);

struct AttnQatBwdParams {
  int batch = 0, heads = 0, len_q = 0, len_kv = 0, head_dim = 128;  // 64 or 128
  float softmax_scale = 0.0f;  // 0 -> 1/sqrt(head_dim)
  AttnQatBwdPMode p_mode = AttnQatBwdPMode::kConsistent;
  AttnQatBwdImpl impl = AttnQatBwdImpl::kAuto;

  BlhdIn q_hat, k_hat, v_hat;  // BF16 [B, Lq|Lkv, H, D]
  BlhdIn d_out, o_hp;          // BF16 [B, Lq, H, D]
  const float* m = nullptr;    // [B, H, Lq]
  const float* l = nullptr;    // [B, H, Lq]

  BlhdOut d_q, d_k, d_v;       // BF16 [B, L*, H, D]

  // Scratch of attn_qat_bwd_workspace_bytes(*this) bytes, 16-byte aligned,
  // owned by the caller (the torch op hands in an allocator block): the row
  // statistics and, for the sm_90 kernels, the fp32 dQ partial sums (1 to 16 of
  // them, B*H*Lq*512 bytes each, fewer as B*H grows: 183 MiB at (1,3,31200) and at
  // (1,12,31200)) with their turn counters, and the tail split's fp32 dK / dV parts
  // (at most 132 * 8 * 128 KiB; 63 MiB at (1,3,31200)).
  void* workspace = nullptr;
};

size_t attn_qat_bwd_workspace_bytes(const AttnQatBwdParams& p);

// Throws vqad::Error on invalid shapes/strides/alignment or an unsupported
// device (the launch convention: names the op, the tensor, the shape and the device
// with its arch); CUDA failures throw std::runtime_error with the op name.
void launch_attn_qat_bwd(const AttnQatBwdParams& p, cudaStream_t stream);

// Tile sizes of the kernels (for benchmarks and docs).
inline constexpr int kAttnQatBwdKeysPerCta = 128;
inline constexpr int kAttnQatBwdQueriesPerCta = 128;

}  // namespace vqad::kernels
