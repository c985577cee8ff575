#include "vqad/train/optimizer.h"

#include "vqad/core/error.h"

namespace vqad::train {

double RoleOptimizer::next_lr() const { return spec.learning_rate * lr_multiplier(schedule, updates); }

double RoleOptimizer::step() {
  const double lr = next_lr();
  for (auto& g : adamw->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  adamw->step();
  ++updates;
  return lr;
}

RoleOptimizers build_optimizers(const RunConfig& run, const MethodRegistration& method, const RoleMap& roles) {
  RoleOptimizers out;
  for (auto& spec : method.optimizers(run)) {
    auto it = roles.find(spec.role);
    VQAD_CHECK(it != roles.end() && it->second->config.trainable, "method ", method.name,
               " declares an optimizer for models.", spec.role, ", which is not a trainable role of the run");
    VQAD_CHECK(!out.count(spec.role), "method ", method.name, " declares two optimizers for models.", spec.role);
    RoleOptimizer o;
    o.params = spec.params.parameters(*it->second);
    VQAD_CHECK(!o.params.empty(), "models.", spec.role, " is trainable but has no trainable parameters");
    torch::optim::AdamWOptions ao(spec.learning_rate);
    ao.betas({spec.betas[0], spec.betas[1]}).weight_decay(spec.weight_decay).eps(spec.eps);
    o.adamw = std::make_unique<torch::optim::AdamW>(o.params, ao);
    o.schedule = lr_schedule_from(run.training.optimizer, spec.schedule, run.training.loop.max_train_steps);
    o.spec = std::move(spec);
    out.emplace(o.spec.role, std::move(o));
  }
  for (const auto& [name, role] : roles)
    VQAD_CHECK(!role->config.trainable || out.count(name), "models.", name, " is trainable but method ", method.name,
               " declares no optimizer for it");
  return out;
}

}  // namespace vqad::train
