#include "vqad/train/methods/layer_recon.h"

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/train/metadata.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/param_groups.h"

namespace vqad::train {

void check_shared_embeddings(Role& student, const Role& teacher, const std::string& method) {
  const auto& sc = student.model->config();
  const auto& tc = teacher.model->config();
  VQAD_CHECK(sc.dim() == tc.dim() && sc.num_layers == tc.num_layers && sc.in_channels == tc.in_channels &&
                 sc.text_dim == tc.text_dim && sc.patch_size == tc.patch_size && sc.ffn_dim == tc.ffn_dim,
             method, ": models.student (", sc.kind(), ", dim ", sc.dim(), ", ", sc.num_layers,
             " layers) and models.teacher (", tc.kind(), ", dim ", tc.dim(), ", ", tc.num_layers,
             " layers) must have the same architecture (the student reconstructs the teacher block by block)");
  auto sp = student.model->named_parameters();
  auto tp = teacher.model->named_parameters();
  torch::NoGradGuard ng;
  // Two random:<preset> roles (benchmarks, smoke runs) get different seeds; the student
  // then takes the teacher's embeddings so that the shared conditioning is its own.
  const bool both_random = student.init_kind == "random" && teacher.init_kind == "random";
  if (both_random)
    log::info(method, ": random student and teacher: the student's patch_embedding and condition_embedder are "
              "set to the teacher's (the conditioning is shared)");
  for (const auto& item : sp) {
    const std::string& name = item.key();
    if (name.rfind("patch_embedding.", 0) != 0 && name.rfind("condition_embedder.", 0) != 0) continue;
    const auto* t = tp.find(name);
    VQAD_CHECK(t != nullptr, method, ": the teacher has no parameter '", name, "'");
    if (both_random) item.value().copy_(t->detach().to(item.value().device()));
    VQAD_CHECK(torch::equal(item.value().detach().cpu(), t->detach().cpu()), method,
               ": the student's frozen embedding parameter '", name,
               "' differs from the teacher's; both models share the teacher's embeddings and conditioning, so "
               "the student must start from the teacher's weights (models.student.init_from = the teacher's "
               "directory or an export trained from it)");
  }
}

int64_t latent_tokens(const model::WanModel& m, const torch::Tensor& x) {
  const auto& pc = m.config().patch_size;
  return x.size(0) * (x.size(2) / pc[0]) * (x.size(3) / pc[1]) * (x.size(4) / pc[2]);
}

torch::Tensor ode_start_of(const data::Batch& batch, torch::Device device, torch::ScalarType dtype,
                           const std::string& method) {
  VQAD_CHECK(batch.ode_start.defined() && batch.ode_timestep.defined() && batch.ode_sigma.defined(), method,
             " trains on ODE-trajectory pairs (x_start, sigma, x_48): training.data.data_path must name an ODE "
             "cache (vqad ode-cache), found a dataset without ODE pairs");
  VQAD_CHECK(batch.ode_start.dim() == 5 && batch.ode_sigma.dim() == 1 &&
                 batch.ode_sigma.size(0) == batch.ode_start.size(0) &&
                 batch.ode_timestep.sizes() == batch.ode_sigma.sizes(),
             method, ": malformed ODE batch (ode_start ", batch.ode_start.sizes(), ", ode_sigma ",
             batch.ode_sigma.sizes(), ", ode_timestep ", batch.ode_timestep.sizes(), ")");
  return batch.ode_start.to(device, dtype);
}

void validate_layer_recon_config(const RunConfig& run) {
  const auto arch = role_architecture(run, "student");
  const int64_t g = run.method.layer_recon.group_size;
  VQAD_CHECK(g >= 1 && arch.num_layers % g == 0, "method.group_size: ", g, " does not divide the student's ",
             arch.num_layers, " blocks (models.student.init_from '", run.role("student").init_from, "')");
}

void apply_method_trainable_scope(Role& student, const std::vector<std::string>& modules) {
  student.trainable_modules = modules;
  student.trainable_names = apply_trainable_scope(*student.model, modules, "method.trainable_modules");
  log::info("models.student: trainable scope ", student.trainable_names.size(), " of ",
            student.model->named_parameters().size(), " parameters (method.trainable_modules)");
}

LayerReconMethod::LayerReconMethod(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher)
    : cfg_(run.method.layer_recon), student_(std::move(student)), teacher_(std::move(teacher)) {
  VQAD_CHECK(student_ && teacher_, "layer_recon needs the roles student and teacher");
  VQAD_CHECK(student_->config.trainable && !teacher_->config.trainable,
             "layer_recon: models.student must be trainable and models.teacher frozen (trainable: false)");
  const int64_t n = student_->model->num_blocks();
  VQAD_CHECK(cfg_.group_size >= 1 && n % cfg_.group_size == 0, "method.group_size: ", cfg_.group_size,
             " does not divide the student's ", n, " blocks");
  num_groups_ = n / cfg_.group_size;
  check_shared_embeddings(*student_, *teacher_, "layer_recon");
  student_->model->set_gradient_checkpointing(cfg_.checkpoint_blocks);
  log::info("layer_recon: ", num_groups_, " groups of ", cfg_.group_size, " blocks, energy floor ",
            cfg_.energy_floor, ", block checkpointing ", cfg_.checkpoint_blocks ? "on" : "off");
}

LayerReconMethod::TeacherStates LayerReconMethod::teacher_states(const data::Batch& batch, torch::Device device) {
  torch::NoGradGuard ng;
  auto& tm = *teacher_->model;
  const auto dtype = tm.options().compute_dtype;
  auto x = ode_start_of(batch, device, dtype, "layer_recon");
  auto t = batch.ode_timestep.to(device, torch::kFloat32);
  auto text = batch.text.to(device, dtype);
  auto e = tm.embed(x, t, text);
  TeacherStates s;
  s.cond = e.cond;
  s.boundaries.push_back(e.hidden);
  auto h = e.hidden;
  for (int64_t g = 0; g < num_groups_; ++g) {
    h = tm.forward_blocks(g * cfg_.group_size, (g + 1) * cfg_.group_size, h, s.cond);
    s.boundaries.push_back(h);
  }
  return s;
}

torch::Tensor LayerReconMethod::group_loss(int64_t g, const TeacherStates& states) {
  VQAD_CHECK(g >= 0 && g < num_groups_, "layer_recon: group ", g, " out of range [0, ", num_groups_, ")");
  auto& sm = *student_->model;
  const auto& in = states.boundaries.at(static_cast<size_t>(g));
  const auto& target = states.boundaries.at(static_cast<size_t>(g + 1));
  auto s = sm.forward_blocks(g * cfg_.group_size, (g + 1) * cfg_.group_size,
                             in.detach().to(sm.options().compute_dtype), states.cond);
  auto tf = target.detach().to(torch::kFloat32);
  auto num = (s.to(torch::kFloat32) - tf).pow(2).mean({1, 2});
  auto den = (tf - in.detach().to(torch::kFloat32)).pow(2).mean({1, 2}).clamp_min(cfg_.energy_floor);
  return num / den;
}

MethodStepResult LayerReconMethod::micro_step(const data::Batch& batch, torch::Generator& /*gen*/,
                                              torch::Device device, long /*step*/, double scale) {
  MethodStepResult out;
  auto states = teacher_states(batch, device);
  double total = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    auto lg = group_loss(g, states).mean();
    if (lg.requires_grad()) (lg * (scale / static_cast<double>(num_groups_))).backward();
    const double v = lg.item<double>();
    out.metrics["recon/group_" + std::to_string(g)] = v;
    total += v;
  }
  const double loss = total / static_cast<double>(num_groups_);
  out.metrics["loss"] = loss;
  out.role_loss["student"] = loss;
  out.tokens = latent_tokens(*student_->model, batch.ode_start);
  return out;
}

MethodRegistration layer_recon_registration() {
  MethodRegistration r;
  r.name = method_name(MethodKind::kLayerRecon);
  r.optimizers = [](const RunConfig& run) { return std::vector<OptimizerSpec>{default_optimizer_spec(run, "student")}; };
  r.validate = validate_layer_recon_config;
  r.prepare_roles = [](const RunConfig& run, RoleMap& roles) {
    apply_method_trainable_scope(*roles.at("student"), run.method.layer_recon.trainable_modules);
  };
  r.create = [](const RunConfig& run, const RoleMap& roles) -> std::unique_ptr<TrainingMethod> {
    return std::make_unique<LayerReconMethod>(run, roles.at("student"), roles.at("teacher"));
  };
  r.supervision = [](const RunConfig& run, const Role& student) {
    return recon_supervision_json(run, student, nullptr);
  };
  // seeds/004 S0 validates with the many-step Wan pipeline: the Euler sampler of sft.
  r.validation_sampler = sft_registration().validation_sampler;
  return r;
}

}  // namespace vqad::train
