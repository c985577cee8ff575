#include "vqad/train/sampling.h"

#include "vqad/core/error.h"
#include "vqad/sample/schedule.h"

namespace vqad::train {

torch::Tensor euler_sample(model::WanModel& m, const torch::Tensor& noise, const torch::Tensor& text,
                           const torch::Tensor& uncond, double guidance, int steps, double shift) {
  torch::NoGradGuard ng;
  const auto dtype = m.options().compute_dtype;
  VQAD_CHECK(steps > 0, "sampling steps must be > 0, found ", steps);
  const auto sched = sample::shifted_schedule(static_cast<float>(shift), steps);
  const auto& sig = sched.sigmas;
  const int64_t B = noise.size(0);
  auto x = noise.to(torch::kFloat32);
  const bool cfg = uncond.defined() && guidance != 1.0;
  for (int i = 0; i < steps; ++i) {
    auto t = torch::full({B}, sched.timesteps[size_t(i)], torch::TensorOptions(noise.device()));
    auto xin = x.to(dtype);
    auto v = m.forward(xin, t, text).to(torch::kFloat32);
    if (cfg) {
      auto vu = m.forward(xin, t, uncond).to(torch::kFloat32);
      v = vu + guidance * (v - vu);
    }
    const float dsigma = sig[size_t(i) + 1] - sig[size_t(i)];
    x = x + dsigma * v;
  }
  return x;
}

torch::Tensor dmd_sample(model::WanModel& m, const FlowMatchGrid& grid, const torch::Tensor& noise,
                         const torch::Tensor& text, const std::vector<double>& timesteps, torch::Generator& gen) {
  VQAD_CHECK(!timesteps.empty(), "dmd sampler: no timesteps");
  torch::NoGradGuard ng;
  const auto dtype = m.options().compute_dtype;
  const int64_t B = noise.size(0);
  auto x = noise.to(dtype);
  torch::Tensor x0;
  for (size_t i = 0; i < timesteps.size(); ++i) {
    auto t = torch::full({B}, timesteps[i], torch::kFloat64);
    auto v = m.forward(x, t.to(noise.device(), torch::kFloat32), text);
    x0 = grid.predict_x0(x, v, t);
    if (i + 1 < timesteps.size()) {
      auto fresh = at::randn(noise.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(noise.device(), dtype);
      x = grid.add_noise(x0, fresh, torch::full({B}, timesteps[i + 1], torch::kFloat64));
    }
  }
  return x0.to(torch::kFloat32);
}

}  // namespace vqad::train
