// What the trainer asks of a training method (sft, dmd2, ...).
//
// Per optimizer step the trainer zeroes every trainable role's gradients, calls
// micro_step once per micro-batch (the method runs its forwards and backward calls,
// scaling each loss by `scale` = 1 / gradient_accumulation_steps), then clips, checks
// and steps the optimizer of each role in roles_to_update(step). A role that is not
// updated at a step gets no backward at all (its optimizer and LR schedule do not move).
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "vqad/data/parquet_dataset.h"

namespace vqad::train {

struct MethodStepResult {
  // Metrics of the micro-batch (averaged over micro-batches by the trainer). "loss" is
  // the headline value (progress bar, summary).
  std::map<std::string, double> metrics;
  // Per updated role: the loss its gradient came from (the NaN/Inf guard names it).
  std::map<std::string, double> role_loss;
  int64_t tokens = 0;  // transformer tokens of one sample x batch (throughput)
};

class TrainingMethod {
 public:
  virtual ~TrainingMethod() = default;
  // Roles whose optimizer steps at optimizer step `step` (1-based).
  virtual std::vector<std::string> roles_to_update(long step) const = 0;
  virtual MethodStepResult micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device,
                                      long step, double scale) = 0;
};

}  // namespace vqad::train
