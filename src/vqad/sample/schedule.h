// The shifted sampling schedule of flow matching (spec/sparse_qad.md "Schedules"), the one
// implementation for the whole code base: the teacher's ODE solver, the ODE-trajectory
// cache, the Euler validation sampler and DMD2's shifted_ode_schedule all use it.
//
// Every operation is rounded to fp32 in this order (torch.linspace(1, 0, steps + 1) in
// fp32, then the shift):
//   step = fp32(-1 / steps)
//   u_i  = fp32(1 + fp32(step * i))              for i <  (steps + 1) / 2
//   u_i  = fp32(0 - fp32(step * (steps - i)))    for i >= (steps + 1) / 2   (i = 0..steps)
//   sigma_i = fp32(fp32(shift * u_i) / fp32(1 + fp32(fp32(shift - 1) * u_i)))
//   t_i     = fp32(1000 * sigma_i)               for i < steps
// At shift 8, 48 steps this reproduces the 49 sigmas and 48 timesteps recorded in
// seeds/004 bit for bit (tests/cpu/test_schedule.cpp).
//
// The 1000-point training grid (spec/training.md "Flow matching", train/flow_matching.h)
// is a different object and is not computed here.
#pragma once
#include <vector>

namespace vqad::sample {

struct ShiftedSchedule {
  float shift = 0;
  int steps = 0;
  std::vector<float> sigmas;     // steps + 1 values, fp32, 1 -> 0
  std::vector<float> timesteps;  // steps values, fp32(1000 * sigma)
};

// Throws vqad::Error unless steps >= 1 and shift > 0.
ShiftedSchedule shifted_schedule(float shift, int steps);

}  // namespace vqad::sample
