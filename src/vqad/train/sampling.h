// Samplers of a trained Wan model (latent space, no VAE): the multi-step Euler ODE
// solver of flow matching with classifier-free guidance (the teacher's sampler), and the
// few-step DMD sampler of a distilled student (predict x0, re-noise to the next step).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "vqad/model/wan/model.h"
#include "vqad/train/flow_matching.h"

namespace vqad::train {

// Euler on sample::shifted_schedule(shift, steps) (fp32 sigmas and timesteps):
// x <- x + fp32(sigma_{i+1} - sigma_i) v, v = v_u + guidance (v_c - v_u) at t = timesteps[i]
// (v_c alone when guidance == 1 or `uncond` is undefined), fp32 state. Returns the final
// x (sigma 0) in fp32.
torch::Tensor euler_sample(model::WanModel& m, const torch::Tensor& noise, const torch::Tensor& text,
                           const torch::Tensor& uncond, double guidance, int steps, double shift);

// DMD sampler: x = noise; for each timestep t_i: x0 = predict_x0(x, v(x, t_i)) on `grid`;
// x = add_noise(x0, fresh noise from `gen`, t_{i+1}) until the last step. Returns the
// last x0 in fp32.
torch::Tensor dmd_sample(model::WanModel& m, const FlowMatchGrid& grid, const torch::Tensor& noise,
                         const torch::Tensor& text, const std::vector<double>& timesteps, torch::Generator& gen);

}  // namespace vqad::train
