#include "vqad/train/param_groups.h"

#include <regex>

#include "vqad/core/error.h"
#include "vqad/model/quant_plan.h"

namespace vqad::train {

std::string wan_fastvideo_module_path(const std::string& path) {
  // Linears: the quant plan's Diffusers -> FastVideo table.
  std::string linear = model::wan_fastvideo_internal_name(path);
  if (linear != path) return linear;
  static const std::vector<std::pair<std::regex, std::string>> rules = [] {
    std::vector<std::pair<std::regex, std::string>> r;
    auto add = [&](const char* from, const char* to) { r.emplace_back(std::regex(from), to); };
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.attn1\.(norm_q|norm_k)$)", "$1blocks.$2.$3");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.attn1\.to_gate_compress$)", "$1blocks.$2.to_gate_compress");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.norm2$)", "$1blocks.$2.self_attn_residual_norm.norm");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.ffn\.net\.0$)", "$1blocks.$2.ffn");
    return r;
  }();
  for (const auto& [re, to] : rules)
    if (std::regex_search(path, re)) return std::regex_replace(path, re, to);
  return path;
}

namespace {
std::string module_path_of(const std::string& param_name) {
  const auto dot = param_name.rfind('.');
  return dot == std::string::npos ? std::string() : param_name.substr(0, dot);
}
bool path_contains(const std::string& path, const std::string& sub) {
  return !path.empty() && path.find(sub) != std::string::npos;
}
}  // namespace

bool in_trainable_scope(const std::string& param_name, const std::vector<std::string>& modules) {
  const std::string path = module_path_of(param_name);
  const std::string fv = wan_fastvideo_module_path(path);
  for (const auto& m : modules)
    if (path_contains(path, m) || path_contains(fv, m)) return true;
  return false;
}

std::vector<std::string> apply_trainable_scope(model::WanModel& model, const std::vector<std::string>& modules,
                                               const std::string& key) {
  VQAD_CHECK(!modules.empty(), key, ": the trainable scope lists no modules");
  std::vector<std::string> names;
  std::vector<bool> used(modules.size(), false);
  for (auto& item : model.named_parameters()) {
    const std::string path = module_path_of(item.key());
    const std::string fv = wan_fastvideo_module_path(path);
    bool on = false;
    for (size_t i = 0; i < modules.size(); ++i) {
      if (path_contains(path, modules[i]) || path_contains(fv, modules[i])) {
        on = true;
        used[i] = true;
      }
    }
    item.value().set_requires_grad(on);
    if (on) names.push_back(item.key());
  }
  for (size_t i = 0; i < modules.size(); ++i) {
    // to_gate_compress exists only in VSA students; a dense model simply has none.
    if (!used[i] && modules[i] != "to_gate_compress")
      fail(key, ": '", modules[i], "' matches no parameter of the model (module paths look like "
           "blocks.0.attn1.to_q or, in FastVideo's names, blocks.0.to_q)");
  }
  VQAD_CHECK(!names.empty(), key, ": the trainable scope selects no parameter");
  return names;
}

}  // namespace vqad::train
