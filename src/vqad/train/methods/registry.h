// The method registry: method name -> what the trainer, the metadata writer and the
// validation callback need from a method, so none of them branches on the method.
//
// A method declares
//   - its roles: trainable / frozen from its shape in config/targets.h (method_roles);
//     every trainable role is checkpointed;
//   - its optimizer specs: one AdamW per trainable role with the parameter group it
//     updates, its hyper-parameters and LR schedule (dmd2's critic takes the method's
//     fake_score_* values here);
//   - its supervision / distillation metadata (training_contract.supervision);
//   - its validation sampler;
//   - whether MFU is defined for its step (one student forward + backward per sample);
//   - a factory for the TrainingMethod that runs its micro-steps.
// Adding a method: write it against methods/method.h and add one line to the table in
// registry.cpp.
#pragma once
#include <torch/torch.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "vqad/train/config.h"
#include "vqad/train/methods/method.h"
#include "vqad/train/roles.h"

namespace vqad::train {

using RoleMap = std::map<std::string, std::shared_ptr<Role>>;

struct RoleSpec {
  std::string name;
  bool trainable = false;
  bool checkpointed = false;  // weights + optimizer state in every trainer checkpoint
};

// Which parameters of a role one optimizer updates.
struct ParamGroupSpec {
  std::string name = "all_trainable";
  // Default (empty): every parameter of the role that requires grad.
  std::function<std::vector<torch::Tensor>(const Role&)> select;
  std::vector<torch::Tensor> parameters(const Role& role) const;
};

struct OptimizerSpec {
  std::string role;
  ParamGroupSpec params;
  double learning_rate = 0.0;
  std::array<double, 2> betas{0.9, 0.999};
  double weight_decay = 0.0;
  double eps = 1e-8;
  LrSchedule schedule = LrSchedule::kConstant;
};

// training.optimizer applied to `role` (the spec of a method's student).
OptimizerSpec default_optimizer_spec(const RunConfig& run, const std::string& role);

// What the validation callback samples with.
struct ValidationSampler {
  std::string name;  // for the log line, e.g. "Euler sampler"
  // Latents [N, C, T, H, W] fp32 from `noise` and `text` with the student; `description`
  // receives a one-line account of the sampler (steps, shift, guidance) for the files.
  std::function<torch::Tensor(Role& student, const torch::Tensor& noise, const torch::Tensor& text,
                              torch::Generator& gen, std::string* description)>
      sample;
};

struct MethodRegistration {
  std::string name;  // method_name(kind)
  std::function<std::vector<OptimizerSpec>(const RunConfig&)> optimizers;
  std::function<std::unique_ptr<TrainingMethod>(const RunConfig&, const RoleMap&)> create;
  std::function<nlohmann::json(const RunConfig&, const Role& student)> supervision;
  std::function<ValidationSampler(const RunConfig&)> validation_sampler;
  bool mfu_is_student_forward_backward = false;
  // Optional hooks (unset: nothing to do).
  // Load-time checks that need more than the config (e.g. the student's architecture read
  // from init_from, the ODE cache's schedule); run before any weights load.
  std::function<void(const RunConfig&)> validate;
  // After the roles are built and before the optimizers: e.g. the trainable scope
  // (requires_grad on the parameters the method trains; the optimizers take those).
  std::function<void(const RunConfig&, RoleMap&)> prepare_roles;
  // The ODE-cache anchors (teacher step indices) the method trains on; they reach the
  // dataset as training.data.ode_anchor_indices does (an anchor the cache lacks fails
  // there, naming that key).
  std::function<std::vector<int64_t>(const RunConfig&)> ode_anchor_indices;
  // The method is a distillation: its supervision() goes into
  // training_contract.distillation (with the roles) instead of training_contract.supervision.
  bool records_distillation = false;
  // The method reaches its models through whole-model forwards only (WanModel::forward), so
  // training.distributed.sp_size > 1 splits their sequences (Ulysses) and hsdp_shard_dim > 1
  // shards their parameters. Methods that run block ranges or taps (the reconstructions)
  // leave it false and refuse both.
  bool whole_model_forwards = false;
};

// nullptr when `name` has no implementation in this build.
const MethodRegistration* find_method(const std::string& name);
// The run's method; an error naming method._target_ and the available methods otherwise.
const MethodRegistration& method_registration(const RunConfig& run);
std::vector<std::string> registered_method_names();
std::vector<RoleSpec> method_role_specs(const RunConfig& run);

// Registrations, one per method file (listed in registry.cpp).
MethodRegistration sft_registration();
MethodRegistration dmd2_registration();
MethodRegistration layer_recon_registration();
MethodRegistration recon_ode_registration();

}  // namespace vqad::train
