// Learning-rate schedules (multipliers of the base LR per optimizer step), as in the
// diffusers/transformers schedulers the FastVideo recipes name.
#pragma once
#include "vqad/train/config.h"

namespace vqad::train {

struct LrScheduleConfig {
  LrSchedule kind = LrSchedule::kConstant;
  long warmup_steps = 0;
  long total_steps = 0;      // loop.max_train_steps
  double num_cycles = 0.5;   // cosine: 0.5 = half a cosine; restarts: number of restarts
  double power = 1.0;        // polynomial
  double lr_end_ratio = 0.0; // polynomial end LR / base LR
  double min_lr_ratio = 0.5; // cosine_with_min_lr
};

// From training.optimizer (student) with the loop length.
LrScheduleConfig lr_schedule_from(const OptimizerConfig& opt, LrSchedule kind, long total_steps);

// Multiplier for the LR used at optimizer step `step` (0-based: the first update uses step 0).
double lr_multiplier(const LrScheduleConfig& c, long step);

}  // namespace vqad::train
