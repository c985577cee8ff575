// The `models` section: one mapping per role (student / teacher / critic).
#include <cmath>

#include "vqad/config/sections.h"

namespace vqad::train::sections {

const SectionSchema& role_schema() {
  static const SectionSchema s{
      "models.<role>",
      {
          key("_target_", K::kString, nullptr, "model class: " + model_target_choices()),
          key("init_from", K::kString, nullptr, "model id or local Diffusers directory (required)"),
          key("trainable", K::kBool, true, "whether the role's weights train"),
          key("disable_custom_init_weights", K::kBool, false,
              "skip transformer_override_safetensor (FastVideo's flag for roles that keep the base weights)"),
          key("flow_shift", K::kFloat, 3.0, "the role's flow-matching shift"),
          choice_key("enable_gradient_checkpointing_type", checkpointing_types(), nullptr,
                     "activation recompute; default training.model's"),
          key("transformer_override_safetensor", K::kString, "", "weights loaded over init_from ('' = none)"),
          key("attention_backend", K::kString, "FLASH_ATTN", "attention backend: " + attention_backend_choices()),
          choice_key("quant_config", quant_configs(), nullptr,
                     "linear quantization; default pipeline.dit_config.quant_config for the student, none otherwise",
                     true),
          not_supported_yet(key("lora", K::kMapping, nullptr,
                                "LoRA adapters; vqad fine-tunes every weight of a trainable role"),
                            Json{{"enable", false}}),
      }};
  return s;
}

RoleConfig parse_role(const Ctx& ctx, const std::string& name, const Json& node, const TrainingConfig& training,
                      const std::string& pipeline_quant) {
  const std::string p = "models." + name;
  if (!node.is_object())
    fail("config ", ctx.source, ": key '", p, "': expected a mapping with _target_, found ", describe(node));
  Section s(ctx, &node, role_schema(), p);
  RoleConfig r;
  r.name = name;
  r.target = s.required_str("_target_");
  auto kind = model_kind_from_target(r.target);
  if (!kind)
    key_fail(ctx, p + "._target_", "unknown model class '", r.target, "' (valid: ", model_target_choices(), ")");
  r.model_kind = *kind;
  r.init_from = s.required_str("init_from");
  r.trainable = s.boolean("trainable");
  r.disable_custom_init_weights = s.boolean("disable_custom_init_weights");
  r.flow_shift = s.f64("flow_shift");
  check(r.flow_shift > 0.0 && std::isfinite(r.flow_shift), ctx, p + ".flow_shift",
        "must be > 0, found " + format_double(r.flow_shift));
  r.enable_gradient_checkpointing_type =
      s.choice("enable_gradient_checkpointing_type", training.model.enable_gradient_checkpointing_type);
  check_checkpointing_type(ctx, p + ".enable_gradient_checkpointing_type", r.enable_gradient_checkpointing_type);
  r.transformer_override_safetensor = s.str("transformer_override_safetensor");
  if (const Json* b = s.get("attention_backend")) {
    std::string bn = as_string(ctx, p + ".attention_backend", *b);
    auto backend = parse_attention_backend(bn);
    if (!backend)
      key_fail(ctx, p + ".attention_backend", "unknown attention backend '", bn,
               "' (valid: ", attention_backend_choices(), ")");
    r.attention_backend = *backend;
  }
  r.quant_config = s.choice("quant_config", name == "student" ? pipeline_quant : "none");
  s.finish();
  return r;
}

}  // namespace vqad::train::sections
