// NVFP4 W4A4 linears for QAT (`nvfp4_qat_train`) and QAD (calibrated static / unit
// activation scales), spec/linear_qat.md and spec/nvfp4.md.
//
// Forward, for X [M, K] and W [N, K] both blocked by 16 along K:
//   Xb = bf16(X), Wb = bf16(W_master)
//   Xu = e2m1(Xb) * S_x   (unit-scaled dequantized operand, exact in BF16)
//   Wu = e2m1(Wb) * S_w
//   dynamic activations (nvfp4_qat_train):
//     y = bf16( alpha * (Xu . Wu^T) + bf16(b) ),          alpha = (1/s_enc_x) * (1/s_enc_w)
//   static / unit activations (the QAD linear, seeds/003's rounding order):
//     y = bf16( bf16(alpha * (Xu . Wu^T)) + bf16(b) ),    alpha = (1/s_enc_w) / s_enc_x
//     (the GEMM's BF16 output, then the bias added in BF16; a static s_enc_x is
//     fp32(2688 / amax) computed once in double, see static_activation_encode_scale)
// which is FQ(X) . FQ(W)^T + b with the two global decode scales folded into one
// fp32 factor - the same numbers an FP4 tensor-core GEMM produces. The CPU path
// accumulates in fp32 (torch mm); the CUDA path runs fused quantize-dequantize
// kernels and a cuBLASLt BF16 GEMM with alpha read from device memory (no host sync).
// The output has x's dtype (fp32 or bf16; the values are those of the bf16 result).
//
// Backward (straight-through over the whole linear, on the saved unquantized X and
// master W, in the gradient's dtype): dX = dY.W, dW = dY^T.X, db = sum(dY).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/linear_quant.h"

namespace c10d {
class ProcessGroup;
}

namespace vqad::ops {

// The unquantized linear: x W^T + b with W and b cast to x's dtype. Disabled and
// calibrating QAD linears run exactly this, so it must also be what an
// unquantized model::Linear computes for them to be bit-identical.
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// ---- the forward GEMM route ---------------------------------------------------------
// kFakeQuant: the unit-scaled dequantized operands through a BF16 GEMM (CPU: torch mm; GPU:
//   kernels/linear + cuBLASLt) - every device, the reference numbers.
// kFp4: on a GPU with FP4 tensor cores (sm_100 / sm_120), X and W quantized to E2M1 codes
//   and E4M3 block scales by the cvt.rn.satfinite.e2m1x2.f32 quantizer and multiplied by
//   cuBLASLt's block-scaled FP4 GEMM (kernels_fp4/), alpha as in kFakeQuant, fp32 output,
//   then the bias in the same order as kFakeQuant. Same codes and scales, so it differs from
//   kFakeQuant only by the GEMM's fp32 summation order.
// kAuto: kFp4 where the device has it, kFakeQuant elsewhere (CPU, sm_90).
enum class Nvfp4GemmRoute { kFakeQuant = 0, kFp4 = 1, kAuto = 2 };

// y = NVFP4 linear (see above) with STE backward. Activation scale:
//   kDynamic: s_enc = 2688 / amax(bf16(x)) recomputed on this call;
//   kStatic:  s_enc = 2688 / act_amax (act_amax > 0, e.g. calibrated);
//   kUnit:    s_enc = 1.
// The weight scale is always dynamic (2688 / amax(bf16(W)) of the current master).
// x [..., K] (fp32 or bf16), weight [N, K] (fp32 or bf16), bias [N] or undefined,
// K % 16 == 0, all on one device (CPU, or CUDA on a GPU build).
//
// weight_amax, when defined, replaces amax(bf16(W)) in the weight scale (a 0-d or 1-element
// fp32 tensor on x's device): the shared global scale of a group of linears
// (linear_quantization.shared_qkv_scale), the max over the group's weights.
//
// route picks the forward's GEMM (kAuto resolved for x's device); the backward is the same
// for every route.
torch::Tensor nvfp4_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                           nvfp4::ScaleMode act_mode, float act_amax = 0.0f,
                           const torch::Tensor& weight_amax = torch::Tensor(),
                           Nvfp4GemmRoute route = Nvfp4GemmRoute::kFakeQuant);

const char* nvfp4_gemm_route_name(Nvfp4GemmRoute r);  // "fake_quant" | "fp4" | "auto"
// "auto" | "fake_quant" | "fp4"; anything else is an error naming `where`.
Nvfp4GemmRoute parse_nvfp4_gemm_route(const std::string& value, const std::string& where);
// Whether the fp4 route runs on `device` (a GPU with FP4 tensor cores, in a build that holds
// the routes); on false *why names the device, its capability and what is missing.
bool nvfp4_fp4_route_available(const torch::Device& device, std::string* why = nullptr);
// The route the linears run on `device` for `requested`: auto -> fp4 or fake_quant;
// fake_quant -> fake_quant; fp4 -> fp4, or a one-line error "<where>: fp4 ... <why>" where
// the device cannot run it. Never kAuto.
Nvfp4GemmRoute resolve_nvfp4_gemm_route(Nvfp4GemmRoute requested, const torch::Device& device,
                                        const std::string& where);

// ---- building blocks (also used by tests and the benchmark) -------------------------
// max |v| over the values of t after rounding to BF16; NaN elements are ignored (a NaN
// only poisons its own 16-block), +-inf gives inf.
float bf16_amax_cpu(const torch::Tensor& t);
// Unit-scaled dequantized operand of a CPU tensor [R, K] (K % 16 == 0): every value
// rounded to BF16, then quantized per 16 along K with encode scale s_enc; returns
// e2m1 * S as fp32 [R, K] (NaN for every element of a block holding a NaN).
torch::Tensor nvfp4_unit_operand_cpu(const torch::Tensor& x, float s_enc);

#ifdef VQAD_WITH_TORCH_CUDA
// The CUDA kernel behind nvfp4_unit_operand_cpu: x [R, K] on a GPU (fp32 or bf16),
// s_enc a 1-element fp32 GPU tensor; returns the bf16 operand [R, K].
torch::Tensor nvfp4_unit_operand_cuda(const torch::Tensor& x, const torch::Tensor& s_enc);
// max |bf16(x)| of a GPU tensor (NaN ignored) as a 1-element fp32 GPU tensor.
torch::Tensor bf16_amax_cuda(const torch::Tensor& x);
#endif

// ---- shared weight global scales ------------------------------------------------------
// Linears whose weights share one global scale (q/k/v of a self-attention, k/v of a
// cross-attention): amax() is max over the members of amax(bf16(W_i)), read from the
// members' current weights on every call (they are master weights that train).
class WeightScaleGroup {
 public:
  using WeightsFn = std::function<std::vector<torch::Tensor>()>;
  WeightScaleGroup(std::string name, std::vector<std::string> members, WeightsFn weights);
  const std::string& name() const { return name_; }
  const std::vector<std::string>& members() const { return members_; }
  // fp32 amax: a 0-d CPU tensor for CPU weights, a 1-element device tensor on a GPU (no sync).
  torch::Tensor amax() const;

 private:
  std::string name_;
  std::vector<std::string> members_;
  WeightsFn weights_;
};

// ---- LinearQuant implementations -----------------------------------------------------
// `nvfp4_qat_train`: weight and activation scales dynamic.
class Nvfp4DynamicLinear : public LinearQuant {
 public:
  explicit Nvfp4DynamicLinear(std::string name) : name_(std::move(name)) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) override;
  std::string describe() const override;
  const std::string& name() const { return name_; }
  void set_weight_scale_group(std::shared_ptr<WeightScaleGroup> g) { group_ = std::move(g); }
  const std::shared_ptr<WeightScaleGroup>& weight_scale_group() const { return group_; }
  // The forward GEMM route (default fake_quant); auto resolves on every call for x's device.
  void set_gemm_route(Nvfp4GemmRoute r) { route_ = r; }
  Nvfp4GemmRoute gemm_route() const { return route_; }

 private:
  std::string name_;
  std::shared_ptr<WeightScaleGroup> group_;
  Nvfp4GemmRoute route_ = Nvfp4GemmRoute::kFakeQuant;
};

// The QAD linear method: weight dynamic (RTN from the current master weight);
// activation `static` (calibrated amax) or `unit`.
class Nvfp4QadLinear : public LinearQuant {
 public:
  // act_mode kStatic or kUnit. A static linear needs a positive input_amax unless
  // allow_uncalibrated (then it must be calibrated before its first quantized use).
  Nvfp4QadLinear(std::string name, nvfp4::ScaleMode act_mode, std::optional<float> input_amax = std::nullopt,
                 bool allow_uncalibrated = false);

  // Calibrating: dense path, records max|x|. Disabled: dense path (bit-identical).
  // Otherwise the NVFP4 linear; a static linear without an amax is an error.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) override;
  std::string describe() const override;

  const std::string& name() const { return name_; }
  nvfp4::ScaleMode activation_mode() const { return act_mode_; }
  std::optional<float> input_amax() const { return input_amax_; }
  void set_input_amax(float amax);  // positive and finite
  bool enabled() const { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }
  void set_weight_scale_group(std::shared_ptr<WeightScaleGroup> g) { group_ = std::move(g); }
  const std::shared_ptr<WeightScaleGroup>& weight_scale_group() const { return group_; }
  // The forward GEMM route (default fake_quant); calibrating and disabled linears run dense.
  void set_gemm_route(Nvfp4GemmRoute r) { route_ = r; }
  Nvfp4GemmRoute gemm_route() const { return route_; }

  // Used by CalibrationScope.
  bool calibrating() const { return calibrating_; }
  void begin_calibration();
  // Stops recording; returns the max |x| seen (0 when nothing was seen).
  float end_calibration();

 private:
  std::string name_;
  nvfp4::ScaleMode act_mode_;
  std::optional<float> input_amax_;
  bool enabled_ = true;
  bool calibrating_ = false;
  std::shared_ptr<WeightScaleGroup> group_;
  Nvfp4GemmRoute route_ = Nvfp4GemmRoute::kFakeQuant;
  torch::Tensor observed_amax_;  // fp32 scalar on the activation's device, undefined until seen
};

void set_qad_enabled(const std::vector<std::shared_ptr<Nvfp4QadLinear>>& layers, bool enabled);

// Sets the forward GEMM route of every NVFP4 linear (dynamic, QAD, packed) among `quants`;
// returns how many it set. gemm_route_of: the route of one (nullopt for other LinearQuants).
size_t set_nvfp4_gemm_route(const std::vector<std::pair<std::string, std::shared_ptr<LinearQuant>>>& quants,
                            Nvfp4GemmRoute route);
std::optional<Nvfp4GemmRoute> gemm_route_of(const LinearQuant& quant);

// In-place MAX all-reduce of a 1-D fp32 CPU tensor over every rank.
using AmaxReducer = std::function<void(torch::Tensor& maxima)>;
// The reducer for a c10d process group (NCCL groups reduce on the current GPU).
AmaxReducer process_group_max_reducer(c10::intrusive_ptr<c10d::ProcessGroup> group);

// While alive, the static QAD linears without an amax (all static ones when
// `recalibrate`) run the dense path and record max|x|. finish() all-reduces the maxima
// (MAX, through `reducer` when given; single process otherwise), errors naming every
// linear that saw no activation, and sets the amaxes. Leaving the scope without
// finish() (e.g. on an exception) only stops the recording: the linears stay uncalibrated.
class CalibrationScope {
 public:
  explicit CalibrationScope(std::vector<std::shared_ptr<Nvfp4QadLinear>> layers, AmaxReducer reducer = {},
                            bool recalibrate = false);
  ~CalibrationScope();
  CalibrationScope(const CalibrationScope&) = delete;
  CalibrationScope& operator=(const CalibrationScope&) = delete;

  // Module name -> calibrated amax of the linears this scope calibrated.
  std::map<std::string, float> finish();
  std::vector<std::string> pending_names() const;

 private:
  std::vector<std::shared_ptr<Nvfp4QadLinear>> pending_;
  AmaxReducer reducer_;
  bool finished_ = false;
};

}  // namespace vqad::ops
