#include "vqad/ops/nvfp4_linear.h"

#include "vqad/ops/nvfp4_packed_linear.h"

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/ops/tensor_text.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "vqad/kernels/linear/nvfp4_linear_kernels.h"
#include "vqad/kernels_fp4/nvfp4_fp4_routes.h"
#endif

#include <mutex>

namespace vqad::ops {
namespace {

using nvfp4::ScaleMode;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Encode scale of the activation for the static and unit modes (dynamic is computed
// from the data); `what` names the op in errors.
float fixed_activation_scale(ScaleMode mode, float act_amax, const char* what) {
  if (mode == ScaleMode::kUnit) return 1.0f;
  VQAD_CHECK(mode == ScaleMode::kStatic, what, ": no fixed activation scale for mode ", nvfp4::scale_mode_name(mode));
  VQAD_CHECK(act_amax > 0.0f && std::isfinite(act_amax), what,
             ": a static activation scale needs a positive finite amax, got ", act_amax);
  return static_activation_encode_scale(act_amax);
}

void check_linear_args(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  VQAD_CHECK(x.defined() && weight.defined(), "nvfp4_linear: x and weight must be defined");
  VQAD_CHECK(weight.dim() == 2, "nvfp4_linear: weight must be [N, K], got ", shape_str(weight));
  VQAD_CHECK(x.dim() >= 1, "nvfp4_linear: x must be [..., K], got a scalar");
  const int64_t n = weight.size(0), k = weight.size(1);
  VQAD_CHECK(x.size(-1) == k, "nvfp4_linear: x ", shape_str(x), " does not match weight ", shape_str(weight),
             " (expected x[..., ", k, "])");
  VQAD_CHECK(k > 0 && k % nvfp4::kBlock == 0, "nvfp4_linear: K = ", k,
             " is not a positive multiple of the NVFP4 block (16); x ", shape_str(x), ", weight ", shape_str(weight));
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  VQAD_CHECK(xt == torch::kFloat32 || xt == torch::kBFloat16, "nvfp4_linear: x must be float32 or bfloat16, got ",
             xt);
  VQAD_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16,
             "nvfp4_linear: weight must be float32 or bfloat16, got ", wt);
  VQAD_CHECK(x.device() == weight.device(), "nvfp4_linear: x is on ", x.device(), " but weight is on ",
             weight.device());
  if (bias.defined()) {
    VQAD_CHECK(bias.dim() == 1 && bias.size(0) == n, "nvfp4_linear: bias must be [", n, "], got ",
               shape_str(bias));
    VQAD_CHECK(bias.device() == weight.device(), "nvfp4_linear: bias is on ", bias.device(), " but weight is on ",
               weight.device());
  }
}

std::vector<int64_t> output_shape(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = n;
  return s;
}

// --- CPU forward ----------------------------------------------------------------------
// The activation half of the CPU linear and the GEMM, given the weight's unit-scaled
// operand wu [N, K] (fp32 values e2m1 * S) and its decode scale w_dec = 1 / s_enc_w: the
// fake-quant linear (wu from the master weight) and the packed linear (wu from the stored
// codes and scales) share every rounding from here on.
torch::Tensor unit_gemm_cpu(const torch::Tensor& x, const torch::Tensor& wu, float w_dec, const torch::Tensor& bias,
                            ScaleMode act_mode, float act_amax) {
  const int64_t n = wu.size(0), k = wu.size(1);
  const torch::Tensor x2 = x.reshape({-1, k});
  const float s_enc_x = act_mode == ScaleMode::kDynamic ? nvfp4::encode_scale_from_amax(bf16_amax_cpu(x2))
                                                        : fixed_activation_scale(act_mode, act_amax, "nvfp4_linear");
  const bool dynamic = act_mode == ScaleMode::kDynamic;
  // seeds/003 (static / unit): alpha = (1 / w_sf) / input_sf, a reciprocal then a division.
  const float alpha = dynamic ? (1.0f / s_enc_x) * w_dec : w_dec / s_enc_x;
  const torch::Tensor xu = nvfp4_unit_operand_cpu(x2, s_enc_x);
  torch::Tensor acc = torch::mm(xu, wu.t());  // fp32 accumulation of exact products
  acc.mul_(alpha);
  if (dynamic) {
    if (bias.defined()) acc.add_(bias.to(torch::kBFloat16).to(torch::kFloat32));
    return acc.to(torch::kBFloat16).to(x.scalar_type()).reshape(output_shape(x, n));
  }
  // seeds/003: the GEMM's BF16 output, then `out + bias.to(out.dtype)` in BF16.
  torch::Tensor y = acc.to(torch::kBFloat16);
  if (bias.defined()) y = (y.to(torch::kFloat32) + bias.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16);
  return y.to(x.scalar_type()).reshape(output_shape(x, n));
}

float weight_amax_value(const torch::Tensor& weight, const torch::Tensor& weight_amax) {
  if (!weight_amax.defined()) return bf16_amax_cpu(weight);
  return weight_amax.to(torch::kCPU, torch::kFloat32).reshape({-1})[0].item<float>();
}

torch::Tensor forward_cpu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          ScaleMode act_mode, float act_amax, const torch::Tensor& weight_amax) {
  const float s_enc_w = nvfp4::encode_scale_from_amax(weight_amax_value(weight, weight_amax));
  return unit_gemm_cpu(x, nvfp4_unit_operand_cpu(weight, s_enc_w), 1.0f / s_enc_w, bias, act_mode, act_amax);
}

#ifdef VQAD_WITH_TORCH_CUDA
namespace kl = vqad::kernels::linear;

kl::ElemType elem_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? kl::ElemType::kBF16 : kl::ElemType::kF32;
}

void check_cuda_device(const torch::Tensor& x, const torch::Tensor& weight) {
  std::string why;
  VQAD_CHECK(kl::kernels_available(x.get_device(), &why), "nvfp4_linear: x ", shape_str(x), ", weight ",
             shape_str(weight), ": ", why);
}

// y = bf16(alpha * xu . wu^T + bf16(b)) for bf16 unit operands xu [M, K], wu [N, K], then x's dtype;
// bias_after (static / unit, seeds/003): y = bf16(bf16(alpha * xu . wu^T) + bf16(b)).
torch::Tensor unit_gemm_cuda(const torch::Tensor& x, const torch::Tensor& xu, const torch::Tensor& wu,
                             const torch::Tensor& bias, const float* alpha_beta, cudaStream_t stream,
                             bool bias_after = false) {
  const int64_t m = xu.size(0), n = wu.size(0), k = wu.size(1);
  torch::Tensor bias_bf16;
  if (bias.defined()) bias_bf16 = bias.to(torch::kBFloat16).contiguous();
  // Compute dtype BF16 (spec/linear_qat.md): one bf16 rounding of alpha * acc + bias, then
  // x's dtype, exactly as forward_cpu (bias_after: the bias is added to the BF16 output).
  torch::Tensor y = torch::empty({m, n}, xu.options());
  const void* bias_ptr = bias_bf16.defined() && !bias_after ? bias_bf16.data_ptr() : nullptr;
  const size_t ws_bytes = kl::gemm_workspace_bytes(m, n, bias_ptr, y.data_ptr());
  torch::Tensor workspace = torch::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(torch::kUInt8));
  kl::gemm_bf16_nt(xu.data_ptr(), wu.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, alpha_beta, workspace.data_ptr(),
                   ws_bytes, stream);
  if (bias_after && bias_bf16.defined()) y = y + bias_bf16;  // bf16 + bf16: fp32 sum, one rounding
  return y.to(x.scalar_type()).reshape(output_shape(x, n));
}

// ---- the fp4 route (kernels_fp4/: Blackwell) -------------------------------------------
namespace fp4k = vqad::kernels::fp4;

int64_t fp4_padded_k(int64_t k) { return (k + 31) / 32 * 32; }
// M and N are padded to multiples of 16 so that every leading dimension of the GEMM (the
// fp32 output's rows included) is a multiple of 16 bytes, as cuBLASLt's FP4 kernels require.
int64_t fp4_padded_rows(int64_t r) { return (r + 15) / 16 * 16; }

// One GEMM operand of the fp4 route: packed E2M1 codes [Rp, Kp/2] and the 128x4-swizzled
// E4M3 block scales of [Rp, Kp/16]. K is padded to Kp (a multiple of 32, what the GEMM takes)
// and the rows to Rp with zero blocks (codes 0, scale 0), which add nothing to any sum.
struct Fp4Operand {
  torch::Tensor codes, scales_swizzled;
};

Fp4Operand fp4_operand(const torch::Tensor& codes, const torch::Tensor& scales, int64_t kp, cudaStream_t stream) {
  const int64_t r = codes.size(0), k = codes.size(1) * 2, rows = fp4_padded_rows(r);
  torch::Tensor c = codes, sc = scales;
  if (kp != k || rows != r) {
    c = torch::constant_pad_nd(codes, {0, (kp - k) / 2, 0, rows - r}, 0);
    sc = torch::constant_pad_nd(scales, {0, (kp - k) / 16, 0, rows - r}, 0);
  }
  c = c.contiguous();
  sc = sc.contiguous();
  torch::Tensor sw = torch::empty({fp4k::swizzled_bytes(rows, kp / 16)}, sc.options());
  fp4k::launch_swizzle_scales(sc.data_ptr<uint8_t>(), rows, kp / 16, sw.data_ptr<uint8_t>(), stream);
  return {c, sw};
}

// bf16(t) [R, K] quantized with the encode scale *s_enc (device float) by the
// cvt.rn.satfinite.e2m1x2.f32 quantizer: the codes and scales of the fake-quant route's
// unit operand (spec/nvfp4.md's block recipe on the same bf16 values).
Fp4Operand fp4_quantized_operand(const torch::Tensor& t, const float* s_enc, int64_t kp, cudaStream_t stream) {
  const torch::Tensor tb = t.to(torch::kBFloat16).contiguous();
  const int64_t rows = tb.size(0), k = tb.size(1);
  const auto u8 = tb.options().dtype(torch::kUInt8);
  torch::Tensor codes = torch::empty({rows, k / 2}, u8), scales = torch::empty({rows, k / 16}, u8);
  fp4k::launch_quantize_e2m1x2(tb.data_ptr(), true, rows, k, s_enc, codes.data_ptr<uint8_t>(),
                               scales.data_ptr<uint8_t>(), stream);
  return fp4_operand(codes, scales, kp, stream);
}

// y = the block-scaled FP4 GEMM alpha * xa . wa^T in fp32, then the bias exactly as
// unit_gemm_cpu: dynamic bf16(alpha * acc + bf16(b)); bias_after (static / unit, seeds/003)
// bf16(bf16(alpha * acc) + bf16(b)); returned in x's dtype.
torch::Tensor fp4_gemm(const torch::Tensor& x, const Fp4Operand& xa, const Fp4Operand& wa, int64_t m, int64_t n,
                       int64_t kp, const torch::Tensor& bias, const float* alpha_beta, bool bias_after,
                       cudaStream_t stream) {
  if (m == 0) return torch::empty(output_shape(x, n), x.options());
  const int64_t mp = xa.codes.size(0), np = wa.codes.size(0);  // padded (fp4_operand)
  torch::Tensor acc_p = torch::empty({mp, np}, x.options().dtype(torch::kFloat32));
  torch::Tensor workspace =
      torch::empty({static_cast<int64_t>(fp4k::kFp4GemmWorkspaceBytes)}, x.options().dtype(torch::kUInt8));
  fp4k::gemm_fp4_nt(xa.codes.data_ptr<uint8_t>(), xa.scales_swizzled.data_ptr<uint8_t>(), wa.codes.data_ptr<uint8_t>(),
                    wa.scales_swizzled.data_ptr<uint8_t>(), acc_p.data_ptr(), mp, np, kp, alpha_beta,
                    workspace.data_ptr(), fp4k::kFp4GemmWorkspaceBytes, stream, fp4k::Fp4GemmOut::kF32);
  torch::Tensor acc = mp == m && np == n ? acc_p : acc_p.narrow(0, 0, m).narrow(1, 0, n).contiguous();
  torch::Tensor y;
  if (!bias_after) {
    if (bias.defined()) acc.add_(bias.to(torch::kBFloat16).to(torch::kFloat32));
    y = acc.to(torch::kBFloat16);
  } else {
    y = acc.to(torch::kBFloat16);
    if (bias.defined())
      y = (y.to(torch::kFloat32) + bias.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16);
  }
  return y.to(x.scalar_type()).reshape(output_shape(x, n));
}

torch::Tensor forward_cuda(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                           ScaleMode act_mode, float act_amax, const torch::Tensor& weight_amax,
                           Nvfp4GemmRoute route) {
  check_cuda_device(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = weight.size(0), k = weight.size(1);
  // The kernels load 16 bytes at a time: views with an odd storage offset are copied.
  auto aligned = [](torch::Tensor t) {
    t = t.contiguous();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const torch::Tensor x2 = aligned(x.reshape({-1, k}));
  const torch::Tensor w2 = aligned(weight);
  const int64_t m = x2.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const auto f32 = x.options().dtype(torch::kFloat32);
  // {amax_x, amax_w, s_enc_x, s_enc_w, alpha, beta}
  torch::Tensor scalars = torch::zeros({8}, f32);
  float* s = scalars.data_ptr<float>();
  const bool dynamic = act_mode == ScaleMode::kDynamic;
  const float act_s_enc = dynamic ? 0.0f : fixed_activation_scale(act_mode, act_amax, "nvfp4_linear");
  if (dynamic) kl::launch_bf16_amax(x2.data_ptr(), elem_type(x2), x2.numel(), s + 0, stream);
  if (weight_amax.defined()) {
    scalars.narrow(0, 1, 1).copy_(weight_amax.to(x.device(), torch::kFloat32).reshape({1}));
  } else {
    kl::launch_bf16_amax(w2.data_ptr(), elem_type(w2), w2.numel(), s + 1, stream);
  }
  kl::launch_linear_scales(dynamic ? s + 0 : nullptr, act_s_enc, s + 1, s + 2, stream);
  // seeds/003 (static / unit): alpha = (1 / s_enc_w) / s_enc_x, IEEE fp32 on the device.
  if (!dynamic) scalars.narrow(0, 4, 1).copy_(scalars.narrow(0, 3, 1).reciprocal().div(scalars.narrow(0, 2, 1)));
  if (route == Nvfp4GemmRoute::kFp4) {
    const int64_t kp = fp4_padded_k(k);
    const Fp4Operand xa = fp4_quantized_operand(x2, s + 2, kp, stream);
    const Fp4Operand wa = fp4_quantized_operand(w2, s + 3, kp, stream);
    return fp4_gemm(x, xa, wa, m, n, kp, bias, s + 4, !dynamic, stream);
  }
  const auto bf16 = x.options().dtype(torch::kBFloat16);
  torch::Tensor xu = torch::empty({m, k}, bf16);
  torch::Tensor wu = torch::empty({n, k}, bf16);
  kl::launch_unit_operand(x2.data_ptr(), elem_type(x2), m, k, s + 2, xu.data_ptr(), stream);
  kl::launch_unit_operand(w2.data_ptr(), elem_type(w2), n, k, s + 3, wu.data_ptr(), stream);
  return unit_gemm_cuda(x, xu, wu, bias, s + 4, stream, !dynamic);
}

// The packed (pre-quantized) linear on a GPU: wu is the stored unit-scaled weight
// operand [N, K] in bf16 (exact) and w_dec its decode scale; the activation and the
// GEMM run exactly as in forward_cuda, and alpha = (1 / s_enc_x) * w_dec is the same
// product forward_cuda's scale kernel forms from the dynamic weight scale.
torch::Tensor forward_cuda_unit_weight(const torch::Tensor& x, const torch::Tensor& wu, float w_dec,
                                       const torch::Tensor& bias, ScaleMode act_mode, float act_amax,
                                       Nvfp4GemmRoute route, const Nvfp4WeightCodes* codes) {
  check_cuda_device(x, wu);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = wu.size(1);
  auto aligned = [](torch::Tensor t) {
    t = t.contiguous();
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
  };
  const torch::Tensor x2 = aligned(x.reshape({-1, k}));
  const int64_t m = x2.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.get_device()).stream();
  // {amax_x, placeholder weight amax (1), s_enc_x, unused, alpha, beta}
  torch::Tensor scalars = torch::zeros({8}, x.options().dtype(torch::kFloat32));
  scalars.narrow(0, 1, 1).fill_(1.0);
  float* s = scalars.data_ptr<float>();
  const bool dynamic = act_mode == ScaleMode::kDynamic;
  const float act_s_enc = dynamic ? 0.0f : fixed_activation_scale(act_mode, act_amax, "nvfp4_linear");
  if (dynamic) kl::launch_bf16_amax(x2.data_ptr(), elem_type(x2), x2.numel(), s + 0, stream);
  kl::launch_linear_scales(dynamic ? s + 0 : nullptr, act_s_enc, s + 1, s + 2, stream);
  // dynamic: alpha = (1 / s_enc_x) * w_dec; static / unit: w_dec / s_enc_x (seeds/003); IEEE-rounded
  // fp32 operations on the device (no sync).
  if (dynamic) {
    scalars.narrow(0, 4, 1).copy_(scalars.narrow(0, 2, 1).reciprocal().mul(static_cast<double>(w_dec)));
  } else {
    scalars.narrow(0, 4, 1).copy_(torch::full_like(scalars.narrow(0, 2, 1), w_dec).div(scalars.narrow(0, 2, 1)));
  }
  if (route == Nvfp4GemmRoute::kFp4) {
    const int64_t kp = fp4_padded_k(k);
    Nvfp4WeightCodes recovered;
    if (!codes) recovered = nvfp4_codes_from_unit_weight(wu.to(torch::kCPU));
    const Nvfp4WeightCodes& wc = codes ? *codes : recovered;
    const Fp4Operand wa = fp4_operand(wc.codes.to(x.device()), wc.scales.to(x.device()), kp, stream);
    const Fp4Operand xa = fp4_quantized_operand(x2, s + 2, kp, stream);
    return fp4_gemm(x, xa, wa, m, wu.size(0), kp, bias, s + 4, !dynamic, stream);
  }
  torch::Tensor xu = torch::empty({m, k}, x.options().dtype(torch::kBFloat16));
  kl::launch_unit_operand(x2.data_ptr(), elem_type(x2), m, k, s + 2, xu.data_ptr(), stream);
  return unit_gemm_cuda(x, xu, aligned(wu.to(torch::kBFloat16)), bias, s + 4, stream, !dynamic);
}
#endif

// `route` already resolved for x's device (kFakeQuant or kFp4; kFp4 only where it runs).
torch::Tensor forward_any(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          ScaleMode act_mode, float act_amax, const torch::Tensor& weight_amax,
                          Nvfp4GemmRoute route) {
  if (x.device().is_cpu()) return forward_cpu(x, weight, bias, act_mode, act_amax, weight_amax);
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.device().is_cuda()) return forward_cuda(x, weight, bias, act_mode, act_amax, weight_amax, route);
#endif
  fail("nvfp4_linear: no NVFP4 linear for device ", x.device(), " in this build (x ", shape_str(x), ", weight ",
       shape_str(weight), ")");
}

// Forward = the NVFP4 linear; backward = the dense linear's gradients on the saved
// unquantized x and master weight (straight-through over the whole linear).
variable_list linear_backward(AutogradContext* ctx, const torch::Tensor& grad, bool has_bias) {
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor& x = saved[0];
  const torch::Tensor& weight = saved[1];
  const int64_t n = weight.size(0), k = weight.size(1);
  const torch::Tensor g = grad.reshape({-1, n});
  const auto gt = g.scalar_type();
  torch::Tensor dx, dw, db;
  if (ctx->needs_input_grad(0)) dx = g.mm(weight.to(gt)).reshape(x.sizes()).to(x.scalar_type());
  if (ctx->needs_input_grad(1)) dw = g.t().mm(x.reshape({-1, k}).to(gt)).to(weight.scalar_type());
  if (has_bias && ctx->needs_input_grad(2)) db = g.sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
  return {dx, dw, db};
}

// The shared weight amax travels as a plain struct, not as a tensor argument: it gets no
// gradient, and it may be undefined.
struct WeightAmaxArg {
  torch::Tensor amax;  // undefined: the linear's own weight
};

// Autograd records every tensor argument of a custom Function, and an undefined one
// has no device, so the bias-free linear is a Function of its own.
struct Nvfp4LinearBiasFunction : public torch::autograd::Function<Nvfp4LinearBiasFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, int64_t act_mode, double act_amax, WeightAmaxArg wa,
                               int64_t route) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return forward_any(x, weight, bias, static_cast<ScaleMode>(act_mode), static_cast<float>(act_amax), wa.amax,
                       static_cast<Nvfp4GemmRoute>(route));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list g = linear_backward(ctx, grads[0], true);
    return {g[0], g[1], g[2], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct Nvfp4LinearNoBiasFunction : public torch::autograd::Function<Nvfp4LinearNoBiasFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               int64_t act_mode, double act_amax, WeightAmaxArg wa, int64_t route) {
    ctx->save_for_backward({x, weight});
    return forward_any(x, weight, torch::Tensor(), static_cast<ScaleMode>(act_mode), static_cast<float>(act_amax),
                       wa.amax, static_cast<Nvfp4GemmRoute>(route));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list g = linear_backward(ctx, grads[0], false);
    return {g[0], g[1], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

std::string format_amax(float v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

// The describe() suffix of a linear's GEMM route; none for the default fake_quant.
std::string route_suffix(Nvfp4GemmRoute r) {
  return r == Nvfp4GemmRoute::kFakeQuant ? std::string() : std::string(" gemm:") + nvfp4_gemm_route_name(r);
}

}  // namespace

torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  const auto dt = x.scalar_type();
  return torch::nn::functional::linear(x, weight.to(dt), bias.defined() ? bias.to(dt) : bias);
}

torch::Tensor nvfp4_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                           nvfp4::ScaleMode act_mode, float act_amax, const torch::Tensor& weight_amax,
                           Nvfp4GemmRoute route) {
  check_linear_args(x, weight, bias);
  const int64_t r = static_cast<int64_t>(resolve_nvfp4_gemm_route(route, x.device(), "nvfp4_linear"));
  if (act_mode != ScaleMode::kDynamic) fixed_activation_scale(act_mode, act_amax, "nvfp4_linear");
  if (weight_amax.defined()) {
    VQAD_CHECK(weight_amax.numel() == 1 && weight_amax.scalar_type() == torch::kFloat32 &&
                   weight_amax.device() == weight.device(),
               "nvfp4_linear: a shared weight amax must be one fp32 value on ", weight.device(), ", got ",
               shape_str(weight_amax), " ", weight_amax.scalar_type(), " on ", weight_amax.device());
  }
  const WeightAmaxArg wa{weight_amax.defined() ? weight_amax.detach() : torch::Tensor()};
  if (bias.defined()) {
    return Nvfp4LinearBiasFunction::apply(x, weight, bias, static_cast<int64_t>(act_mode),
                                          static_cast<double>(act_amax), wa, r);
  }
  return Nvfp4LinearNoBiasFunction::apply(x, weight, static_cast<int64_t>(act_mode), static_cast<double>(act_amax),
                                          wa, r);
}

float static_activation_encode_scale(float amax) {
  // seeds/003: FP4_RANGE / max(input_amax, 1e-12) in Python (double), then one rounding to fp32.
  return static_cast<float>(2688.0 / std::max(static_cast<double>(amax), 1e-12));
}

WeightScaleGroup::WeightScaleGroup(std::string name, std::vector<std::string> members, WeightsFn weights)
    : name_(std::move(name)), members_(std::move(members)), weights_(std::move(weights)) {
  VQAD_CHECK(!members_.empty() && weights_, "weight scale group '", name_, "': no members");
}

torch::Tensor WeightScaleGroup::amax() const {
  const std::vector<torch::Tensor> ws = weights_();
  VQAD_CHECK(ws.size() == members_.size(), "weight scale group '", name_, "': ", ws.size(), " weights for ",
             members_.size(), " members");
  const torch::Device dev = ws.front().device();
  for (size_t i = 0; i < ws.size(); ++i)
    VQAD_CHECK(ws[i].defined() && ws[i].device() == dev, "weight scale group '", name_, "': weight of '", members_[i],
               "' is ", ws[i].defined() ? "on " + ws[i].device().str() : std::string("undefined"), ", expected ",
               dev.str());
  if (dev.is_cpu()) {
    float m = 0.0f;
    for (const auto& w : ws) m = std::fmax(m, bf16_amax_cpu(w.detach()));
    return torch::full({}, m, torch::kFloat32);
  }
#ifdef VQAD_WITH_TORCH_CUDA
  torch::Tensor m = bf16_amax_cuda(ws.front().detach());
  for (size_t i = 1; i < ws.size(); ++i) m = torch::maximum(m, bf16_amax_cuda(ws[i].detach()));
  return m;
#else
  fail("weight scale group '", name_, "': no NVFP4 linear for device ", dev, " in this build");
#endif
}

torch::Tensor nvfp4_linear_unit_weight(const torch::Tensor& x, const torch::Tensor& wu, float w_dec,
                                       const torch::Tensor& bias, nvfp4::ScaleMode act_mode, float act_amax,
                                       Nvfp4GemmRoute route, const Nvfp4WeightCodes* codes) {
  check_linear_args(x, wu, bias);
  if (act_mode != ScaleMode::kDynamic) fixed_activation_scale(act_mode, act_amax, "nvfp4_linear_unit_weight");
  VQAD_CHECK(std::isfinite(w_dec) && w_dec > 0.0f, "nvfp4_linear_unit_weight: weight decode scale must be positive "
             "and finite, got ", w_dec);
  [[maybe_unused]] const Nvfp4GemmRoute r = resolve_nvfp4_gemm_route(route, x.device(), "nvfp4_linear_unit_weight");
  if (x.device().is_cpu()) return unit_gemm_cpu(x, wu.to(torch::kFloat32), w_dec, bias, act_mode, act_amax);
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.device().is_cuda()) return forward_cuda_unit_weight(x, wu, w_dec, bias, act_mode, act_amax, r, codes);
#endif
  fail("nvfp4_linear_unit_weight: no NVFP4 linear for device ", x.device(), " in this build (x ", shape_str(x),
       ", weight ", shape_str(wu), ")");
}

float bf16_amax_cpu(const torch::Tensor& t) {
  VQAD_CHECK(t.device().is_cpu(), "bf16_amax_cpu: tensor is on ", t.device());
  const torch::Tensor v = t.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  const float* p = v.data_ptr<float>();
  const int64_t n = v.numel();
  // fmax drops NaN; a per-chunk max then a max of the chunks.
  const int64_t grain = 1 << 16;
  const int64_t chunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  std::vector<float> part(chunks, 0.0f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float m = 0.0f;
      const int64_t end = std::min(n, (c + 1) * grain);
      for (int64_t i = c * grain; i < end; ++i) m = std::fmax(m, std::fabs(p[i]));
      part[c] = m;
    }
  });
  float m = 0.0f;
  for (float v2 : part) m = std::fmax(m, v2);
  return m;
}

torch::Tensor nvfp4_unit_operand_cpu(const torch::Tensor& x, float s_enc) {
  VQAD_CHECK(x.device().is_cpu(), "nvfp4_unit_operand_cpu: tensor is on ", x.device());
  VQAD_CHECK(x.dim() == 2, "nvfp4_unit_operand_cpu: expected [rows, K], got ", shape_str(x));
  VQAD_CHECK(x.size(1) % nvfp4::kBlock == 0, "nvfp4_unit_operand_cpu: K = ", x.size(1),
             " is not a multiple of 16");
  const torch::Tensor v = x.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty_like(v);
  const float* src = v.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t blocks = v.numel() / nvfp4::kBlock;
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const nvfp4::BlockQuant q = nvfp4::quantize_block(src + b * nvfp4::kBlock, s_enc);
      const float S = nvfp4::e4m3_decode(q.scale_bits);
      float* y = dst + b * nvfp4::kBlock;
      if (q.scale_bits == nvfp4::kE4M3NaN) {
        for (int i = 0; i < nvfp4::kBlock; ++i) y[i] = std::nanf("");
      } else {
        for (int i = 0; i < nvfp4::kBlock; ++i) y[i] = nvfp4::e2m1_decode(q.codes[i]) * S;
      }
    }
  });
  return out;
}

#ifdef VQAD_WITH_TORCH_CUDA
torch::Tensor nvfp4_unit_operand_cuda(const torch::Tensor& x, const torch::Tensor& s_enc) {
  VQAD_CHECK(x.is_cuda() && s_enc.is_cuda() && s_enc.scalar_type() == torch::kFloat32 && s_enc.numel() >= 1,
             "nvfp4_unit_operand_cuda: expected GPU x and a fp32 GPU s_enc, got x on ", x.device(), ", s_enc ",
             s_enc.scalar_type(), " on ", s_enc.device());
  VQAD_CHECK(x.dim() == 2 && x.size(1) % 16 == 0, "nvfp4_unit_operand_cuda: expected [rows, K % 16 == 0], got ",
             shape_str(x));
  VQAD_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
             "nvfp4_unit_operand_cuda: x must be float32 or bfloat16, got ", x.scalar_type());
  check_cuda_device(x, x);
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor xc = x.contiguous();
  if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 != 0) xc = xc.clone();
  torch::Tensor out = torch::empty(xc.sizes(), xc.options().dtype(torch::kBFloat16));
  kl::launch_unit_operand(xc.data_ptr(), elem_type(xc), xc.size(0), xc.size(1), s_enc.data_ptr<float>(),
                          out.data_ptr(), at::cuda::getCurrentCUDAStream(x.get_device()).stream());
  return out;
}

torch::Tensor bf16_amax_cuda(const torch::Tensor& x) {
  VQAD_CHECK(x.is_cuda(), "bf16_amax_cuda: tensor is on ", x.device());
  VQAD_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
             "bf16_amax_cuda: expected float32 or bfloat16, got ", x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::zeros({1}, xc.options().dtype(torch::kFloat32));
  kl::launch_bf16_amax(xc.data_ptr(), elem_type(xc), xc.numel(), out.data_ptr<float>(),
                       at::cuda::getCurrentCUDAStream(x.get_device()).stream());
  return out;
}
#endif

// --- Nvfp4DynamicLinear ------------------------------------------------------------------
torch::Tensor Nvfp4DynamicLinear::forward(const torch::Tensor& x, const torch::Tensor& weight,
                                          const torch::Tensor& bias) {
  return nvfp4_linear(x, weight, bias, ScaleMode::kDynamic, 0.0f, group_ ? group_->amax() : torch::Tensor(), route_);
}

std::string Nvfp4DynamicLinear::describe() const {
  return std::string("nvfp4 W:dynamic") + (group_ ? "(shared " + group_->name() + ")" : std::string()) +
         " A:dynamic" + route_suffix(route_);
}

// --- Nvfp4QadLinear ----------------------------------------------------------------------
Nvfp4QadLinear::Nvfp4QadLinear(std::string name, nvfp4::ScaleMode act_mode, std::optional<float> input_amax,
                               bool allow_uncalibrated)
    : name_(std::move(name)), act_mode_(act_mode) {
  VQAD_CHECK(act_mode == ScaleMode::kStatic || act_mode == ScaleMode::kUnit, "QAD linear '", name_,
             "': activation scale must be static or unit, got ", nvfp4::scale_mode_name(act_mode));
  if (act_mode == ScaleMode::kStatic) {
    if (input_amax.has_value()) {
      set_input_amax(*input_amax);
    } else {
      VQAD_CHECK(allow_uncalibrated, "QAD linear '", name_,
                 "': a static activation scale needs a calibrated input amax (none given; calibrate first or "
                 "allow uncalibrated linears)");
    }
  }
}

void Nvfp4QadLinear::set_input_amax(float amax) {
  VQAD_CHECK(act_mode_ == ScaleMode::kStatic, "QAD linear '", name_, "': only static linears take an input amax");
  VQAD_CHECK(amax > 0.0f && std::isfinite(amax), "QAD linear '", name_,
             "': calibrated input amax must be positive and finite, got ", amax);
  input_amax_ = amax;
}

void Nvfp4QadLinear::begin_calibration() {
  calibrating_ = true;
  observed_amax_ = torch::Tensor();
}

float Nvfp4QadLinear::end_calibration() {
  calibrating_ = false;
  if (!observed_amax_.defined()) return 0.0f;
  const float v = observed_amax_.item<float>();
  observed_amax_ = torch::Tensor();
  return v;
}

torch::Tensor Nvfp4QadLinear::forward(const torch::Tensor& x, const torch::Tensor& weight,
                                      const torch::Tensor& bias) {
  if (calibrating_) {
    // abs().amax() propagates NaN, so a NaN activation makes the calibration fail loudly.
    const torch::Tensor a = x.detach().abs().amax().to(torch::kFloat32);
    observed_amax_ = observed_amax_.defined() ? torch::maximum(observed_amax_, a) : a;
    return dense_linear(x, weight, bias);
  }
  if (!enabled_) return dense_linear(x, weight, bias);
  if (act_mode_ == ScaleMode::kStatic) {
    VQAD_CHECK(input_amax_.has_value(), "QAD linear '", name_,
               "': static activation scale used before calibration (run a CalibrationScope or load an amax "
               "table)");
    return nvfp4_linear(x, weight, bias, ScaleMode::kStatic, *input_amax_,
                        group_ ? group_->amax() : torch::Tensor(), route_);
  }
  return nvfp4_linear(x, weight, bias, ScaleMode::kUnit, 0.0f, group_ ? group_->amax() : torch::Tensor(), route_);
}

std::string Nvfp4QadLinear::describe() const {
  std::string a = nvfp4::scale_mode_name(act_mode_);
  if (act_mode_ == ScaleMode::kStatic) {
    a += input_amax_ ? "(amax=" + format_amax(*input_amax_) + ")" : std::string("(uncalibrated)");
  }
  return std::string("nvfp4-qad W:dynamic") + (group_ ? "(shared " + group_->name() + ")" : std::string()) +
         " A:" + a + route_suffix(route_) + (enabled_ ? "" : " [disabled]");
}

// --- Nvfp4PackedLinear ----------------------------------------------------------------------
Nvfp4PackedLinear::Nvfp4PackedLinear(std::string name, torch::Tensor unit_weight, float weight_decode_scale,
                                     nvfp4::ScaleMode act_mode, float act_amax)
    : name_(std::move(name)), w_dec_(weight_decode_scale), act_mode_(act_mode), act_amax_(act_amax) {
  VQAD_CHECK(unit_weight.defined() && unit_weight.dim() == 2 && unit_weight.size(1) % nvfp4::kBlock == 0,
             "packed NVFP4 linear '", name_, "': unit weight must be [N, K % 16 == 0], got ",
             unit_weight.defined() ? shape_str(unit_weight) : std::string("undefined"));
  VQAD_CHECK(std::isfinite(w_dec_) && w_dec_ > 0.0f, "packed NVFP4 linear '", name_,
             "': weight_scale_2 must be positive and finite, got ", w_dec_);
  if (act_mode_ != ScaleMode::kDynamic) fixed_activation_scale(act_mode_, act_amax_, name_.c_str());
  unit_weight_ = unit_weight.to(torch::kCPU, torch::kFloat32).contiguous();
}

torch::Tensor Nvfp4PackedLinear::forward(const torch::Tensor& x, const torch::Tensor& weight,
                                         const torch::Tensor& bias) {
  VQAD_CHECK(!(torch::GradMode::is_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()))),
             "packed NVFP4 linear '", name_, "' is inference-only (its weight exists only quantized); to train "
             "from a packed export use it as init_from");
  VQAD_CHECK(!weight.defined() || weight.sizes() == unit_weight_.sizes(), "packed NVFP4 linear '", name_,
             "': model weight ", shape_str(weight), " does not match the packed weight ", shape_str(unit_weight_));
  if (x.device().is_cpu())
    return nvfp4_linear_unit_weight(x, unit_weight_, w_dec_, bias, act_mode_, act_amax_, route_);
  if (!device_copy_.defined() || device_copy_.device() != x.device())
    device_copy_ = unit_weight_.to(x.device(), torch::kBFloat16).contiguous();
  if (resolve_nvfp4_gemm_route(route_, x.device(), name_) == Nvfp4GemmRoute::kFp4) {
    if (!device_codes_.codes.defined() || device_codes_.codes.device() != x.device()) {
      const Nvfp4WeightCodes c = nvfp4_codes_from_unit_weight(unit_weight_);
      device_codes_ = {c.codes.to(x.device()), c.scales.to(x.device())};
    }
    return nvfp4_linear_unit_weight(x, device_copy_, w_dec_, bias, act_mode_, act_amax_, Nvfp4GemmRoute::kFp4,
                                    &device_codes_);
  }
  return nvfp4_linear_unit_weight(x, device_copy_, w_dec_, bias, act_mode_, act_amax_, Nvfp4GemmRoute::kFakeQuant);
}

std::string Nvfp4PackedLinear::describe() const {
  std::string a = nvfp4::scale_mode_name(act_mode_);
  if (act_mode_ == ScaleMode::kStatic) a += "(amax=" + format_amax(act_amax_) + ")";
  return "nvfp4-packed W:stored(weight_scale_2=" + format_amax(w_dec_) + ") A:" + a + route_suffix(route_);
}

// --- GEMM routes ----------------------------------------------------------------------------
const char* nvfp4_gemm_route_name(Nvfp4GemmRoute r) {
  switch (r) {
    case Nvfp4GemmRoute::kFakeQuant: return "fake_quant";
    case Nvfp4GemmRoute::kFp4: return "fp4";
    case Nvfp4GemmRoute::kAuto: return "auto";
  }
  return "?";
}

Nvfp4GemmRoute parse_nvfp4_gemm_route(const std::string& value, const std::string& where) {
  if (value == "auto") return Nvfp4GemmRoute::kAuto;
  if (value == "fake_quant") return Nvfp4GemmRoute::kFakeQuant;
  if (value == "fp4") return Nvfp4GemmRoute::kFp4;
  fail(where, ": unknown NVFP4 GEMM route '", value, "' (valid: auto, fake_quant, fp4)");
}

bool nvfp4_fp4_route_available(const torch::Device& device, std::string* why) {
  auto set = [&](std::string w) {
    if (why) *why = std::move(w);
    return false;
  };
  if (!device.is_cuda())
    return set("device " + device.str() + " is not a GPU (the fp4 route needs FP4 tensor cores: sm_100 or sm_120)");
#ifdef VQAD_WITH_TORCH_CUDA
  // Device properties cannot change: one probe per device.
  static std::mutex mu;
  static std::map<int, std::pair<bool, std::string>> cache;
  const int index = device.has_index() ? device.index() : static_cast<int>(c10::cuda::current_device());
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(index);
  if (it == cache.end()) {
    std::string w;
    const bool ok = fp4k::fp4_routes_available(index, &w);
    it = cache.emplace(index, std::make_pair(ok, w)).first;
  }
  if (!it->second.first) return set(it->second.second);
  if (why) why->clear();
  return true;
#else
  return set("this build of vqad has no CUDA LibTorch (the fp4 route runs on a GPU build)");
#endif
}

Nvfp4GemmRoute resolve_nvfp4_gemm_route(Nvfp4GemmRoute requested, const torch::Device& device,
                                        const std::string& where) {
  if (requested == Nvfp4GemmRoute::kFakeQuant) return requested;
  std::string why;
  const bool fp4 = nvfp4_fp4_route_available(device, &why);
  if (requested == Nvfp4GemmRoute::kAuto) return fp4 ? Nvfp4GemmRoute::kFp4 : Nvfp4GemmRoute::kFakeQuant;
  VQAD_CHECK(fp4, where, ": the fp4 GEMM route needs a GPU with FP4 tensor cores, but ", why,
             "; use fake_quant (or auto) here");
  return Nvfp4GemmRoute::kFp4;
}

Nvfp4WeightCodes nvfp4_codes_from_unit_weight(const torch::Tensor& wu) {
  VQAD_CHECK(wu.defined() && wu.dim() == 2 && wu.size(1) % nvfp4::kBlock == 0,
             "nvfp4_codes_from_unit_weight: expected [N, K % 16 == 0], got ",
             wu.defined() ? shape_str(wu) : std::string("undefined"));
  const torch::Tensor v = wu.to(torch::kCPU, torch::kFloat32).contiguous();
  const int64_t rows = v.size(0), k = v.size(1), kb = k / nvfp4::kBlock;
  torch::Tensor codes = torch::empty({rows, k / 2}, torch::kUInt8), scales = torch::empty({rows, kb}, torch::kUInt8);
  const float* src = v.data_ptr<float>();
  uint8_t* pc = codes.data_ptr<uint8_t>();
  uint8_t* ps = scales.data_ptr<uint8_t>();
  static const float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::vector<int64_t> bad(static_cast<size_t>(at::get_num_threads()) + 1, -1);
  at::parallel_for(0, rows * kb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = src + b * nvfp4::kBlock;
      float m = 0.0f;
      bool finite = true;
      for (int i = 0; i < nvfp4::kBlock; ++i) {
        finite = finite && std::isfinite(x[i]);
        m = std::fmax(m, std::fabs(x[i]));
      }
      uint8_t c[nvfp4::kBlock] = {};
      uint8_t sbits = 0;
      bool ok = finite;
      if (ok && m > 0.0f) {
        // S = m / g for the largest code value g of the block: try each grid value as that code.
        ok = false;
        for (int g = 7; g >= 1 && !ok; --g) {
          const float S = m / kGrid[g];
          const uint8_t bits = nvfp4::e4m3_encode_rn_satfinite(S);
          if (nvfp4::e4m3_decode(bits) != S) continue;
          bool all = true;
          for (int i = 0; i < nvfp4::kBlock && all; ++i) {
            const float a = std::fabs(x[i]);
            int code = -1;
            for (int q = 0; q < 8; ++q)
              if (kGrid[q] * S == a) code = q;
            all = code >= 0;
            c[i] = static_cast<uint8_t>((code < 0 ? 0 : code) | (std::signbit(x[i]) ? 8 : 0));
          }
          if (all) {
            ok = true;
            sbits = bits;
          }
        }
      }
      if (!ok) {
        bad[at::get_thread_num()] = b;
        continue;
      }
      ps[b] = sbits;
      for (int i = 0; i < nvfp4::kBlock / 2; ++i) pc[b * 8 + i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
    }
  });
  for (int64_t b : bad)
    VQAD_CHECK(b < 0, "nvfp4_codes_from_unit_weight: weight ", shape_str(wu), " row ", b / kb, " block ", b % kb,
               " (columns ", (b % kb) * 16, "..", (b % kb) * 16 + 15, ") is not an NVFP4 value e2m1 * S");
  return {codes, scales};
}

std::optional<Nvfp4GemmRoute> gemm_route_of(const LinearQuant& quant) {
  if (auto* d = dynamic_cast<const Nvfp4DynamicLinear*>(&quant)) return d->gemm_route();
  if (auto* q = dynamic_cast<const Nvfp4QadLinear*>(&quant)) return q->gemm_route();
  if (auto* p = dynamic_cast<const Nvfp4PackedLinear*>(&quant)) return p->gemm_route();
  return std::nullopt;
}

size_t set_nvfp4_gemm_route(const std::vector<std::pair<std::string, std::shared_ptr<LinearQuant>>>& quants,
                            Nvfp4GemmRoute route) {
  size_t n = 0;
  for (const auto& [name, q] : quants) {
    if (auto d = std::dynamic_pointer_cast<Nvfp4DynamicLinear>(q)) {
      d->set_gemm_route(route);
    } else if (auto l = std::dynamic_pointer_cast<Nvfp4QadLinear>(q)) {
      l->set_gemm_route(route);
    } else if (auto p = std::dynamic_pointer_cast<Nvfp4PackedLinear>(q)) {
      p->set_gemm_route(route);
    } else {
      continue;
    }
    ++n;
  }
  return n;
}

void set_qad_enabled(const std::vector<std::shared_ptr<Nvfp4QadLinear>>& layers, bool enabled) {
  for (const auto& l : layers) l->set_enabled(enabled);
}

AmaxReducer process_group_max_reducer(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  VQAD_CHECK(group, "process_group_max_reducer: null process group");
  return [group](torch::Tensor& maxima) {
    torch::Tensor buf = maxima;
#ifdef VQAD_WITH_TORCH_CUDA
    if (group->getBackendName() == "nccl") {
      buf = maxima.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(c10::cuda::current_device())));
    }
#endif
    std::vector<torch::Tensor> tensors{buf};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    group->allreduce(tensors, opts)->wait();
    if (!buf.is_same(maxima)) maxima.copy_(buf.cpu());
  };
}

// --- CalibrationScope -----------------------------------------------------------------------
CalibrationScope::CalibrationScope(std::vector<std::shared_ptr<Nvfp4QadLinear>> layers, AmaxReducer reducer,
                                   bool recalibrate)
    : reducer_(std::move(reducer)) {
  for (auto& l : layers) {
    VQAD_CHECK(l, "CalibrationScope: null linear");
    if (l->activation_mode() != ScaleMode::kStatic) continue;
    if (l->input_amax().has_value() && !recalibrate) continue;
    VQAD_CHECK(!l->calibrating(), "CalibrationScope: linear '", l->name(), "' is already being calibrated");
    pending_.push_back(l);
  }
  // Sorted so that every rank reduces the same vector in the same order.
  std::sort(pending_.begin(), pending_.end(), [](const auto& a, const auto& b) { return a->name() < b->name(); });
  for (auto& l : pending_) l->begin_calibration();
}

CalibrationScope::~CalibrationScope() {
  if (finished_) return;
  for (auto& l : pending_) {
    try {
      l->end_calibration();
    } catch (...) {
      // A device error while reading the observed amax must not escape a destructor;
      // the linear stays uncalibrated and its first use reports it.
    }
  }
}

std::vector<std::string> CalibrationScope::pending_names() const {
  std::vector<std::string> names;
  for (const auto& l : pending_) names.push_back(l->name());
  return names;
}

std::map<std::string, float> CalibrationScope::finish() {
  VQAD_CHECK(!finished_, "CalibrationScope::finish called twice");
  finished_ = true;
  std::vector<float> values;
  for (auto& l : pending_) values.push_back(l->end_calibration());
  std::map<std::string, float> result;
  if (pending_.empty()) return result;
  torch::Tensor maxima = torch::from_blob(values.data(), {static_cast<int64_t>(values.size())}, torch::kFloat32).clone();
  if (reducer_) {
    reducer_(maxima);
    VQAD_CHECK(maxima.numel() == static_cast<int64_t>(values.size()) && maxima.scalar_type() == torch::kFloat32,
               "CalibrationScope: the reducer changed the maxima tensor (expected ", values.size(), " fp32 values)");
  }
  maxima = maxima.cpu().contiguous();
  const float* m = maxima.data_ptr<float>();
  std::vector<std::string> empty, bad;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (std::isnan(m[i]) || std::isinf(m[i])) {
      bad.push_back(pending_[i]->name() + " (" + format_amax(m[i]) + ")");
    } else if (!(m[i] > 0.0f)) {
      empty.push_back(pending_[i]->name());
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  };
  VQAD_CHECK(empty.empty(), "calibration: ", empty.size(), " static linear(s) saw no activation: ", join(empty));
  VQAD_CHECK(bad.empty(), "calibration: non-finite input amax for ", join(bad));
  for (size_t i = 0; i < pending_.size(); ++i) {
    pending_[i]->set_input_amax(m[i]);
    result[pending_[i]->name()] = m[i];
  }
  return result;
}

}  // namespace vqad::ops
