#include "vqad/ops/attention_qat.h"

#include <sstream>

#include "vqad/core/error.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/ops/attention_qat_cuda.h"
#include "vqad/ops/tensor_text.h"

namespace vqad::ops {
namespace {

namespace ref = vqad::attn_qat_ref;

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const AttnQatOptions& opts) {
  const char* what = "attention_qat (ATTN_QAT_TRAIN)";
  VQAD_CHECK(q.defined() && k.defined() && v.defined(), what, ": q, k and v must be defined");
  VQAD_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what,
             ": expected q [B, Lq, H, D] and k, v [B, Lkv, H, D], found ", describe_qkv(q, k, v));
  VQAD_CHECK(k.sizes() == v.sizes(), what, ": k and v must have the same shape, found ",
             describe_qkv(q, k, v));
  VQAD_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), what,
             ": q and k/v must agree in batch, heads and head_dim, found ", describe_qkv(q, k, v));
  VQAD_CHECK(q.size(0) >= 1 && q.size(1) >= 1 && k.size(1) >= 1 && q.size(2) >= 1, what,
             ": empty attention is not supported, found ", describe_qkv(q, k, v));
  VQAD_CHECK(q.size(3) % 16 == 0 && q.size(3) > 0, what,
             ": head_dim must be a multiple of 16 (NVFP4 blocks along D), found ", q.size(3));
  for (const auto* t : {&q, &k, &v}) {
    VQAD_CHECK(t->is_floating_point(), what, ": expected floating-point q, k, v, found dtype ",
               t->scalar_type(), " (", describe_qkv(q, k, v), ")");
  }
  VQAD_CHECK(q.device() == k.device() && q.device() == v.device(), what,
             ": q, k and v must be on one device, found ", q.device(), ", ", k.device(), ", ",
             v.device());
  VQAD_CHECK(opts.block_n >= 16 && opts.block_n % 16 == 0, what,
             ": block_n must be a positive multiple of 16, found ", opts.block_n);
}

ref::Options to_ref(const AttnQatOptions& o) {
  ref::Options r;
  r.block_n = o.block_n;
  r.quant_p = o.quant_p;
  r.quant_v = o.quant_v;
  r.quant_qk = o.quant_qk;
  r.bwd_mode = o.bwd_mode == AttnQatBwdMode::kFastVideo ? ref::BwdMode::kFastVideo
                                                         : ref::BwdMode::kConsistent;
  return r;
}

// Training computes in BF16: every input is rounded to bf16 once, then carried
// as fp32 for the reference. The innermost dim must be contiguous.
torch::Tensor as_bf16_valued_float(const torch::Tensor& t) {
  torch::Tensor r = t.to(torch::kBFloat16).to(torch::kFloat32);
  if (r.stride(3) != 1) r = r.contiguous();
  return r;
}

ref::ConstView cview(const torch::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
ref::View view(torch::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
ref::Dims dims_of(const torch::Tensor& q, const torch::Tensor& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), q.size(3)};
}

[[noreturn]] void no_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const char* why) {
  fail("attention_qat (ATTN_QAT_TRAIN): no kernel for device ", q.device(), " (", why,
       "), shape ", describe_qkv(q, k, v),
       "; ATTN_QAT_TRAIN never falls back to another attention path");
}

class AttnQatFunction : public torch::autograd::Function<AttnQatFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t block_n,
                               bool quant_p, bool quant_v, bool quant_qk, bool fastvideo_bwd) {
    AttnQatOptions opts;
    opts.block_n = static_cast<int>(block_n);
    opts.quant_p = quant_p;
    opts.quant_v = quant_v;
    opts.quant_qk = quant_qk;
    opts.bwd_mode = fastvideo_bwd ? AttnQatBwdMode::kFastVideo : AttnQatBwdMode::kConsistent;
    check_inputs(q, k, v, opts);
    // What backward needs besides the saved tensors (both device paths).
    auto save_options = [&] {
      ctx->saved_data["block_n"] = block_n;
      ctx->saved_data["quant_p"] = quant_p;
      ctx->saved_data["quant_v"] = quant_v;
      ctx->saved_data["quant_qk"] = quant_qk;
      ctx->saved_data["fastvideo_bwd"] = fastvideo_bwd;
      ctx->saved_data["q_dtype"] = static_cast<int64_t>(q.scalar_type());
      ctx->saved_data["k_dtype"] = static_cast<int64_t>(k.scalar_type());
      ctx->saved_data["v_dtype"] = static_cast<int64_t>(v.scalar_type());
    };

    if (q.device().is_cpu()) {
      torch::Tensor q32 = as_bf16_valued_float(q);
      torch::Tensor k32 = as_bf16_valued_float(k);
      torch::Tensor v32 = as_bf16_valued_float(v);
      const ref::Dims d = dims_of(q, k);
      auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
      torch::Tensor o = torch::empty({d.batch, d.len_q, d.heads, d.head_dim}, f32);
      torch::Tensor o_hp = torch::empty_like(o);
      torch::Tensor m = torch::empty({d.batch, d.heads, d.len_q}, f32);
      torch::Tensor l = torch::empty_like(m);
      ref::forward(d, cview(q32), cview(k32), cview(v32), to_ref(opts), view(o), view(o_hp),
                   m.data_ptr<float>(), l.data_ptr<float>());
      ctx->save_for_backward({q32, k32, v32, o_hp, m, l});
      save_options();
      return o.to(q.scalar_type());
    }
#ifdef VQAD_WITH_TORCH_CUDA
    if (q.is_cuda()) {
      // CUDA DISPATCH POINT: the Hopper kernels (ops/attention_qat_cuda.h); they refuse
      // unsupported devices and shapes rather than substitute dense attention.
      AttnQatCudaForward r = attention_qat_cuda_forward(q, k, v, opts);
      ctx->save_for_backward({r.q_hat, r.k_hat, r.v_hat, r.o_hp, r.m, r.l});
      save_options();
      return r.o;
    }
#endif
    no_kernel(q, k, v, "only CPU tensors are supported in this build");
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor q32 = saved[0], k32 = saved[1], v32 = saved[2], o_hp = saved[3], m = saved[4],
                  l = saved[5];
    AttnQatOptions opts;
    opts.block_n = static_cast<int>(ctx->saved_data["block_n"].toInt());
    opts.quant_p = ctx->saved_data["quant_p"].toBool();
    opts.quant_v = ctx->saved_data["quant_v"].toBool();
    opts.quant_qk = ctx->saved_data["quant_qk"].toBool();
    opts.bwd_mode = ctx->saved_data["fastvideo_bwd"].toBool() ? AttnQatBwdMode::kFastVideo
                                                              : AttnQatBwdMode::kConsistent;
    const auto q_dtype = static_cast<torch::ScalarType>(ctx->saved_data["q_dtype"].toInt());
    const auto k_dtype = static_cast<torch::ScalarType>(ctx->saved_data["k_dtype"].toInt());
    const auto v_dtype = static_cast<torch::ScalarType>(ctx->saved_data["v_dtype"].toInt());

#ifdef VQAD_WITH_TORCH_CUDA
    // CUDA DISPATCH POINT: saved[0..2] are Q^, K^, V^ (BF16) on the GPU path.
    if (q32.is_cuda()) {
      AttnQatCudaGrads g = attention_qat_cuda_backward(grads[0], q32, k32, v32, o_hp, m, l, opts,
                                                       q_dtype, k_dtype, v_dtype);
      return {g.dq, g.dk, g.dv, torch::Tensor(), torch::Tensor(),
              torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
#endif
    torch::Tensor d_o = grads[0];
    VQAD_CHECK(d_o.defined() && d_o.sizes() == o_hp.sizes(),
               "attention_qat backward: expected dO of shape ", shape_str(o_hp), ", found ",
               d_o.defined() ? shape_str(d_o) : std::string("undefined"));
    d_o = d_o.to(torch::kCPU).to(torch::kFloat32);
    if (d_o.stride(3) != 1) d_o = d_o.contiguous();

    const ref::Dims d = dims_of(q32, k32);
    torch::Tensor dq = torch::empty({d.batch, d.len_q, d.heads, d.head_dim}, torch::kFloat32);
    torch::Tensor dk = torch::empty({d.batch, d.len_kv, d.heads, d.head_dim}, torch::kFloat32);
    torch::Tensor dv = torch::empty_like(dk);
    ref::backward(d, cview(q32), cview(k32), cview(v32), cview(o_hp), cview(d_o),
                  m.data_ptr<float>(), l.data_ptr<float>(), to_ref(opts), view(dq), view(dk),
                  view(dv));
    return {dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

AttnQatBwdMode parse_attn_qat_bwd_mode(const std::string& s) {
  if (s == "consistent") return AttnQatBwdMode::kConsistent;
  if (s == "fastvideo") return AttnQatBwdMode::kFastVideo;
  fail("attention backward mode: unknown value '", s, "' (valid: consistent, fastvideo)");
}

torch::Tensor attention_qat(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const AttnQatOptions& opts) {
  check_inputs(q, k, v, opts);
#ifdef VQAD_WITH_TORCH_CUDA
  // No graph is recorded (grad mode off, as in the first pass of an activation-checkpointed
  // block, or no input needs a gradient): nothing is saved for a backward, and the kernel
  // skips the high-precision P.V product that only the backward's O_hp needs. The output
  // is the same bits as with a graph (GPU test AttentionQatOpCuda.NoGradForwardIsTheSameBits).
  if (q.is_cuda() && !opts.full_forward_without_grad &&
      !(torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())))
    return attention_qat_cuda_forward(q, k, v, opts, /*for_backward=*/false).o;
#endif
  return AttnQatFunction::apply(q, k, v, static_cast<int64_t>(opts.block_n), opts.quant_p,
                                opts.quant_v, opts.quant_qk,
                                opts.bwd_mode == AttnQatBwdMode::kFastVideo);
}

}  // namespace vqad::ops
