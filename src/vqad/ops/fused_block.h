// Fused forms of the Wan block's fp32 elementwise work (model/wan/modules.cpp), with
// autograd. On CUDA tensors each op is one forward kernel and one backward kernel
// (+ a fixed-order reduction for the per-column gradients, so results are deterministic);
// on any other device it is the composite torch expression the model always ran, which
// is the reference: same math, fp32 arithmetic, the same rounding points to the
// activation dtype. Kernels: kernels/fused/fused_block_kernels.h.
//
// Activations x, a: [B, L, C], float32 or bfloat16. Modulation vectors (scale, shift,
// gate): float32 [B or 1, 1, C] (chunks of the block's `e` are fine: only C must be
// contiguous on CUDA).
#pragma once
#include <torch/torch.h>

namespace vqad::ops {

// (layer_norm_fp32(x, eps) * (1 + scale) + shift).to(x.dtype), layer norm without affine.
// Gradients: x (through the fp32 expression), scale and shift (summed over L, and B when
// broadcast).
torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& scale, const torch::Tensor& shift,
                                   double eps);

// (x.to(f32) + a.to(f32) * gate).to(x.dtype); x and a of one dtype and shape.
// Gradients: dx = grad, da = (grad * gate).to(a.dtype), dgate = sum_L(grad * a).
torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& gate);

// The Wan RMSNorm over the whole row C followed (when cos is defined) by RoPE on the
// heads of head_dim = 2 * cos.size(1):
//   n = (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype) * weight.to(x.dtype)
//   out = apply_rope(n.reshape(B, L, H, D), cos, sin).reshape(B, L, C)
// weight [C] (float32 or bfloat16), cos/sin float32 [L, D/2] or both undefined (no RoPE).
// Gradients: x and weight.
torch::Tensor rms_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                            const torch::Tensor& cos = {}, const torch::Tensor& sin = {});

// The composite expressions (what the non-CUDA path runs), for tests and benchmarks.
torch::Tensor modulated_layer_norm_composite(const torch::Tensor& x, const torch::Tensor& scale,
                                             const torch::Tensor& shift, double eps);
torch::Tensor gated_residual_composite(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& gate);
torch::Tensor rms_norm_rope_composite(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                      const torch::Tensor& cos = {}, const torch::Tensor& sin = {});

}  // namespace vqad::ops
