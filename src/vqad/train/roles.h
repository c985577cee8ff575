// Roles: the models a method trains or consults (student, teacher, critic), each
// built from models.<role> inside its own attention-backend scope and quant plan.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/train/config.h"
#include "vqad/train/flow_matching.h"

namespace vqad::train {

struct Role {
  std::string name;
  RoleConfig config;
  std::shared_ptr<model::WanModel> model;
  FlowMatchGrid grid;
  model::QuantConfig quant_config;
  model::QuantPlan plan;  // empty for dense roles
  std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> quants;
  std::string init_kind;            // "random" | "diffusers" | "vqad_export"
  // VSA compression gates (to_gate_compress): "" when the model has none, "zero" when they
  // start at zero (random init, or a checkpoint without them), "checkpoint" when loaded.
  std::string compression_gate_initialization;
  nlohmann::json parent_metadata;   // metadata.json of a vqad export init_from (else null)
  // Trainable scope (train/param_groups.h) when the method restricts it: the listed
  // module names and the resolved trainable parameter names. Empty: every parameter of a
  // trainable role trains.
  std::vector<std::string> trainable_modules, trainable_names;

  std::vector<torch::Tensor> trainable_parameters() const;
};

struct RoleBuildOptions {
  torch::Device device = torch::kCPU;
  torch::ScalarType compute_dtype = torch::kBFloat16;
  uint64_t seed = 0;   // random init: torch::manual_seed(seed) right before construction
};

// init_from: a local Diffusers model directory (or its transformer/ directory), a vqad
// export, or "random:<preset>" (tiny, tiny-hd128, tiny-4head, 1.3B, 14B) for a freshly
// initialized model. Hub ids are not downloaded: a non-existent path is an error naming
// models.<role>.init_from.
std::shared_ptr<Role> build_role(const RunConfig& run, const std::string& role_name,
                                 const RoleBuildOptions& options);

// The self-attention spec a role's model is built with: its backend and, for the VSA
// backends, training.vsa (selection, top_p, the sparsity of step 1).
ops::AttentionSpec role_attention_spec(const RunConfig& run, const std::string& role_name);

// The VSA sparsity used at training step `step` (1-based, as in metrics.jsonl):
// training.vsa.sparsity when decay_rate is 0 (constant); otherwise the linear ramp
// min(sparsity, decay_rate * floor(step / decay_interval_steps)), which starts at 0 and
// reaches the target after ceil(sparsity / decay_rate) intervals.
double vsa_sparsity_at_step(const VsaConfig& vsa, long step);

// Builds the quant plan of `config` for the model's linears and attaches it.
std::pair<model::QuantPlan, std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>>
attach_quant_plan(model::WanModel& model, const model::QuantConfig& config);

// The architecture a role will have, read without loading weights (the preset of
// random:<preset>, else the transformer config.json of init_from). Errors name
// models.<role>.init_from.
model::WanConfig role_architecture(const RunConfig& run, const std::string& role_name);

}  // namespace vqad::train
