#include "vqad/model/wan/modules.h"

#include <cmath>

#include "vqad/core/error.h"
#include "vqad/dist/ulysses.h"
#include "vqad/ops/fused_block.h"

namespace vqad::model {
namespace {

torch::Tensor cast_like(const torch::Tensor& w, const torch::Tensor& x) {
  return w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type());
}

// torch.nn default init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)).
void uniform_fan_in(torch::Tensor& t, int64_t fan_in) {
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  t.uniform_(-bound, bound);
}

}  // namespace

// ---------------------------------------------------------------------------------------
Linear::Linear(int64_t in, int64_t out, bool with_bias, const torch::TensorOptions& options)
    : in_features(in), out_features(out) {
  weight = register_parameter("weight", torch::empty({out, in}, options));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}, options));
  reset_parameters();
}

void Linear::reset_parameters() {
  uniform_fan_in(weight, in_features);
  if (bias.defined()) uniform_fan_in(bias, in_features);
}

torch::Tensor Linear::forward(const torch::Tensor& x) {
  VQAD_CHECK(x.dim() >= 1 && x.size(-1) == in_features, "Linear [", out_features, " x ",
             in_features, "]: expected input [..., ", in_features, "], found ", x.sizes());
  if (quant_) return quant_->forward(x, weight, bias);
  return torch::nn::functional::linear(x, cast_like(weight, x),
                                       bias.defined() ? cast_like(bias, x) : torch::Tensor());
}

// ---------------------------------------------------------------------------------------
RMSNorm::RMSNorm(int64_t dim, double eps_, const torch::TensorOptions& options) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}, options));
}

torch::Tensor RMSNorm::forward(const torch::Tensor& x) {
  if (x.dim() == 3) return ops::rms_norm_rope(x, weight, eps);
  VQAD_CHECK(x.dim() >= 1, "RMSNorm: expected input [..., ", weight.size(0), "], found a scalar");
  return ops::rms_norm_rope(x.reshape({1, -1, x.size(-1)}), weight, eps).reshape(x.sizes());
}

torch::Tensor RMSNorm::forward_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return ops::rms_norm_rope(x, weight, eps, cos, sin);
}

FP32LayerNorm::FP32LayerNorm(int64_t dim, double eps_, const torch::TensorOptions& options)
    : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}, options));
  bias = register_parameter("bias", torch::zeros({dim}, options));
}

torch::Tensor FP32LayerNorm::forward(const torch::Tensor& x) {
  return torch::layer_norm(x.to(torch::kFloat32), {x.size(-1)}, weight.to(torch::kFloat32),
                           bias.to(torch::kFloat32), eps)
      .to(x.scalar_type());
}

torch::Tensor layer_norm_fp32(const torch::Tensor& x, double eps) {
  return torch::layer_norm(x.to(torch::kFloat32), {x.size(-1)}, {}, {}, eps);
}

// ---------------------------------------------------------------------------------------
PatchEmbedding::PatchEmbedding(int64_t in_channels, int64_t dim, std::array<int64_t, 3> p,
                               const torch::TensorOptions& options)
    : patch(p) {
  weight = register_parameter("weight", torch::empty({dim, in_channels, p[0], p[1], p[2]}, options));
  bias = register_parameter("bias", torch::empty({dim}, options));
  const int64_t fan_in = in_channels * p[0] * p[1] * p[2];
  uniform_fan_in(weight, fan_in);
  uniform_fan_in(bias, fan_in);
}

torch::Tensor PatchEmbedding::forward(const torch::Tensor& x) {
  VQAD_CHECK(x.dim() == 5 && x.size(1) == weight.size(1), "patch_embedding: expected latents [B, ",
             weight.size(1), ", T, H, W], found ", x.sizes());
  auto tokens = patchify(x, patch, /*channel_last=*/false);
  auto w = cast_like(weight, x).reshape({weight.size(0), -1});
  return torch::nn::functional::linear(tokens, w, cast_like(bias, x));
}

torch::Tensor patchify(const torch::Tensor& x, std::array<int64_t, 3> p, bool channel_last) {
  VQAD_CHECK(x.dim() == 5, "patchify: expected [B, C, T, H, W], found ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
  VQAD_CHECK(T % p[0] == 0 && H % p[1] == 0 && W % p[2] == 0, "patchify: latent [T, H, W] = [", T,
             ", ", H, ", ", W, "] is not divisible by the patch (", p[0], ", ", p[1], ", ", p[2], ")");
  const int64_t t = T / p[0], h = H / p[1], w = W / p[2];
  auto v = x.reshape({B, C, t, p[0], h, p[1], w, p[2]});
  // dims: 0 B, 1 C, 2 t, 3 pt, 4 h, 5 ph, 6 w, 7 pw
  auto perm = channel_last ? v.permute({0, 2, 4, 6, 3, 5, 7, 1}) : v.permute({0, 2, 4, 6, 1, 3, 5, 7});
  return perm.reshape({B, t * h * w, C * p[0] * p[1] * p[2]});
}

torch::Tensor unpatchify(const torch::Tensor& tokens, std::array<int64_t, 3> g,
                         std::array<int64_t, 3> p, int64_t C) {
  VQAD_CHECK(tokens.dim() == 3 && tokens.size(1) == g[0] * g[1] * g[2] &&
                 tokens.size(2) == p[0] * p[1] * p[2] * C,
             "unpatchify: expected [B, ", g[0] * g[1] * g[2], ", ", p[0] * p[1] * p[2] * C,
             "], found ", tokens.sizes());
  const int64_t B = tokens.size(0);
  auto v = tokens.reshape({B, g[0], g[1], g[2], p[0], p[1], p[2], C});
  // -> [B, C, t, pt, h, ph, w, pw]
  return v.permute({0, 7, 1, 4, 2, 5, 3, 6}).reshape({B, C, g[0] * p[0], g[1] * p[1], g[2] * p[2]});
}

// ---------------------------------------------------------------------------------------
torch::Tensor timestep_sinusoid(const torch::Tensor& t, int64_t dim) {
  VQAD_CHECK(t.dim() == 1, "timestep: expected [B], found ", t.sizes());
  const int64_t half = dim / 2;
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(t.device());
  auto exponent = torch::arange(half, opts) * static_cast<float>(-std::log(10000.0)) /
                  static_cast<float>(half);
  auto args = t.to(torch::kFloat32).unsqueeze(1) * torch::exp(exponent).unsqueeze(0);
  return torch::cat({torch::cos(args), torch::sin(args)}, 1);
}

std::pair<torch::Tensor, torch::Tensor> rope_tables(std::array<int64_t, 3> grid, int64_t head_dim,
                                                    double theta, int64_t max_seq_len,
                                                    const torch::Device& device) {
  const int64_t d6 = head_dim / 6;
  const std::array<int64_t, 3> axes{head_dim - 4 * d6, 2 * d6, 2 * d6};
  const char* axis_names[3] = {"t", "h", "w"};
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<torch::Tensor> angles;
  for (int a = 0; a < 3; ++a) {
    VQAD_CHECK(grid[a] <= max_seq_len, "RoPE: ", grid[a], " positions along ", axis_names[a],
               " exceed rope_max_seq_len ", max_seq_len);
    auto freqs = 1.0 / torch::pow(theta, torch::arange(0, axes[a], 2, f64) / static_cast<double>(axes[a]));
    auto pos = torch::arange(grid[a], f64);
    auto ang = torch::outer(pos, freqs);  // [n_a, D_a / 2]
    std::vector<int64_t> shape{1, 1, 1, axes[a] / 2};
    shape[a] = grid[a];
    angles.push_back(ang.reshape(shape).expand({grid[0], grid[1], grid[2], axes[a] / 2}));
  }
  auto all = torch::cat(angles, -1).reshape({grid[0] * grid[1] * grid[2], head_dim / 2});
  return {torch::cos(all).to(torch::kFloat32).to(device), torch::sin(all).to(torch::kFloat32).to(device)};
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  VQAD_CHECK(x.dim() == 4 && cos.dim() == 2 && cos.size(0) == x.size(1) && cos.size(1) * 2 == x.size(3),
             "RoPE: expected x [B, L, H, D] and tables [L, D/2], found x ", x.sizes(), ", tables ",
             cos.sizes());
  auto xf = x.to(torch::kFloat32).reshape({x.size(0), x.size(1), x.size(2), x.size(3) / 2, 2});
  auto x0 = xf.select(-1, 0), x1 = xf.select(-1, 1);
  auto c = cos.unsqueeze(0).unsqueeze(2), s = sin.unsqueeze(0).unsqueeze(2);  // [1, L, 1, D/2]
  auto out = torch::stack({x0 * c - x1 * s, x1 * c + x0 * s}, -1);
  return out.reshape(x.sizes()).to(x.scalar_type());
}

// ---------------------------------------------------------------------------------------
TwoLayerMlp::TwoLayerMlp(int64_t in, int64_t hidden, int64_t out, Act act_,
                         const torch::TensorOptions& options)
    : act(act_) {
  linear_1 = register_module("linear_1", std::make_shared<Linear>(in, hidden, true, options));
  linear_2 = register_module("linear_2", std::make_shared<Linear>(hidden, out, true, options));
}

torch::Tensor TwoLayerMlp::forward(const torch::Tensor& x) {
  auto h = linear_1->forward(x);
  h = act == Act::kSilu ? torch::silu(h) : torch::gelu(h, "tanh");
  return linear_2->forward(h);
}

ConditionEmbedder::ConditionEmbedder(int64_t dim, int64_t freq_dim_, int64_t text_dim,
                                     const torch::TensorOptions& options)
    : freq_dim(freq_dim_) {
  time_embedder = register_module(
      "time_embedder", std::make_shared<TwoLayerMlp>(freq_dim, dim, dim, TwoLayerMlp::Act::kSilu, options));
  time_proj = register_module("time_proj", std::make_shared<Linear>(dim, 6 * dim, true, options));
  text_embedder = register_module(
      "text_embedder",
      std::make_shared<TwoLayerMlp>(text_dim, dim, dim, TwoLayerMlp::Act::kGeluTanh, options));
}

// ---------------------------------------------------------------------------------------
WanAttention::WanAttention(int64_t dim, int64_t heads_, double eps, const torch::TensorOptions& options)
    : heads(heads_) {
  to_q = register_module("to_q", std::make_shared<Linear>(dim, dim, true, options));
  to_k = register_module("to_k", std::make_shared<Linear>(dim, dim, true, options));
  to_v = register_module("to_v", std::make_shared<Linear>(dim, dim, true, options));
  auto to_out = register_module("to_out", torch::nn::ModuleList());
  to_out_0 = std::make_shared<Linear>(dim, dim, true, options);
  to_out->push_back(to_out_0);  // "to_out.0"; Diffusers' to_out.1 is a dropout
  norm_q = register_module("norm_q", std::make_shared<RMSNorm>(dim, eps, options));
  norm_k = register_module("norm_k", std::make_shared<RMSNorm>(dim, eps, options));
}

torch::Tensor WanAttention::self_forward(const torch::Tensor& h, const torch::Tensor& rope_cos,
                                         const torch::Tensor& rope_sin, const ops::AttentionSpec& spec,
                                         const torch::Tensor& gate, std::array<int64_t, 3> grid,
                                         dist::ProcessGroup* sp) {
  const int64_t B = h.size(0), L = h.size(1);
  // RMSNorm and RoPE in one op (one kernel on CUDA); the same math as
  // apply_rope(norm_q->forward(.).reshape(B, L, H, D)).
  auto q = norm_q->forward_rope(to_q->forward(h), rope_cos, rope_sin).reshape({B, L, heads, -1});
  auto k = norm_k->forward_rope(to_k->forward(h), rope_cos, rope_sin).reshape({B, L, heads, -1});
  auto v = to_v->forward(h).reshape({B, L, heads, -1});
  ops::VsaInputs vsa;
  if (gate.defined()) vsa.gate = gate.reshape({B, L, heads, -1});
  vsa.grid = grid;
  if (sp) {
    // Ulysses: [B, L = S/P, H, D] -> [B, S, H/P, D]; the attention (and VSA's cube tiling)
    // sees the whole sequence in its original order, for this rank's heads.
    q = dist::seq_to_heads(q, *sp, "self-attention q");
    k = dist::seq_to_heads(k, *sp, "self-attention k");
    v = dist::seq_to_heads(v, *sp, "self-attention v");
    if (vsa.gate.defined()) vsa.gate = dist::seq_to_heads(vsa.gate, *sp, "self-attention VSA gate");
  }
  auto o = ops::self_attention(q, k, v, spec, vsa);
  if (sp) o = dist::heads_to_seq(o, *sp, "self-attention output");
  return to_out_0->forward(o.reshape({B, L, -1}).to(h.scalar_type()));
}

torch::Tensor WanAttention::cross_forward(const torch::Tensor& h, const torch::Tensor& context) {
  const int64_t B = h.size(0), L = h.size(1), Lt = context.size(1);
  auto q = norm_q->forward(to_q->forward(h)).reshape({B, L, heads, -1});
  auto k = norm_k->forward(to_k->forward(context)).reshape({B, Lt, heads, -1});
  auto v = to_v->forward(context).reshape({B, Lt, heads, -1});
  auto o = ops::dense_attention(q, k, v);
  return to_out_0->forward(o.reshape({B, L, -1}).to(h.scalar_type()));
}

// ---------------------------------------------------------------------------------------
FeedForward::FeedForward(int64_t dim, int64_t ffn_dim, const torch::TensorOptions& options) {
  auto net = register_module("net", torch::nn::ModuleList());
  auto gelu = std::make_shared<torch::nn::Module>("GELU");
  fc_in = gelu->register_module("proj", std::make_shared<Linear>(dim, ffn_dim, true, options));
  fc_out = std::make_shared<Linear>(ffn_dim, dim, true, options);
  net->push_back(gelu);                     // net.0 (proj)
  net->push_back(torch::nn::Identity());    // net.1: dropout in Diffusers, no parameters
  net->push_back(fc_out);                   // net.2
}

torch::Tensor FeedForward::forward(const torch::Tensor& x) {
  return fc_out->forward(torch::gelu(fc_in->forward(x), "tanh"));
}

// ---------------------------------------------------------------------------------------
WanBlock::WanBlock(int64_t dim, int64_t heads, int64_t ffn_dim, double eps_, bool gate_compress,
                   const torch::TensorOptions& options)
    : eps(eps_), spec_(ops::current_attention_spec()) {
  attn1 = register_module("attn1", std::make_shared<WanAttention>(dim, heads, eps, options));
  attn2 = register_module("attn2", std::make_shared<WanAttention>(dim, heads, eps, options));
  norm2 = register_module("norm2", std::make_shared<FP32LayerNorm>(dim, eps, options));
  ffn = register_module("ffn", std::make_shared<FeedForward>(dim, ffn_dim, options));
  scale_shift_table = register_parameter("scale_shift_table", torch::empty({1, 6, dim}, options));
  {
    torch::NoGradGuard no_grad;
    scale_shift_table.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(dim)));
  }
  if (gate_compress) {
    to_gate_compress =
        register_module("to_gate_compress", std::make_shared<Linear>(dim, dim, true, options));
    // A fresh gate contributes nothing until trained (compression_gate_initialization: zero).
    torch::NoGradGuard no_grad;
    to_gate_compress->weight.zero_();
    to_gate_compress->bias.zero_();
  }
}

torch::Tensor WanBlock::forward(const torch::Tensor& x, const WanConditioning& cond, BlockTaps* taps) {
  return forward_tensors(x, cond.time_mod, cond.context, cond.rope_cos, cond.rope_sin, taps, cond.grid, cond.sp);
}

torch::Tensor WanBlock::forward_tensors(const torch::Tensor& x, const torch::Tensor& time_mod,
                                        const torch::Tensor& context, const torch::Tensor& rope_cos,
                                        const torch::Tensor& rope_sin, BlockTaps* taps,
                                        std::array<int64_t, 3> grid, dist::ProcessGroup* sp) {
  const auto cdt = x.scalar_type();
  auto e = (scale_shift_table.to(torch::kFloat32) + time_mod.to(torch::kFloat32)).chunk(6, 1);
  const auto &shift = e[0], &scale = e[1], &gate = e[2];
  const auto &c_shift = e[3], &c_scale = e[4], &c_gate = e[5];

  // (layer_norm_fp32(x) * (1 + scale) + shift).to(cdt) and (x + a * gate).to(cdt) in fp32:
  // fused ops (one kernel each on CUDA, the composite elsewhere).
  auto h1 = ops::modulated_layer_norm(x, scale, shift, eps);
  // VSA: the compression gate is a plain (never quantized) linear on the same modulated
  // input as q, k, v; a VSA block always has it (zero until trained).
  torch::Tensor vsa_gate;
  if (ops::is_vsa_backend(spec_.backend)) {
    VQAD_CHECK(to_gate_compress, "Wan block: attention backend ", attention_backend_name(spec_.backend),
               " needs to_gate_compress, but the block was built without it");
    vsa_gate = to_gate_compress->forward(h1);
  }
  auto attn = attn1->self_forward(h1, rope_cos, rope_sin, spec_, vsa_gate, grid, sp);
  if (taps) taps->attn_out = attn;
  auto out = ops::gated_residual(x, attn, gate);

  auto h2 = norm2->forward(out);
  out = out + attn2->cross_forward(h2, context.to(cdt));

  auto h3 = ops::modulated_layer_norm(out, c_scale, c_shift, eps);
  auto f = ffn->forward(h3);
  if (taps) taps->ffn_out = f;
  return ops::gated_residual(out, f, c_gate);
}

}  // namespace vqad::model
