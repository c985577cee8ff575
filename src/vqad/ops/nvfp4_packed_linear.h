// The packed (pre-quantized) NVFP4 linear of an exported model (export/packed.h),
// implemented with the fake-quant linear in ops/nvfp4_linear.cpp so that both share
// every rounding after the weight operand.
#pragma once
#include <torch/torch.h>

#include <string>

#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/linear_quant.h"
#include "vqad/ops/nvfp4_linear.h"

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
//
// route kFp4 (or kAuto on a GPU with FP4 tensor cores) runs the block-scaled FP4 GEMM on the
// weight's E2M1 codes and E4M3 scales: `codes` when given (from nvfp4_codes_from_unit_weight,
// on x's device), else recovered from wu on every call.
struct Nvfp4WeightCodes;
torch::Tensor nvfp4_linear_unit_weight(const torch::Tensor& x, const torch::Tensor& wu, float w_dec,
                                       const torch::Tensor& bias, nvfp4::ScaleMode act_mode, float act_amax = 0.0f,
                                       Nvfp4GemmRoute route = Nvfp4GemmRoute::kFakeQuant,
                                       const Nvfp4WeightCodes* codes = nullptr);

// The FP4 GEMM operand of a unit-scaled weight wu [N, K] (values e2m1 * S): packed E2M1
// codes [N, K/2] (even k in the low nibble) and E4M3 block-scale bytes [N, K/16], both u8,
// with e2m1(code) * e4m3(scale) == wu exactly for every element (the export's weight and
// weight_scale when wu came from them; a zero block gets scale 0). Computed on the CPU; a
// block that is not an NVFP4 value (NaN, or no E4M3 scale S with every |v| / S on the E2M1
// grid) is an error naming the row and block.
struct Nvfp4WeightCodes {
  torch::Tensor codes;   // u8 [N, K / 2]
  torch::Tensor scales;  // u8 [N, K / 16]
};
Nvfp4WeightCodes nvfp4_codes_from_unit_weight(const torch::Tensor& wu);

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
  // The forward GEMM route (default fake_quant; see nvfp4_linear_unit_weight).
  void set_gemm_route(Nvfp4GemmRoute r) { route_ = r; }
  Nvfp4GemmRoute gemm_route() const { return route_; }

 private:
  std::string name_;
  torch::Tensor unit_weight_;  // fp32 CPU
  torch::Tensor device_copy_;  // bf16 copy on the last GPU used
  Nvfp4WeightCodes device_codes_;  // the fp4 route's weight operand on the last GPU used
  Nvfp4GemmRoute route_ = Nvfp4GemmRoute::kFakeQuant;
  float w_dec_;
  nvfp4::ScaleMode act_mode_;
  float act_amax_;
};

}  // namespace vqad::ops
