// Trainer checkpoints: checkpoint-<step>/ holds, per checkpointed role, its weights
// (Diffusers layout) and optimizer state (<role>/optimizer.pt), plus trainer_state.json
// (step, data position, generator state, per-role optimizer update counts),
// resolved.yaml and metadata.json; written atomically (checkpoint_dir.h).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "vqad/data/loader.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/optimizer.h"

namespace vqad::train {

// Writes checkpoint-<step> under output_dir, applies checkpoints_total_limit; returns its path.
std::string save_trainer_checkpoint(const RunConfig& run, const RoleMap& roles, const std::string& output_dir,
                                    long step, const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                                    torch::Generator& gen, const std::string& started_at,
                                    const nlohmann::json& mesh = nlohmann::json{{"world_size", 1}});

// Restores the checkpointed roles' weights and optimizers, the data position, the
// generator and the update counts; returns the checkpoint's step.
long load_trainer_checkpoint(const CheckpointEntry& checkpoint, const RunConfig& run, RoleMap& roles,
                             RoleOptimizers& optimizers, data::PrefetchLoader& loader, torch::Generator& gen);

// Generator state <-> hex text (trainer_state.json).
std::string hex_encode(const torch::Tensor& bytes);
torch::Tensor hex_decode(const std::string& s, const std::string& where);

}  // namespace vqad::train
