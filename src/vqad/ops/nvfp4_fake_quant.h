// NVFP4 as torch ops (spec/nvfp4.md): fake quantization with a straight-through
// backward for training, and quantize / dequantize for export and tools. CPU
// tensors run the scalar reference (numerics/nvfp4.h), CUDA tensors the kernels
// (kernels/nvfp4/); any other device, dtype or shape is an error.
#pragma once
#include <torch/torch.h>

#include "vqad/numerics/nvfp4.h"

namespace vqad::ops {

using nvfp4::ScaleMode;

// FQ(x) = dequantize(quantize(x)) along the last dim (a multiple of 16), in x's
// dtype (F32 or BF16). unit: s_enc = 1; dynamic: s_enc = 2688 / max(amax(x), 1e-12),
// recomputed every call; static: the given s_enc (2688 / calibrated amax).
// `s_enc` must stay 1 for unit and dynamic. Backward: identity (STE).
torch::Tensor nvfp4_fake_quant(const torch::Tensor& x, ScaleMode mode, float s_enc = 1.0f);

// max |x| as a 0-dim F32 tensor on x's device (NaN propagates).
torch::Tensor nvfp4_amax(const torch::Tensor& x);

// Quantized form of x [..., K]: tensors on x's device.
struct Nvfp4Quantized {
  torch::Tensor packed_codes;     // uint8 [..., K / 2], element 2i in the low nibble
  torch::Tensor scales;           // uint8 [..., K / 16], E4M3 bytes, linear layout
  torch::Tensor scales_swizzled;  // uint8 [round_up(rows, 128) * round_up(K / 16, 4)]
  torch::Tensor s_enc;            // F32 0-dim: the encode scale used
};
Nvfp4Quantized nvfp4_quantize(const torch::Tensor& x, ScaleMode mode, float s_enc = 1.0f);

// (e2m1(code) * S) / s_enc from packed codes and linear scales, as `dtype` (F32 or BF16).
torch::Tensor nvfp4_dequantize(const Nvfp4Quantized& q, torch::ScalarType dtype);

// One code per element (uint8 [..., K], bit 3 = sign) from packed codes.
torch::Tensor nvfp4_unpack_codes(const torch::Tensor& packed_codes);

}  // namespace vqad::ops
