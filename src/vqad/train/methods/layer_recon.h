// `layer_recon` (seeds/004 S0, `fixed_teacher_layer_reconstruction`; spec/sparse_qad.md).
//
// Roles: student (trainable, QAT attention + QAT linears, trainable scope
// method.trainable_modules) and teacher (frozen, dense). Data: ODE-cache pairs
// (batch.ode_start at batch.ode_timestep, no re-noising).
//
// Per micro-batch:
//   cond, h_0 = teacher.embed(x_start, t, text)     (no grad; shared by both models)
//   h_{k+G} = teacher.blocks[k, k+G)(h_k)            (no grad), k = 0, G, ..., N - G
//   s_g = student.blocks[gG, gG+G)(h_{gG})           (h_{gG} is a detached teacher state)
//   L_{g,b} = mean_{L,C}((s_g - h_{gG+G})^2) / max(mean_{L,C}((h_{gG+G} - h_{gG})^2), floor)
//   L = mean over b and g (fp32)
// Each group's loss is backpropagated on its own right after its forward (the groups share
// no parameters and no graph, so the gradient is that of L), which keeps one group's
// activations alive at a time; with method.checkpoint_blocks each block is recomputed in
// backward. The conditioning comes from the teacher, so the student's frozen embeddings
// must equal the teacher's (checked at construction). No random draws.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "vqad/train/config.h"
#include "vqad/train/methods/method.h"
#include "vqad/train/roles.h"

namespace vqad::train {

// The student must read the same frozen embeddings / conditioning as the teacher: every
// parameter outside the blocks (patch_embedding, condition_embedder) must be identical.
// Throws naming `method` and the first parameter that differs. Exception: when both roles
// are random:<preset> (benchmarks), the student takes the teacher's embeddings (logged).
void check_shared_embeddings(Role& student, const Role& teacher, const std::string& method);

// The student's tokens in a micro-batch (throughput).
int64_t latent_tokens(const model::WanModel& m, const torch::Tensor& latents);

// Checks that the batch carries ODE pairs and returns x_start in `dtype` on `device`.
torch::Tensor ode_start_of(const data::Batch& batch, torch::Device device, torch::ScalarType dtype,
                           const std::string& method);

// Load-time checks that need the student's architecture (read without weights):
// method.group_size must divide the number of blocks.
void validate_layer_recon_config(const RunConfig& run);

// trainable_scope quantized_path for a reconstruction method's student: requires_grad
// exactly on the parameters inside `modules` (train/param_groups.h), recorded in
// student.trainable_modules / trainable_names; errors name method.trainable_modules.
void apply_method_trainable_scope(Role& student, const std::vector<std::string>& modules);

class LayerReconMethod : public TrainingMethod {
 public:
  LayerReconMethod(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher);
  std::vector<std::string> roles_to_update(long) const override { return {"student"}; }
  MethodStepResult micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device, long step,
                              double scale) override;

  struct TeacherStates {
    model::WanConditioning cond;
    std::vector<torch::Tensor> boundaries;  // h_0, h_G, ..., h_N (num_groups + 1), detached
  };
  TeacherStates teacher_states(const data::Batch& batch, torch::Device device);
  // Per-sample normalised loss of group g: [B] fp32, differentiable w.r.t. the student.
  torch::Tensor group_loss(int64_t g, const TeacherStates& states);
  int64_t num_groups() const { return num_groups_; }
  int64_t group_size() const { return cfg_.group_size; }

 private:
  LayerReconConfig cfg_;
  std::shared_ptr<Role> student_, teacher_;
  int64_t num_groups_ = 0;
};

}  // namespace vqad::train
