// `dmd2`: distribution-matching distillation (FastVideo's DMD2Method, spec/training.md).
//
// Roles: student (trainable, few-step generator), teacher (frozen, the "real score"),
// critic (trainable, the "fake score"), each with its own attention backend, quant plan
// and flow-matching grid (models.<role>.flow_shift).
//
// Iteration k (1-based optimizer step):
//   upd = k % generator_update_interval == 0
//   if upd:  x0_g = rollout(grad)                     student's few-step prediction
//            L_gen = dmd_loss(x0_g); backward -> student
//   no grad: x0_c = rollout()                         an independent student sample
//   t_f = score_timestep(); n_f ~ N(0, I); x_f = add_noise(x0_c, n_f, t_f)
//   L_fake = mean((critic(x_f, t_f) - (n_f - x0_c))^2) in fp32; backward -> critic
// The critic's optimizer steps every iteration, the student's only when upd.
//
// dmd_loss(x0):  t = score_timestep(); n ~ N(0, I); x_t = add_noise(x0, n, t)
//   f = critic_x0(x_t, t, cond)
//   r = teacher_x0(x_t, t, uncond) + g (teacher_x0(x_t, t, cond) - teacher_x0(x_t, t, uncond))
//   grad = nan_to_num((f - r) / mean|x0 - r|)         (fp32)
//   L_gen = 0.5 mean((x0 - sg(x0 - grad))^2)   =>   dL_gen/dx0 = grad / numel(x0)
// score_timestep(): randint(0, 1000) -> shift_timestep(pipeline.flow_shift) -> clamp to
//   [0, 1000] and [int(min_ratio 1000), int(max_ratio 1000)].
//
// Rollouts (steps = dmd_denoising_steps, raw timesteps, floats allowed):
//   data_latent: j = randint(len); n ~ N(0, I); x_t = add_noise(x0_data, n, steps[j]);
//                x0_g = student_x0(x_t, steps[j])
//   simulate:    j = randint(len); x = n ~ N(0, I); the len-1 no-grad steps
//                x0 = student_x0(x, steps[i]); x = add_noise(x0, randn, steps[i+1]) always run;
//                x0_g = student_x0(j == 0 ? n : x after step j-1, steps[j]) (grad if asked)
// With warp_denoising_step each step s is replaced by the student grid's timestep at
// index 1000 - s (0 past the end), FastVideo's warp.
//
// Random draws, all from the trainer's generator, in this order per micro-batch:
//   [upd] rollout (randint over len, randn x shape, [simulate: randn per no-grad step]),
//         dmd (randint(1000), randn);
//   critic rollout (same draws as a rollout), critic (randint(1000), randn).
// Noise is drawn in fp32 on the CPU and cast to the compute dtype on the device.
//
// With method.shifted_ode_schedule (seeds/004 S2) the denoising steps are the shifted
// schedule's timesteps at `indices` (sample::shifted_schedule(flow_shift, teacher_steps),
// fp32), and the rollout's x0 = x - sigma v and re-noising x' = (1 - sigma') x0 + sigma' n
// use that schedule's fp32 sigmas exactly (not the nearest point of the 1000-point
// training grid), in fp32. The recorded sigmas / timesteps and dmd_denoising_steps must
// equal the computed ones (an error names the key otherwise).
//
// Differences from FastVideo, on purpose: the DMD gradient and both losses are computed
// in fp32 (FastVideo computes the critic loss in bf16); the SFT noise that FastVideo's
// batch preparation draws and throws away is not drawn.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vqad/train/config.h"
#include "vqad/train/methods/method.h"
#include "vqad/train/roles.h"

namespace vqad::train {

struct DmdLossParts {
  torch::Tensor loss;        // scalar fp32, differentiable w.r.t. x0
  torch::Tensor grad;        // fp32, shape of x0: (critic_x0 - teacher_cfg_x0) / normalizer
  torch::Tensor critic_x0;   // compute dtype
  torch::Tensor teacher_x0;  // CFG-combined, fp32
  double timestep = 0;       // the score timestep used
  double normalizer = 0;     // mean|x0 - teacher_cfg_x0|
};

class Dmd2Method : public TrainingMethod {
 public:
  // `negative_text`: [1, text_len, text_dim] unconditional text for the teacher (any
  // device/dtype); resolved from the config by load_negative_text when empty.
  Dmd2Method(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher,
             std::shared_ptr<Role> critic, torch::Tensor negative_text = {});

  std::vector<std::string> roles_to_update(long step) const override;
  MethodStepResult micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device, long step,
                              double scale) override;

  bool updates_student(long step) const { return step % cfg_.generator_update_interval == 0; }
  // The denoising steps after the optional warp.
  const std::vector<double>& denoising_steps() const { return steps_; }
  // The exact fp32 sigmas of the denoising steps (shifted_ode_schedule), else empty.
  const std::vector<float>& exact_sigmas() const { return sigmas_; }
  double score_timestep(torch::Generator& gen) const;
  // The student's few-step prediction of x0 for the batch (grad on the last student call
  // only when `grad`); `x0_data` is the batch's latents (data_latent) or undefined.
  torch::Tensor rollout(const torch::Tensor& x0_data, const std::vector<int64_t>& shape, const torch::Tensor& text,
                        torch::Generator& gen, bool grad);
  DmdLossParts dmd_loss(const torch::Tensor& x0, const torch::Tensor& text, torch::Generator& gen);
  // x0 prediction of a role at one timestep (t broadcast over the batch).
  static torch::Tensor predict_x0(Role& role, const torch::Tensor& x_t, double t, const torch::Tensor& text);
  // The same at an exact sigma: x0 = x_t - sigma v in fp32, returned in v's dtype.
  static torch::Tensor predict_x0_sigma(Role& role, const torch::Tensor& x_t, double t, float sigma,
                                        const torch::Tensor& text);
  // The unconditional text the teacher sees for a batch of `b`.
  torch::Tensor uncond_text(const torch::Tensor& text) const;
  // Latent shape [B, 16, T, H, W] of a batch (from its latents, else from training.data).
  std::vector<int64_t> latent_shape(const data::Batch& batch) const;

  // Test hook: called with the student's graded x0 and the DMD parts before backward.
  std::function<void(torch::Tensor& x0_g, const DmdLossParts&)> probe;

 private:
  Dmd2Config cfg_;
  DataConfig data_;  // latent geometry of text_only batches
  std::shared_ptr<Role> student_, teacher_, critic_;
  std::vector<double> steps_;
  std::vector<float> sigmas_;  // exact sigmas of steps_ (shifted_ode_schedule), else empty
  double timestep_shift_ = 1.0;
  // Student x0 at denoising step i, and re-noising of x0 to step i (exact sigmas when set).
  torch::Tensor student_x0(const torch::Tensor& x, size_t i, const torch::Tensor& text);
  torch::Tensor noise_to_step(const torch::Tensor& x0, const torch::Tensor& noise, size_t i) const;
  std::string uncond_mode_;     // negative_prompt | zero | keep
  torch::Tensor negative_text_; // [1, L, D] fp32 (negative_prompt mode)
};

// Reads the negative prompt's text embedding named by method.negative_prompt_embedding
// (safetensors with one [L, D] / [1, L, D] tensor, or a parquet dataset's first row),
// zero-padded or cropped to text_len -> [1, text_len, text_dim] fp32.
torch::Tensor load_negative_text(const std::string& path, int64_t text_len, int64_t text_dim);

// The few-step DMD sampler on exact fp32 sigmas: x = noise; for each step i:
// x0 = x - sigmas[i] v(x, timesteps[i]) (fp32); x = (1 - sigmas[i+1]) x0 + sigmas[i+1] n
// with fresh n from `gen` until the last step. Returns the last x0 in fp32. Used by the
// validation of dmd2 with shifted_ode_schedule and of recon_ode.
torch::Tensor shifted_dmd_sample(model::WanModel& m, const torch::Tensor& noise, const torch::Tensor& text,
                                 const std::vector<float>& timesteps, const std::vector<float>& sigmas,
                                 torch::Generator& gen);

}  // namespace vqad::train
