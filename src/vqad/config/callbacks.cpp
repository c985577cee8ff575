// The `callbacks` section (grad_clip, ema, validation; a null entry removes the
// callback) and the `pipeline` section.
#include <cmath>
#include <set>

#include "vqad/config/sections.h"

namespace vqad::train::sections {

namespace {

KeyDesc callback_target_key() {
  return key("_target_", K::kString, "", "callback class: " + callback_target_choices());
}

const SectionSchema& grad_clip_schema() {
  static const SectionSchema s{
      "callbacks.<grad_clip>",
      {callback_target_key(), key("max_grad_norm", K::kFloat, 1.0, "global grad-norm clip per role (0 = no clipping)"),
       key("log_grad_norms", K::kBool, true, "log grad_norm/<role> (always logged)")}};
  return s;
}

const SectionSchema& validation_schema() {
  static const SectionSchema s{
      "callbacks.<validation>",
      {callback_target_key(),
       key("pipeline_target", K::kString, "", "FastVideo pipeline class (informational: vqad picks the sampler of "
                                              "the method)"),
       key("dataset_file", K::kString, "", "prompts with text embeddings: parquet dataset or JSON list"),
       key("output_dir", K::kString, "", "'' = <training.checkpoint.output_dir>/validation"),
       key("every_steps", K::kInt, 0, "validate every N steps; 0 turns the callback off (no files are opened)"),
       key("sampling_steps", K::kIntList, Json::array(), "Euler steps (first entry) of the sft sampler"),
       key("sampling_timesteps", K::kFloatList, Json::array(), "DMD sampler timesteps (default the method's)"),
       key("guidance_scale", K::kFloat, 5.0, "CFG scale of the sft sampler"),
       key("run_at_start", K::kBool, true, "also validate before the first step"),
       key("height", K::kInt, 0, "sample height (0 = training.data's)"),
       key("width", K::kInt, 0, "sample width (0 = training.data's)"),
       key("num_frames", K::kInt, 0, "sample frames (0 = training.data's)"),
       key("offload_training_state", K::kBool, false, "a GPU-memory knob of FastVideo's validation"),
       key("unload_pipeline_after_validation", K::kBool, false, "a GPU-memory knob of FastVideo's validation"),
       not_supported_yet(key("attn_qat_infer", K::kBool, false,
                             "sampling with the inference variant of the QAT attention; vqad samples with the "
                             "student's training backend"),
                         false),
       key("use_validation_media_conditioning", K::kBool, false, "image conditioning (T2V: none)"),
       key("vae", K::kString, "",
           "vqad: Wan VAE (a vae/ directory or a Diffusers root) to decode the samples into sample_<i>.mp4 and "
           "contact_sheet.png; '' = the student's Diffusers root when it has vae/, 'none' = latents only"),
       key("fps", K::kInt, 16, "vqad: frames per second of the decoded MP4s")}};
  return s;
}

const SectionSchema& ema_schema() {
  static const SectionSchema s{
      "callbacks.<ema>",
      {callback_target_key(),
       not_supported_yet(key("decay", K::kFloat, 0.9999, "EMA weights; vqad keeps and exports the trained weights")),
       not_supported_yet(key("start_iter", K::kInt, 0, "EMA weights; vqad keeps and exports the trained weights"))}};
  return s;
}

const SectionSchema& dit_config_schema() {
  static const SectionSchema s{
      "pipeline.dit_config",
      {choice_key("quant_config", quant_configs(), "none", "the student's linear quantization", true)}};
  return s;
}

const SectionSchema& pipeline_schema() {
  static const SectionSchema s{
      "pipeline",
      {key("flow_shift", K::kFloat, nullptr, "sampling / score shift (default the student's flow_shift)"),
       key("dit_config", K::kMapping, nullptr, "transformer config"),
       key("dmd_denoising_steps", K::kFloatList, Json::array(), "FastVideo pipeline copy of the DMD steps"),
       key("warp_denoising_step", K::kBool, false, "FastVideo pipeline copy of the warp flag"),
       key("negative_prompt", K::kString, "", "the negative prompt text (vqad reads its embedding from "
                                              "method.negative_prompt_embedding)")}};
  return s;
}

}  // namespace

const std::vector<const SectionSchema*>& callback_schemas() {
  static const std::vector<const SectionSchema*> v = {&grad_clip_schema(), &validation_schema(), &ema_schema()};
  return v;
}

const std::vector<const SectionSchema*>& pipeline_schemas() {
  static const std::vector<const SectionSchema*> v = {&pipeline_schema(), &dit_config_schema()};
  return v;
}

CallbacksConfig parse_callbacks(const Ctx& ctx, const Json* node) {
  CallbacksConfig c;
  if (!node || node->is_null()) return c;
  if (!node->is_object())
    fail("config ", ctx.source, ": key 'callbacks': expected a mapping, found ", describe(*node));
  std::set<std::string> seen;
  for (auto it = node->begin(); it != node->end(); ++it) {
    const std::string name = it.key();
    const std::string p = "callbacks." + name;
    if (it.value().is_null()) continue;  // `callbacks.X: null` / `--callbacks.X none` removes callback X
    std::string target;
    if (it.value().is_object() && it.value().contains("_target_") && !it.value()["_target_"].is_null())
      target = as_string(ctx, p + "._target_", it.value()["_target_"]);
    std::string kind;
    if (!target.empty()) {
      auto k = callback_kind_from_target(target);
      if (!k)
        key_fail(ctx, p + "._target_", "unknown callback class '", target, "' (valid: ", callback_target_choices(),
                 ")");
      kind = *k;
    } else if (name == "grad_clip" || name == "ema" || name == "validation") {
      kind = name;
    } else {
      if (!it.value().is_object())
        fail("config ", ctx.source, ": key '", p, "': expected a mapping, found ", describe(it.value()));
      key_fail(ctx, p, "unknown callback without _target_ (valid names: grad_clip, validation, ema)");
    }
    check(seen.insert(kind).second, ctx, p, "a second " + kind + " callback is not supported");
    if (kind == "grad_clip") {
      Section s(ctx, &it.value(), grad_clip_schema(), p);
      c.grad_clip.enabled = true;
      c.grad_clip.max_grad_norm = s.f64("max_grad_norm");
      c.grad_clip.log_grad_norms = s.boolean("log_grad_norms");
      check(c.grad_clip.max_grad_norm >= 0.0, ctx, p + ".max_grad_norm", "must be >= 0 (0 = no clipping)");
      s.finish();
    } else if (kind == "ema") {
      key_fail(ctx, p, "the EMA callback is not supported yet (vqad keeps and exports the trained weights, not an "
               "average): remove it, e.g. --", p, " none");
    } else {
      Section s(ctx, &it.value(), validation_schema(), p);
      auto& v = c.validation;
      v.target = target;
      v.pipeline_target = s.str("pipeline_target");
      v.dataset_file = s.str("dataset_file");
      v.output_dir = s.str("output_dir");
      v.every_steps = s.i64("every_steps");
      v.sampling_steps = s.i64_list("sampling_steps");
      v.sampling_timesteps = s.f64_list("sampling_timesteps");
      v.guidance_scale = s.f64("guidance_scale");
      check(std::isfinite(v.guidance_scale) && v.guidance_scale >= 0.0, ctx, p + ".guidance_scale",
            "must be finite and >= 0, found " + format_double(v.guidance_scale));
      v.run_at_start = s.boolean("run_at_start");
      v.height = s.i64("height");
      v.width = s.i64("width");
      v.num_frames = s.i64("num_frames");
      v.offload_training_state = s.boolean("offload_training_state");
      v.unload_pipeline_after_validation = s.boolean("unload_pipeline_after_validation");
      v.attn_qat_infer = s.boolean("attn_qat_infer");
      v.use_validation_media_conditioning = s.boolean("use_validation_media_conditioning");
      v.vae = s.str("vae");
      v.fps = s.i64("fps");
      check(v.fps >= 1, ctx, p + ".fps", "must be >= 1, found " + std::to_string(v.fps));
      check(v.every_steps >= 0, ctx, p + ".every_steps", "must be >= 0");
      if (v.every_steps > 0) {
        check(!v.dataset_file.empty(), ctx, p + ".dataset_file", "must be set when every_steps > 0");
        check(!v.sampling_steps.empty(), ctx, p + ".sampling_steps", "must be set when every_steps > 0");
      }
      for (auto n : v.sampling_steps) check(n >= 1, ctx, p + ".sampling_steps", "entries must be >= 1");
      // every_steps 0: the callback is off (run_at_start included), so nothing is opened.
      v.enabled = v.every_steps > 0;
      s.finish();
    }
    c.order.push_back(name);
  }
  return c;
}

PipelineConfig parse_pipeline(const Ctx& ctx, const Json* node) {
  PipelineConfig c;
  if (node && node->is_string())
    key_fail(ctx, "pipeline", "a pipeline config file path is not supported; write its keys inline");
  Section s(ctx, node, pipeline_schema(), "pipeline");
  if (s.has("flow_shift")) {
    c.flow_shift = s.f64("flow_shift", 0.0);
    check(*c.flow_shift > 0.0, ctx, "pipeline.flow_shift", "must be > 0, found " + format_double(*c.flow_shift));
  }
  {
    Section d = s.sub("dit_config", dit_config_schema());
    c.quant_config = d.choice("quant_config");
    d.finish();
  }
  c.dmd_denoising_steps = s.f64_list("dmd_denoising_steps");
  c.warp_denoising_step = s.boolean("warp_denoising_step");
  c.negative_prompt = s.str("negative_prompt");
  s.finish();
  return c;
}

}  // namespace vqad::train::sections
