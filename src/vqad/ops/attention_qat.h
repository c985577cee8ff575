// ATTN_QAT_TRAIN as a torch autograd op (spec/attention.md). The CPU path runs
// the scalar reference (numerics/attention_qat_ref.h); CUDA tensors go to the
// Hopper kernels (kernels/attention/). There is no fallback between them.
#pragma once
#include <torch/torch.h>

#include <string>

namespace vqad::ops {

enum class AttnQatBwdMode { kConsistent, kFastVideo };

struct AttnQatOptions {
  int block_n = 128;      // KV tile of the running-max P quantization (part of the contract)
  bool quant_p = true;
  bool quant_v = true;
  bool quant_qk = true;   // Q and K fake-quantized (false only for tests/ablations)
  AttnQatBwdMode bwd_mode = AttnQatBwdMode::kConsistent;
  // A CUDA call that records no graph runs the kernel without O_hp (same output bits,
  // less work); true runs the full forward anyway, for same-run comparisons
  // (bench step --qat-full-nograd-forward). Not a config key.
  bool full_forward_without_grad = false;
};

AttnQatBwdMode parse_attn_qat_bwd_mode(const std::string& s);  // "consistent" | "fastvideo"

// Whether the CUDA kernels take this head dimension (64 or 128); the CPU path takes any
// multiple of 16. The same list as kernels/attention/attention_qat.h's
// attn_qat_head_dim_supported (attention_qat_cuda.cpp asserts it).
constexpr bool attention_qat_cuda_head_dim_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// q [B, Lq, H, D], k/v [B, Lkv, H, D] (BLHD, any strides); returns o [B, Lq, H, D]
// in q's dtype. Differentiable with respect to q, k, v (straight-through).
torch::Tensor attention_qat(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const AttnQatOptions& opts = {});

}  // namespace vqad::ops
