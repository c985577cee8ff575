#include "vqad/train/methods/registry.h"

#include "vqad/core/error.h"

namespace vqad::train {

namespace {
const std::vector<MethodRegistration>& registry() {
  static const std::vector<MethodRegistration> r = {
      sft_registration(),
      dmd2_registration(),
      layer_recon_registration(),
      recon_ode_registration(),
  };
  return r;
}
}  // namespace

std::vector<torch::Tensor> ParamGroupSpec::parameters(const Role& role) const {
  return select ? select(role) : role.trainable_parameters();
}

OptimizerSpec default_optimizer_spec(const RunConfig& run, const std::string& role) {
  const auto& oc = run.training.optimizer;
  OptimizerSpec s;
  s.role = role;
  s.learning_rate = oc.learning_rate;
  s.betas = oc.betas;
  s.weight_decay = oc.weight_decay;
  s.eps = oc.eps;
  s.schedule = oc.lr_scheduler;
  return s;
}

const MethodRegistration* find_method(const std::string& name) {
  for (const auto& m : registry())
    if (m.name == name) return &m;
  return nullptr;
}

std::vector<std::string> registered_method_names() {
  std::vector<std::string> v;
  for (const auto& m : registry()) v.push_back(m.name);
  return v;
}

const MethodRegistration& method_registration(const RunConfig& run) {
  const std::string name = method_name(run.method.kind);
  const MethodRegistration* m = find_method(name);
  VQAD_CHECK(m != nullptr, "method '", name, "' is not available in this vqad build (available: ",
             config::join(registered_method_names()), ")");
  return *m;
}

std::vector<RoleSpec> method_role_specs(const RunConfig& run) {
  std::vector<RoleSpec> v;
  for (const auto& r : method_roles(run.method.kind)) v.push_back({r.name, r.trainable, r.trainable});
  return v;
}

}  // namespace vqad::train
