#include "vqad/train/flow_matching.h"

#include <cmath>

#include "vqad/core/error.h"

namespace vqad::train {

FlowMatchGrid::FlowMatchGrid(double shift, int n) : shift_(shift) {
  VQAD_CHECK(shift > 0, "flow_shift must be > 0, found ", shift);
  VQAD_CHECK(n > 0, "num_train_timesteps must be > 0, found ", n);
  sigmas_.resize(n);
  timesteps_.resize(n);
  for (int i = 0; i < n; ++i) {
    const double sigma = shifted_sigma(static_cast<double>(n - i) / n, shift);
    sigmas_[i] = sigma;
    timesteps_[i] = 1000.0 * sigma;
  }
}

int FlowMatchGrid::nearest_index(double t) const {
  // timesteps_ is strictly decreasing: binary search, then compare neighbours.
  int lo = 0, hi = size() - 1;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (timesteps_[mid] >= t) lo = mid; else hi = mid;
  }
  return std::fabs(timesteps_[lo] - t) <= std::fabs(timesteps_[hi] - t) ? lo : hi;
}

int FlowMatchGrid::index_from_uniform(double u) const {
  int i = static_cast<int>(std::floor(u * size()));
  return std::min(std::max(i, 0), size() - 1);
}

torch::Tensor FlowMatchGrid::sigmas_for(const torch::Tensor& t) const {
  auto tc = t.detach().to(torch::kCPU, torch::kFloat64).contiguous().reshape({-1});
  auto out = torch::empty_like(tc);
  const double* tp = tc.data_ptr<double>();
  double* op = out.data_ptr<double>();
  for (int64_t i = 0; i < tc.numel(); ++i) op[i] = sigmas_[nearest_index(tp[i])];
  return out;
}

static torch::Tensor broadcast_sigma(const torch::Tensor& sigma, const torch::Tensor& like,
                                     torch::ScalarType dtype) {
  std::vector<int64_t> shape(like.dim(), 1);
  VQAD_CHECK(like.dim() >= 1 && (sigma.numel() == like.size(0) || sigma.numel() == 1),
             "flow matching: timestep count ", sigma.numel(), " does not match batch ",
             like.dim() ? like.size(0) : 0);
  shape[0] = sigma.numel();
  return sigma.to(like.device(), dtype).reshape(shape);
}

torch::Tensor FlowMatchGrid::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                       const torch::Tensor& t) const {
  auto s = broadcast_sigma(sigmas_for(t), x0, torch::kFloat32);
  auto xt = (1.0 - s) * x0.to(torch::kFloat32) + s * noise.to(torch::kFloat32);
  return xt.to(noise.scalar_type());
}

torch::Tensor FlowMatchGrid::predict_x0(const torch::Tensor& x_t, const torch::Tensor& v,
                                        const torch::Tensor& t) const {
  auto s = broadcast_sigma(sigmas_for(t), x_t, torch::kFloat64);
  return (x_t.to(torch::kFloat64) - s * v.to(torch::kFloat64)).to(v.scalar_type());
}

double shifted_sigma(double s, double shift) { return shift * s / (1.0 + (shift - 1.0) * s); }

double shift_timestep(double t, double shift) {
  if (shift == 1.0) return t;
  // shifted_sigma's formula with the factor 1000 applied first (kept in this order so
  // that DMD2's sampled timesteps keep their fp64 bits).
  const double x = t / 1000.0;
  return 1000.0 * shift * x / (1.0 + (shift - 1.0) * x);
}

}  // namespace vqad::train
