#include "vqad/train/methods/sft.h"

#include <cmath>

#include "vqad/core/error.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/sampling.h"
#include "vqad/dist/batch_random.h"

namespace vqad::train {

SftMethod::SftMethod(const RunConfig& run, std::shared_ptr<Role> student)
    : cfg_(run.training.model), student_(std::move(student)) {
  VQAD_CHECK(run.training.optimizer.learning_rate > 0, "training.optimizer.learning_rate must be > 0 for sft, found ",
             run.training.optimizer.learning_rate);
  VQAD_CHECK(cfg_.weighting_scheme == "uniform" || cfg_.weighting_scheme == "logit_normal" ||
                 cfg_.weighting_scheme == "mode",
             "training.model.weighting_scheme: unknown '", cfg_.weighting_scheme,
             "' (valid: uniform, logit_normal, mode)");
}

std::vector<int64_t> SftMethod::sample_indices(int64_t batch, torch::Generator& gen) const {
  torch::Tensor u;
  if (cfg_.weighting_scheme == "logit_normal") {
    u = torch::sigmoid(dist::normal_batch(cfg_.logit_mean, cfg_.logit_std, {batch}, gen, torch::TensorOptions(torch::kFloat64)));
  } else {
    u = dist::rand_batch({batch}, gen, torch::TensorOptions(torch::kFloat64));
    if (cfg_.weighting_scheme == "mode") {
      const double pi = 3.14159265358979323846;
      u = 1.0 - u - cfg_.mode_scale * (torch::cos(pi * u / 2.0).pow(2) - 1.0 + u);
    }
  }
  std::vector<int64_t> idx(batch);
  auto acc = u.accessor<double, 1>();
  for (int64_t b = 0; b < batch; ++b) idx[b] = student_->grid.index_from_uniform(acc[b]);
  return idx;
}

SftStepResult SftMethod::loss(const data::Batch& batch, torch::Generator& gen, torch::Device device) {
  VQAD_CHECK(batch.latent.defined(), "sft needs latents: the dataset is text_only (use a t2v dataset)");
  const auto dtype = student_->model->options().compute_dtype;
  auto x0 = batch.latent.to(device, dtype);
  auto noise = dist::randn_batch(batch.latent.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(device, dtype);
  const int64_t B = x0.size(0);
  auto idx = sample_indices(B, gen);
  std::vector<double> tv(B);
  for (int64_t b = 0; b < B; ++b) tv[b] = student_->grid.timestep(static_cast<int>(idx[b]));
  auto t = torch::tensor(tv, torch::kFloat64);
  auto x_t = student_->grid.add_noise(x0, noise, t);
  auto text = batch.text.to(device, dtype);
  auto v = student_->model->forward(x_t, t.to(device, torch::kFloat32), text);
  torch::Tensor loss;
  if (cfg_.precondition_outputs) {
    auto sig = student_->grid.sigmas_for(t).to(device, torch::kFloat32).reshape({B, 1, 1, 1, 1});
    loss = ((x_t.to(torch::kFloat32) - sig * v.to(torch::kFloat32)) - x0.to(torch::kFloat32)).pow(2).mean();
  } else {
    loss = (v.to(torch::kFloat32) - (noise.to(torch::kFloat32) - x0.to(torch::kFloat32))).pow(2).mean();
  }
  const auto& pc = student_->model->config().patch_size;
  const int64_t tokens = B * (x0.size(2) / pc[0]) * (x0.size(3) / pc[1]) * (x0.size(4) / pc[2]);
  return {loss, tokens};
}

MethodStepResult SftMethod::micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device,
                                       long /*step*/, double scale) {
  auto r = loss(batch, gen, device);
  (r.loss * scale).backward();
  MethodStepResult out;
  const double l = r.loss.item<double>();
  out.metrics["loss"] = l;
  out.role_loss["student"] = l;
  out.tokens = r.tokens;
  return out;
}



MethodRegistration sft_registration() {
  MethodRegistration r;
  r.name = method_name(MethodKind::kSft);
  r.optimizers = [](const RunConfig& run) { return std::vector<OptimizerSpec>{default_optimizer_spec(run, "student")}; };
  r.create = [](const RunConfig& run, const RoleMap& roles) -> std::unique_ptr<TrainingMethod> {
    return std::make_unique<SftMethod>(run, roles.at("student"));
  };
  r.supervision = [](const RunConfig& run, const Role& student) {
    nlohmann::json sup;
    sup["objective"] = "flow_matching_velocity_mse";
    sup["loss"] = "mean((v - (noise - x0))^2) in fp32";
    sup["weighting_scheme"] = run.training.model.weighting_scheme;
    sup["flow_shift"] = student.config.flow_shift;
    return sup;
  };
  // Euler with sampling_steps[0] steps (50 when unset), CFG against the zero text (the
  // unconditional the SFT text dropout trains), shift pipeline.flow_shift else the student's.
  r.validation_sampler = [](const RunConfig& run) {
    ValidationSampler s;
    s.name = "Euler sampler";
    const ValidationConfig v = run.callbacks.validation;
    const std::optional<double> pipeline_shift = run.pipeline.flow_shift;
    s.sample = [v, pipeline_shift](Role& student, const torch::Tensor& noise, const torch::Tensor& text,
                                   torch::Generator&, std::string* description) {
      const int steps = static_cast<int>(v.sampling_steps.empty() ? 50 : v.sampling_steps.front());
      const double shift = pipeline_shift.value_or(student.config.flow_shift);
      auto latents =
          euler_sample(*student.model, noise, text, torch::zeros_like(text), v.guidance_scale, steps, shift);
      if (description)
        *description = "euler, " + std::to_string(steps) + " steps, shift " + std::to_string(shift) + ", guidance " +
                       std::to_string(v.guidance_scale);
      return latents;
    };
    return s;
  };
  r.mfu_is_student_forward_backward = true;
  r.whole_model_forwards = true;
  return r;
}

}  // namespace vqad::train
