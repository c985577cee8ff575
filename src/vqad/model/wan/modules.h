// Building blocks of the Wan2.1 DiT (spec/wan_model.md "Forward"). Module and parameter
// names are the Diffusers ones, so named_parameters() yields Diffusers keys directly.
//
// Precision: parameters are fp32 masters; activations run in the compute dtype (the dtype
// of the hidden stream, bf16 in training) with weights cast per use, so gradients land on
// the fp32 masters. LayerNorm, modulation, gates and RoPE run in fp32.
#pragma once
#include <torch/torch.h>

#include <array>
#include <memory>
#include <string>

#include "vqad/ops/attention.h"
#include "vqad/ops/linear_quant.h"

namespace vqad::dist {
class ProcessGroup;
}

namespace vqad::model {

// A linear layer whose math a quant plan can replace (ops::LinearQuant). Without a quant
// attached it is x W^T + b with W and b cast to x's dtype.
class Linear : public torch::nn::Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool with_bias,
         const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

  void attach_quant(std::shared_ptr<ops::LinearQuant> quant) { quant_ = std::move(quant); }
  const std::shared_ptr<ops::LinearQuant>& quant() const { return quant_; }
  // torch.nn.Linear's default initialisation (uniform +-1/sqrt(in_features)).
  void reset_parameters();

  int64_t in_features, out_features;
  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out] or undefined

 private:
  std::shared_ptr<ops::LinearQuant> quant_;
};

// RMSNorm over the last dim with a weight: statistics in fp32, normalised value cast to
// the input dtype, then scaled by the weight (cast to the input dtype).
class RMSNorm : public torch::nn::Module {
 public:
  RMSNorm(int64_t dim, double eps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  // forward(x) on x [B, L, dim], then RoPE on its heads (apply_rope with cos, sin
  // [L, head_dim / 2]); returned as [B, L, dim]. One op (ops::rms_norm_rope).
  torch::Tensor forward_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::Tensor weight;
  double eps;
};

// LayerNorm with affine parameters, computed in fp32, result in the input dtype (`norm2`).
class FP32LayerNorm : public torch::nn::Module {
 public:
  FP32LayerNorm(int64_t dim, double eps, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
  double eps;
};

// Conv3d(in -> dim, kernel = stride = patch) evaluated as one linear over flattened patches.
class PatchEmbedding : public torch::nn::Module {
 public:
  PatchEmbedding(int64_t in_channels, int64_t dim, std::array<int64_t, 3> patch,
                 const torch::TensorOptions& options);
  // x [B, C, T, H, W] (T, H, W divisible by the patch) -> [B, L, dim] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // [dim, C, pt, ph, pw]
  torch::Tensor bias;    // [dim]
  std::array<int64_t, 3> patch;
};

// Linear -> activation -> Linear, named linear_1 / linear_2 (time and text embedders).
class TwoLayerMlp : public torch::nn::Module {
 public:
  enum class Act { kSilu, kGeluTanh };
  TwoLayerMlp(int64_t in, int64_t hidden, int64_t out, Act act, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  std::shared_ptr<Linear> linear_1, linear_2;
  Act act;
};

// Diffusers `condition_embedder`: time_embedder, time_proj, text_embedder.
class ConditionEmbedder : public torch::nn::Module {
 public:
  ConditionEmbedder(int64_t dim, int64_t freq_dim, int64_t text_dim,
                    const torch::TensorOptions& options);
  std::shared_ptr<TwoLayerMlp> time_embedder, text_embedder;
  std::shared_ptr<Linear> time_proj;  // dim -> 6 dim
  int64_t freq_dim;
};

// Diffusers WanAttention (attn1 = self, attn2 = cross): to_q/k/v, to_out.0, norm_q/k.
class WanAttention : public torch::nn::Module {
 public:
  WanAttention(int64_t dim, int64_t heads, double eps, const torch::TensorOptions& options);
  // h [B, L, dim]; rope tables [L, D/2] fp32. Output after to_out: [B, L, dim].
  // VSA backends: `gate` [B, L, dim] (to_gate_compress output; undefined = zero gate) and
  // `grid` (tokens per axis after patchify).
  // With `sp` (Ulysses sequence parallelism) h holds this rank's slice of the sequence and
  // the RoPE tables its positions; q, k, v (and the VSA gate) are exchanged to the whole
  // sequence for H/P heads before the attention and the output back after it.
  torch::Tensor self_forward(const torch::Tensor& h, const torch::Tensor& rope_cos,
                             const torch::Tensor& rope_sin, const ops::AttentionSpec& spec,
                             const torch::Tensor& gate = {}, std::array<int64_t, 3> grid = {0, 0, 0},
                             dist::ProcessGroup* sp = nullptr);
  // h [B, L, dim], context [B, Lt, dim]; always dense.
  torch::Tensor cross_forward(const torch::Tensor& h, const torch::Tensor& context);

  std::shared_ptr<Linear> to_q, to_k, to_v, to_out_0;
  std::shared_ptr<RMSNorm> norm_q, norm_k;
  int64_t heads;
};

// Diffusers FeedForward: net.0.proj (GELU tanh), net.1 (dropout, no parameters), net.2.
class FeedForward : public torch::nn::Module {
 public:
  FeedForward(int64_t dim, int64_t ffn_dim, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  std::shared_ptr<Linear> fc_in, fc_out;  // net.0.proj and net.2
};

// What a block exposes to the methods (reconstruction targets).
struct BlockTaps {
  torch::Tensor attn_out;  // self-attention after to_out, before the gated residual
  torch::Tensor ffn_out;   // FFN output before the gated residual
};

// Per-forward conditioning shared by all blocks.
struct WanConditioning {
  torch::Tensor temb;      // [B, dim], compute dtype (head modulation)
  torch::Tensor time_mod;  // [B, 6, dim] fp32 (time_proj output)
  torch::Tensor context;   // [B, Lt, dim] compute dtype (text embedding)
  torch::Tensor rope_cos;  // [L, head_dim / 2] fp32
  torch::Tensor rope_sin;
  std::array<int64_t, 3> grid{0, 0, 0};  // tokens per axis after patchify (T', H', W')
  // Sequence parallelism (WanModel::forward under a dist::SequenceParallelScope): the group
  // the sequence is split over; the hidden states and the RoPE tables are this rank's slice.
  dist::ProcessGroup* sp = nullptr;
};

class WanBlock : public torch::nn::Module {
 public:
  // The self-attention backend is the one current at construction (role scope).
  WanBlock(int64_t dim, int64_t heads, int64_t ffn_dim, double eps, bool gate_compress,
           const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const WanConditioning& cond,
                        BlockTaps* taps = nullptr);
  // The same computation with the conditioning as plain tensors (activation checkpointing).
  // `grid` (tokens per axis after patchify) is needed by the VSA backends only.
  torch::Tensor forward_tensors(const torch::Tensor& x, const torch::Tensor& time_mod,
                                const torch::Tensor& context, const torch::Tensor& rope_cos,
                                const torch::Tensor& rope_sin, BlockTaps* taps,
                                std::array<int64_t, 3> grid = {0, 0, 0}, dist::ProcessGroup* sp = nullptr);

  const ops::AttentionSpec& attention_spec() const { return spec_; }
  // VSA: the sparsity used from the next forward on (the trainer's schedule).
  void set_vsa_sparsity(double sparsity) { spec_.vsa.sparsity = sparsity; }

  std::shared_ptr<WanAttention> attn1, attn2;
  std::shared_ptr<FP32LayerNorm> norm2;
  std::shared_ptr<FeedForward> ffn;
  std::shared_ptr<Linear> to_gate_compress;  // null unless configured; used by VSA backends
  torch::Tensor scale_shift_table;           // [1, 6, dim]
  double eps;

 private:
  ops::AttentionSpec spec_;
};

// --- functional pieces (exposed for tests and for other modules) ---

// Sinusoid of the raw timestep: [cos(t f_i), sin(t f_i)], f_i = exp(-ln(10000) i / (dim/2)).
// t [B] -> [B, dim] fp32.
torch::Tensor timestep_sinusoid(const torch::Tensor& t, int64_t dim);

// cos/sin tables [T*H*W, head_dim/2] fp32 for tokens in (t, h, w) raster order. Angles and
// their cos/sin are computed in float64 and rounded to fp32 once.
std::pair<torch::Tensor, torch::Tensor> rope_tables(std::array<int64_t, 3> grid, int64_t head_dim,
                                                    double theta, int64_t max_seq_len,
                                                    const torch::Device& device);

// x [B, L, H, D]; rotates interleaved pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) in fp32,
// returns x's dtype.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// x [B, C, T, H, W] -> [B, L, patch_volume * C]. channel_last = false: per-token features in
// Conv3d weight order (C, pt, ph, pw); true: (pt, ph, pw, C), the inverse of unpatchify.
torch::Tensor patchify(const torch::Tensor& x, std::array<int64_t, 3> patch, bool channel_last);
// tokens [B, L, pt*ph*pw*C] with C fastest -> [B, C, T'*pt, H'*ph, W'*pw].
torch::Tensor unpatchify(const torch::Tensor& tokens, std::array<int64_t, 3> grid,
                         std::array<int64_t, 3> patch, int64_t channels);

// LayerNorm without affine parameters in fp32 (norm1, norm3, norm_out).
torch::Tensor layer_norm_fp32(const torch::Tensor& x, double eps);

}  // namespace vqad::model
