// Trainer checkpoints: checkpoint-<step>/ holds, per checkpointed role, its weights
// (Diffusers layout) and AdamW state (<role>/optimizer.safetensors), plus
// trainer_state.json (step, data position, generator state, per-role optimizer update
// counts, mesh), resolved.yaml and signed metadata.json; snapshotted on the training
// thread and written (in the background by default) and published atomically by a
// CheckpointWriter (checkpoint_writer.h). Reading one verifies it first.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "vqad/data/loader.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/checkpoint_writer.h"
#include "vqad/train/optimizer.h"

namespace vqad::train {

// Hands checkpoint-<step> to `writer` (which writes it under its output directory and
// applies checkpoints_total_limit). Refuses non-finite weights / optimizer state. The
// metadata records the mesh, the determinism settings in effect and, for a resumed run,
// the lineage segments (`resumed_metadata`: metadata of the checkpoint resumed from, or
// null). Returns the seconds the caller was blocked. Only rank 0 of a multi-process run
// calls it (the state is replicated).
// Lets the writer allocate its host buffers for the run's checkpointed roles in the background.
void prepare_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles,
                                const RoleOptimizers& optimizers);
double save_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles, long step,
                               const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                               torch::Generator& gen, const std::string& started_at,
                               const nlohmann::json& mesh = nlohmann::json{{"world_size", 1}},
                               const nlohmann::json& resumed_metadata = nullptr);
// Sharded data parallelism: this rank's part of checkpoint-<step> (CheckpointWriter::save_sharded;
// every rank of the first shard group calls it, the writer's parts set; `optimizers` update
// the shards). The files are the same Diffusers layout, split by units, with index files.
void prepare_sharded_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run,
                                        const std::map<std::string, dist::FullyShardedModel*>& models,
                                        const RoleOptimizers& optimizers);
double save_sharded_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles,
                                       long step, const std::map<std::string, dist::FullyShardedModel*>& models,
                                       const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                                       torch::Generator& gen, const std::string& started_at,
                                       const nlohmann::json& mesh, const nlohmann::json& resumed_metadata);

// Verifies the checkpoint against its metadata, then restores the checkpointed roles'
// weights and optimizers, the data position, the generator and the update counts;
// returns the checkpoint's step. Every failure is one vqad::Error naming the file.
// `optimizer_state_on_host`: see load_checkpoint_state (sharded runs).
long load_trainer_checkpoint(const CheckpointEntry& checkpoint, const RunConfig& run, RoleMap& roles,
                             RoleOptimizers& optimizers, data::PrefetchLoader& loader, torch::Generator& gen,
                             bool optimizer_state_on_host = false);

// Generator state <-> hex text (trainer_state.json).
std::string hex_encode(const torch::Tensor& bytes);
torch::Tensor hex_decode(const std::string& s, const std::string& where);

}  // namespace vqad::train
