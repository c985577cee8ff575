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
};

AttnQatBwdMode parse_attn_qat_bwd_mode(const std::string& s);  // "consistent" | "fastvideo"

// q [B, Lq, H, D], k/v [B, Lkv, H, D] (BLHD, any strides); returns o [B, Lq, H, D]
// in q's dtype. Differentiable with respect to q, k, v (straight-through).
torch::Tensor attention_qat(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const AttnQatOptions& opts = {});

}  // namespace vqad::ops
