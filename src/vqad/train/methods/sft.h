// `sft`: flow-matching fine-tuning of the student (FastVideo's FineTuneMethod).
//   x0 = latents, n ~ N(0, I), u ~ U[0,1) (or logit-normal / mode), i = floor(1000 u),
//   t = t_i, x_t = (1 - sigma_i) x0 + sigma_i n, loss = mean((v - (n - x0))^2) in fp32.
// Random draws, in this order per micro-batch, from the trainer's generator: the
// noise (randn, shape of x0, fp32 then cast to the compute dtype), then u (B draws).
#pragma once
#include <torch/torch.h>

#include "vqad/data/parquet_dataset.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/method.h"
#include "vqad/train/roles.h"

namespace vqad::train {

struct SftStepResult {
  torch::Tensor loss;  // scalar fp32, differentiable
  int64_t tokens = 0;  // transformer tokens in the micro-batch
};

class SftMethod : public TrainingMethod {
 public:
  SftMethod(const RunConfig& run, std::shared_ptr<Role> student);
  std::vector<std::string> roles_to_update(long) const override { return {"student"}; }
  MethodStepResult micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device, long step,
                              double scale) override;
  SftStepResult loss(const data::Batch& batch, torch::Generator& gen, torch::Device device);
  // Timestep-grid indices for B samples (weighting scheme of training.model).
  std::vector<int64_t> sample_indices(int64_t batch, torch::Generator& gen) const;

 private:
  ModelTrainingConfig cfg_;
  std::shared_ptr<Role> student_;
};

}  // namespace vqad::train
