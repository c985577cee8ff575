// Entry points: YAML -> overrides -> per-section readers -> cross-section rules ->
// resolved dump and hashes.
#include "vqad/config/run_config.h"

#include "vqad/config/linear_quantization.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "vqad/config/sections.h"
#include "vqad/core/sha256.h"

namespace vqad::train {

using config::Ctx;
using config::describe;
using config::join;
using config::key_fail;

std::vector<std::string> MethodConfig::roles() const {
  std::vector<std::string> v;
  for (const auto& r : method_roles(kind)) v.push_back(r.name);
  return v;
}

const RoleConfig& RunConfig::role(const std::string& name) const {
  auto it = models.find(name);
  if (it == models.end()) {
    std::vector<std::string> have;
    for (const auto& [k, v] : models) have.push_back(k);
    fail("config: no model role '", name, "' (roles: ", join(have), ")");
  }
  return it->second;
}

namespace sections {
const SectionSchema& top_level_schema() {
  static const SectionSchema s{"<top level>",
                               {key("models", KeyType::kMapping, nullptr, "role -> model (student, teacher, critic)"),
                                key("method", KeyType::kMapping, nullptr, "the training method (_target_ + its keys)"),
                                key("training", KeyType::kMapping, nullptr, "FastVideo's TrainingConfig"),
                                key("callbacks", KeyType::kMapping, nullptr,
                                    "name -> callback (grad_clip, validation, ema); null removes one"),
                                key("pipeline", KeyType::kMapping, nullptr, "sampling pipeline settings")}};
  return s;
}
}  // namespace sections

std::vector<const config::SectionSchema*> run_config_schemas() {
  std::vector<const config::SectionSchema*> v = {&sections::top_level_schema(), &sections::role_schema()};
  for (auto* group : {&sections::method_schemas(), &sections::training_schemas(), &sections::callback_schemas(),
                      &sections::pipeline_schemas()})
    v.insert(v.end(), group->begin(), group->end());
  return v;
}

namespace {

void validate_roles(const Ctx& ctx, const RunConfig& c, const Json& raw_models, const Json* training) {
  std::vector<std::string> need = c.method.roles();
  const char* mname = method_name(c.method.kind);
  for (const auto& r : need)
    if (!c.models.count(r))
      fail("config ", ctx.source, ": key 'models.", r, "': method ", mname, " needs roles ", join(need), "; '", r,
           "' is missing");
  for (auto it = raw_models.begin(); it != raw_models.end(); ++it)
    if (std::find(need.begin(), need.end(), it.key()) == need.end())
      key_fail(ctx, "models." + it.key(), "method ", mname, " uses roles ", join(need), "; remove the unused role '",
               it.key(), "'");
  auto want_trainable = [&](const std::string& role, bool trainable) {
    const RoleConfig& r = c.models.at(role);
    if (r.trainable != trainable)
      key_fail(ctx, "models." + role + ".trainable", "method ", mname, " needs ", role,
               trainable ? " trainable (true)" : " frozen (false)", ", found ", r.trainable ? "true" : "false");
  };
  for (const auto& r : method_roles(c.method.kind)) want_trainable(r.name, r.trainable);
  if (c.method.kind == MethodKind::kDmd2 && c.training.data.preprocessed_data_type == "text_only" &&
      c.method.dmd2.rollout_mode != RolloutMode::kSimulate)
    key_fail(ctx, "method.rollout_mode",
             "training.data.preprocessed_data_type text_only has no latents; rollout_mode must be simulate, found ",
             rollout_mode_name(c.method.dmd2.rollout_mode));
  if (c.method.kind == MethodKind::kReconOde) {
    // recon_ode trains the VSA compression gates: a dense student has none.
    const auto& tm = c.method.recon_ode.trainable_modules;
    const auto b = c.models.at("student").attention_backend;
    const bool vsa = b == AttentionBackend::kVsaTrain || b == AttentionBackend::kVsaTrainC128 ||
                     b == AttentionBackend::kVsaQatTrainC64 || b == AttentionBackend::kVsaQatTrainC128;
    if (std::find(tm.begin(), tm.end(), "to_gate_compress") != tm.end() && !vsa)
      key_fail(ctx, "models.student.attention_backend", "method recon_ode trains the VSA compression gates "
               "(method.trainable_modules lists to_gate_compress), so the student needs a VSA backend "
               "(VSA_TRAIN, VSA_TRAIN_C64, VSA_TRAIN_C128, VSA_QAT_TRAIN_C64, VSA_QAT_TRAIN_C128), found ",
               attention_backend_name(b), "; for a dense student remove to_gate_compress from method.trainable_modules");
  }
  {
    // training.linear_quantization acts on the student's NVFP4 linears: with dense linears, or
    // an amax table for a method without static scales, a set key would do nothing.
    const LinearQuantizationConfig q = sections::parse_linear_quantization(ctx, training);
    const LinearQuantizationConfig d;
    const std::string sq = c.models.at("student").quant_config;
    const std::string p = "training.linear_quantization.";
    if (sq == "none") {
      auto refuse = [&](bool set, const char* k) {
        if (set) key_fail(ctx, p + k, "the student's linears are dense (quant_config none); set "
                          "pipeline.dit_config.quant_config or models.student.quant_config, or remove the key");
      };
      refuse(!q.act_amax_json.empty(), "act_amax_json");
      refuse(q.quantize_attention != d.quantize_attention, "quantize_attention");
      refuse(q.quantize_ffn != d.quantize_ffn, "quantize_ffn");
      refuse(q.quantize_gate != d.quantize_gate, "quantize_gate");
      refuse(!q.skip_blocks.empty(), "skip_blocks");
      refuse(q.shared_qkv_scale, "shared_qkv_scale");
      refuse(q.gemm != d.gemm, "gemm");
    } else if (sq != "nvfp4_qad" && !q.act_amax_json.empty()) {
      key_fail(ctx, p + "act_amax_json", "quant_config ", sq, " has no static (calibrated) activation scales; the "
               "amax table applies to nvfp4_qad");
    }
  }
  config::check(c.training.optimizer.learning_rate > 0.0, ctx, "training.optimizer.learning_rate",
                std::string("method ") + mname + " trains the student; learning_rate must be > 0, found " +
                    config::format_double(c.training.optimizer.learning_rate));
}

}  // namespace

LinearQuantizationConfig linear_quantization_config(const RunConfig& run) {
  const Json& t = run.resolved.is_object() && run.resolved.contains("training") ? run.resolved["training"] : Json();
  Ctx ctx{run.source_path.empty() ? std::string("<resolved>") : run.source_path};
  return sections::parse_linear_quantization(ctx, t.is_object() ? &t : nullptr);
}

RunConfig parse_run_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                           const std::string& source_name) {
  Ctx ctx{source_name.empty() ? std::string("<string>") : source_name};
  RunConfig c;
  c.source_sha256 = sha256_hex(yaml_text);
  c.overrides = overrides;
  Json raw = yaml_to_json(yaml_text, ctx.source);
  if (raw.is_null()) fail("config ", ctx.source, ": empty; expected a mapping with models, method, training");
  if (!raw.is_object())
    fail("config ", ctx.source,
         ": top level must be a mapping (models, method, training, callbacks, pipeline), found ", describe(raw));
  for (const auto& [key, value] : parse_overrides(overrides)) apply_override(raw, key, value);
  c.raw = raw;

  config::Section top(ctx, &c.raw, sections::top_level_schema(), "");
  const Json* models = top.get("models");
  const Json* method = top.get("method");
  const Json* training = top.get("training");
  const Json* callbacks = top.get("callbacks");
  const Json* pipeline = top.get("pipeline");
  top.finish();
  if (!models) fail("config ", ctx.source, ": missing required section 'models'");
  if (!models->is_object() || models->empty())
    fail("config ", ctx.source, ": key 'models': expected a mapping role -> model, found ", describe(*models));
  if (!training) fail("config ", ctx.source, ": missing required section 'training'");

  c.pipeline = sections::parse_pipeline(ctx, pipeline);
  c.training = sections::parse_training(ctx, training, *models);
  for (auto it = models->begin(); it != models->end(); ++it)
    c.models.emplace(it.key(),
                     sections::parse_role(ctx, it.key(), it.value(), c.training, c.pipeline.quant_config));
  c.method = sections::parse_method(ctx, method);
  c.callbacks = sections::parse_callbacks(ctx, callbacks);
  validate_roles(ctx, c, *models, training);

  c.resolved = Json::object();
  Json rm = Json::object();
  for (auto it = models->begin(); it != models->end(); ++it) rm[it.key()] = sections::to_json(c.models.at(it.key()));
  c.resolved["models"] = rm;
  c.resolved["method"] = sections::to_json(c.method);
  c.resolved["training"] = sections::to_json(c.training);
  // Only when the recipe has the section, so that recipes without it resolve as before.
  if (training->is_object() && training->contains("linear_quantization") &&
      !(*training)["linear_quantization"].is_null())
    c.resolved["training"]["linear_quantization"] = sections::to_json(sections::parse_linear_quantization(ctx, training));
  c.resolved["callbacks"] = sections::to_json(c.callbacks, callbacks ? *callbacks : Json::object());
  c.resolved["pipeline"] = sections::to_json(c.pipeline);
  c.resolved_yaml = dump_yaml(c.resolved);
  c.resolved_sha256 = sha256_hex(c.resolved_yaml);
  return c;
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  VQAD_CHECK(in.good(), "config ", path, ": cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  RunConfig c = parse_run_config(ss.str(), overrides, path);
  c.source_path = path;
  return c;
}

}  // namespace vqad::train
