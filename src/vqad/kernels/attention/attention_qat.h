// Launch interface of the ATTN_QAT_TRAIN CUDA kernels (spec/attention.md). Plain
// C++ (no torch): raw device pointers, element strides in BLHD order and a stream.
//
// Forward pipeline for one attention call:
//   1. launch_fake_quant_qkv: Q, K, V -> Q^, K^, V^ (contiguous BF16 [B, L, H, D],
//      NVFP4 unit scale, 16-channel blocks along D, bit-exact with
//      nvfp4::quantize_block). The backward reuses Q^, K^, V^.
//   2. launch_attn_qat_fwd: flash attention over Q^, K^, V^ with P fake-quantized per
//      16 keys against the running row max; writes O (quantized P path), O_hp (BF16 P
//      path, for the backward's delta) and the row statistics m (log2 domain) and l.
// Unsupported shapes or devices throw std::runtime_error naming shape and arch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace vqad::kernels::attention {

// The forward kernel's KV tile: P is quantized against the running max of whole
// tiles of this many keys, so the CPU reference must run at the same BLOCK_N.
inline constexpr int kAttnQatBlockN = 128;
// Query rows per CTA of the forward kernel.
inline constexpr int kAttnQatBlockM = 128;
// The only head dimension the kernels support.
inline constexpr int kAttnQatHeadDim = 128;

// Element strides of a [B, L, H, D] view (BLHD). The innermost stride must be 1
// and the others multiples of 8 elements (16-byte vector loads).
struct BlhdStrides {
  int64_t b = 0, l = 0, h = 0, d = 1;
};

// Strides of a contiguous [B, L, H, D] tensor.
inline BlhdStrides contiguous_blhd(int64_t len, int64_t heads, int64_t head_dim) {
  return BlhdStrides{len * heads * head_dim, heads * head_dim, head_dim, 1};
}

struct FakeQuantQkvParams {
  const void* q = nullptr;  // BF16, [B, Lq, H, D] with q_stride
  const void* k = nullptr;  // BF16, [B, Lkv, H, D] with k_stride
  const void* v = nullptr;  // BF16, [B, Lkv, H, D] with v_stride
  BlhdStrides q_stride, k_stride, v_stride;
  void* q_out = nullptr;  // BF16, contiguous [B, Lq, H, D]
  void* k_out = nullptr;  // BF16, contiguous [B, Lkv, H, D]
  void* v_out = nullptr;  // BF16, contiguous [B, Lkv, H, D]
  int batch = 0, heads = 0, len_q = 0, len_kv = 0, head_dim = 0;  // D: multiple of 16
  bool quant_qk = true;  // false: Q and K are copied unchanged
  bool quant_v = true;   // false: V is copied unchanged
};
void launch_fake_quant_qkv(const FakeQuantQkvParams& p, cudaStream_t stream);

struct AttnQatFwdParams {
  const void* q = nullptr;  // Q^ BF16 [B, Lq, H, D]
  const void* k = nullptr;  // K^ BF16 [B, Lkv, H, D]
  const void* v = nullptr;  // V^ BF16 [B, Lkv, H, D]
  BlhdStrides q_stride, k_stride, v_stride;
  void* o = nullptr;     // BF16 [B, Lq, H, D]: sum_j bf16(P^_j) V_j / l
  void* o_hp = nullptr;  // BF16 [B, Lq, H, D]: sum_j bf16(P_j) V_j / l (may be null)
  BlhdStrides o_stride, o_hp_stride;
  float* m = nullptr;  // FP32 [B, H, Lq] contiguous: final row max of s (log2 domain); may be null
  float* l = nullptr;  // FP32 [B, H, Lq] contiguous: sum of bf16(P) against that max; may be null
  int batch = 0, heads = 0, len_q = 0, len_kv = 0, head_dim = 0;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(D); s = (q.k) * softmax_scale * log2(e)
  bool quant_p = true;         // false: plain BF16 flash attention (O == O_hp)
};
void launch_attn_qat_fwd(const AttnQatFwdParams& p, cudaStream_t stream);

}  // namespace vqad::kernels::attention
