// Wan2.1 T2V DiT (Diffusers WanTransformer3DModel) as a LibTorch module.
//
// The forward is split embed -> blocks -> head so that methods can run a range of blocks
// (layer reconstruction) with the conditioning computed once. named_parameters() gives the
// Diffusers keys (825 for 1.3B). The self-attention backend of every block is the one of
// the AttentionBackendScope active when the model is constructed.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vqad/dist/fully_sharded.h"
#include "vqad/model/wan/config.h"
#include "vqad/model/wan/modules.h"

namespace vqad::model {

struct WanModelOptions {
  torch::Device device = torch::kCPU;         // where the fp32 master parameters live (kMeta: no storage)
  torch::ScalarType compute_dtype = torch::kBFloat16;  // kBFloat16 or kFloat32
  bool gradient_checkpointing = false;        // per block, recompute in backward
};

class WanModel : public torch::nn::Module {
 public:
  // The config's gate_compress is forced on when the scope's backend is a VSA backend.
  explicit WanModel(const WanConfig& config, const WanModelOptions& options = {});

  struct Embedded {
    torch::Tensor hidden;  // [B, L, dim], compute dtype
    WanConditioning cond;
  };
  // x [B, in_channels, T, H, W], timestep [B] (0..1000 scale), text [B, Lt, text_dim].
  Embedded embed(const torch::Tensor& x, const torch::Tensor& timestep, const torch::Tensor& text);
  // Blocks [begin, end). With `taps`, one entry per block run is appended. Checkpointing
  // applies when enabled, grad mode is on and no taps are requested (taps must stay
  // differentiable, so tapped blocks keep their activations).
  torch::Tensor forward_blocks(int64_t begin, int64_t end, torch::Tensor hidden,
                               const WanConditioning& cond, std::vector<BlockTaps>* taps = nullptr);
  // Final modulation, proj_out and unpatchify -> [B, out_channels, T, H, W] in the compute dtype.
  torch::Tensor head(const torch::Tensor& hidden, const WanConditioning& cond);
  // The whole model: the velocity prediction (noise - x0). Under a dist::SequenceParallelScope
  // (Ulysses SP) the sequence is split over the scope's group after the patch embedding and
  // gathered after proj_out, so every rank returns the whole prediction; embed /
  // forward_blocks / head called directly never split.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& timestep, const torch::Tensor& text,
                        std::vector<BlockTaps>* taps = nullptr);

  // Every model::Linear with its Diffusers module name (e.g. "blocks.3.attn1.to_q").
  std::vector<std::pair<std::string, Linear*>> named_linears();
  // Attach (or with nullptr detach) a quant to the named linear; unknown names are an error.
  void attach_linear_quant(const std::string& name, std::shared_ptr<ops::LinearQuant> quant);

  const WanConfig& config() const { return config_; }
  const WanModelOptions& options() const { return options_; }
  const ops::AttentionSpec& attention_spec() const { return spec_; }
  void set_gradient_checkpointing(bool on) { options_.gradient_checkpointing = on; }
  // VSA backends: the sparsity every block uses from the next forward on (the trainer
  // sets it each step from training.vsa); vqad::Error outside [0, 1).
  void set_vsa_sparsity(double sparsity);
  void set_compute_dtype(torch::ScalarType dtype);
  int64_t num_blocks() const { return static_cast<int64_t>(block_list_.size()); }
  WanBlock& block(int64_t i);

  // Sharded data parallelism (dist/fully_sharded.h). The units: "root" (everything outside
  // the blocks: embeddings, proj_out, scale_shift_table), then the blocks, `blocks_per_unit`
  // to a unit (training.distributed.fsdp_modules_per_group). Under BF16 compute the weights
  // and biases of the linear layers and the patch embedding are marked read_as_bf16.
  std::vector<dist::ShardUnitSpec> shard_units(int64_t blocks_per_unit);
  // From now on embed / forward_blocks / head gather and release through `sharded` (built
  // from shard_units(blocks_per_unit)); nullptr: the parameters are whole again (the caller
  // gathered them).
  void set_sharding(dist::FullyShardedModel* sharded, int64_t blocks_per_unit);

  std::shared_ptr<PatchEmbedding> patch_embedding;
  std::shared_ptr<ConditionEmbedder> condition_embedder;
  torch::nn::ModuleList blocks;
  std::shared_ptr<Linear> proj_out;
  torch::Tensor scale_shift_table;  // [1, 2, dim]

 private:
  WanConfig config_;
  WanModelOptions options_;
  ops::AttentionSpec spec_;
  std::vector<std::shared_ptr<WanBlock>> block_list_;
  dist::FullyShardedModel* sharded_ = nullptr;
  int64_t blocks_per_unit_ = 1;
};

bool is_vsa_backend(AttentionBackend b);

}  // namespace vqad::model
