// CUDA path of the ATTN_QAT_TRAIN autograd op (ops/attention_qat.h): the Hopper
// kernels of kernels/attention/ behind torch tensors, on the current CUDA stream.
// Only built where LibTorch's CUDA libraries are linked; the op calls these for
// CUDA tensors and never substitutes another attention path.
#pragma once
#include <torch/torch.h>

#include "vqad/ops/attention_qat.h"

namespace vqad::ops {

#ifdef VQAD_WITH_TORCH_CUDA

// What the forward returns and what the backward needs. q_hat, k_hat, v_hat, o_hp
// are contiguous BF16 [B, L, H, D]; m (log2-domain row max) and l (row sum) are
// contiguous FP32 [B, H, Lq].
struct AttnQatCudaForward {
  torch::Tensor o;  // [B, Lq, H, D] in q's dtype
  torch::Tensor q_hat, k_hat, v_hat, o_hp, m, l;
};

// q [B, Lq, H, D], k/v [B, Lkv, H, D] on one CUDA device, any floating dtype (cast
// to BF16 first), BLHD views with any strides. Errors name device, arch and shape
// when the device is not sm_90, D is not 64 or 128, or opts.block_n != the kernel's BLOCK_N.
// for_backward = false (a call that records no graph): only o is returned, the other
// fields stay undefined, and the kernel skips the high-precision P.V product that O_hp
// needs; o is the same bits either way.
AttnQatCudaForward attention_qat_cuda_forward(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const AttnQatOptions& opts,
                                              bool for_backward = true);

struct AttnQatCudaGrads {
  torch::Tensor dq, dk, dv;
};

// Straight-through backward from the forward's saved tensors; dq, dk, dv come back
// in the given dtypes (the dtypes of the original q, k, v).
AttnQatCudaGrads attention_qat_cuda_backward(const torch::Tensor& d_o, const torch::Tensor& q_hat,
                                             const torch::Tensor& k_hat, const torch::Tensor& v_hat,
                                             const torch::Tensor& o_hp, const torch::Tensor& m,
                                             const torch::Tensor& l, const AttnQatOptions& opts,
                                             torch::ScalarType q_dtype, torch::ScalarType k_dtype,
                                             torch::ScalarType v_dtype);

#endif  // VQAD_WITH_TORCH_CUDA

}  // namespace vqad::ops
