// The `_target_` tables: FastVideo class paths (and vqad's short names) -> vqad
// methods, models and callbacks, and the named enums of the run config.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace vqad::train {

enum class MethodKind { kSft, kDmd2, kLayerRecon, kReconOde };
const char* method_name(MethodKind m);  // "sft", "dmd2", "layer_recon", "recon_ode"
// A FastVideo class path or a vqad name -> method.
std::optional<MethodKind> method_from_target(std::string_view target);
std::string method_target_choices();
const std::vector<std::pair<std::string, MethodKind>>& method_target_table();

// The roles a method needs, in build order, and whether each trains (the config
// refuses a role whose `trainable` differs; trainable roles are checkpointed).
struct MethodRole {
  std::string name;
  bool trainable = false;
};
const std::vector<MethodRole>& method_roles(MethodKind m);

// Model plugins: every FastVideo Wan role class maps to vqad's Wan model.
std::optional<std::string> model_kind_from_target(std::string_view target);  // -> "wan"
std::string model_target_choices();

// Callbacks: a FastVideo callback class (or a vqad name) -> grad_clip | ema | validation.
std::optional<std::string> callback_kind_from_target(std::string_view target);
std::string callback_target_choices();

enum class LrSchedule {
  kConstant,
  kConstantWithWarmup,
  kLinear,
  kCosine,
  kCosineWithRestarts,
  kCosineWithMinLr,
  kPolynomial,
  kPiecewiseConstant,
};
const char* lr_schedule_name(LrSchedule s);
std::optional<LrSchedule> parse_lr_schedule(std::string_view name);
std::string lr_schedule_choices();

enum class RolloutMode { kSimulate, kDataLatent };
const char* rollout_mode_name(RolloutMode m);  // "simulate", "data_latent"
// Accepts FastVideo's aliases: sim, data, vae_latent.
std::optional<RolloutMode> parse_rollout_mode(std::string_view name);

// Linear quantization config names (spec/linear_qat.md).
const std::vector<std::string>& quant_configs();
std::string quant_config_choices();  // "none, nvfp4_qat_train, nvfp4_qad"

}  // namespace vqad::train
