// The packed (pre-quantized) NVFP4 linear of an exported model (export/packed.h),
// implemented with the fake-quant linear in ops/nvfp4_linear.cpp so that both share
// every rounding after the weight operand.
#pragma once
#include <torch/torch.h>

#include <string>

#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/linear_quant.h"

namespace vqad::ops {

// Encode scale s_enc of a static (calibrated) activation scale: 2688 / max(amax, 1e-12)
// computed once in double and rounded to fp32 (seeds/003: a Python float division, then
// torch.tensor(float32)). One function for training, export and the packed loader, so
// that all three agree.
float static_activation_encode_scale(float amax);

// The weight operand is given as its unit-scaled values wu = e2m1(code) * S ([N, K], fp32
// or bf16; exact in both) and its decode scale w_dec (weight_scale_2 of a packed export).
// The activation is quantized as in nvfp4_linear and the GEMM, alpha and bias follow
// nvfp4_linear's order for act_mode (dynamic: alpha = (1/s_enc_x) * w_dec, one rounding
// with the bias; static / unit: alpha = w_dec / s_enc_x, bias added to the BF16 output),
// which is nvfp4_linear bit for bit when wu and w_dec are those its dynamic weight scale
// produces (w_dec = 1 / s_enc_w). No autograd: the weight exists only quantized.
torch::Tensor nvfp4_linear_unit_weight(const torch::Tensor& x, const torch::Tensor& wu, float w_dec,
                                       const torch::Tensor& bias, nvfp4::ScaleMode act_mode, float act_amax = 0.0f);

// A linear loaded from a packed NVFP4 export (inference): the stored codes and block
// scales as the unit-scaled operand, the stored weight_scale_2 as its decode scale, and
// the activation scale of the plan the model was trained with. The model's own weight
// parameter (the dequantized values) is not used by forward. Gradients are refused.
class Nvfp4PackedLinear : public LinearQuant {
 public:
  // unit_weight: fp32 [N, K] (e2m1 * S); act_mode dynamic | static (act_amax > 0) | unit.
  Nvfp4PackedLinear(std::string name, torch::Tensor unit_weight, float weight_decode_scale,
                    nvfp4::ScaleMode act_mode, float act_amax = 0.0f);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) override;
  std::string describe() const override;
  const std::string& name() const { return name_; }
  nvfp4::ScaleMode activation_mode() const { return act_mode_; }
  float activation_amax() const { return act_amax_; }
  float weight_decode_scale() const { return w_dec_; }
  const torch::Tensor& unit_weight() const { return unit_weight_; }

 private:
  std::string name_;
  torch::Tensor unit_weight_;  // fp32 CPU
  torch::Tensor device_copy_;  // bf16 copy on the last GPU used
  float w_dec_;
  nvfp4::ScaleMode act_mode_;
  float act_amax_;
};

}  // namespace vqad::ops
