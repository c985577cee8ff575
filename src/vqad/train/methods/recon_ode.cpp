#include "vqad/train/methods/recon_ode.h"

#include <algorithm>
#include <cstring>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/data/ode_cache.h"
#include "vqad/model/wan/model.h"
#include "vqad/sample/schedule.h"
#include "vqad/train/metadata.h"
#include "vqad/train/methods/dmd2.h"
#include "vqad/train/methods/layer_recon.h"
#include "vqad/train/methods/registry.h"

namespace vqad::train {

nlohmann::json FewStepSchedule::to_json() const {
  nlohmann::json s = nlohmann::json::array(), t = nlohmann::json::array();
  for (float v : sigmas) s.push_back(static_cast<double>(v));
  for (float v : timesteps) t.push_back(static_cast<double>(v));
  return {{"flow_shift", flow_shift}, {"indices", indices},         {"sigmas", s},
          {"student_steps", student_steps}, {"teacher_steps", teacher_steps}, {"timesteps", t},
          {"version", version}};
}

FewStepSchedule few_step_schedule(double flow_shift, int64_t teacher_steps, int64_t student_steps,
                                  const std::vector<int64_t>& cache_anchors, const std::string& where) {
  VQAD_CHECK(student_steps >= 1 && teacher_steps >= 1 && teacher_steps % student_steps == 0,
             "method.student_steps: ", student_steps, " does not divide the ODE cache's ", teacher_steps,
             " teacher steps (", where, ")");
  FewStepSchedule s;
  s.flow_shift = flow_shift;
  s.teacher_steps = teacher_steps;
  s.student_steps = student_steps;
  const auto full = sample::shifted_schedule(static_cast<float>(flow_shift), static_cast<int>(teacher_steps));
  const int64_t stride = teacher_steps / student_steps;
  for (int64_t k = 0; k < student_steps; ++k) {
    const int64_t idx = k * stride;
    if (std::find(cache_anchors.begin(), cache_anchors.end(), idx) == cache_anchors.end()) {
      std::string have;
      for (auto a : cache_anchors) have += (have.empty() ? "" : ", ") + std::to_string(a);
      fail("method.student_steps: ", student_steps, " steps need the anchor at teacher step ", idx,
           ", which is not in the ODE cache (", where, " has anchors {", have, "})");
    }
    s.indices.push_back(idx);
    s.sigmas.push_back(full.sigmas[static_cast<size_t>(idx)]);
    s.timesteps.push_back(full.timesteps[static_cast<size_t>(idx)]);
  }
  return s;
}

FewStepSchedule recon_ode_schedule(const RunConfig& run) {
  const auto& d = run.training.data;
  VQAD_CHECK(d.data_path.size() == 1, "training.data.data_path: recon_ode trains on one ODE cache, found ",
             d.data_path.size(), " sources");
  auto cache = data::OdeCache::open(d.data_path[0].path);
  const auto& sc = cache.meta().schedule;
  auto s = few_step_schedule(sc.flow_shift, sc.teacher_steps, run.method.recon_ode.student_steps, sc.student_indices,
                             "training.data.data_path '" + d.data_path[0].path + "'");
  if (!d.ode_anchor_indices.empty() && d.ode_anchor_indices != s.indices) {
    auto show = [](const std::vector<int64_t>& v) {
      std::string out;
      for (auto i : v) out += (out.empty() ? "" : ", ") + std::to_string(i);
      return "[" + out + "]";
    };
    fail("training.data.ode_anchor_indices: ", show(d.ode_anchor_indices), " but recon_ode with method.student_steps ",
         s.student_steps, " trains on the anchors ", show(s.indices), " of the cache's ", s.teacher_steps,
         " teacher steps (remove the key or set it to those)");
  }
  return s;
}

ReconOdeMethod::ReconOdeMethod(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher,
                               std::optional<FewStepSchedule> schedule)
    : cfg_(run.method.recon_ode), student_(std::move(student)), teacher_(std::move(teacher)) {
  VQAD_CHECK(student_ && teacher_, "recon_ode needs the roles student and teacher");
  VQAD_CHECK(student_->config.trainable && !teacher_->config.trainable,
             "recon_ode: models.student must be trainable and models.teacher frozen (trainable: false)");
  check_shared_embeddings(*student_, *teacher_, "recon_ode");
  schedule_ = schedule ? *schedule : recon_ode_schedule(run);
  VQAD_CHECK(schedule_.student_steps == cfg_.student_steps, "method.student_steps: ", cfg_.student_steps,
             " but the training schedule has ", schedule_.student_steps, " steps");
  student_->model->set_gradient_checkpointing(cfg_.checkpoint_blocks);
  std::string idx;
  for (auto i : schedule_.indices) idx += (idx.empty() ? "" : ", ") + std::to_string(i);
  log::info("recon_ode: weights attention ", cfg_.attention_weight, ", mlp ", cfg_.mlp_weight, ", ode ",
            cfg_.ode_weight, "; anchors {", idx, "} of ", schedule_.teacher_steps, " teacher steps; block "
            "checkpointing ", cfg_.checkpoint_blocks ? "on" : "off");
}

void ReconOdeMethod::check_anchors(const data::Batch& batch) const {
  const int64_t B = batch.ode_start.size(0);
  VQAD_CHECK(static_cast<int64_t>(batch.ode_teacher_step.size()) == B, "recon_ode: the batch has ",
             batch.ode_teacher_step.size(), " teacher-step indices for ", B, " ODE pairs");
  auto sig = batch.ode_sigma.to(torch::kCPU, torch::kFloat32).contiguous();
  const float* sp = sig.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const auto it = std::find(schedule_.indices.begin(), schedule_.indices.end(), batch.ode_teacher_step[b]);
    VQAD_CHECK(it != schedule_.indices.end(), "recon_ode: the batch holds a pair at teacher step ",
               batch.ode_teacher_step[b], ", which is not one of the training schedule's anchors (the ODE "
               "dataset must be restricted to them)");
    const float want = schedule_.sigmas[static_cast<size_t>(it - schedule_.indices.begin())];
    VQAD_CHECK(std::memcmp(&want, &sp[b], sizeof(float)) == 0, "recon_ode: the pair at teacher step ",
               batch.ode_teacher_step[b], " has sigma ", sp[b], ", the shifted schedule's sigma is ", want,
               " (the ODE cache's schedule disagrees with the training schedule)");
  }
}

ReconOdeMethod::TeacherPass ReconOdeMethod::teacher_pass(const data::Batch& batch, torch::Device device) {
  torch::NoGradGuard ng;
  auto& tm = *teacher_->model;
  const auto dtype = tm.options().compute_dtype;
  auto x = ode_start_of(batch, device, dtype, "recon_ode");
  auto e = tm.embed(x, batch.ode_timestep.to(device, torch::kFloat32), batch.text.to(device, dtype));
  TeacherPass p;
  p.cond = e.cond;
  auto h = e.hidden;
  for (int64_t l = 0; l < tm.num_blocks(); ++l) {
    p.inputs.push_back(h);
    h = tm.forward_blocks(l, l + 1, h, p.cond, &p.taps);
  }
  return p;
}

model::BlockTaps ReconOdeMethod::student_block_taps(int64_t l, const TeacherPass& teacher) {
  auto& sm = *student_->model;
  std::vector<model::BlockTaps> taps;
  sm.forward_blocks(l, l + 1, teacher.inputs.at(static_cast<size_t>(l)).detach().to(sm.options().compute_dtype),
                    teacher.cond, &taps);
  return taps.at(0);
}

torch::Tensor ReconOdeMethod::ode_loss(const data::Batch& batch, torch::Device device) {
  VQAD_CHECK(batch.ode_target.defined(), "recon_ode: the batch has no ODE target (ode_target, the clean x_48)");
  auto& sm = *student_->model;
  const auto dtype = sm.options().compute_dtype;
  auto x = ode_start_of(batch, device, dtype, "recon_ode");
  const int64_t B = x.size(0);
  auto v = sm.forward(x, batch.ode_timestep.to(device, torch::kFloat32), batch.text.to(device, dtype));
  auto sigma = batch.ode_sigma.to(device, torch::kFloat32).reshape({B, 1, 1, 1, 1});
  auto x0 = batch.ode_start.to(device, torch::kFloat32) - sigma * v.to(torch::kFloat32);
  return (x0 - batch.ode_target.to(device, torch::kFloat32)).pow(2).mean();
}

ReconOdeLosses ReconOdeMethod::forward_backward(const data::Batch& batch, torch::Device device, double scale) {
  ode_start_of(batch, device, torch::kFloat32, "recon_ode");  // the batch check, before any work
  check_anchors(batch);
  ReconOdeLosses r;
  const int64_t n = student_->model->num_blocks();
  const double inv_n = 1.0 / static_cast<double>(n);
  if (cfg_.attention_weight > 0 || cfg_.mlp_weight > 0) {
    auto tp = teacher_pass(batch, device);
    for (int64_t l = 0; l < n; ++l) {
      auto st = student_block_taps(l, tp);
      const auto& tt = tp.taps[static_cast<size_t>(l)];
      auto la = (st.attn_out.to(torch::kFloat32) - tt.attn_out.to(torch::kFloat32)).pow(2).mean();
      auto lm = (st.ffn_out.to(torch::kFloat32) - tt.ffn_out.to(torch::kFloat32)).pow(2).mean();
      auto local = la * cfg_.attention_weight + lm * cfg_.mlp_weight;
      if (local.requires_grad()) (local * (scale * inv_n)).backward();
      r.attn += la.item<double>() * inv_n;
      r.mlp += lm.item<double>() * inv_n;
    }
  }
  if (cfg_.ode_weight > 0) {
    auto lo = ode_loss(batch, device);
    if (lo.requires_grad()) (lo * (cfg_.ode_weight * scale)).backward();
    r.ode = lo.item<double>();
  }
  r.total = cfg_.attention_weight * r.attn + cfg_.mlp_weight * r.mlp + cfg_.ode_weight * r.ode;
  return r;
}

MethodStepResult ReconOdeMethod::micro_step(const data::Batch& batch, torch::Generator& /*gen*/, torch::Device device,
                                            long /*step*/, double scale) {
  auto r = forward_backward(batch, device, scale);
  MethodStepResult out;
  out.metrics["loss"] = r.total;
  out.metrics["loss_attn"] = r.attn;
  out.metrics["loss_mlp"] = r.mlp;
  out.metrics["loss_ode"] = r.ode;
  out.role_loss["student"] = r.total;
  out.tokens = latent_tokens(*student_->model, batch.ode_start);
  return out;
}

MethodRegistration recon_ode_registration() {
  MethodRegistration r;
  r.name = method_name(MethodKind::kReconOde);
  r.optimizers = [](const RunConfig& run) { return std::vector<OptimizerSpec>{default_optimizer_spec(run, "student")}; };
  r.validate = [](const RunConfig& run) { recon_ode_schedule(run); };
  r.ode_anchor_indices = [](const RunConfig& run) { return recon_ode_schedule(run).indices; };
  r.prepare_roles = [](const RunConfig& run, RoleMap& roles) {
    apply_method_trainable_scope(*roles.at("student"), run.method.recon_ode.trainable_modules);
  };
  r.create = [](const RunConfig& run, const RoleMap& roles) -> std::unique_ptr<TrainingMethod> {
    return std::make_unique<ReconOdeMethod>(run, roles.at("student"), roles.at("teacher"));
  };
  r.supervision = [](const RunConfig& run, const Role& student) {
    return recon_supervision_json(run, student, recon_ode_schedule(run).to_json());
  };
  // seeds/004 S1: the 3-step shifted DMD sampler on the training schedule's exact sigmas.
  r.validation_sampler = [](const RunConfig& run) {
    const auto sched = recon_ode_schedule(run);
    ValidationSampler s;
    s.name = "shifted DMD sampler (exact sigmas)";
    s.sample = [ts = sched.timesteps, sig = sched.sigmas](Role& student, const torch::Tensor& noise,
                                                          const torch::Tensor& text, torch::Generator& gen,
                                                          std::string* description) {
      auto latents = shifted_dmd_sample(*student.model, noise, text, ts, sig, gen);
      if (description) *description = "shifted dmd (exact sigmas), timesteps " + nlohmann::json(ts).dump();
      return latents;
    };
    return s;
  };
  return r;
}

}  // namespace vqad::train
