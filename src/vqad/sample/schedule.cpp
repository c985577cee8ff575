#include "vqad/sample/schedule.h"

#include <cmath>

#include "vqad/core/error.h"

namespace vqad::sample {

// volatile stores force each intermediate to a rounded fp32 value whatever the
// compiler's floating-point contraction settings (no fused multiply-add, no excess
// precision), so the order written in the header is the order computed.
ShiftedSchedule shifted_schedule(float shift, int steps) {
  VQAD_CHECK(steps >= 1, "shifted schedule: steps must be >= 1, found ", steps);
  VQAD_CHECK(std::isfinite(shift) && shift > 0.0f, "shifted schedule: shift must be a positive number, found ",
             shift);
  ShiftedSchedule s;
  s.shift = shift;
  s.steps = steps;
  s.sigmas.resize(size_t(steps) + 1);
  s.timesteps.resize(size_t(steps));
  volatile float step = -1.0f / static_cast<float>(steps);
  volatile float shift_m1 = shift - 1.0f;
  const int halfway = (steps + 1) / 2;
  for (int i = 0; i <= steps; ++i) {
    volatile float prod, u;
    if (i < halfway) {
      prod = step * static_cast<float>(i);
      u = 1.0f + prod;
    } else {
      prod = step * static_cast<float>(steps - i);
      u = 0.0f - prod;
    }
    volatile float num = shift * u;
    volatile float den_prod = shift_m1 * u;
    volatile float den = 1.0f + den_prod;
    volatile float sigma = num / den;
    s.sigmas[size_t(i)] = sigma;
  }
  for (int i = 0; i < steps; ++i) {
    volatile float t = 1000.0f * s.sigmas[size_t(i)];
    s.timesteps[size_t(i)] = t;
  }
  return s;
}

}  // namespace vqad::sample
