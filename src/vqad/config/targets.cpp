#include "vqad/config/targets.h"

#include "vqad/config/value.h"

namespace vqad::train {

using config::join;

const char* method_name(MethodKind m) {
  switch (m) {
    case MethodKind::kSft: return "sft";
    case MethodKind::kDmd2: return "dmd2";
    case MethodKind::kLayerRecon: return "layer_recon";
    case MethodKind::kReconOde: return "recon_ode";
  }
  return "?";
}

const std::vector<std::pair<std::string, MethodKind>>& method_target_table() {
  static const std::vector<std::pair<std::string, MethodKind>> t = {
      {"fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod", MethodKind::kSft},
      {"fastvideo.train.methods.distribution_matching.dmd2.DMD2Method", MethodKind::kDmd2},
      {"fastvideo.train.methods.layer_reconstruction.method.LayerReconstructionMethod",
       MethodKind::kLayerRecon},
      {"fastvideo.train.methods.reconstruction_ode.method.ReconstructionODEMethod",
       MethodKind::kReconOde},
      {"sft", MethodKind::kSft},
      {"dmd2", MethodKind::kDmd2},
      {"layer_recon", MethodKind::kLayerRecon},
      {"recon_ode", MethodKind::kReconOde},
  };
  return t;
}

const std::vector<MethodRole>& method_roles(MethodKind m) {
  static const std::vector<MethodRole> sft = {{"student", true}};
  static const std::vector<MethodRole> dmd2 = {{"student", true}, {"teacher", false}, {"critic", true}};
  static const std::vector<MethodRole> teacher_student = {{"student", true}, {"teacher", false}};
  switch (m) {
    case MethodKind::kSft: return sft;
    case MethodKind::kDmd2: return dmd2;
    case MethodKind::kLayerRecon:
    case MethodKind::kReconOde: return teacher_student;
  }
  return sft;
}

std::optional<MethodKind> method_from_target(std::string_view target) {
  for (const auto& [name, kind] : method_target_table())
    if (target == name) return kind;
  return std::nullopt;
}

std::string method_target_choices() {
  std::vector<std::string> v;
  for (const auto& [name, kind] : method_target_table()) v.push_back(name);
  return join(v);
}

namespace {
const std::vector<std::string>& model_targets() {
  static const std::vector<std::string> t = {
      "fastvideo.train.models.wan.WanModel",
      "fastvideo.train.models.wan.wan.WanModel",
      "fastvideo.train.methods.layer_reconstruction.model.LayerReconstructionWanModel",
      "fastvideo.train.methods.reconstruction_ode.model.ReconstructionODEWanModel",
      "wan",
  };
  return t;
}

struct CallbackTarget {
  const char* target;
  const char* kind;
};
constexpr CallbackTarget kCallbackTargets[] = {
    {"fastvideo.train.callbacks.grad_clip.GradNormClipCallback", "grad_clip"},
    {"fastvideo.train.callbacks.ema.EMACallback", "ema"},
    {"fastvideo.train.callbacks.validation.ValidationCallback", "validation"},
    {"fastvideo.train.methods.ode_init.dmd_validation.ShiftedDMDValidationCallback", "validation"},
    {"fastvideo.train.methods.layer_reconstruction.validation.LayerReconstructionValidationCallback",
     "validation"},
    {"fastvideo.train.methods.reconstruction_ode.validation.ReconstructionODEValidationCallback",
     "validation"},
    {"grad_clip", "grad_clip"},
    {"ema", "ema"},
    {"validation", "validation"},
};

constexpr std::pair<LrSchedule, const char*> kLrSchedules[] = {
    {LrSchedule::kLinear, "linear"},
    {LrSchedule::kCosine, "cosine"},
    {LrSchedule::kCosineWithRestarts, "cosine_with_restarts"},
    {LrSchedule::kCosineWithMinLr, "cosine_with_min_lr"},
    {LrSchedule::kPolynomial, "polynomial"},
    {LrSchedule::kConstant, "constant"},
    {LrSchedule::kConstantWithWarmup, "constant_with_warmup"},
    {LrSchedule::kPiecewiseConstant, "piecewise_constant"},
};
}  // namespace

std::optional<std::string> model_kind_from_target(std::string_view target) {
  for (const auto& t : model_targets())
    if (target == t) return std::string("wan");
  return std::nullopt;
}

std::string model_target_choices() { return join(model_targets()); }

std::optional<std::string> callback_kind_from_target(std::string_view target) {
  for (const auto& c : kCallbackTargets)
    if (target == c.target) return std::string(c.kind);
  return std::nullopt;
}

std::string callback_target_choices() {
  std::vector<std::string> v;
  for (const auto& c : kCallbackTargets) v.push_back(c.target);
  return join(v);
}

const char* lr_schedule_name(LrSchedule s) {
  for (const auto& [k, n] : kLrSchedules)
    if (k == s) return n;
  return "?";
}

std::optional<LrSchedule> parse_lr_schedule(std::string_view name) {
  for (const auto& [k, n] : kLrSchedules)
    if (name == n) return k;
  return std::nullopt;
}

std::string lr_schedule_choices() {
  std::vector<std::string> v;
  for (const auto& [k, n] : kLrSchedules) v.push_back(n);
  return join(v);
}

const char* rollout_mode_name(RolloutMode m) { return m == RolloutMode::kSimulate ? "simulate" : "data_latent"; }

std::optional<RolloutMode> parse_rollout_mode(std::string_view name) {
  if (name == "simulate" || name == "sim") return RolloutMode::kSimulate;
  if (name == "data_latent" || name == "data" || name == "vae_latent") return RolloutMode::kDataLatent;
  return std::nullopt;
}

const std::vector<std::string>& quant_configs() {
  static const std::vector<std::string> q = {"none", "nvfp4_qat_train", "nvfp4_qad"};
  return q;
}

std::string quant_config_choices() { return join(quant_configs()); }

}  // namespace vqad::train
