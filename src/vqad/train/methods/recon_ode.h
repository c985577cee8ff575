// `recon_ode` (seeds/004 S1, `attention_mlp_reconstruction_and_ode_endpoint`;
// spec/sparse_qad.md "recon_ode").
//
// Roles: student (trainable, VSA-QAT attention + QAT linears, trainable scope
// method.trainable_modules) and teacher (frozen, dense). Data: ODE-cache pairs restricted
// to the training schedule's anchors (teacher steps k * teacher_steps / student_steps,
// seeds/004: {0, 16, 32} of 48).
//
// Per micro-batch (no random draws):
//   cond, h_0 = teacher.embed(x_start, t_start, text)            (no grad, shared)
//   teacher block l on h_l -> h_{l+1}, taps a_l (self-attention after to_out, before the
//     gated residual) and f_l (FFN output before the gated residual)   (no grad)
//   student block l on the detached h_l -> taps a'_l, f'_l   (teacher-driven, local)
//   L_attn = mean_l mean((a'_l - a_l)^2),  L_mlp = mean_l mean((f'_l - f_l)^2)   (fp32)
//   v = student(x_start, t_start, text)                    (a separate full forward)
//   L_ode = mean((x_start - sigma_start v - x_48)^2)       (fp32)
//   L = w_attn L_attn + w_mlp L_mlp + w_ode L_ode          (method.*_weight)
// Each block's local term is backpropagated right after the block (blocks share no graph
// in the local pass), then the ODE term; the sum of the gradients is that of L. With
// method.checkpoint_blocks the student's blocks are recomputed in backward, taps
// included (they are outputs of the checkpointed segment).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vqad/train/config.h"
#include "vqad/train/methods/method.h"
#include "vqad/train/roles.h"

namespace vqad::train {

// The few-step schedule a recon_ode student trains on (seeds/004
// supervision.training_schedule): anchors indices[k] = k * teacher_steps / student_steps
// of the teacher's shifted schedule, with that schedule's exact fp32 sigmas / timesteps.
struct FewStepSchedule {
  double flow_shift = 0;
  int64_t teacher_steps = 0, student_steps = 0, version = 1;
  std::vector<int64_t> indices;
  std::vector<float> sigmas, timesteps;
  nlohmann::json to_json() const;
};

// From the teacher schedule (shift, teacher_steps) and the anchors available in the
// cache: throws naming method.student_steps when student_steps does not divide
// teacher_steps or an anchor is not in `cache_anchors`.
FewStepSchedule few_step_schedule(double flow_shift, int64_t teacher_steps, int64_t student_steps,
                                  const std::vector<int64_t>& cache_anchors, const std::string& where);
// The same, reading the ODE cache named by training.data.data_path. When
// training.data.ode_anchor_indices is set it must list exactly the schedule's anchors
// (an error naming that key otherwise); the schedule's anchors are what the ODE dataset
// of a recon_ode run serves.
FewStepSchedule recon_ode_schedule(const RunConfig& run);

struct ReconOdeLosses {
  double attn = 0, mlp = 0, ode = 0, total = 0;
};

class ReconOdeMethod : public TrainingMethod {
 public:
  // `schedule`: the training schedule (else read from the ODE cache of the config).
  ReconOdeMethod(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher,
                 std::optional<FewStepSchedule> schedule = std::nullopt);
  std::vector<std::string> roles_to_update(long) const override { return {"student"}; }
  MethodStepResult micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device, long step,
                              double scale) override;

  struct TeacherPass {
    model::WanConditioning cond;
    std::vector<torch::Tensor> inputs;  // h_l, the input of block l (detached)
    std::vector<model::BlockTaps> taps; // a_l, f_l
  };
  TeacherPass teacher_pass(const data::Batch& batch, torch::Device device);
  // The student's taps of block l run on the teacher's h_l (differentiable).
  model::BlockTaps student_block_taps(int64_t l, const TeacherPass& teacher);
  // L_ode of the batch (scalar fp32, differentiable).
  torch::Tensor ode_loss(const data::Batch& batch, torch::Device device);
  // Runs the whole objective with backward (scaled by `scale`) and returns its parts.
  ReconOdeLosses forward_backward(const data::Batch& batch, torch::Device device, double scale);
  const FewStepSchedule& schedule() const { return schedule_; }

 private:
  void check_anchors(const data::Batch& batch) const;
  ReconOdeConfig cfg_;
  std::shared_ptr<Role> student_, teacher_;
  FewStepSchedule schedule_;
};

}  // namespace vqad::train
