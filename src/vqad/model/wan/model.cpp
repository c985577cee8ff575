#include "vqad/model/wan/model.h"

#include <cmath>
#include <set>

#include "vqad/core/error.h"
#include "vqad/dist/ulysses.h"
#include "vqad/ops/checkpoint.h"
#include "vqad/ops/fused_block.h"

namespace vqad::model {

bool is_vsa_backend(AttentionBackend b) { return ops::is_vsa_backend(b); }

WanModel::WanModel(const WanConfig& config, const WanModelOptions& options)
    : config_(config), options_(options), spec_(ops::current_attention_spec()) {
  config_.validate("Wan model config");
  if (is_vsa_backend(spec_.backend)) config_.gate_compress = true;
  set_compute_dtype(options.compute_dtype);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(options.device);
  const int64_t dim = config_.dim();

  patch_embedding = register_module(
      "patch_embedding",
      std::make_shared<PatchEmbedding>(config_.in_channels, dim, config_.patch_size, opts));
  condition_embedder = register_module(
      "condition_embedder",
      std::make_shared<ConditionEmbedder>(dim, config_.freq_dim, config_.text_dim, opts));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    auto b = std::make_shared<WanBlock>(dim, config_.num_attention_heads, config_.ffn_dim,
                                        config_.eps, config_.gate_compress, opts);
    blocks->push_back(b);
    block_list_.push_back(b);
  }
  proj_out = register_module(
      "proj_out",
      std::make_shared<Linear>(dim, config_.out_channels * config_.patch_volume(), true, opts));
  scale_shift_table = register_parameter("scale_shift_table", torch::empty({1, 2, dim}, opts));
  torch::NoGradGuard no_grad;
  scale_shift_table.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(dim)));
}

void WanModel::set_compute_dtype(torch::ScalarType dtype) {
  VQAD_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
             "Wan model: compute dtype must be float32 or bfloat16, found ", c10::toString(dtype));
  VQAD_CHECK(!sharded_ || dtype == options_.compute_dtype, "Wan model: the compute dtype cannot change while the "
             "model is sharded (the sharding chose its gather dtypes for ", c10::toString(options_.compute_dtype), ")");
  options_.compute_dtype = dtype;
}

void WanModel::set_vsa_sparsity(double sparsity) {
  VQAD_CHECK(sparsity >= 0.0 && sparsity < 1.0, "Wan model: VSA sparsity must be in [0, 1), found ", sparsity);
  spec_.vsa.sparsity = sparsity;
  for (auto& b : block_list_) b->set_vsa_sparsity(sparsity);
}

WanBlock& WanModel::block(int64_t i) {
  VQAD_CHECK(i >= 0 && i < num_blocks(), "Wan model: block index ", i, " out of range [0, ",
             num_blocks(), ")");
  return *block_list_[i];
}

WanModel::Embedded WanModel::embed(const torch::Tensor& x, const torch::Tensor& timestep,
                                   const torch::Tensor& text) {
  const auto cdt = options_.compute_dtype;
  VQAD_CHECK(x.dim() == 5 && x.size(1) == config_.in_channels, "Wan forward: latents must be [B, ",
             config_.in_channels, ", T, H, W], found ", x.sizes());
  const int64_t B = x.size(0);
  VQAD_CHECK(timestep.dim() == 1 && (timestep.size(0) == B || timestep.size(0) == 1),
             "Wan forward: timestep must be [B] or [1] with B = ", B, ", found ", timestep.sizes());
  VQAD_CHECK(text.dim() == 3 && text.size(0) == B && text.size(2) == config_.text_dim,
             "Wan forward: text embeddings must be [", B, ", Lt, ", config_.text_dim, "], found ",
             text.sizes());
  const auto& p = config_.patch_size;
  VQAD_CHECK(x.size(2) % p[0] == 0 && x.size(3) % p[1] == 0 && x.size(4) % p[2] == 0,
             "Wan forward: latent [T, H, W] = [", x.size(2), ", ", x.size(3), ", ", x.size(4),
             "] is not divisible by the patch (", p[0], ", ", p[1], ", ", p[2], ")");

  if (sharded_) sharded_->gather(0);
  Embedded out;
  out.cond.grid = {x.size(2) / p[0], x.size(3) / p[1], x.size(4) / p[2]};
  out.hidden = patch_embedding->forward(x.to(cdt));

  auto t = timestep.size(0) == B ? timestep : timestep.expand({B});
  auto sinus = timestep_sinusoid(t.to(x.device()), config_.freq_dim).to(cdt);
  auto& ce = *condition_embedder;
  out.cond.temb = ce.time_embedder->forward(sinus);
  out.cond.time_mod = ce.time_proj->forward(torch::silu(out.cond.temb))
                          .reshape({B, 6, config_.dim()})
                          .to(torch::kFloat32);
  out.cond.context = ce.text_embedder->forward(text.to(cdt));
  std::tie(out.cond.rope_cos, out.cond.rope_sin) =
      rope_tables(out.cond.grid, config_.attention_head_dim, config_.rope_theta,
                  config_.rope_max_seq_len, x.device());
  return out;
}

torch::Tensor WanModel::forward_blocks(int64_t begin, int64_t end, torch::Tensor hidden,
                                       const WanConditioning& cond, std::vector<BlockTaps>* taps) {
  VQAD_CHECK(0 <= begin && begin <= end && end <= num_blocks(), "Wan model: block range [", begin,
             ", ", end, ") is not inside [0, ", num_blocks(), "]");
  // Checkpointing applies with taps too (model.h's note predates this): a tapped block
  // returns {output, attn_out, ffn_out} from one checkpointed segment and recomputes all
  // three in backward, so reconstruction losses on the taps keep no block activations.
  const bool ckpt = options_.gradient_checkpointing && torch::GradMode::is_enabled();
  VQAD_CHECK(!sharded_ || !taps, "Wan model: block taps are not available under sharded data parallelism");
  for (int64_t i = begin; i < end; ++i) {
    WanBlock* blk = block_list_[i].get();
    // Sharded: the block's unit is gathered before it runs and released after it.
    const size_t unit = static_cast<size_t>(1 + i / blocks_per_unit_);
    const bool unit_last = (i + 1) % blocks_per_unit_ == 0 || i + 1 == end;
    if (sharded_) hidden = sharded_->enter_block(unit, i % blocks_per_unit_ == 0 || i == begin, hidden);
    if (ckpt && taps) {
      // The tapped tensors are outputs of the checkpointed segment: recomputed in backward
      // like the block output, differentiable through the same recomputation.
      auto fn = [blk, grid = cond.grid, sp = cond.sp](const std::vector<torch::Tensor>& in) {
        BlockTaps tap;
        auto h = blk->forward_tensors(in[0], in[1], in[2], in[3], in[4], &tap, grid, sp);
        return std::vector<torch::Tensor>{h, tap.attn_out, tap.ffn_out};
      };
      auto outs = ops::checkpoint_multi(fn, {hidden, cond.time_mod, cond.context, cond.rope_cos, cond.rope_sin},
                                        blk->parameters());
      hidden = outs[0];
      taps->push_back(BlockTaps{outs[1], outs[2]});
    } else if (ckpt) {
      // The SP group is captured: the recomputation in backward exchanges like the forward.
      auto fn = [blk, grid = cond.grid, sp = cond.sp](const std::vector<torch::Tensor>& in) {
        return blk->forward_tensors(in[0], in[1], in[2], in[3], in[4], nullptr, grid, sp);
      };
      hidden = ops::checkpoint(fn, {hidden, cond.time_mod, cond.context, cond.rope_cos, cond.rope_sin},
                               blk->parameters());
    } else if (taps) {
      BlockTaps tap;
      hidden = blk->forward(hidden, cond, &tap);
      taps->push_back(std::move(tap));
    } else {
      hidden = blk->forward(hidden, cond, nullptr);
    }
    if (sharded_) hidden = sharded_->leave_block(unit, unit_last, hidden);
  }
  return hidden;
}

std::vector<dist::ShardUnitSpec> WanModel::shard_units(int64_t blocks_per_unit) {
  VQAD_CHECK(blocks_per_unit >= 1, "Wan model: blocks per sharding unit must be >= 1, found ", blocks_per_unit);
  const int64_t n_units = (num_blocks() + blocks_per_unit - 1) / blocks_per_unit;
  std::vector<dist::ShardUnitSpec> units(static_cast<size_t>(1 + n_units));
  units[0].name = "root";
  for (int64_t u = 0; u < n_units; ++u) {
    const int64_t b = u * blocks_per_unit, e = std::min(num_blocks(), b + blocks_per_unit);
    units[u + 1].name = "blocks." + std::to_string(b) + (e - b > 1 ? "-" + std::to_string(e - 1) : "");
  }
  // Under BF16 compute the linear layers and the patch embedding read their weights and
  // biases only as bf16(w) (cast_like, and the NVFP4 linears quantize bf16(w) and take their
  // straight-through backward in the gradient's BF16); norms, the modulation tables and
  // everything run in fp32 read the fp32 values.
  std::set<std::string> bf16_read;
  if (options_.compute_dtype == torch::kBFloat16) {
    for (const auto& [name, lin] : named_linears())
      for (const auto& p : lin->named_parameters(false)) bf16_read.insert(name + "." + p.key());
    for (const auto& p : patch_embedding->named_parameters(false)) bf16_read.insert("patch_embedding." + p.key());
  }
  for (const auto& item : named_parameters(true)) {
    const std::string& k = item.key();
    size_t unit = 0;
    if (k.rfind("blocks.", 0) == 0) unit = 1 + std::stoll(k.substr(7)) / blocks_per_unit;
    units.at(unit).params.push_back({k, item.value(), bf16_read.count(k) > 0});
  }
  return units;
}

void WanModel::set_sharding(dist::FullyShardedModel* sharded, int64_t blocks_per_unit) {
  VQAD_CHECK(blocks_per_unit >= 1, "Wan model: blocks per sharding unit must be >= 1, found ", blocks_per_unit);
  VQAD_CHECK(!sharded || sharded->num_units() == static_cast<size_t>(1 + (num_blocks() + blocks_per_unit - 1) /
                                                                          blocks_per_unit),
             "Wan model: the sharding has ", sharded ? sharded->num_units() : 0, " units, this model needs 1 + ",
             (num_blocks() + blocks_per_unit - 1) / blocks_per_unit);
  sharded_ = sharded;
  blocks_per_unit_ = blocks_per_unit;
}

torch::Tensor WanModel::head(const torch::Tensor& hidden, const WanConditioning& cond) {
  if (sharded_) sharded_->gather(0);
  auto mod = (scale_shift_table.to(torch::kFloat32) + cond.temb.to(torch::kFloat32).unsqueeze(1))
                 .chunk(2, 1);
  const auto &shift = mod[0], &scale = mod[1];
  auto y = ops::modulated_layer_norm(hidden, scale, shift, config_.eps);
  y = proj_out->forward(y);
  // SP: every rank gets the whole output (the loss is computed alike on every SP rank).
  if (cond.sp) y = dist::gather_sequence(y, *cond.sp, "proj_out");
  return unpatchify(y, cond.grid, config_.patch_size, config_.out_channels);
}

torch::Tensor WanModel::forward(const torch::Tensor& x, const torch::Tensor& timestep,
                                const torch::Tensor& text, std::vector<BlockTaps>* taps) {
  auto e = embed(x, timestep, text);
  if (dist::ProcessGroup* sp = dist::sequence_parallel_group()) {
    // Ulysses SP: the sequence is split at the patch embedding; every rank keeps the RoPE
    // rows of its positions (RoPE is per token, so applying it to the slice before the
    // exchange is the same arithmetic as after it), and head() gathers the output.
    const int64_t S = e.hidden.size(1), P = sp->size();
    VQAD_CHECK(S % P == 0, "Wan forward under sequence parallelism: the latent grid ", e.cond.grid[0], "x",
               e.cond.grid[1], "x", e.cond.grid[2], " gives ", S,
               " tokens, which training.distributed.sp_size = ", P,
               " does not divide (choose an sp_size that divides the token count, or sp_size 1)");
    VQAD_CHECK(!taps, "Wan forward: block taps are not available under sequence parallelism (the taps would hold "
                      "one rank's slice of the sequence)");
    const int64_t n = S / P, off = sp->rank() * n;
    e.hidden = dist::shard_sequence(e.hidden, *sp, "patch embedding");
    e.cond.rope_cos = e.cond.rope_cos.narrow(0, off, n).contiguous();
    e.cond.rope_sin = e.cond.rope_sin.narrow(0, off, n).contiguous();
    e.cond.sp = sp;
  }
  auto h = forward_blocks(0, num_blocks(), e.hidden, e.cond, taps);
  return head(h, e.cond);
}

std::vector<std::pair<std::string, Linear*>> WanModel::named_linears() {
  std::vector<std::pair<std::string, Linear*>> out;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    if (auto* lin = dynamic_cast<Linear*>(item.value().get())) out.emplace_back(item.key(), lin);
  }
  return out;
}

void WanModel::attach_linear_quant(const std::string& name, std::shared_ptr<ops::LinearQuant> quant) {
  for (auto& [n, lin] : named_linears()) {
    if (n == name) {
      lin->attach_quant(std::move(quant));
      return;
    }
  }
  fail("Wan model: no linear named '", name,
       "' (names look like blocks.0.attn1.to_q, blocks.0.ffn.net.0.proj, proj_out)");
}

}  // namespace vqad::model
