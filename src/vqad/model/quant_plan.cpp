#include "vqad/model/quant_plan.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

namespace vqad::model {
namespace {

using nvfp4::ScaleMode;

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// Diffusers -> FastVideo internal module names of Wan (FastVideo's
// WanVideoArchConfig.param_names_mapping, applied to module names).
const std::vector<std::pair<std::regex, std::string>>& wan_name_rules() {
  static const std::vector<std::pair<std::regex, std::string>> rules = [] {
    std::vector<std::pair<std::regex, std::string>> r;
    auto add = [&](const char* from, const char* to) { r.emplace_back(std::regex(from), to); };
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.attn1\.to_(q|k|v)$)", "$1blocks.$2.to_$3");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.attn1\.to_out\.0$)", "$1blocks.$2.to_out");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.attn2\.to_out\.0$)", "$1blocks.$2.attn2.to_out");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.ffn\.net\.0\.proj$)", "$1blocks.$2.ffn.fc_in");
    add(R"(^((?:.*\.)?)blocks\.(\d+)\.ffn\.net\.2$)", "$1blocks.$2.ffn.fc_out");
    add(R"(^((?:.*\.)?)condition_embedder\.time_embedder\.linear_1$)",
        "$1condition_embedder.time_embedder.mlp.fc_in");
    add(R"(^((?:.*\.)?)condition_embedder\.time_embedder\.linear_2$)",
        "$1condition_embedder.time_embedder.mlp.fc_out");
    add(R"(^((?:.*\.)?)condition_embedder\.time_proj$)", "$1condition_embedder.time_modulation.linear");
    add(R"(^((?:.*\.)?)condition_embedder\.text_embedder\.linear_1$)", "$1condition_embedder.text_embedder.fc_in");
    add(R"(^((?:.*\.)?)condition_embedder\.text_embedder\.linear_2$)", "$1condition_embedder.text_embedder.fc_out");
    return r;
  }();
  return rules;
}

bool contains_any(const std::string& name, const std::vector<std::string>& subs) {
  for (const auto& s : subs) {
    if (name.find(s) != std::string::npos) return true;
  }
  return false;
}

ScaleMode mode_from_json(const nlohmann::json& j, const char* key, const std::string& where) {
  VQAD_CHECK(j.contains(key) && j[key].is_string(), where, ": expected string field '", key, "'");
  const std::string v = j[key].get<std::string>();
  return nvfp4::parse_scale_mode(v.c_str(), (where + "." + key).c_str());
}

}  // namespace

const char* quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kNone: return "none";
    case QuantMethod::kNvfp4QatTrain: return "nvfp4_qat_train";
    case QuantMethod::kNvfp4Qad: return "nvfp4_qad";
  }
  return "?";
}

QuantMethod parse_quant_method(const std::string& value, const std::string& where) {
  if (value.empty() || value == "none") return QuantMethod::kNone;
  if (value == "nvfp4_qat_train") return QuantMethod::kNvfp4QatTrain;
  if (value == "nvfp4_qad") return QuantMethod::kNvfp4Qad;
  fail(where, ": unknown quant_config '", value, "' (valid: none, nvfp4_qat_train, nvfp4_qad)");
}

const std::vector<std::string>& default_target_prefix_substrings() {
  static const std::vector<std::string> v = {"ffn.fc_in", "ffn.fc_out", "to_q", "to_k", "to_v", "to_out",
                                             "self_attention.out_layer", "cross_attention.out_layer",
                                             "feed_forward.mlp.fc_in", "feed_forward.mlp.fc_out"};
  return v;
}

QuantConfig quant_config_from_yaml(const YAML::Node& dit_config, const std::string& where) {
  QuantConfig cfg;
  if (!dit_config || dit_config.IsNull()) return cfg;
  VQAD_CHECK(dit_config.IsMap(), where, ": expected a map");
  const YAML::Node q = dit_config["quant_config"];
  const std::string qwhere = where + ".quant_config";
  if (!q || q.IsNull()) return cfg;
  if (q.IsScalar()) {
    cfg.method = parse_quant_method(q.as<std::string>(), qwhere);
    return cfg;
  }
  VQAD_CHECK(q.IsMap(), qwhere, ": expected a method name or a map, got a sequence");
  bool has_method = false;
  for (const auto& kv : q) {
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    if (key == "method") {
      VQAD_CHECK(v.IsScalar(), qwhere, ".method: expected a string");
      cfg.method = parse_quant_method(v.as<std::string>(), qwhere + ".method");
      has_method = true;
    } else if (key == "target_prefix_substrings") {
      VQAD_CHECK(v.IsSequence(), qwhere, ".target_prefix_substrings: expected a list of strings");
      cfg.target_prefix_substrings.clear();
      for (const auto& s : v) {
        VQAD_CHECK(s.IsScalar() && !s.as<std::string>().empty(), qwhere,
                   ".target_prefix_substrings: expected non-empty strings");
        cfg.target_prefix_substrings.push_back(s.as<std::string>());
      }
      VQAD_CHECK(!cfg.target_prefix_substrings.empty(), qwhere, ".target_prefix_substrings: empty list");
    } else if (key == "act_amax_json") {
      VQAD_CHECK(v.IsScalar(), qwhere, ".act_amax_json: expected a path");
      cfg.act_amax_json = v.as<std::string>();
    } else if (key == "allow_uncalibrated") {
      try {
        cfg.allow_uncalibrated = v.as<bool>();
      } catch (const YAML::Exception&) {
        fail(qwhere, ".allow_uncalibrated: expected true or false, got '", v.as<std::string>(), "'");
      }
    } else {
      fail(qwhere, ": unknown key '", key,
           "' (valid: method, target_prefix_substrings, act_amax_json, allow_uncalibrated)");
    }
  }
  VQAD_CHECK(has_method, qwhere, ": missing 'method'");
  VQAD_CHECK(cfg.method == QuantMethod::kNvfp4Qad || (cfg.act_amax_json.empty() && !cfg.allow_uncalibrated), qwhere,
             ": act_amax_json and allow_uncalibrated apply only to nvfp4_qad, method is ",
             quant_method_name(cfg.method));
  return cfg;
}

QuantConfig quant_config_for_role(const QuantConfig& config, const std::string& role) {
  if (role == "student") return config;
  QuantConfig none = config;
  none.method = QuantMethod::kNone;
  none.act_amax_json.clear();
  none.allow_uncalibrated = false;
  return none;
}

std::string wan_fastvideo_internal_name(const std::string& diffusers_name) {
  for (const auto& [re, to] : wan_name_rules()) {
    if (std::regex_search(diffusers_name, re)) return std::regex_replace(diffusers_name, re, to);
  }
  return diffusers_name;
}

bool is_ffn_linear(const std::string& name) {
  static const std::vector<std::string> ffn = {"ffn.fc_in", "ffn.fc_out", "feed_forward.mlp.fc_in",
                                               "feed_forward.mlp.fc_out", "ff.fc_in", "ff.fc_out"};
  return contains_any(name, ffn) || contains_any(wan_fastvideo_internal_name(name), ffn);
}

std::string linear_kind(const std::string& name) {
  if (is_ffn_linear(name)) return "ffn";
  if (name.find("to_gate_compress") != std::string::npos) return "gate";
  return "attention";
}

std::vector<std::pair<std::string, std::vector<std::string>>> shared_scale_groups(const QuantPlan& plan) {
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  if (!plan.shared_qkv_scale) return groups;
  // On FastVideo's internal names: self-attention blocks.N.to_q/k/v, cross-attention
  // blocks.N.attn2.to_k/v (attn2.to_q has another input and keeps its own scale).
  static const std::regex self_re(R"(^((?:.*\.)?blocks\.\d+)\.to_(q|k|v)$)");
  static const std::regex cross_re(R"(^((?:.*\.)?blocks\.\d+)\.attn2\.to_(k|v)$)");
  std::map<std::string, size_t> index;
  for (const auto& e : plan.entries) {
    const std::string internal = wan_fastvideo_internal_name(e.module);
    std::smatch m;
    std::string group;
    if (std::regex_search(internal, m, self_re)) {
      group = m[1].str() + ".attn1.qkv";
    } else if (std::regex_search(internal, m, cross_re)) {
      group = m[1].str() + ".attn2.kv";
    } else {
      continue;
    }
    auto it = index.find(group);
    if (it == index.end()) {
      index[group] = groups.size();
      groups.push_back({group, {e.module}});
    } else {
      groups[it->second].second.push_back(e.module);
    }
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (auto& g : groups)
    if (g.second.size() >= 2) out.push_back(std::move(g));
  return out;
}

const QuantPlanEntry* QuantPlan::find(const std::string& module) const {
  for (const auto& e : entries) {
    if (e.module == module) return &e;
  }
  return nullptr;
}

std::string QuantPlan::to_text() const {
  std::ostringstream os;
  os << "quant plan: " << quant_method_name(method) << ", " << entries.size() << " linear(s)\n";
  for (const auto& e : entries) {
    os << "  " << e.module << "  W:" << nvfp4::scale_mode_name(e.weight_mode)
       << " A:" << nvfp4::scale_mode_name(e.activation_mode) << "\n";
  }
  return os.str();
}

nlohmann::json QuantPlan::to_json() const {
  nlohmann::json j;
  j["method"] = quant_method_name(method);
  j["target_prefix_substrings"] = target_prefix_substrings;
  j["count"] = entries.size();
  nlohmann::json list = nlohmann::json::array();
  for (const auto& e : entries) {
    list.push_back({{"module", e.module},
                    {"weight", nvfp4::scale_mode_name(e.weight_mode)},
                    {"activation", nvfp4::scale_mode_name(e.activation_mode)}});
  }
  j["linears"] = std::move(list);
  if (shared_qkv_scale) j["shared_qkv_scale"] = true;
  return j;
}

QuantPlan QuantPlan::from_json(const nlohmann::json& j, const std::string& where) {
  VQAD_CHECK(j.is_object(), where, ": a quant plan must be a JSON object");
  QuantPlan p;
  VQAD_CHECK(j.contains("method") && j["method"].is_string(), where, ": missing string 'method'");
  p.method = parse_quant_method(j["method"].get<std::string>(), where + ".method");
  if (j.contains("target_prefix_substrings")) {
    p.target_prefix_substrings = j["target_prefix_substrings"].get<std::vector<std::string>>();
  }
  VQAD_CHECK(j.contains("linears") && j["linears"].is_array(), where, ": missing array 'linears'");
  for (size_t i = 0; i < j["linears"].size(); ++i) {
    const auto& e = j["linears"][i];
    const std::string w = where + ".linears[" + std::to_string(i) + "]";
    VQAD_CHECK(e.is_object() && e.contains("module") && e["module"].is_string(), w, ": missing string 'module'");
    p.entries.push_back({e["module"].get<std::string>(), mode_from_json(e, "weight", w),
                         mode_from_json(e, "activation", w)});
  }
  if (j.contains("shared_qkv_scale")) {
    VQAD_CHECK(j["shared_qkv_scale"].is_boolean(), where, ": 'shared_qkv_scale' must be true or false");
    p.shared_qkv_scale = j["shared_qkv_scale"].get<bool>();
  }
  if (j.contains("count")) {
    VQAD_CHECK(j["count"].is_number_integer() && j["count"].get<size_t>() == p.entries.size(), where,
               ": 'count' does not match the number of linears (", p.entries.size(), ")");
  }
  return p;
}

QuantPlan build_quant_plan(const std::vector<std::string>& linear_names, const QuantConfig& config) {
  QuantPlan plan;
  plan.method = config.method;
  plan.target_prefix_substrings = config.target_prefix_substrings;
  if (!config.enabled()) return plan;
  plan.shared_qkv_scale = config.shared_qkv_scale;
  VQAD_CHECK(!config.target_prefix_substrings.empty(), "quant plan (", quant_method_name(config.method),
             "): target_prefix_substrings is empty");
  VQAD_CHECK(config.quantize_attention || config.quantize_ffn || config.quantize_gate, "quant plan (",
             quant_method_name(config.method), "): quantize_attention, quantize_ffn and quantize_gate are all false");
  std::set<int64_t> skip(config.skip_blocks.begin(), config.skip_blocks.end());
  std::set<int64_t> blocks;
  bool any_gate = false;
  std::set<std::string> seen;
  for (const auto& name : linear_names) {
    VQAD_CHECK(seen.insert(name).second, "quant plan: linear name '", name, "' appears twice");
    const std::string kind = linear_kind(name);
    int block = -1;
    const bool in_block = split_block_name(name, &block, nullptr);
    if (in_block) blocks.insert(block);
    any_gate = any_gate || kind == "gate";
    // The gate is quantized iff quantize_gate (seeds/003), whatever the substrings say.
    const bool targeted = kind == "gate" ? config.quantize_gate
                                         : contains_any(name, config.target_prefix_substrings) ||
                                               contains_any(wan_fastvideo_internal_name(name),
                                                            config.target_prefix_substrings);
    if (!targeted) continue;
    if ((kind == "ffn" && !config.quantize_ffn) || (kind == "attention" && !config.quantize_attention)) continue;
    if (in_block && skip.count(block)) continue;
    QuantPlanEntry e{name, ScaleMode::kDynamic, ScaleMode::kDynamic};
    if (config.method == QuantMethod::kNvfp4Qad) {
      e.activation_mode = is_ffn_linear(name) ? ScaleMode::kStatic : ScaleMode::kUnit;
    }
    plan.entries.push_back(std::move(e));
  }
  VQAD_CHECK(!config.quantize_gate || any_gate, "quant plan: quantize_gate is set but the model has no "
             "to_gate_compress linears (only VSA models have compression gates)");
  for (int64_t b : config.skip_blocks)
    VQAD_CHECK(blocks.count(b), "quant plan: skip_blocks lists block ", b, " but the model's blocks are ",
               blocks.empty() ? std::string("none") : "0.." + std::to_string(*blocks.rbegin()));
  if (plan.entries.empty()) {
    std::vector<std::string> sample(linear_names.begin(),
                                    linear_names.begin() + std::min<size_t>(linear_names.size(), 5));
    fail("quant plan: quant_config ", quant_method_name(config.method), " matched none of the model's ",
         linear_names.size(), " linears (target_prefix_substrings: ", join(config.target_prefix_substrings),
         "; first linears: ", join(sample), ")");
  }
  return plan;
}

bool split_block_name(const std::string& name, int* block, std::string* sub) {
  static const std::regex re(R"((?:^|\.)(?:transformer_)?blocks\.(\d+)\.(.+)$)");
  std::smatch m;
  if (!std::regex_search(name, m, re)) return false;
  if (block) *block = std::stoi(m[1].str());
  if (sub) *sub = m[2].str();
  return true;
}

std::map<std::string, float> amax_table_from_json(const nlohmann::json& j, const std::string& where) {
  VQAD_CHECK(j.is_object(), where, ": an activation-amax table must be a JSON object of name -> amax");
  std::map<std::string, float> table;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const nlohmann::json* v = &it.value();
    if (v->is_object()) {
      VQAD_CHECK(v->contains("all"), where, ": entry '", it.key(), "' is an object without 'all'");
      v = &(*v)["all"];
    }
    VQAD_CHECK(v->is_number(), where, ": entry '", it.key(), "' must be a number or {\"all\": number}, got ",
               v->dump());
    const double d = v->get<double>();
    VQAD_CHECK(d > 0.0 && std::isfinite(d) && std::isfinite(static_cast<float>(d)), where, ": entry '", it.key(),
               "' must be a positive finite amax, got ", v->dump());
    table[it.key()] = static_cast<float>(d);
  }
  return table;
}

std::map<std::string, float> load_amax_table(const std::string& path) {
  std::ifstream in(path);
  VQAD_CHECK(in.good(), "activation-amax table ", path, ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("activation-amax table ", path, ": invalid JSON: ", e.what());
  }
  return amax_table_from_json(j, "activation-amax table " + path);
}

const float* lookup_amax(const std::map<std::string, float>& table, const std::string& module) {
  for (const std::string& name : {module, wan_fastvideo_internal_name(module)}) {
    auto it = table.find(name);
    if (it != table.end()) return &it->second;
    int block = 0;
    std::string sub;
    if (!split_block_name(name, &block, &sub)) continue;
    for (const std::string& key : {"b" + std::to_string(block) + "." + sub, "blocks." + std::to_string(block) + "." + sub,
                                   "transformer_blocks." + std::to_string(block) + "." + sub}) {
      it = table.find(key);
      if (it != table.end()) return &it->second;
    }
  }
  return nullptr;
}

std::map<std::string, float> shared_group_input_amax(const QuantPlan& plan,
                                                     const std::map<std::string, float>& amax_table) {
  // The unit and dynamic activation scales of a group's members are equal already (they
  // share the input); static members take the group's max calibrated amax.
  std::map<std::string, float> out;
  for (const auto& [group, members] : shared_scale_groups(plan)) {
    std::optional<float> m;
    bool complete = true;
    for (const auto& mod : members) {
      const QuantPlanEntry* e = plan.find(mod);
      if (e->activation_mode != ScaleMode::kStatic) continue;
      const float* a = lookup_amax(amax_table, mod);
      if (!a) {
        complete = false;  // an uncalibrated member is reported where its amax is needed
        break;
      }
      m = m ? std::max(*m, *a) : *a;
    }
    if (complete && m)
      for (const auto& mod : members)
        if (plan.find(mod)->activation_mode == ScaleMode::kStatic) out[mod] = *m;
  }
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> make_linear_quants(
    const QuantPlan& plan, const QuantConfig& config, const std::map<std::string, float>& amax_table) {
  std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> out;
  const std::map<std::string, float> group_amax = shared_group_input_amax(plan, amax_table);
  for (const auto& e : plan.entries) {
    VQAD_CHECK(e.weight_mode == ScaleMode::kDynamic, "quant plan: linear '", e.module, "' has weight scale ",
               nvfp4::scale_mode_name(e.weight_mode), "; only dynamic weight scales are implemented");
    if (plan.method == QuantMethod::kNvfp4QatTrain) {
      VQAD_CHECK(e.activation_mode == ScaleMode::kDynamic, "quant plan: nvfp4_qat_train linear '", e.module,
                 "' must have a dynamic activation scale, has ", nvfp4::scale_mode_name(e.activation_mode));
      auto lin = std::make_shared<ops::Nvfp4DynamicLinear>(e.module);
      lin->set_gemm_route(config.gemm_route);
      out.emplace_back(e.module, std::move(lin));
    } else if (plan.method == QuantMethod::kNvfp4Qad) {
      std::optional<float> amax;
      if (e.activation_mode == ScaleMode::kStatic) {
        if (const float* a = lookup_amax(amax_table, e.module)) amax = *a;
        if (amax && group_amax.count(e.module)) amax = group_amax.at(e.module);
        if (!amax && !config.allow_uncalibrated) {
          int block = 0;
          std::string sub;
          const std::string key = split_block_name(e.module, &block, &sub)
                                      ? "b" + std::to_string(block) + "." + sub
                                      : e.module;
          fail("quant plan: no calibrated input amax for static linear '", e.module, "' (table key '", key,
               "'", config.act_amax_json.empty() ? std::string() : " in " + config.act_amax_json,
               "); run `vqad calibrate` and give its table (training.linear_quantization.act_amax_json)");
        }
      }
      auto lin = std::make_shared<ops::Nvfp4QadLinear>(e.module, e.activation_mode, amax, config.allow_uncalibrated);
      lin->set_gemm_route(config.gemm_route);
      out.emplace_back(e.module, std::move(lin));
    } else {
      fail("quant plan: method none has no linears, but the plan lists '", e.module, "'");
    }
  }
  return out;
}

std::vector<std::shared_ptr<ops::Nvfp4QadLinear>> qad_linears(
    const std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>& quants) {
  std::vector<std::shared_ptr<ops::Nvfp4QadLinear>> out;
  for (const auto& [name, q] : quants) {
    if (auto qad = std::dynamic_pointer_cast<ops::Nvfp4QadLinear>(q)) out.push_back(qad);
  }
  return out;
}

void attach_shared_weight_scales(const QuantPlan& plan,
                                 const std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>& quants,
                                 const std::function<torch::Tensor(const std::string&)>& weight_of) {
  std::map<std::string, std::shared_ptr<ops::LinearQuant>> by_name(quants.begin(), quants.end());
  for (const auto& [group, members] : shared_scale_groups(plan)) {
    auto g = std::make_shared<ops::WeightScaleGroup>(group, members, [members, weight_of] {
      std::vector<torch::Tensor> ws;
      for (const auto& m : members) ws.push_back(weight_of(m));
      return ws;
    });
    for (const auto& m : members) {
      auto it = by_name.find(m);
      VQAD_CHECK(it != by_name.end(), "shared_qkv_scale: linear '", m, "' of group ", group, " has no quant");
      if (auto d = std::dynamic_pointer_cast<ops::Nvfp4DynamicLinear>(it->second)) {
        d->set_weight_scale_group(g);
      } else if (auto q = std::dynamic_pointer_cast<ops::Nvfp4QadLinear>(it->second)) {
        q->set_weight_scale_group(g);
      } else {
        fail("shared_qkv_scale: linear '", m, "' (", it->second->describe(), ") cannot share a weight scale");
      }
    }
  }
}

nlohmann::json export_amax_table(const std::vector<std::shared_ptr<ops::Nvfp4QadLinear>>& layers) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& l : layers) {
    if (l->activation_mode() != ScaleMode::kStatic) continue;
    VQAD_CHECK(l->input_amax().has_value(), "export amax table: static linear '", l->name(),
               "' is not calibrated");
    int block = 0;
    std::string sub;
    const std::string key = split_block_name(l->name(), &block, &sub) ? "b" + std::to_string(block) + "." + sub
                                                                      : l->name();
    VQAD_CHECK(!j.contains(key), "export amax table: two linears map to key '", key, "'");
    j[key] = *l->input_amax();
  }
  return j;
}

void save_amax_table(const std::vector<std::shared_ptr<ops::Nvfp4QadLinear>>& layers, const std::string& path) {
  const nlohmann::json j = export_amax_table(layers);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    VQAD_CHECK(out.good(), "activation-amax table ", path, ": cannot write ", tmp);
    out << j.dump(2) << "\n";
    out.flush();
    VQAD_CHECK(out.good(), "activation-amax table ", path, ": write to ", tmp, " failed");
  }
  VQAD_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "activation-amax table ", path, ": cannot rename ", tmp);
}

}  // namespace vqad::model
