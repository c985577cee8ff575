// The `method` section: `_target_` picks the method; each method kind has its own keys.
#include <cmath>

#include "vqad/config/sections.h"

namespace vqad::train::sections {

namespace {

KeyDesc target_key() {
  return key("_target_", K::kString, nullptr, "method class or name: " + method_target_choices());
}

const SectionSchema& sft_schema() {
  static const SectionSchema s{
      "method (sft)",
      {target_key(),
       choice_key("attn_kind", {"", "dense", "vsa"}, "", "informational in FastVideo (derived from the backend)",
                  true)}};
  return s;
}

const SectionSchema& cfg_uncond_schema() {
  static const SectionSchema s{
      "method.cfg_uncond",
      {choice_key("on_missing", {"error", "ignore"}, "error",
                  "without a negative prompt embedding: error, or ignore (teacher sees the zero text)"),
       choice_key("text", {"keep", "zero", "negative_prompt"}, "keep",
                  "the teacher's unconditional text (drop is rejected for Wan)")}};
  return s;
}

const SectionSchema& shifted_ode_schema() {
  static const SectionSchema s{
      "method.shifted_ode_schedule",
      {key("flow_shift", K::kFloat, 0.0, "schedule shift (> 0)"),
       key("teacher_steps", K::kInt, 0, "teacher ODE steps (> 0)"),
       key("student_steps", K::kInt, 0, "student steps (= number of indices)"),
       key("version", K::kInt, 1, "schedule format version"),
       key("indices", K::kIntList, Json::array(), "teacher step of each student step"),
       key("sigmas", K::kFloatList, Json::array(), "recorded sigmas"),
       key("timesteps", K::kFloatList, Json::array(), "recorded timesteps")}};
  return s;
}

const SectionSchema& dmd2_schema() {
  static const SectionSchema s{
      "method (dmd2)",
      {target_key(),
       key("rollout_mode", K::kString, nullptr, "simulate | data_latent (aliases sim, data, vae_latent); required"),
       key("dmd_denoising_steps", K::kFloatList, nullptr, "student timesteps in (0, 1000]; required"),
       key("generator_update_interval", K::kInt, 1, "student update every N steps (>= 1; FastVideo's coercion of 0 to 1 is refused)"),
       key("min_timestep_ratio", K::kFloat, 0.0, "score timestep range lower bound, in [0, 1]"),
       key("max_timestep_ratio", K::kFloat, 1.0, "score timestep range upper bound, in [0, 1]"),
       key("real_score_guidance_scale", K::kFloat, 1.0, "teacher CFG scale"),
       key("warp_denoising_step", K::kBool, false, "map the steps onto the student grid"),
       key("fake_score_learning_rate", K::kFloat, nullptr, "critic AdamW learning rate (> 0); required"),
       key("fake_score_betas", K::kPair, Json::array({0.9, 0.999}), "critic AdamW betas; required"),
       key("fake_score_lr_scheduler", K::kString, nullptr, "critic LR schedule; required"),
       key("cfg_uncond", K::kMapping, nullptr, "the teacher's unconditional branch"),
       key("negative_prompt_embedding", K::kString, "",
           "vqad extension: .safetensors [L, D] or a parquet dataset whose first row holds the negative prompt's "
           "text embedding"),
       key("shifted_ode_schedule", K::kMapping, nullptr, "the shifted ODE schedule of sparse DMD2")}};
  return s;
}

const SectionSchema& layer_recon_schema() {
  static const LayerReconConfig d;
  static const SectionSchema s{
      "method (layer_recon)",
      {target_key(), key("group_size", K::kInt, d.group_size, "blocks per reconstruction group"),
       key("energy_floor", K::kFloat, d.energy_floor, "normalizer floor of the relative loss"),
       choice_key("input_source", {"ode_start"}, d.input_source, "inputs of the groups"),
       choice_key("propagation", {"teacher"}, d.propagation, "which model feeds the next group"),
       choice_key("loss", {"mse"}, d.loss, "reconstruction loss"),
       choice_key("trainable_scope", {"quantized_path"}, d.trainable_scope, "which parameters train"),
       key("checkpoint_blocks", K::kBool, d.checkpoint_blocks, "recompute blocks in backward"),
       key("trainable_modules", K::kStringList, d.trainable_modules, "module names that train")}};
  return s;
}

const SectionSchema& recon_ode_schema() {
  static const ReconOdeConfig d;
  static const SectionSchema s{
      "method (recon_ode)",
      {target_key(),
       key("attention_weight", K::kFloat, d.attention_weight, "weight of the attention reconstruction"),
       key("mlp_weight", K::kFloat, d.mlp_weight, "weight of the MLP reconstruction"),
       key("ode_weight", K::kFloat, d.ode_weight, "weight of the ODE endpoint loss"),
       key("student_steps", K::kInt, d.student_steps,
           "student steps: trains on the ODE-cache anchors k * teacher_steps / student_steps"),
       choice_key("loss", {"mse"}, d.loss, "loss"),
       choice_key("trainable_scope", {"quantized_path"}, d.trainable_scope, "which parameters train"),
       key("checkpoint_blocks", K::kBool, d.checkpoint_blocks, "recompute blocks in backward"),
       key("trainable_modules", K::kStringList, d.trainable_modules, "module names that train")}};
  return s;
}

const SectionSchema& schema_of(MethodKind k) {
  switch (k) {
    case MethodKind::kSft: return sft_schema();
    case MethodKind::kDmd2: return dmd2_schema();
    case MethodKind::kLayerRecon: return layer_recon_schema();
    case MethodKind::kReconOde: return recon_ode_schema();
  }
  return sft_schema();
}

std::string fmt(double v) { return format_double(v); }

void parse_dmd2(const Ctx& ctx, const Section& s, Dmd2Config& d) {
  const Json* rm = s.get("rollout_mode");
  if (!rm) fail("config ", ctx.source, ": missing required key 'method.rollout_mode' (valid: simulate, data_latent)");
  std::string rms = as_string(ctx, "method.rollout_mode", *rm);
  auto mode = parse_rollout_mode(rms);
  if (!mode)
    key_fail(ctx, "method.rollout_mode", "unknown rollout mode '", rms,
             "' (valid: simulate, data_latent; aliases sim, data, vae_latent)");
  d.rollout_mode = *mode;
  if (!s.has("dmd_denoising_steps")) fail("config ", ctx.source, ": missing required key 'method.dmd_denoising_steps'");
  d.dmd_denoising_steps = s.f64_list("dmd_denoising_steps");
  check(!d.dmd_denoising_steps.empty(), ctx, "method.dmd_denoising_steps", "must not be empty");
  for (double t : d.dmd_denoising_steps)
    check(t > 0.0 && t <= 1000.0, ctx, "method.dmd_denoising_steps", "timesteps must be in (0, 1000], found " + fmt(t));
  d.generator_update_interval = s.i64("generator_update_interval");
  // FastVideo coerces 0 to 1; vqad refuses it rather than train something other than asked.
  check(d.generator_update_interval >= 1, ctx, "method.generator_update_interval",
        "must be >= 1, found " + std::to_string(d.generator_update_interval));
  d.min_timestep_ratio = s.f64("min_timestep_ratio");
  d.max_timestep_ratio = s.f64("max_timestep_ratio");
  check(0.0 <= d.min_timestep_ratio && d.min_timestep_ratio <= d.max_timestep_ratio && d.max_timestep_ratio <= 1.0,
        ctx, "method.min_timestep_ratio",
        "need 0 <= min_timestep_ratio <= max_timestep_ratio <= 1, found " + fmt(d.min_timestep_ratio) + " and " +
            fmt(d.max_timestep_ratio));
  d.real_score_guidance_scale = s.f64("real_score_guidance_scale");
  check(std::isfinite(d.real_score_guidance_scale) && d.real_score_guidance_scale >= 0.0, ctx,
        "method.real_score_guidance_scale", "must be finite and >= 0, found " + fmt(d.real_score_guidance_scale));
  d.warp_denoising_step = s.boolean("warp_denoising_step");
  if (!s.has("fake_score_learning_rate"))
    fail("config ", ctx.source, ": missing required key 'method.fake_score_learning_rate'");
  d.fake_score_learning_rate = s.f64("fake_score_learning_rate", 0.0);
  check(d.fake_score_learning_rate > 0.0, ctx, "method.fake_score_learning_rate",
        "must be > 0, found " + fmt(d.fake_score_learning_rate));
  d.fake_score_betas = s.betas("fake_score_betas", true);
  if (!s.has("fake_score_lr_scheduler"))
    fail("config ", ctx.source, ": missing required key 'method.fake_score_lr_scheduler' (valid: ",
         lr_schedule_choices(), ")");
  std::string sched = s.str("fake_score_lr_scheduler", "constant");
  auto ls = parse_lr_schedule(sched);
  if (!ls)
    key_fail(ctx, "method.fake_score_lr_scheduler", "unknown LR schedule '", sched, "' (valid: ", lr_schedule_choices(),
             ")");
  d.fake_score_lr_scheduler = *ls;
  if (s.has("cfg_uncond")) {
    Section u = s.sub("cfg_uncond", cfg_uncond_schema());
    CfgUncondConfig cu;
    cu.on_missing = u.choice("on_missing");
    cu.text = u.str("text");
    if (cu.text == "drop")
      key_fail(ctx, "method.cfg_uncond.text", "'drop' is not supported for Wan (valid: keep, zero, negative_prompt)");
    u.choice("text");
    u.finish();
    d.cfg_uncond = cu;
  }
  d.negative_prompt_embedding = s.str("negative_prompt_embedding");
  if (s.has("shifted_ode_schedule")) {
    Section o = s.sub("shifted_ode_schedule", shifted_ode_schema());
    auto& so = d.shifted_ode_schedule;
    so.present = true;
    so.flow_shift = o.f64("flow_shift");
    so.teacher_steps = o.i64("teacher_steps");
    so.student_steps = o.i64("student_steps");
    so.version = o.i64("version");
    so.indices = o.i64_list("indices");
    so.sigmas = o.f64_list("sigmas");
    so.timesteps = o.f64_list("timesteps");
    o.finish();
    check(so.flow_shift > 0.0, ctx, "method.shifted_ode_schedule.flow_shift", "must be > 0");
    check(so.teacher_steps > 0, ctx, "method.shifted_ode_schedule.teacher_steps", "must be > 0");
    check(so.indices.size() == static_cast<size_t>(so.student_steps), ctx, "method.shifted_ode_schedule.indices",
          "must have student_steps entries");
    for (auto i : so.indices)
      check(i >= 0 && i < so.teacher_steps, ctx, "method.shifted_ode_schedule.indices",
            "entries must be in [0, teacher_steps), found " + std::to_string(i));
  }
}

}  // namespace

const std::vector<const SectionSchema*>& method_schemas() {
  static const std::vector<const SectionSchema*> v = {&sft_schema(),         &dmd2_schema(),
                                                      &cfg_uncond_schema(),  &shifted_ode_schema(),
                                                      &layer_recon_schema(), &recon_ode_schema()};
  return v;
}

MethodConfig parse_method(const Ctx& ctx, const Json* node) {
  if (!node || node->is_null()) fail("config ", ctx.source, ": missing required section 'method'");
  MethodConfig m;
  {
    // The target picks the schema the rest of the section is read against.
    Section t(ctx, node, sft_schema(), "method");
    m.target = t.required_str("_target_");
  }
  auto kind = method_from_target(m.target);
  if (!kind)
    key_fail(ctx, "method._target_", "unknown method '", m.target, "' (valid: ", method_target_choices(), ")");
  m.kind = *kind;
  Section s(ctx, node, schema_of(m.kind), "method");
  switch (m.kind) {
    case MethodKind::kSft:
      m.sft.attn_kind = s.choice("attn_kind");
      break;
    case MethodKind::kDmd2:
      parse_dmd2(ctx, s, m.dmd2);
      break;
    case MethodKind::kLayerRecon: {
      auto& l = m.layer_recon;
      l.group_size = s.i64("group_size");
      l.energy_floor = s.f64("energy_floor");
      l.input_source = s.choice("input_source");
      l.propagation = s.choice("propagation");
      l.loss = s.choice("loss");
      l.trainable_scope = s.choice("trainable_scope");
      l.checkpoint_blocks = s.boolean("checkpoint_blocks");
      l.trainable_modules = s.str_list("trainable_modules");
      check(l.group_size >= 1, ctx, "method.group_size", "must be >= 1");
      check(l.energy_floor > 0.0, ctx, "method.energy_floor", "must be > 0");
      check(!l.trainable_modules.empty(), ctx, "method.trainable_modules", "must not be empty");
      break;
    }
    case MethodKind::kReconOde: {
      auto& r = m.recon_ode;
      r.attention_weight = s.f64("attention_weight");
      r.mlp_weight = s.f64("mlp_weight");
      r.ode_weight = s.f64("ode_weight");
      r.student_steps = s.i64("student_steps");
      r.loss = s.choice("loss");
      r.trainable_scope = s.choice("trainable_scope");
      r.checkpoint_blocks = s.boolean("checkpoint_blocks");
      r.trainable_modules = s.str_list("trainable_modules");
      for (auto [k, v] : {std::pair<const char*, double>{"attention_weight", r.attention_weight},
                          {"mlp_weight", r.mlp_weight},
                          {"ode_weight", r.ode_weight}})
        check(v >= 0.0, ctx, std::string("method.") + k, "must be >= 0, found " + fmt(v));
      check(r.attention_weight + r.mlp_weight + r.ode_weight > 0.0, ctx, "method",
            "attention_weight + mlp_weight + ode_weight must be > 0");
      check(r.student_steps >= 1, ctx, "method.student_steps", "must be >= 1");
      break;
    }
  }
  s.finish();
  return m;
}

}  // namespace vqad::train::sections
