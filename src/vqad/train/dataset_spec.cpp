#include "vqad/train/dataset_spec.h"

#include "vqad/train/methods/registry.h"

namespace vqad::train {

data::DatasetSpec training_dataset_spec(const RunConfig& run, const model::WanConfig& student) {
  const auto& d = run.training.data;
  data::DatasetSpec spec;
  for (const auto& src : d.data_path) spec.sources.emplace_back(src.path, src.repeat);
  spec.kind = d.preprocessed_data_type;
  spec.text_len = student.text_len;
  spec.text_dim = student.text_dim;
  spec.num_latent_t = d.num_latent_t;
  spec.num_height = d.num_height;
  spec.num_width = d.num_width;
  spec.cfg_rate = d.training_cfg_rate;
  spec.seed = d.seed;
  const MethodRegistration& method = method_registration(run);
  spec.ode_anchor_indices = method.ode_anchor_indices ? method.ode_anchor_indices(run) : d.ode_anchor_indices;
  return spec;
}

}  // namespace vqad::train
