#include "vqad/train/methods/dmd2.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/dist/batch_random.h"
#include "vqad/core/log.h"
#include "vqad/data/text_embeddings.h"
#include "vqad/sample/schedule.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/sampling.h"

namespace fs = std::filesystem;

namespace vqad::train {

torch::Tensor load_negative_text(const std::string& path, int64_t text_len, int64_t text_dim) {
  const std::string where = "method.negative_prompt_embedding '" + path + "'";
  VQAD_CHECK(fs::exists(path), where, ": no such file or directory");
  if (fs::is_regular_file(path) && path.ends_with(".safetensors"))
    return data::read_text_embedding_file(path, text_len, text_dim, where).unsqueeze(0);
  // A preprocessed parquet dataset whose first row is the negative prompt.
  return data::read_text_embedding_rows(path, text_len, text_dim, where).text.narrow(0, 0, 1);
}

Dmd2Method::Dmd2Method(const RunConfig& run, std::shared_ptr<Role> student, std::shared_ptr<Role> teacher,
                       std::shared_ptr<Role> critic, torch::Tensor negative_text)
    : cfg_(run.method.dmd2), data_(run.training.data), student_(std::move(student)), teacher_(std::move(teacher)),
      critic_(std::move(critic)) {
  VQAD_CHECK(student_ && teacher_ && critic_, "dmd2 needs the roles student, teacher and critic");
  VQAD_CHECK(student_->config.trainable && critic_->config.trainable && !teacher_->config.trainable,
             "dmd2: student and critic must be trainable and the teacher frozen");
  VQAD_CHECK(cfg_.generator_update_interval >= 1, "method.generator_update_interval must be >= 1");
  const auto& sc = student_->model->config();
  for (const auto* r : {teacher_.get(), critic_.get()}) {
    const auto& c = r->model->config();
    VQAD_CHECK(c.in_channels == sc.in_channels && c.out_channels == sc.out_channels && c.text_dim == sc.text_dim &&
                   c.patch_size == sc.patch_size,
               "dmd2: models.", r->name, " (in ", c.in_channels, ", out ", c.out_channels, ", text_dim ", c.text_dim,
               ") does not match models.student (in ", sc.in_channels, ", out ", sc.out_channels, ", text_dim ",
               sc.text_dim, "): the roles must share the latent and text spaces");
  }
  timestep_shift_ = run.pipeline.flow_shift.value_or(student_->config.flow_shift);
  // Denoising steps: the exact shifted schedule, raw timesteps, or warped through the
  // student's grid.
  if (cfg_.shifted_ode_schedule.present) {
    const auto& so = cfg_.shifted_ode_schedule;
    VQAD_CHECK(!cfg_.warp_denoising_step, "method.warp_denoising_step: must be false with "
               "method.shifted_ode_schedule (the steps are the schedule's exact timesteps)");
    const auto full = sample::shifted_schedule(static_cast<float>(so.flow_shift), static_cast<int>(so.teacher_steps));
    std::vector<float> ts;
    for (auto i : so.indices) {
      sigmas_.push_back(full.sigmas[static_cast<size_t>(i)]);
      ts.push_back(full.timesteps[static_cast<size_t>(i)]);
    }
    auto same = [](const std::vector<double>& given, const std::vector<float>& want) {
      if (given.size() != want.size()) return false;
      for (size_t k = 0; k < want.size(); ++k)
        if (static_cast<float>(given[k]) != want[k]) return false;
      return true;
    };
    auto show = [](const std::vector<float>& v) {
      std::string out;
      for (float x : v) out += (out.empty() ? "" : ", ") + std::to_string(static_cast<double>(x));
      return "[" + out + "]";
    };
    VQAD_CHECK(so.sigmas.empty() || same(so.sigmas, sigmas_), "method.shifted_ode_schedule.sigmas: the recorded "
               "sigmas differ from the shifted schedule's (shift ", so.flow_shift, ", ", so.teacher_steps,
               " steps) at the indices: ", show(sigmas_));
    VQAD_CHECK(so.timesteps.empty() || same(so.timesteps, ts), "method.shifted_ode_schedule.timesteps: the "
               "recorded timesteps differ from the shifted schedule's at the indices: ", show(ts));
    VQAD_CHECK(cfg_.dmd_denoising_steps.empty() || same(cfg_.dmd_denoising_steps, ts),
               "method.dmd_denoising_steps: must equal the shifted_ode_schedule's timesteps ", show(ts));
    for (float t : ts) steps_.push_back(static_cast<double>(t));
  }
  for (double s : cfg_.shifted_ode_schedule.present ? std::vector<double>{} : cfg_.dmd_denoising_steps) {
    if (!cfg_.warp_denoising_step) {
      steps_.push_back(s);
      continue;
    }
    VQAD_CHECK(std::floor(s) == s, "method.dmd_denoising_steps: warp_denoising_step needs integer steps, found ", s);
    const int idx = 1000 - static_cast<int>(s);
    steps_.push_back(idx >= student_->grid.size() ? 0.0 : student_->grid.timestep(idx));
  }

  // Unconditional text of the teacher's CFG.
  uncond_mode_ = cfg_.cfg_uncond ? cfg_.cfg_uncond->text : "negative_prompt";
  if (uncond_mode_ == "negative_prompt") {
    if (negative_text.defined()) {
      negative_text_ =
          data::fit_text_embedding(negative_text.detach().cpu(), sc.text_len, sc.text_dim, "negative text embedding")
              .unsqueeze(0);
    } else if (!cfg_.negative_prompt_embedding.empty()) {
      negative_text_ = load_negative_text(cfg_.negative_prompt_embedding, sc.text_len, sc.text_dim);
    } else if (cfg_.cfg_uncond && cfg_.cfg_uncond->on_missing == "ignore") {
      log::warn("method.cfg_uncond.on_missing: ignore and no method.negative_prompt_embedding: the teacher's "
                "unconditional branch uses a zero text embedding");
      uncond_mode_ = "zero";
    } else {
      fail("method dmd2: the teacher's classifier-free guidance needs the negative prompt's text embedding "
           "(vqad has no text encoder). Set method.negative_prompt_embedding to a .safetensors file with one "
           "[L, ", sc.text_dim, "] tensor or to a parquet dataset whose first row is the negative prompt, or set "
           "method.cfg_uncond.text to zero or keep");
    }
  }
  log::info("dmd2: rollout ", rollout_mode_name(cfg_.rollout_mode), ", ", steps_.size(), " denoising steps, "
            "student update every ", cfg_.generator_update_interval, " step(s), guidance ",
            cfg_.real_score_guidance_scale, ", score timestep shift ", timestep_shift_, ", unconditional text: ",
            uncond_mode_);
}

std::vector<std::string> Dmd2Method::roles_to_update(long step) const {
  if (updates_student(step)) return {"critic", "student"};
  return {"critic"};
}

double Dmd2Method::score_timestep(torch::Generator& gen) const {
  const double r = static_cast<double>(at::randint(0, 1000, {1}, gen, torch::TensorOptions(torch::kInt64)).item<int64_t>());
  double t = shift_timestep(r, timestep_shift_);
  t = std::clamp(t, 0.0, 1000.0);
  const double lo = static_cast<double>(static_cast<int64_t>(cfg_.min_timestep_ratio * 1000.0));
  const double hi = static_cast<double>(static_cast<int64_t>(cfg_.max_timestep_ratio * 1000.0));
  return std::clamp(t, lo, hi);
}

torch::Tensor Dmd2Method::predict_x0(Role& role, const torch::Tensor& x_t, double t, const torch::Tensor& text) {
  const int64_t B = x_t.size(0);
  auto tt = torch::full({B}, t, torch::kFloat64);
  auto v = role.model->forward(x_t, tt.to(x_t.device(), torch::kFloat32), text);
  return role.grid.predict_x0(x_t, v, tt);
}

torch::Tensor Dmd2Method::predict_x0_sigma(Role& role, const torch::Tensor& x_t, double t, float sigma,
                                           const torch::Tensor& text) {
  const int64_t B = x_t.size(0);
  auto tt = torch::full({B}, t, torch::kFloat64);
  auto v = role.model->forward(x_t, tt.to(x_t.device(), torch::kFloat32), text);
  return (x_t.to(torch::kFloat32) - sigma * v.to(torch::kFloat32)).to(v.scalar_type());
}

torch::Tensor Dmd2Method::student_x0(const torch::Tensor& x, size_t i, const torch::Tensor& text) {
  if (!sigmas_.empty()) return predict_x0_sigma(*student_, x, steps_[i], sigmas_[i], text);
  return predict_x0(*student_, x, steps_[i], text);
}

torch::Tensor Dmd2Method::noise_to_step(const torch::Tensor& x0, const torch::Tensor& noise, size_t i) const {
  if (!sigmas_.empty()) {
    const float s = sigmas_[i];
    return ((1.0f - s) * x0.to(torch::kFloat32) + s * noise.to(torch::kFloat32)).to(noise.scalar_type());
  }
  return student_->grid.add_noise(x0, noise, torch::full({x0.size(0)}, steps_[i], torch::kFloat64));
}

torch::Tensor shifted_dmd_sample(model::WanModel& m, const torch::Tensor& noise, const torch::Tensor& text,
                                 const std::vector<float>& timesteps, const std::vector<float>& sigmas,
                                 torch::Generator& gen) {
  VQAD_CHECK(!timesteps.empty() && timesteps.size() == sigmas.size(), "shifted dmd sampler: ", timesteps.size(),
             " timesteps and ", sigmas.size(), " sigmas");
  torch::NoGradGuard ng;
  const auto dtype = m.options().compute_dtype;
  const int64_t B = noise.size(0);
  auto x = noise.to(dtype);
  torch::Tensor x0;
  for (size_t i = 0; i < timesteps.size(); ++i) {
    auto t = torch::full({B}, timesteps[i], torch::TensorOptions(torch::kFloat32).device(noise.device()));
    auto v = m.forward(x, t, text);
    x0 = x.to(torch::kFloat32) - sigmas[i] * v.to(torch::kFloat32);
    if (i + 1 < timesteps.size()) {
      auto fresh = at::randn(noise.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(noise.device());
      const float s = sigmas[i + 1];
      x = ((1.0f - s) * x0.to(dtype).to(torch::kFloat32) + s * fresh.to(dtype).to(torch::kFloat32)).to(dtype);
    }
  }
  return x0;
}

torch::Tensor Dmd2Method::uncond_text(const torch::Tensor& text) const {
  if (uncond_mode_ == "keep") return text;
  if (uncond_mode_ == "zero") return torch::zeros_like(text);
  VQAD_CHECK(negative_text_.size(1) == text.size(1), "dmd2: negative text length ", negative_text_.size(1),
             " != batch text length ", text.size(1));
  return negative_text_.to(text.device(), text.scalar_type()).expand({text.size(0), -1, -1});
}

std::vector<int64_t> Dmd2Method::latent_shape(const data::Batch& batch) const {
  if (batch.latent.defined()) return batch.latent.sizes().vec();
  const auto& d = data_;
  VQAD_CHECK(d.num_latent_t > 0 && d.num_height > 0 && d.num_width > 0,
             "dmd2 simulate on text_only data: training.data.num_latent_t, num_height and num_width must be set "
             "(found ", d.num_latent_t, ", ", d.num_height, ", ", d.num_width, ")");
  VQAD_CHECK(d.num_height % 8 == 0 && d.num_width % 8 == 0, "training.data.num_height/num_width (", d.num_height,
             " x ", d.num_width, ") must be multiples of 8 (the Wan VAE's spatial factor)");
  return {batch.text.size(0), student_->model->config().in_channels, d.num_latent_t, d.num_height / 8,
          d.num_width / 8};
}

torch::Tensor Dmd2Method::rollout(const torch::Tensor& x0_data, const std::vector<int64_t>& shape,
                                  const torch::Tensor& text, torch::Generator& gen, bool grad) {
  const auto dtype = student_->model->options().compute_dtype;
  const auto dev = text.device();
  const int64_t n = static_cast<int64_t>(steps_.size());
  const int64_t j = at::randint(0, n, {1}, gen, torch::TensorOptions(torch::kInt64)).item<int64_t>();
  auto noise = dist::randn_batch(shape, gen, torch::TensorOptions(torch::kFloat32)).to(dev, dtype);
  torch::Tensor input;
  if (cfg_.rollout_mode == RolloutMode::kDataLatent) {
    VQAD_CHECK(x0_data.defined(), "dmd2 rollout_mode data_latent needs latents; the dataset is text_only "
               "(use rollout_mode: simulate)");
    input = noise_to_step(x0_data.to(dev, dtype), noise, static_cast<size_t>(j));
  } else {
    std::vector<torch::Tensor> kept;
    torch::Tensor x = noise;
    {
      torch::NoGradGuard ng;
      for (int64_t i = 0; i + 1 < n; ++i) {
        auto x0 = student_x0(x, static_cast<size_t>(i), text);
        auto fresh = dist::randn_batch(shape, gen, torch::TensorOptions(torch::kFloat32)).to(dev, dtype);
        x = noise_to_step(x0, fresh, static_cast<size_t>(i + 1));
        kept.push_back(x);
      }
    }
    input = j == 0 ? noise : kept[j - 1];
  }
  // The graded call keeps the caller's grad mode; the critic's rollout has none.
  torch::AutoGradMode mode(grad && torch::GradMode::is_enabled());
  return student_x0(input, static_cast<size_t>(j), text);
}

DmdLossParts Dmd2Method::dmd_loss(const torch::Tensor& x0, const torch::Tensor& text, torch::Generator& gen) {
  DmdLossParts p;
  {
    torch::NoGradGuard ng;
    const auto dtype = critic_->model->options().compute_dtype;
    p.timestep = score_timestep(gen);
    auto noise = dist::randn_batch(x0.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(x0.device(), dtype);
    const int64_t B = x0.size(0);
    auto x_t = student_->grid.add_noise(x0.detach().to(dtype), noise, torch::full({B}, p.timestep, torch::kFloat64));
    p.critic_x0 = predict_x0(*critic_, x_t, p.timestep, text);
    auto r_c = predict_x0(*teacher_, x_t, p.timestep, text).to(torch::kFloat32);
    auto r_u = predict_x0(*teacher_, x_t, p.timestep, uncond_text(text)).to(torch::kFloat32);
    p.teacher_x0 = r_u + cfg_.real_score_guidance_scale * (r_c - r_u);
    auto x0f = x0.detach().to(torch::kFloat32);
    auto norm = (x0f - p.teacher_x0).abs().mean();
    p.normalizer = norm.item<double>();
    p.grad = torch::nan_to_num((p.critic_x0.to(torch::kFloat32) - p.teacher_x0) / norm);
  }
  auto xf = x0.to(torch::kFloat32);
  p.loss = 0.5 * (xf - (xf - p.grad).detach()).pow(2).mean();
  return p;
}

MethodStepResult Dmd2Method::micro_step(const data::Batch& batch, torch::Generator& gen, torch::Device device,
                                        long step, double scale) {
  MethodStepResult out;
  const auto dtype = student_->model->options().compute_dtype;
  auto text = batch.text.to(device, dtype);
  auto shape = latent_shape(batch);
  torch::Tensor x0_data;  // only data_latent rollouts read the batch's latents
  if (cfg_.rollout_mode == RolloutMode::kDataLatent && batch.latent.defined())
    x0_data = batch.latent.to(device, dtype);
  const auto& pc = student_->model->config().patch_size;
  out.tokens = shape[0] * (shape[2] / pc[0]) * (shape[3] / pc[1]) * (shape[4] / pc[2]);

  double gen_loss = 0;
  const bool upd = updates_student(step);
  if (upd) {
    auto x0_g = rollout(x0_data, shape, text, gen, true);
    auto parts = dmd_loss(x0_g, text, gen);
    if (probe) probe(x0_g, parts);
    (parts.loss * scale).backward();
    gen_loss = parts.loss.item<double>();
    out.role_loss["student"] = gen_loss;
    out.metrics["dmd_timestep"] = parts.timestep;
    out.metrics["dmd_normalizer"] = parts.normalizer;
  }
  torch::Tensor x0_c = rollout(x0_data, shape, text, gen, false);
  const double t_f = score_timestep(gen);
  auto n_f = dist::randn_batch(shape, gen, torch::TensorOptions(torch::kFloat32)).to(device, critic_->model->options().compute_dtype);
  const int64_t B = shape[0];
  auto tt = torch::full({B}, t_f, torch::kFloat64);
  auto x_f = critic_->grid.add_noise(x0_c, n_f, tt);
  auto v_c = critic_->model->forward(x_f, tt.to(device, torch::kFloat32), text);
  auto fake_loss = (v_c.to(torch::kFloat32) - (n_f.to(torch::kFloat32) - x0_c.to(torch::kFloat32))).pow(2).mean();
  (fake_loss * scale).backward();
  const double fl = fake_loss.item<double>();
  out.role_loss["critic"] = fl;
  out.metrics["generator_loss"] = gen_loss;
  out.metrics["fake_score_loss"] = fl;
  out.metrics["update_student"] = upd ? 1.0 : 0.0;
  out.metrics["loss"] = gen_loss + fl;
  return out;
}

MethodRegistration dmd2_registration() {
  MethodRegistration r;
  r.name = method_name(MethodKind::kDmd2);
  r.records_distillation = true;
  r.whole_model_forwards = true;
  // The critic's own AdamW: the method's fake_score_* learning rate, betas and schedule
  // (weight decay and eps of training.optimizer).
  r.optimizers = [](const RunConfig& run) {
    const auto& d = run.method.dmd2;
    OptimizerSpec critic = default_optimizer_spec(run, "critic");
    critic.learning_rate = d.fake_score_learning_rate;
    critic.betas = d.fake_score_betas;
    critic.schedule = d.fake_score_lr_scheduler;
    return std::vector<OptimizerSpec>{default_optimizer_spec(run, "student"), critic};
  };
  r.create = [](const RunConfig& run, const RoleMap& roles) -> std::unique_ptr<TrainingMethod> {
    return std::make_unique<Dmd2Method>(run, roles.at("student"), roles.at("teacher"), roles.at("critic"));
  };
  r.supervision = [](const RunConfig& run, const Role& student) {
    const auto& d = run.method.dmd2;
    nlohmann::json sup;
    sup["objective"] = "distribution_matching_distillation_dmd2";
    sup["generator_loss"] = "0.5 mean((x0 - sg(x0 - grad))^2), grad = nan_to_num((critic_x0 - teacher_cfg_x0) / "
                            "mean|x0 - teacher_cfg_x0|), fp32";
    sup["critic_loss"] = "mean((v_critic - (noise - x0_student))^2) in fp32 on an independent no-grad rollout";
    sup["rollout_mode"] = rollout_mode_name(d.rollout_mode);
    sup["dmd_denoising_steps"] = d.dmd_denoising_steps;
    sup["generator_update_interval"] = d.generator_update_interval;
    sup["real_score_guidance_scale"] = d.real_score_guidance_scale;
    sup["score_timestep"] = {{"shift", run.pipeline.flow_shift.value_or(student.config.flow_shift)},
                             {"min_ratio", d.min_timestep_ratio},
                             {"max_ratio", d.max_timestep_ratio}};
    sup["unconditional_text"] = d.cfg_uncond ? d.cfg_uncond->text : std::string("negative_prompt");
    if (!d.negative_prompt_embedding.empty()) sup["negative_prompt_embedding"] = d.negative_prompt_embedding;
    return sup;
  };
  // The few-step DMD sampler on sampling_timesteps (else method.dmd_denoising_steps); with
  // method.shifted_ode_schedule on the schedule's exact fp32 sigmas.
  r.validation_sampler = [](const RunConfig& run) {
    ValidationSampler s;
    const auto& so = run.method.dmd2.shifted_ode_schedule;
    if (so.present) {
      s.name = "shifted DMD sampler (exact sigmas)";
      const auto full = sample::shifted_schedule(static_cast<float>(so.flow_shift), static_cast<int>(so.teacher_steps));
      std::vector<float> ts, sig;
      for (auto i : so.indices) {
        ts.push_back(full.timesteps[static_cast<size_t>(i)]);
        sig.push_back(full.sigmas[static_cast<size_t>(i)]);
      }
      s.sample = [ts, sig](Role& student, const torch::Tensor& noise, const torch::Tensor& text,
                           torch::Generator& gen, std::string* description) {
        auto latents = shifted_dmd_sample(*student.model, noise, text, ts, sig, gen);
        if (description) *description = "shifted dmd (exact sigmas), timesteps " + nlohmann::json(ts).dump();
        return latents;
      };
      return s;
    }
    s.name = "DMD sampler";
    std::vector<double> ts = run.callbacks.validation.sampling_timesteps;
    if (ts.empty()) ts = run.method.dmd2.dmd_denoising_steps;
    s.sample = [ts](Role& student, const torch::Tensor& noise, const torch::Tensor& text, torch::Generator& gen,
                    std::string* description) {
      auto latents = dmd_sample(*student.model, student.grid, noise, text, ts, gen);
      if (description) *description = "dmd, timesteps " + nlohmann::json(ts).dump();
      return latents;
    };
    return s;
  };
  return r;
}

}  // namespace vqad::train
