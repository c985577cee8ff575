// Per-GPU memory estimate of a training mesh (printed by `vqad train --dry-run`).
//
// Components, per GPU:
//  - states: a trainable role holds FP32 master weights, FP32 gradients and two FP32 AdamW
//    moments (16 bytes per parameter), a frozen role its FP32 weights (4 bytes); both are
//    divided by hsdp_shard_dim (per-block sharding shards every role's blocks; a frozen role
//    only with shard_frozen_roles);
//  - gathered buffers (shard > 1, dist/fully_sharded.h), for the largest role: the FP32
//    parameters of the root unit (kept from embedding to head) and of two units of
//    blocks_per_unit blocks (the one computing and the prefetched next one), one unit's full
//    FP32 gradients and the reduce-scatter buffer of the same size; without reshard_after_forward every block's FP32 parameters stay
//    gathered from forward to backward; with unreduced accumulation, every trainable role's
//    full FP32 gradients (held across the micro-steps);
//  - activations of the trainable roles: with per-block activation checkpointing, the FP32
//    input of every block plus the working set of one block's recompute and backward; without
//    it, that working set for every block. The working set is modelled as
//    tokens x (14 dim + 2 ffn_dim) BF16 values (q, k, v, attention out, the norms and
//    modulations, the FFN hidden twice), tokens = batch x sequence / sp_size. Attention
//    itself is flash-style (no L x L matrix).
// Allocator fragmentation, CUDA context (~0.5-1 GB) and the text encoder are not included.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vqad/model/wan/config.h"

namespace vqad::dist {

struct RoleFootprint {
  std::string name;
  model::WanConfig model;
  bool trainable = false;
};

struct MemoryMesh {
  int64_t replicate = 1, shard = 1, sp = 1;
  int64_t batch = 1;             // per-rank batch
  int64_t tokens_per_sample = 0; // full sequence (before SP)
  bool activation_checkpointing = false;
  int64_t blocks_per_unit = 1;        // training.distributed.fsdp_modules_per_group
  bool reshard_after_forward = true;  // training.distributed.reshard_after_forward
  bool shard_frozen = true;           // training.distributed.shard_frozen_roles
  // training.distributed.accumulate_unreduced_gradients with gradient accumulation: the full
  // fp32 gradients of a sharded trainable role stay on every rank across the micro-steps
  bool unreduced_accumulation = false;
};

struct MemoryEstimate {
  double states_gib = 0, gathered_gib = 0, activations_gib = 0;
  double total_gib() const { return states_gib + gathered_gib + activations_gib; }
  std::string text;  // one line per component and the total
};

// Parameters of a Wan model from its config (equals the built model's count).
int64_t wan_parameter_count(const model::WanConfig& c);
int64_t wan_block_parameter_count(const model::WanConfig& c);

MemoryEstimate estimate_memory(const std::vector<RoleFootprint>& roles, const MemoryMesh& mesh);

}  // namespace vqad::dist
