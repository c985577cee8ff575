#include "vqad/ops/fused_block.h"

#include <string>

#include "vqad/core/error.h"
#include "vqad/ops/tensor_text.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "vqad/kernels/fused/fused_block_kernels.h"
#endif

namespace vqad::ops {
namespace {

constexpr const char* kModLn = "modulated_layer_norm";
constexpr const char* kGated = "gated_residual";
constexpr const char* kRms = "rms_norm_rope";

void check_activation(const char* op, const char* name, const torch::Tensor& t) {
  VQAD_CHECK(t.defined(), op, ": ", name, " is undefined");
  VQAD_CHECK(t.dim() == 3 && t.size(2) > 0, op, ": ", name, " must be [B, L, C] with C > 0, found ", shape_str(t));
  VQAD_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, op, ": ", name,
             " must be float32 or bfloat16, found ", t.scalar_type(), " (", name, " ", shape_str(t), ")");
}

void check_same_device(const char* op, const char* name, const torch::Tensor& t, const torch::Tensor& x) {
  VQAD_CHECK(t.device() == x.device(), op, ": ", name, " ", shape_str(t), " is on ", t.device(), " but x ",
             shape_str(x), " is on ", x.device());
}

// A modulation vector: float32 [B or 1, 1, C] on x's device.
void check_vector(const char* op, const char* name, const torch::Tensor& v, const torch::Tensor& x) {
  VQAD_CHECK(v.defined(), op, ": ", name, " is undefined");
  const int64_t B = x.size(0), C = x.size(2);
  VQAD_CHECK(v.dim() == 3 && (v.size(0) == B || v.size(0) == 1) && v.size(1) == 1 && v.size(2) == C, op, ": ",
             name, " must be [", B, " or 1, 1, ", C, "] for x ", shape_str(x), ", found ", shape_str(v));
  VQAD_CHECK(v.scalar_type() == torch::kFloat32, op, ": ", name, " must be float32, found ", v.scalar_type(),
             " (", name, " ", shape_str(v), ")");
  check_same_device(op, name, v, x);
}

void check_rope_tables(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  VQAD_CHECK(cos.defined() == sin.defined(), kRms, ": cos and sin must both be given or both be undefined, found ",
             cos.defined() ? "cos" : "sin", " alone");
  if (!cos.defined()) return;
  VQAD_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(1) && cos.size(1) > 0 &&
                 x.size(2) % (2 * cos.size(1)) == 0,
             kRms, ": expected RoPE tables cos, sin [L, D/2] with L = ", x.size(1),
             " and C divisible by D for x [B, L, C] = ", shape_str(x), ", found cos ", shape_str(cos), ", sin ",
             shape_str(sin));
  VQAD_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, kRms,
             ": RoPE tables must be float32, found cos ", cos.scalar_type(), ", sin ", sin.scalar_type());
  check_same_device(kRms, "cos", cos, x);
  check_same_device(kRms, "sin", sin, x);
}

#ifdef VQAD_WITH_TORCH_CUDA
namespace kf = vqad::kernels::fused;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

kf::ElemType elem_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? kf::ElemType::kBF16 : kf::ElemType::kF32;
}

kf::RowShape row_shape(const torch::Tensor& x) { return {x.size(0), x.size(1), x.size(2)}; }

cudaStream_t stream_of(const torch::Tensor& t) { return at::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

void check_cuda_support(const char* op, const torch::Tensor& x, bool paired) {
  std::string why;
  VQAD_CHECK(kf::kernels_available(x.get_device(), &why), op, ": x ", shape_str(x), ": ", why);
  VQAD_CHECK(kf::supports_cols(x.size(2), paired, &why), op, ": x ", shape_str(x), ": ", why);
}

// Contiguous and 16-byte aligned (the kernels' vector accesses); views at odd offsets are copied.
torch::Tensor aligned(torch::Tensor t) {
  t = t.contiguous();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

// A [B or 1, 1, C] fp32 vector with contiguous C (chunks of `e` already are).
torch::Tensor vector_rows(const torch::Tensor& v) { return v.stride(2) == 1 ? v : v.contiguous(); }

kf::BatchVector batch_vector(const torch::Tensor& v) {
  return {v.data_ptr<float>(), v.size(0) == 1 ? 0 : v.stride(0)};
}

// [B, C] per-batch column sums -> the gradient of a [vector_batch, 1, C] input.
torch::Tensor fold_batch(const torch::Tensor& per_batch, int64_t vector_batch) {
  if (vector_batch == 1 && per_batch.size(0) != 1) return per_batch.sum(0).reshape({1, 1, -1});
  return per_batch.unsqueeze(1);
}

torch::Tensor workspace(const kf::RowShape& s, int64_t vectors, const torch::Tensor& like) {
  return torch::empty({static_cast<int64_t>(kf::partials_floats(s)) * vectors}, like.options().dtype(torch::kFloat32));
}

float* ptr_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

struct ModulatedLayerNormFunction : public torch::autograd::Function<ModulatedLayerNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& scale,
                               const torch::Tensor& shift, double eps) {
    const c10::cuda::CUDAGuard guard(x.device());
    const torch::Tensor xc = aligned(x);
    const torch::Tensor sc = vector_rows(scale), sh = vector_rows(shift);
    const kf::RowShape s = row_shape(xc);
    torch::Tensor out = torch::empty(xc.sizes(), xc.options());
    torch::Tensor mean = torch::empty({s.batch * s.len}, xc.options().dtype(torch::kFloat32));
    torch::Tensor rstd = torch::empty_like(mean);
    kf::launch_modulated_layer_norm_fwd(xc.data_ptr(), elem_type(xc), s, batch_vector(sc), batch_vector(sh),
                                        static_cast<float>(eps), out.data_ptr(), mean.data_ptr<float>(),
                                        rstd.data_ptr<float>(), stream_of(xc));
    ctx->save_for_backward({xc, sc, mean, rstd});
    ctx->saved_data["shift_batch"] = shift.size(0);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &scale = saved[1], &mean = saved[2], &rstd = saved[3];
    torch::Tensor dx, dscale, dshift;
    if (!grads[0].defined()) return {dx, dscale, dshift, torch::Tensor()};
    const c10::cuda::CUDAGuard guard(x.device());
    const torch::Tensor g = aligned(grads[0].to(x.scalar_type()));
    const kf::RowShape s = row_shape(x);
    const auto f32 = x.options().dtype(torch::kFloat32);
    torch::Tensor dscale_b, dshift_b, ws;
    if (ctx->needs_input_grad(0)) dx = torch::empty(x.sizes(), x.options());
    if (ctx->needs_input_grad(1)) dscale_b = torch::empty({s.batch, s.cols}, f32);
    if (ctx->needs_input_grad(2)) dshift_b = torch::empty({s.batch, s.cols}, f32);
    if (dscale_b.defined() || dshift_b.defined()) ws = workspace(s, 2, x);
    kf::launch_modulated_layer_norm_bwd(g.data_ptr(), x.data_ptr(), elem_type(x), s, batch_vector(scale),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                        dx.defined() ? dx.data_ptr() : nullptr, ptr_or_null(dscale_b),
                                        ptr_or_null(dshift_b), ptr_or_null(ws), stream_of(x));
    if (dscale_b.defined()) dscale = fold_batch(dscale_b, scale.size(0));
    if (dshift_b.defined()) dshift = fold_batch(dshift_b, ctx->saved_data["shift_batch"].toInt());
    return {dx, dscale, dshift, torch::Tensor()};
  }
};

struct GatedResidualFunction : public torch::autograd::Function<GatedResidualFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& a,
                               const torch::Tensor& gate) {
    const c10::cuda::CUDAGuard guard(x.device());
    const torch::Tensor xc = aligned(x), ac = aligned(a), gt = vector_rows(gate);
    torch::Tensor out = torch::empty(xc.sizes(), xc.options());
    kf::launch_gated_residual_fwd(xc.data_ptr(), ac.data_ptr(), elem_type(xc), row_shape(xc), batch_vector(gt),
                                  out.data_ptr(), stream_of(xc));
    ctx->save_for_backward({ac, gt});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &a = saved[0], &gate = saved[1];
    torch::Tensor dx, da, dgate;
    if (!grads[0].defined()) return {dx, da, dgate};
    // out = x + a * gate in fp32, rounded once: the gradient reaches x unchanged.
    if (ctx->needs_input_grad(0)) dx = grads[0].to(a.scalar_type());
    if (!ctx->needs_input_grad(1) && !ctx->needs_input_grad(2)) return {dx, da, dgate};
    const c10::cuda::CUDAGuard guard(a.device());
    const torch::Tensor g = aligned(grads[0].to(a.scalar_type()));
    const kf::RowShape s = row_shape(a);
    torch::Tensor dgate_b, ws;
    if (ctx->needs_input_grad(1)) da = torch::empty(a.sizes(), a.options());
    if (ctx->needs_input_grad(2)) {
      dgate_b = torch::empty({s.batch, s.cols}, a.options().dtype(torch::kFloat32));
      ws = workspace(s, 1, a);
    }
    kf::launch_gated_residual_bwd(g.data_ptr(), a.data_ptr(), elem_type(a), s, batch_vector(gate),
                                  da.defined() ? da.data_ptr() : nullptr, ptr_or_null(dgate_b), ptr_or_null(ws),
                                  stream_of(a));
    if (dgate_b.defined()) dgate = fold_batch(dgate_b, gate.size(0));
    return {dx, da, dgate};
  }
};

kf::RopeTables rope_tables_of(const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!cos.defined()) return {};
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), 2 * cos.size(1)};
}

// Shared by the RoPE and plain RMSNorm functions (autograd cannot take undefined tensor
// arguments, so the plain one is a Function of its own).
torch::Tensor rms_forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& cos, const torch::Tensor& sin, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = aligned(x);
  const torch::Tensor w = weight.to(torch::kFloat32).contiguous();
  const torch::Tensor cc = cos.defined() ? cos.contiguous() : cos, ss = sin.defined() ? sin.contiguous() : sin;
  const kf::RowShape s = row_shape(xc);
  torch::Tensor out = torch::empty(xc.sizes(), xc.options());
  torch::Tensor rstd = torch::empty({s.batch * s.len}, xc.options().dtype(torch::kFloat32));
  kf::launch_rms_norm_fwd(xc.data_ptr(), elem_type(xc), s, w.data_ptr<float>(), static_cast<float>(eps),
                          rope_tables_of(cc, ss), out.data_ptr(), rstd.data_ptr<float>(), stream_of(xc));
  if (cc.defined()) {
    ctx->save_for_backward({xc, w, rstd, cc, ss});
  } else {
    ctx->save_for_backward({xc, w, rstd});
  }
  ctx->saved_data["weight_dtype"] = weight.scalar_type();
  return out;
}

// {dx, dweight}
variable_list rms_backward(AutogradContext* ctx, const torch::Tensor& grad) {
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
  const torch::Tensor cos = saved.size() > 3 ? saved[3] : torch::Tensor();
  const torch::Tensor sin = saved.size() > 3 ? saved[4] : torch::Tensor();
  torch::Tensor dx, dweight;
  if (!grad.defined()) return {dx, dweight};
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor g = aligned(grad.to(x.scalar_type()));
  const kf::RowShape s = row_shape(x);
  torch::Tensor dw, ws;
  if (ctx->needs_input_grad(0)) dx = torch::empty(x.sizes(), x.options());
  if (ctx->needs_input_grad(1)) {
    dw = torch::empty({s.cols}, x.options().dtype(torch::kFloat32));
    ws = workspace(s, 1, x);
  }
  if (!dx.defined() && !dw.defined()) return {dx, dweight};
  kf::launch_rms_norm_bwd(g.data_ptr(), x.data_ptr(), elem_type(x), s, w.data_ptr<float>(), rope_tables_of(cos, sin),
                          rstd.data_ptr<float>(), dx.defined() ? dx.data_ptr() : nullptr, ptr_or_null(dw),
                          ptr_or_null(ws), stream_of(x));
  if (dw.defined()) dweight = dw.to(ctx->saved_data["weight_dtype"].toScalarType());
  return {dx, dweight};
}

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    return rms_forward(ctx, x, weight, torch::Tensor(), torch::Tensor(), eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list g = rms_backward(ctx, grads[0]);
    return {g[0], g[1], torch::Tensor()};
  }
};

struct RmsNormRopeFunction : public torch::autograd::Function<RmsNormRopeFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& cos, const torch::Tensor& sin, double eps) {
    return rms_forward(ctx, x, weight, cos, sin, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list g = rms_backward(ctx, grads[0]);
    return {g[0], g[1], torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif  // VQAD_WITH_TORCH_CUDA

}  // namespace

// ---- composites (the reference; the model's expressions before fusion) --------------------
torch::Tensor modulated_layer_norm_composite(const torch::Tensor& x, const torch::Tensor& scale,
                                             const torch::Tensor& shift, double eps) {
  return (torch::layer_norm(x.to(torch::kFloat32), {x.size(-1)}, {}, {}, eps) * (1 + scale) + shift)
      .to(x.scalar_type());
}

torch::Tensor gated_residual_composite(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& gate) {
  return (x.to(torch::kFloat32) + a.to(torch::kFloat32) * gate).to(x.scalar_type());
}

torch::Tensor rms_norm_rope_composite(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                      const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto dt = x.scalar_type();
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  auto y = normed.to(dt) * (weight.scalar_type() == dt ? weight : weight.to(dt));
  if (!cos.defined()) return y;
  // apply_rope on y viewed as [B, L, H, D].
  const int64_t B = y.size(0), L = y.size(1), D = 2 * cos.size(1), H = y.size(2) / D;
  auto yf = y.reshape({B, L, H, D}).to(torch::kFloat32).reshape({B, L, H, D / 2, 2});
  auto y0 = yf.select(-1, 0), y1 = yf.select(-1, 1);
  auto c = cos.unsqueeze(0).unsqueeze(2), s = sin.unsqueeze(0).unsqueeze(2);  // [1, L, 1, D/2]
  auto out = torch::stack({y0 * c - y1 * s, y1 * c + y0 * s}, -1);
  return out.reshape({B, L, H, D}).to(dt).reshape(y.sizes());
}

// ---- ops -------------------------------------------------------------------------------------
torch::Tensor modulated_layer_norm(const torch::Tensor& x, const torch::Tensor& scale, const torch::Tensor& shift,
                                   double eps) {
  check_activation(kModLn, "x", x);
  check_vector(kModLn, "scale", scale, x);
  check_vector(kModLn, "shift", shift, x);
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.is_cuda()) {
    check_cuda_support(kModLn, x, false);
    return ModulatedLayerNormFunction::apply(x, scale, shift, eps);
  }
#endif
  return modulated_layer_norm_composite(x, scale, shift, eps);
}

torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& gate) {
  check_activation(kGated, "x", x);
  check_activation(kGated, "a", a);
  VQAD_CHECK(a.sizes() == x.sizes() && a.scalar_type() == x.scalar_type(), kGated, ": a must match x (",
             shape_str(x), ", ", x.scalar_type(), "), found a ", shape_str(a), ", ", a.scalar_type());
  check_same_device(kGated, "a", a, x);
  check_vector(kGated, "gate", gate, x);
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.is_cuda()) {
    check_cuda_support(kGated, x, false);
    return GatedResidualFunction::apply(x, a, gate);
  }
#endif
  return gated_residual_composite(x, a, gate);
}

torch::Tensor rms_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& cos,
                            const torch::Tensor& sin) {
  check_activation(kRms, "x", x);
  VQAD_CHECK(weight.defined() && weight.dim() == 1 && weight.size(0) == x.size(2), kRms, ": weight must be [",
             x.size(2), "] for x ", shape_str(x), ", found ",
             weight.defined() ? shape_str(weight) : std::string("undefined"));
  VQAD_CHECK(weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16, kRms,
             ": weight must be float32 or bfloat16, found ", weight.scalar_type());
  check_same_device(kRms, "weight", weight, x);
  check_rope_tables(x, cos, sin);
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.is_cuda()) {
    check_cuda_support(kRms, x, true);
    if (cos.defined()) return RmsNormRopeFunction::apply(x, weight, cos, sin, eps);
    return RmsNormFunction::apply(x, weight, eps);
  }
#endif
  return rms_norm_rope_composite(x, weight, eps, cos, sin);
}

}  // namespace vqad::ops
