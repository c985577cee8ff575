// Flow matching as the Wan recipes use it (spec/training.md "Flow matching").
//
// Training grid: 1000 points, s_i = (1000 - i)/1000, sigma_i = S s_i / (1 + (S-1) s_i),
// t_i = 1000 sigma_i (descending, no terminal 0). Noise and x0 conversions pick the
// nearest grid sigma for a timestep, so any float t works.
#pragma once
#include <torch/torch.h>

#include <vector>

namespace vqad::train {

class FlowMatchGrid {
 public:
  explicit FlowMatchGrid(double shift = 3.0, int num_train_timesteps = 1000);
  double shift() const { return shift_; }
  int size() const { return static_cast<int>(sigmas_.size()); }
  double sigma(int i) const { return sigmas_.at(i); }
  double timestep(int i) const { return timesteps_.at(i); }
  // argmin_i |t_i - t| (first index on ties).
  int nearest_index(double t) const;
  // sigma of the nearest grid point for each t in `t` ([B], any float dtype) -> [B] fp64.
  torch::Tensor sigmas_for(const torch::Tensor& t) const;
  // x_t = (1 - sigma) x0 + sigma n, computed in fp32, returned in n's dtype.
  torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& t) const;
  // x0 = x_t - sigma v in fp64, returned in v's dtype.
  torch::Tensor predict_x0(const torch::Tensor& x_t, const torch::Tensor& v, const torch::Tensor& t) const;
  // Index from a uniform u in [0,1): floor(u * 1000), clamped to the grid.
  int index_from_uniform(double u) const;

 private:
  double shift_;
  std::vector<double> sigmas_, timesteps_;
};

// Sampling schedules (the Euler solver, the DMD sampler's shifted_ode_schedule, the ODE
// cache) are not computed here: they come from sample::shifted_schedule (fp32, bit-exact
// with seeds/004). This file holds only the training grid and the timestep warp below,
// which share one fp64 formula, shifted_sigma().

// sigma = S s / (1 + (S-1) s) in fp64: the training grid's points and the timestep warp.
double shifted_sigma(double s, double shift);
// shift_timestep(t, S) = 1000 shifted_sigma(t/1000, S) (up to fp64 rounding order); identity for S == 1.
double shift_timestep(double t, double shift);

}  // namespace vqad::train
