// Quant plans: which linears of a transformer are NVFP4-quantized, and how
// (spec/linear_qat.md). A plan is plain data - a list of (module name, weight
// scale mode, activation scale mode) - built from the run config and the
// model's linear names, printed by a run and recorded in checkpoint metadata.
// Only the student role is ever quantized; teacher and critic drop the config.
#pragma once
#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_linear.h"

namespace vqad::model {

// Values of `pipeline.dit_config.quant_config`.
enum class QuantMethod {
  kNone,
  kNvfp4QatTrain,  // "nvfp4_qat_train": W and A dynamic (per-call amax)
  kNvfp4Qad,       // "nvfp4_qad": W dynamic; A static (FFN, calibrated) or unit (attention)
};
const char* quant_method_name(QuantMethod m);
// "none" (or ""), "nvfp4_qat_train", "nvfp4_qad"; anything else is an error naming `where`.
QuantMethod parse_quant_method(const std::string& value, const std::string& where);

// The substrings of FastVideo's DEFAULT_FP4_LAYERS (seeds/004 target_prefix_substrings).
const std::vector<std::string>& default_target_prefix_substrings();

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  std::vector<std::string> target_prefix_substrings = default_target_prefix_substrings();
  // QAD only: activation-amax JSON table for the static linears, and whether static
  // linears may be installed without one (to be calibrated before use).
  std::string act_amax_json;
  bool allow_uncalibrated = false;
  // seeds/003's plan toggles (training.linear_quantization): which kinds of targeted
  // linears are quantized (attention: to_q/k/v/out of self- and cross-attention; ffn: both
  // FFN linears; gate: the VSA compression gate to_gate_compress, which the default targets
  // leave out), and blocks left high precision.
  bool quantize_attention = true;
  bool quantize_ffn = true;
  bool quantize_gate = false;
  std::vector<int64_t> skip_blocks;
  // One weight global scale (and one activation global scale) for the q/k/v of each
  // self-attention and the k/v of each cross-attention (training and packed export).
  bool shared_qkv_scale = false;
  // The forward GEMM route every linear of the plan gets (training.linear_quantization.gemm,
  // resolved for the role's device by the role builder; kAuto resolves per call).
  ops::Nvfp4GemmRoute gemm_route = ops::Nvfp4GemmRoute::kFakeQuant;

  bool enabled() const { return method != QuantMethod::kNone; }
};

// Reads `pipeline.dit_config.quant_config` given the dit_config node (may be null).
// Accepted forms: absent/null/"none"; a method name string; or a map
//   {method: <name>, target_prefix_substrings: [..], act_amax_json: <path>,
//    allow_uncalibrated: <bool>}.
// `where` names the node in error messages (e.g. "run.yaml: pipeline.dit_config").
QuantConfig quant_config_from_yaml(const YAML::Node& dit_config, const std::string& where);

// The config a role is built with: student keeps it, every other role gets none.
QuantConfig quant_config_for_role(const QuantConfig& config, const std::string& role);

// FastVideo's internal name of a Wan module given its Diffusers name
// (attn1.to_q -> to_q, attn1.to_out.0 -> to_out, ffn.net.0.proj -> ffn.fc_in, ...);
// names without a mapping are returned unchanged.
std::string wan_fastvideo_internal_name(const std::string& diffusers_name);

struct QuantPlanEntry {
  std::string module;                 // name as the model reports it
  nvfp4::ScaleMode weight_mode;       // always dynamic for vqad's methods
  nvfp4::ScaleMode activation_mode;   // dynamic | static | unit
};

struct QuantPlan {
  QuantMethod method = QuantMethod::kNone;
  std::vector<std::string> target_prefix_substrings;
  std::vector<QuantPlanEntry> entries;
  bool shared_qkv_scale = false;  // see QuantConfig; recorded as "shared_qkv_scale" (absent = false)

  bool empty() const { return entries.empty(); }
  const QuantPlanEntry* find(const std::string& module) const;
  // One line per linear plus a header line with the method and the count.
  std::string to_text() const;
  // {"method", "target_prefix_substrings", "count", "linears": [{"module","weight","activation"}]}
  nlohmann::json to_json() const;
  static QuantPlan from_json(const nlohmann::json& j, const std::string& where);
};

// A linear is targeted when its name, or its FastVideo internal name, contains one
// of the config's substrings. QAD: FFN linears get static activation scales, all
// other targeted linears unit scales. A config that asks for quantization and
// matches nothing is an error (a plan of none is empty and fine).
QuantPlan build_quant_plan(const std::vector<std::string>& linear_names, const QuantConfig& config);

// Whether a (Diffusers or FastVideo internal) linear name is an FFN linear.
bool is_ffn_linear(const std::string& name);
// The kind of a linear for the plan toggles: "ffn", "gate" (to_gate_compress) or "attention".
std::string linear_kind(const std::string& name);

// The shared-scale groups of a plan with shared_qkv_scale: group name
// ("blocks.3.attn1.qkv", "blocks.3.attn2.kv") -> its members in plan order (q, k, v).
// Self-attention q/k/v and cross-attention k/v of the same block form a group when at
// least two of them are planned. Empty when the plan does not share scales.
std::vector<std::pair<std::string, std::vector<std::string>>> shared_scale_groups(const QuantPlan& plan);

// ---- activation-amax tables (QAD static scales) -------------------------------------
// Splits "blocks.12.ffn.net.0.proj" (also "transformer_blocks.12....", "model.blocks...")
// into {12, "ffn.net.0.proj"}; returns false for names outside a block.
bool split_block_name(const std::string& name, int* block, std::string* sub);

// Loads `{"b<block>.<sub>": amax}` JSON (also full module names, and values given
// as {"all": amax}). Every value must be a positive finite number.
std::map<std::string, float> load_amax_table(const std::string& path);
std::map<std::string, float> amax_table_from_json(const nlohmann::json& j, const std::string& where);
// The table entry for a module: its full name, then b<block>.<sub>, then
// blocks.<block>.<sub>, each also with the FastVideo internal name of the module
// (b3.ffn.fc_in for blocks.3.ffn.net.0.proj); nullptr when absent.
const float* lookup_amax(const std::map<std::string, float>& table, const std::string& module);
// {"b<block>.<sub>": amax} of the calibrated static linears (full module names for
// linears outside a block); an uncalibrated static linear is an error.
nlohmann::json export_amax_table(const std::vector<std::shared_ptr<ops::Nvfp4QadLinear>>& layers);
// Writes export_amax_table(layers) to `path` (temp file + rename).
void save_amax_table(const std::vector<std::shared_ptr<ops::Nvfp4QadLinear>>& layers, const std::string& path);

// ---- attaching the plan to a model -----------------------------------------------
// One LinearQuant per plan entry. QAD static linears take their amax from `amax_table`
// (an error naming the module and its table key when absent, unless
// config.allow_uncalibrated, which leaves them for a CalibrationScope). With
// plan.shared_qkv_scale the static members of a group take the group's max amax.
std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> make_linear_quants(
    const QuantPlan& plan, const QuantConfig& config, const std::map<std::string, float>& amax_table = {});

// Static members of a shared-scale group -> the group's max calibrated amax (training and
// packed export use it instead of the member's own table value).
std::map<std::string, float> shared_group_input_amax(const QuantPlan& plan,
                                                     const std::map<std::string, float>& amax_table);

// Gives the members of every shared-scale group of `plan` one ops::WeightScaleGroup whose
// weights come from `weight_of(module)` (read on every forward).
void attach_shared_weight_scales(const QuantPlan& plan,
                                 const std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>& quants,
                                 const std::function<torch::Tensor(const std::string&)>& weight_of);

// The QAD linears among `quants` (for calibration, enable/disable and table export).
std::vector<std::shared_ptr<ops::Nvfp4QadLinear>> qad_linears(
    const std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>& quants);

// Attaches the plan's linears to a model exposing
//   named_linears()                      -> a range of names, or of (name, module) pairs
//   attach_linear_quant(name, shared_ptr<ops::LinearQuant>)
// Every plan entry must name one of the model's linears. Returns the attached objects.
template <class Model>
std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> apply_quant_plan(
    Model& model, const QuantPlan& plan, const QuantConfig& config,
    const std::map<std::string, float>& amax_table = {}) {
  std::vector<std::string> names;
  for (const auto& item : model.named_linears()) {
    if constexpr (requires { item.first; }) {
      names.emplace_back(item.first);
    } else {
      names.emplace_back(item);
    }
  }
  for (const QuantPlanEntry& e : plan.entries) {
    bool found = false;
    for (const std::string& n : names) found = found || n == e.module;
    VQAD_CHECK(found, "quant plan: linear '", e.module, "' is not a linear of this model (",
               names.size(), " linears)");
  }
  auto quants = make_linear_quants(plan, config, amax_table);
  if (plan.shared_qkv_scale) {
    if constexpr (requires { model.named_linears().front().second->weight; }) {
      std::map<std::string, decltype(model.named_linears().front().second)> by_name;
      for (auto& item : model.named_linears()) by_name.emplace(item.first, item.second);
      attach_shared_weight_scales(plan, quants, [by_name](const std::string& m) { return by_name.at(m)->weight; });
    } else {
      fail("quant plan: shared_qkv_scale needs a model whose linears expose their weights");
    }
  }
  for (auto& [name, quant] : quants) model.attach_linear_quant(name, quant);
  return quants;
}

}  // namespace vqad::model
