// Optimizers of a run: one AdamW per optimizer spec of the method (methods/registry.h),
// each with its parameter group, hyper-parameters and LR schedule position.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vqad/train/lr_schedule.h"
#include "vqad/train/methods/registry.h"

namespace vqad::train {

struct RoleOptimizer {
  OptimizerSpec spec;
  std::vector<torch::Tensor> params;  // the parameter group it updates (also what grad clipping sees)
  std::unique_ptr<torch::optim::AdamW> adamw;
  LrScheduleConfig schedule;
  long updates = 0;  // optimizer steps taken: the LR schedule position

  // spec.learning_rate x the schedule's multiplier at `updates`.
  double next_lr() const;
  // Sets next_lr() on every param group, steps, counts the update; returns the LR used.
  double step();
};

using RoleOptimizers = std::map<std::string, RoleOptimizer>;  // by role

// One optimizer per spec of the method; every trainable role needs exactly one and every
// spec a trainable role (errors name models.<role>).
RoleOptimizers build_optimizers(const RunConfig& run, const MethodRegistration& method, const RoleMap& roles);

}  // namespace vqad::train
