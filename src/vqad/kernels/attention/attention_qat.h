// Launch interface of the ATTN_QAT_TRAIN CUDA kernels (spec/attention.md). Plain
// C++ (no torch): BLHD views (kernels/common/launch.h: device pointer + element
// strides) and a stream.
//
// Forward pipeline for one attention call:
//   1. launch_fake_quant_qkv: Q, K, V -> Q^, K^, V^ (contiguous BF16 [B, L, H, D],
//      NVFP4 unit scale, 16-channel blocks along D, bit-exact with
//      nvfp4::quantize_block). The backward reuses Q^, K^, V^.
//   2. launch_attn_qat_fwd: flash attention over Q^, K^, V^ with P fake-quantized per
//      16 keys against the running row max; writes O (quantized P path), O_hp (BF16 P
//      path, for the backward's delta) and the row statistics m (log2 domain) and l.
// Unsupported shapes, strides, alignments or devices throw vqad::Error naming the op,
// the tensor, the shape and the device with its arch (the launch convention of
// kernels/common/launch.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "vqad/kernels/attention/attn_qat_fwd_split.h"
#include "vqad/kernels/common/launch.h"

namespace vqad::kernels::attention {

// The forward kernel's KV tile: P is quantized against the running max of whole
// tiles of this many keys, so the CPU reference must run at the same BLOCK_N.
inline constexpr int kAttnQatBlockN = 128;
// Query rows per CTA of the forward kernel.
inline constexpr int kAttnQatBlockM = 128;
// The head dimensions the kernels support (forward and backward; the VSA visit-list
// kernels: 128 only).
constexpr bool attn_qat_head_dim_supported(int64_t d) { return d == 64 || d == 128; }

// Every BLHD view below: head dim contiguous, the other strides multiples of 8
// elements and a 16-byte aligned start (16-byte vector loads; check_blhd). The
// forward's q, k, v are read by TMA, which also needs those strides positive wherever
// the dimension has more than one entry (no broadcast views; the op passes the
// pre-pass's contiguous outputs).
struct FakeQuantQkvParams {
  BlhdIn q;  // BF16, [B, Lq, H, D]
  BlhdIn k;  // BF16, [B, Lkv, H, D]
  BlhdIn v;  // BF16, [B, Lkv, H, D]
  void* q_out = nullptr;  // BF16, contiguous [B, Lq, H, D]
  void* k_out = nullptr;  // BF16, contiguous [B, Lkv, H, D]
  void* v_out = nullptr;  // BF16, contiguous [B, Lkv, H, D]
  int batch = 0, heads = 0, len_q = 0, len_kv = 0, head_dim = 0;  // D: multiple of 16
  bool quant_qk = true;  // false: Q and K are copied unchanged
  bool quant_v = true;   // false: V is copied unchanged
};
void launch_fake_quant_qkv(const FakeQuantQkvParams& p, cudaStream_t stream);

struct AttnQatFwdParams {
  BlhdIn q;      // Q^ BF16 [B, Lq, H, D]
  BlhdIn k;      // K^ BF16 [B, Lkv, H, D]
  BlhdIn v;      // V^ BF16 [B, Lkv, H, D]
  BlhdOut o;     // BF16 [B, Lq, H, D]: sum_j bf16(P^_j) V_j / l
  // BF16 [B, Lq, H, D]: sum_j bf16(P_j) V_j / l. May be null: with quant_p the kernel then
  // skips the high-precision P.V product (a call that needs no gradient); O is the same bits.
  BlhdOut o_hp;
  float* m = nullptr;  // FP32 [B, H, Lq] contiguous: final row max of s (log2 domain); may be null
  float* l = nullptr;  // FP32 [B, H, Lq] contiguous: sum of bf16(P) against that max; may be null
  int batch = 0, heads = 0, len_q = 0, len_kv = 0, head_dim = 0;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(D); s = (q.k) * softmax_scale * log2(e)
  bool quant_p = true;         // false: plain BF16 flash attention (O == O_hp)
  // Key split of the grid's last query tiles (attn_qat_fwd_split_plan): a split tile runs
  // as two CTAs, the earlier keys and the later ones, the later part first taking the
  // running max over the earlier keys (Q^ K^T only) so that every P tile is quantized
  // against the maximum the unsplit tile has there: m is the unsplit kernel's bit for
  // bit, O / O_hp / l differ by the fp32 rounding of one rescale (the CPU reference:
  // attn_qat_ref::forward_part / forward_combine). The two partial tiles meet in the
  // workspace, attn_qat_fwd_workspace_bytes(p) bytes, 16-byte aligned; with no workspace
  // (null) or split_tiles = 0 no tile is split.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int split_tiles = -1;     // -1: the plan for this device; 0: none; n > 0: the last n tiles
  int split_key_tile = -1;  // -1: the plan's; else the later part's first KV tile (1 .. tiles - 1)
};
void launch_attn_qat_fwd(const AttnQatFwdParams& p, cudaStream_t stream);

// Workspace of the split launch_attn_qat_fwd would make for p on the current device (0
// when no tile would split); the launcher splits only with at least this much.
size_t attn_qat_fwd_workspace_bytes(const AttnQatFwdParams& p);

}  // namespace vqad::kernels::attention
