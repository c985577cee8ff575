// The resolved dump: every value of each section with its default filled in, in a
// form that loads again to the same RunConfig (and the same dump).
#include <algorithm>

#include "vqad/config/sections.h"

namespace vqad::train::sections {

namespace {
Json str_or_null(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }
}  // namespace

Json to_json(const RoleConfig& r) {
  Json j = Json::object();
  j["_target_"] = r.target;
  j["init_from"] = r.init_from;
  j["trainable"] = r.trainable;
  j["disable_custom_init_weights"] = r.disable_custom_init_weights;
  j["flow_shift"] = r.flow_shift;
  j["enable_gradient_checkpointing_type"] = str_or_null(r.enable_gradient_checkpointing_type);
  j["transformer_override_safetensor"] = str_or_null(r.transformer_override_safetensor);
  j["attention_backend"] = attention_backend_name(r.attention_backend);
  j["quant_config"] = r.quant_config;
  return j;
}

Json to_json(const MethodConfig& m) {
  Json j = Json::object();
  j["_target_"] = m.target;
  switch (m.kind) {
    case MethodKind::kSft:
      if (!m.sft.attn_kind.empty()) j["attn_kind"] = m.sft.attn_kind;
      break;
    case MethodKind::kDmd2: {
      const auto& d = m.dmd2;
      j["rollout_mode"] = rollout_mode_name(d.rollout_mode);
      j["dmd_denoising_steps"] = d.dmd_denoising_steps;
      j["generator_update_interval"] = d.generator_update_interval;
      j["min_timestep_ratio"] = d.min_timestep_ratio;
      j["max_timestep_ratio"] = d.max_timestep_ratio;
      j["real_score_guidance_scale"] = d.real_score_guidance_scale;
      j["warp_denoising_step"] = d.warp_denoising_step;
      j["fake_score_learning_rate"] = d.fake_score_learning_rate;
      j["fake_score_betas"] = {d.fake_score_betas[0], d.fake_score_betas[1]};
      j["fake_score_lr_scheduler"] = lr_schedule_name(d.fake_score_lr_scheduler);
      if (d.cfg_uncond) j["cfg_uncond"] = {{"on_missing", d.cfg_uncond->on_missing}, {"text", d.cfg_uncond->text}};
      if (!d.negative_prompt_embedding.empty()) j["negative_prompt_embedding"] = d.negative_prompt_embedding;
      if (d.shifted_ode_schedule.present) {
        const auto& s = d.shifted_ode_schedule;
        j["shifted_ode_schedule"] = {{"flow_shift", s.flow_shift},   {"teacher_steps", s.teacher_steps},
                                     {"student_steps", s.student_steps}, {"version", s.version},
                                     {"indices", s.indices},         {"sigmas", s.sigmas},
                                     {"timesteps", s.timesteps}};
      }
      break;
    }
    case MethodKind::kLayerRecon: {
      const auto& l = m.layer_recon;
      j["group_size"] = l.group_size;
      j["energy_floor"] = l.energy_floor;
      j["input_source"] = l.input_source;
      j["propagation"] = l.propagation;
      j["loss"] = l.loss;
      j["trainable_scope"] = l.trainable_scope;
      j["checkpoint_blocks"] = l.checkpoint_blocks;
      j["trainable_modules"] = l.trainable_modules;
      break;
    }
    case MethodKind::kReconOde: {
      const auto& r = m.recon_ode;
      j["attention_weight"] = r.attention_weight;
      j["mlp_weight"] = r.mlp_weight;
      j["ode_weight"] = r.ode_weight;
      j["student_steps"] = r.student_steps;
      j["loss"] = r.loss;
      j["trainable_scope"] = r.trainable_scope;
      j["checkpoint_blocks"] = r.checkpoint_blocks;
      j["trainable_modules"] = r.trainable_modules;
      break;
    }
  }
  return j;
}

Json to_json(const TrainingConfig& t) {
  Json j = Json::object();
  const auto& d = t.distributed;
  j["distributed"] = {{"num_gpus", d.num_gpus},
                      {"tp_size", d.tp_size},
                      {"sp_size", d.sp_size},
                      {"hsdp_replicate_dim", d.hsdp_replicate_dim},
                      {"hsdp_shard_dim", d.hsdp_shard_dim},
                      {"pin_cpu_memory", d.pin_cpu_memory},
                      {"reshard_after_forward", d.reshard_after_forward},
                      {"fsdp_modules_per_group", d.fsdp_modules_per_group},
                      {"shard_frozen_roles", d.shard_frozen_roles},
                      {"accumulate_unreduced_gradients", d.accumulate_unreduced_gradients},
                      {"gather_dtype", d.gather_dtype},
                      {"reduce_dtype", d.reduce_dtype},
                      {"fsdp_symmetric_memory", d.fsdp_symmetric_memory}};
  const auto& a = t.data;
  Json paths;
  bool plain = std::all_of(a.data_path.begin(), a.data_path.end(), [](const DataSource& s) { return s.repeat == 1; });
  if (a.data_path.empty()) {
    paths = "";
  } else if (a.data_path.size() == 1 && plain) {
    paths = a.data_path[0].path;
  } else if (plain) {
    paths = Json::array();
    for (const auto& s : a.data_path) paths.push_back(s.path);
  } else {
    paths = Json::object();
    for (const auto& s : a.data_path) paths[s.path] = s.repeat;
  }
  j["data"] = {{"data_path", paths},
               {"preprocessed_data_type", a.preprocessed_data_type},
               {"train_batch_size", a.train_batch_size},
               {"dataloader_num_workers", a.dataloader_num_workers},
               {"training_cfg_rate", a.training_cfg_rate},
               {"seed", a.seed},
               {"num_height", a.num_height},
               {"num_width", a.num_width},
               {"num_latent_t", a.num_latent_t},
               {"num_frames", a.num_frames}};
  if (!a.ode_anchor_indices.empty()) j["data"]["ode_anchor_indices"] = a.ode_anchor_indices;
  const auto& o = t.optimizer;
  j["optimizer"] = {{"learning_rate", o.learning_rate},
                    {"betas", {o.betas[0], o.betas[1]}},
                    {"weight_decay", o.weight_decay},
                    {"eps", o.eps},
                    {"lr_scheduler", lr_schedule_name(o.lr_scheduler)},
                    {"lr_warmup_steps", o.lr_warmup_steps},
                    {"lr_num_cycles", o.lr_num_cycles},
                    {"lr_power", o.lr_power},
                    {"min_lr_ratio", o.min_lr_ratio}};
  if (o.fused) j["optimizer"]["fused"] = *o.fused;
  j["loop"] = {{"max_train_steps", t.loop.max_train_steps},
               {"gradient_accumulation_steps", t.loop.gradient_accumulation_steps}};
  const auto& c = t.checkpoint;
  j["checkpoint"] = {{"output_dir", c.output_dir},
                     {"resume_from_checkpoint", c.resume_from_checkpoint},
                     {"training_state_checkpointing_steps", c.training_state_checkpointing_steps},
                     {"checkpoints_total_limit", c.checkpoints_total_limit}};
  j["tracker"] = {{"trackers", t.tracker.trackers.empty() ? Json::array() : Json(t.tracker.trackers)},
                  {"entity", t.tracker.entity},
                  {"project_name", t.tracker.project_name},
                  {"run_name", t.tracker.run_name}};
  const auto& v = t.vsa;
  j["vsa"] = {{"sparsity", v.sparsity},         {"cache_tile_buf", v.cache_tile_buf},
              {"decay_rate", v.decay_rate},     {"decay_interval_steps", v.decay_interval_steps},
              {"selection", v.selection},       {"top_p", v.top_p}};
  const auto& m = t.model;
  j["model"] = {{"weighting_scheme", m.weighting_scheme},
                {"logit_mean", m.logit_mean},
                {"logit_std", m.logit_std},
                {"mode_scale", m.mode_scale},
                {"precondition_outputs", m.precondition_outputs},
                {"enable_gradient_checkpointing_type", str_or_null(m.enable_gradient_checkpointing_type)}};
  j["dit_precision"] = t.dit_precision;
  j["model_path"] = t.model_path;
  return j;
}

Json to_json(const CallbacksConfig& c, const Json& raw_callbacks) {
  Json j = Json::object();
  for (const auto& name : c.order) {
    const Json& raw = raw_callbacks[name];
    std::string target = raw.is_object() && raw.contains("_target_") && raw["_target_"].is_string()
                             ? raw["_target_"].get<std::string>()
                             : "";
    Json e = Json::object();
    if (!target.empty()) e["_target_"] = target;
    std::string kind = target.empty() ? name : callback_kind_from_target(target).value_or("");
    if (kind == "grad_clip") {
      e["max_grad_norm"] = c.grad_clip.max_grad_norm;
      e["log_grad_norms"] = c.grad_clip.log_grad_norms;
    } else if (kind == "ema") {
      e["decay"] = c.ema.decay;
      e["start_iter"] = c.ema.start_iter;
    } else {
      const auto& v = c.validation;
      e["pipeline_target"] = v.pipeline_target;
      e["dataset_file"] = v.dataset_file;
      e["output_dir"] = v.output_dir;
      e["every_steps"] = v.every_steps;
      e["sampling_steps"] = v.sampling_steps.empty() ? Json::array() : Json(v.sampling_steps);
      e["sampling_timesteps"] = v.sampling_timesteps.empty() ? Json::array() : Json(v.sampling_timesteps);
      e["guidance_scale"] = v.guidance_scale;
      e["run_at_start"] = v.run_at_start;
      e["height"] = v.height;
      e["width"] = v.width;
      e["num_frames"] = v.num_frames;
      e["offload_training_state"] = v.offload_training_state;
      e["unload_pipeline_after_validation"] = v.unload_pipeline_after_validation;
      e["attn_qat_infer"] = v.attn_qat_infer;
      e["use_validation_media_conditioning"] = v.use_validation_media_conditioning;
      if (!v.vae.empty()) e["vae"] = v.vae;
      if (v.fps != 16) e["fps"] = v.fps;
    }
    j[name] = e;
  }
  return j;
}

Json to_json(const PipelineConfig& p) {
  Json j = Json::object();
  if (p.flow_shift) j["flow_shift"] = *p.flow_shift;
  j["dit_config"] = {{"quant_config", p.quant_config}};
  if (!p.dmd_denoising_steps.empty()) j["dmd_denoising_steps"] = p.dmd_denoising_steps;
  j["warp_denoising_step"] = p.warp_denoising_step;
  if (!p.negative_prompt.empty()) j["negative_prompt"] = p.negative_prompt;
  return j;
}

}  // namespace vqad::train::sections
