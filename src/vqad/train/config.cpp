#include "vqad/train/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/sha256.h"

namespace vqad::train {

// ===========================================================================
// Tables
// ===========================================================================
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

std::optional<MethodKind> method_from_target(std::string_view target) {
  for (const auto& [name, kind] : method_target_table())
    if (target == name) return kind;
  return std::nullopt;
}

namespace {
std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (const auto& x : v) {
    if (!s.empty()) s += sep;
    s += x;
  }
  return s;
}

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

std::string callback_target_choices() {
  std::vector<std::string> v;
  for (const auto& c : kCallbackTargets) v.push_back(c.target);
  return join(v);
}

const std::vector<std::string>& quant_configs() {
  static const std::vector<std::string> q = {"none", "nvfp4_qat_train", "nvfp4_qad"};
  return q;
}
}  // namespace

std::optional<std::string> model_kind_from_target(std::string_view target) {
  for (const auto& t : model_targets())
    if (target == t) return std::string("wan");
  return std::nullopt;
}

std::string model_target_choices() { return join(model_targets()); }

std::string method_target_choices() {
  std::vector<std::string> v;
  for (const auto& [name, kind] : method_target_table()) v.push_back(name);
  return join(v);
}

namespace {
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

const char* rollout_mode_name(RolloutMode m) {
  return m == RolloutMode::kSimulate ? "simulate" : "data_latent";
}

std::optional<RolloutMode> parse_rollout_mode(std::string_view name) {
  if (name == "simulate" || name == "sim") return RolloutMode::kSimulate;
  if (name == "data_latent" || name == "data" || name == "vae_latent") return RolloutMode::kDataLatent;
  return std::nullopt;
}

std::string quant_config_choices() { return join(quant_configs()); }

std::vector<std::string> MethodConfig::roles() const {
  if (kind == MethodKind::kDmd2) return {"student", "teacher", "critic"};
  if (kind == MethodKind::kSft) return {"student"};
  return {"student", "teacher"};
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

// ===========================================================================
// YAML <-> JSON
// ===========================================================================
namespace {

bool is_int_text(std::string_view s, int64_t* out) {
  // Python int(): optional sign, decimal digits with single '_' between digits.
  std::string digits;
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (i >= s.size()) return false;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits += c;
      prev_digit = true;
    } else if (c == '_' && prev_digit && i + 1 < s.size() &&
               std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      prev_digit = false;
    } else {
      return false;
    }
  }
  if (digits.empty()) return false;
  int64_t v = 0;
  auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) return false;
  if (out) *out = neg ? -v : v;
  return true;
}

bool is_float_text(std::string_view s, double* out) {
  // Python float(): decimal or exponent notation, inf/infinity/nan (any case).
  std::string t;
  for (char c : s)
    if (c != '_') t += c;
  if (t.empty()) return false;
  for (char c : t)
    if (c == 'x' || c == 'X') return false;
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return false;
  if (out) *out = v;
  return true;
}

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return std::string(s.substr(a, b - a));
}

// Plain (unquoted) YAML scalar -> typed value, following PyYAML's safe_load
// resolver (YAML 1.1 booleans included); exponent floats without a dot are
// read as floats too, which only matters for values that are cast anyway.
Json resolve_plain_scalar(const std::string& s) {
  static const std::set<std::string> kNull = {"", "~", "null", "Null", "NULL"};
  static const std::set<std::string> kTrue = {"true", "True", "TRUE", "yes", "Yes",
                                              "YES",  "on",   "On",   "ON"};
  static const std::set<std::string> kFalse = {"false", "False", "FALSE", "no", "No",
                                               "NO",    "off",   "Off",   "OFF"};
  if (kNull.count(s)) return nullptr;
  if (kTrue.count(s)) return true;
  if (kFalse.count(s)) return false;
  int64_t i = 0;
  if (is_int_text(s, &i)) return i;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    char* end = nullptr;
    long long v = std::strtoll(s.c_str() + 2, &end, 16);
    if (end == s.c_str() + s.size()) return static_cast<int64_t>(v);
  }
  static const std::set<std::string> kInf = {".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"};
  static const std::set<std::string> kNegInf = {"-.inf", "-.Inf", "-.INF"};
  static const std::set<std::string> kNan = {".nan", ".NaN", ".NAN"};
  if (kInf.count(s)) return std::numeric_limits<double>::infinity();
  if (kNegInf.count(s)) return -std::numeric_limits<double>::infinity();
  if (kNan.count(s)) return std::numeric_limits<double>::quiet_NaN();
  // Only digit-led forms: "inf" / "nan" words stay strings as in YAML.
  bool numeric_start = !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) ||
                                      ((s[0] == '-' || s[0] == '+' || s[0] == '.') && s.size() > 1 &&
                                       (std::isdigit(static_cast<unsigned char>(s[1])) || s[1] == '.')));
  double d = 0;
  if (numeric_start && is_float_text(s, &d)) return d;
  return s;
}

Json node_to_json(const YAML::Node& n, const std::string& path, const std::string& source) {
  switch (n.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      return nullptr;
    case YAML::NodeType::Scalar: {
      const std::string& tag = n.Tag();
      if (tag == "!" || tag == "tag:yaml.org,2002:str") return n.Scalar();
      return resolve_plain_scalar(n.Scalar());
    }
    case YAML::NodeType::Sequence: {
      Json a = Json::array();
      size_t i = 0;
      for (const auto& x : n) a.push_back(node_to_json(x, path + "[" + std::to_string(i++) + "]", source));
      return a;
    }
    case YAML::NodeType::Map: {
      Json o = Json::object();
      for (auto it = n.begin(); it != n.end(); ++it) {
        VQAD_CHECK(it->first.IsScalar(), "config ", source, ": key under '",
                   path.empty() ? "<top level>" : path, "' must be a plain string");
        std::string key = it->first.Scalar();
        std::string child = path.empty() ? key : path + "." + key;
        VQAD_CHECK(!o.contains(key), "config ", source, ": duplicate key '", child, "'");
        o[key] = node_to_json(it->second, child, source);
      }
      return o;
    }
  }
  return nullptr;
}

std::string format_double(double v) {
  if (std::isnan(v)) return ".nan";
  if (std::isinf(v)) return v > 0 ? ".inf" : "-.inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  // Keep it a float for every YAML reader (PyYAML needs a dot before 'e').
  if (s.find('.') == std::string::npos) {
    size_t e = s.find('e');
    if (e == std::string::npos) s += ".0";
    else s.insert(e, ".0");
  }
  return s;
}

bool is_scalar_list(const Json& v) {
  for (const auto& x : v)
    if (x.is_object() || x.is_array()) return false;
  return true;
}

void emit(YAML::Emitter& e, const Json& v) {
  if (v.is_null()) {
    e << YAML::Null;
  } else if (v.is_boolean()) {
    e << (v.get<bool>() ? "true" : "false");
  } else if (v.is_number_integer()) {
    e << std::to_string(v.get<int64_t>());
  } else if (v.is_number_unsigned()) {
    e << std::to_string(v.get<uint64_t>());
  } else if (v.is_number_float()) {
    e << format_double(v.get<double>());
  } else if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    // Quote whatever a reader would not read back as this same string.
    if (!resolve_plain_scalar(s).is_string()) e << YAML::DoubleQuoted << s;
    else e << s;
  } else if (v.is_array()) {
    if (is_scalar_list(v)) e << YAML::Flow;
    e << YAML::BeginSeq;
    for (const auto& x : v) emit(e, x);
    e << YAML::EndSeq;
  } else if (v.is_object()) {
    e << YAML::BeginMap;
    for (auto it = v.begin(); it != v.end(); ++it) {
      e << YAML::Key;
      if (!resolve_plain_scalar(it.key()).is_string()) e << YAML::DoubleQuoted;
      e << it.key() << YAML::Value;
      emit(e, it.value());
    }
    e << YAML::EndMap;
  }
}

}  // namespace

Json yaml_to_json(const std::string& yaml_text, const std::string& source_name) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail("config ", source_name, ": invalid YAML: ", e.what());
  }
  return node_to_json(root, "", source_name);
}

std::string dump_yaml(const Json& value) {
  YAML::Emitter e;
  e.SetIndent(2);
  emit(e, value);
  VQAD_CHECK(e.good(), "dump_yaml: ", e.GetLastError());
  return std::string(e.c_str()) + "\n";
}

// ===========================================================================
// Overrides (research §3.2)
// ===========================================================================
Json cast_override_value(std::string_view text) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "true") return true;
  if (lower == "false") return false;
  if (lower == "none" || lower == "null") return nullptr;
  std::string t = trim(text);
  int64_t i = 0;
  if (is_int_text(t, &i)) return i;
  double d = 0;
  if (is_float_text(t, &d)) return d;
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') {
    Json list = yaml_to_json(t, "override value '" + std::string(text) + "'");
    VQAD_CHECK(list.is_array(), "override value '", text, "': expected a YAML list");
    return list;
  }
  return std::string(text);
}

std::vector<std::pair<std::string, Json>> parse_overrides(const std::vector<std::string>& tokens) {
  std::vector<std::pair<std::string, Json>> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i];
    VQAD_CHECK(tok.size() > 2 && tok.rfind("--", 0) == 0, "override '", tok,
               "': expected --dotted.key value or --dotted.key=value");
    std::string body = tok.substr(2);
    std::string key, value;
    size_t eq = body.find('=');
    if (eq != std::string::npos) {
      key = body.substr(0, eq);
      value = body.substr(eq + 1);
    } else {
      key = body;
      VQAD_CHECK(i + 1 < tokens.size(), "override '", tok, "' has no value");
      value = tokens[++i];
    }
    VQAD_CHECK(!key.empty() && key.front() != '.' && key.back() != '.' &&
                   key.find("..") == std::string::npos,
               "override '", tok, "': malformed key '", key, "'");
    out.emplace_back(key, cast_override_value(value));
  }
  return out;
}

void apply_override(Json& root, const std::string& dotted_key, const Json& value) {
  if (!root.is_object()) root = Json::object();
  Json* cur = &root;
  size_t start = 0;
  while (true) {
    size_t dot = dotted_key.find('.', start);
    std::string part = dotted_key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*cur)[part] = value;
      return;
    }
    Json& next = (*cur)[part];
    if (!next.is_object()) next = Json::object();
    cur = &next;
    start = dot + 1;
  }
}

// ===========================================================================
// Typed reading with key paths
// ===========================================================================
namespace {

std::string describe(const Json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return v.dump() + " (a bool)";
  if (v.is_number_integer() || v.is_number_unsigned()) return v.dump() + " (an integer)";
  if (v.is_number_float()) return format_double(v.get<double>()) + " (a float)";
  if (v.is_string()) return "'" + v.get<std::string>() + "' (a string)";
  if (v.is_array()) return v.dump() + " (a list)";
  return "a mapping";
}

bool falsy(const Json& v) {
  if (v.is_null()) return true;
  if (v.is_boolean()) return !v.get<bool>();
  if (v.is_number_integer()) return v.get<int64_t>() == 0;
  if (v.is_number_unsigned()) return v.get<uint64_t>() == 0;
  if (v.is_number_float()) return v.get<double>() == 0.0;
  if (v.is_string()) return v.get_ref<const std::string&>().empty();
  return v.empty();
}

struct Ctx {
  std::string source;
};

template <typename... Args>
[[noreturn]] void key_fail(const Ctx& ctx, const std::string& path, Args&&... args) {
  fail("config ", ctx.source, ": key '", path, "': ", std::forward<Args>(args)...);
}

int64_t as_int(const Ctx& ctx, const std::string& path, const Json& v) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_unsigned()) return static_cast<int64_t>(v.get<uint64_t>());
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  if (v.is_string()) {
    int64_t i = 0;
    if (is_int_text(trim(v.get<std::string>()), &i)) return i;
  }
  key_fail(ctx, path, "expected an integer, found ", describe(v));
}

double as_double(const Ctx& ctx, const std::string& path, const Json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    double d = 0;
    if (is_float_text(trim(v.get<std::string>()), &d)) return d;
  }
  key_fail(ctx, path, "expected a number, found ", describe(v));
}

bool as_bool(const Ctx& ctx, const std::string& path, const Json& v) {
  if (v.is_boolean()) return v.get<bool>();
  key_fail(ctx, path, "expected true or false, found ", describe(v));
}

std::string as_string(const Ctx& ctx, const std::string& path, const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer() || v.is_number_unsigned()) return v.dump();
  if (v.is_number_float()) return format_double(v.get<double>());
  key_fail(ctx, path, "expected a string, found ", describe(v));
}

// One mapping of the config. Every getter registers its key as known; finish()
// rejects the keys nobody asked for.
class Section {
 public:
  Section(const Ctx& ctx, const Json* node, std::string path)
      : ctx_(ctx), node_(node), path_(std::move(path)) {
    if (node_ && node_->is_null()) node_ = nullptr;
    if (node_ && !node_->is_object())
      fail("config ", ctx_.source, ": key '", path_, "': expected a mapping, found ", describe(*node_));
  }

  std::string key_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const Ctx& ctx() const { return ctx_; }
  const std::string& path() const { return path_; }

  // The raw value, or nullptr when absent or null.
  const Json* get(const std::string& key) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.push_back(key);
    if (!node_) return nullptr;
    auto it = node_->find(key);
    if (it == node_->end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const std::string& key) { return get(key) != nullptr; }

  // or_default: FastVideo's `x or default` (falsy values give the default).
  int64_t i64(const std::string& key, int64_t def, bool or_default = false) {
    const Json* v = get(key);
    if (!v || (or_default && falsy(*v))) return def;
    return as_int(ctx_, key_path(key), *v);
  }
  double f64(const std::string& key, double def, bool or_default = false) {
    const Json* v = get(key);
    if (!v || (or_default && falsy(*v))) return def;
    return as_double(ctx_, key_path(key), *v);
  }
  bool boolean(const std::string& key, bool def) {
    const Json* v = get(key);
    return v ? as_bool(ctx_, key_path(key), *v) : def;
  }
  std::string str(const std::string& key, const std::string& def, bool or_default = false) {
    const Json* v = get(key);
    if (!v || (or_default && falsy(*v))) return def;
    return as_string(ctx_, key_path(key), *v);
  }
  std::string required_str(const std::string& key) {
    const Json* v = get(key);
    if (!v) fail("config ", ctx_.source, ": missing required key '", key_path(key), "'");
    std::string s = as_string(ctx_, key_path(key), *v);
    if (trim(s).empty()) key_fail(ctx_, key_path(key), "must not be empty");
    return s;
  }
  // One of `choices` (exact match); `def` when absent.
  std::string choice(const std::string& key, const std::vector<std::string>& choices,
                     const std::string& def, bool or_default = false) {
    std::string s = str(key, def, or_default);
    if (std::find(choices.begin(), choices.end(), s) == choices.end())
      key_fail(ctx_, key_path(key), "unknown value '", s, "' (valid: ", join(choices), ")");
    return s;
  }
  std::vector<std::string> str_list(const std::string& key, std::vector<std::string> def) {
    const Json* v = get(key);
    if (!v) return def;
    if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of strings, found ", describe(*v));
    std::vector<std::string> out;
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back(as_string(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
    return out;
  }
  std::vector<double> f64_list(const std::string& key) {
    const Json* v = get(key);
    if (!v) return {};
    if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of numbers, found ", describe(*v));
    std::vector<double> out;
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back(as_double(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
    return out;
  }
  std::vector<int64_t> i64_list(const std::string& key) {
    const Json* v = get(key);
    if (!v) return {};
    if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of integers, found ", describe(*v));
    std::vector<int64_t> out;
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back(as_int(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
    return out;
  }
  // [b1, b2] or "b1,b2".
  std::array<double, 2> betas(const std::string& key, std::array<double, 2> def, bool required = false) {
    const Json* v = get(key);
    if (!v) {
      if (required) fail("config ", ctx_.source, ": missing required key '", key_path(key), "'");
      return def;
    }
    std::vector<Json> parts;
    if (v->is_array()) {
      for (const auto& x : *v) parts.push_back(x);
    } else if (v->is_string()) {
      std::stringstream ss(v->get<std::string>());
      std::string p;
      while (std::getline(ss, p, ','))
        if (!trim(p).empty()) parts.push_back(trim(p));
    } else {
      key_fail(ctx_, key_path(key), "expected [beta1, beta2] or 'beta1,beta2', found ", describe(*v));
    }
    if (parts.size() != 2)
      key_fail(ctx_, key_path(key), "expected two betas, found ", describe(*v));
    std::array<double, 2> b{as_double(ctx_, key_path(key), parts[0]),
                            as_double(ctx_, key_path(key), parts[1])};
    for (double x : b)
      if (!(x >= 0.0 && x < 1.0)) key_fail(ctx_, key_path(key), "betas must be in [0, 1), found ", v->dump());
    return b;
  }
  Section sub(const std::string& key) { return Section(ctx_, get(key), key_path(key)); }

  void finish() const {
    if (!node_) return;
    for (auto it = node_->begin(); it != node_->end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) == known_.end())
        fail("config ", ctx_.source, ": unknown key '", key_path(it.key()), "' (found value ",
             describe(it.value()), "; valid keys of ", path_.empty() ? "the top level" : path_, ": ",
             join(known_), ")");
    }
  }

 private:
  const Ctx& ctx_;
  const Json* node_;
  std::string path_;
  std::vector<std::string> known_;
};

void check(bool ok, const Ctx& ctx, const std::string& path, const std::string& what) {
  if (!ok) key_fail(ctx, path, what);
}

std::string fmt(double v) { return format_double(v); }

// ---------------------------------------------------------------------------
// training
// ---------------------------------------------------------------------------
std::vector<DataSource> parse_data_path(Section& s) {
  const Json* v = s.get("data_path");
  std::string path = s.key_path("data_path");
  std::vector<DataSource> out;
  if (!v || falsy(*v)) return out;
  if (v->is_object()) {
    for (auto it = v->begin(); it != v->end(); ++it)
      out.push_back({it.key(), as_int(s.ctx(), path + "." + it.key(), it.value())});
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back({as_string(s.ctx(), path + "[" + std::to_string(i) + "]", (*v)[i]), 1});
  } else {
    // "a:2,b" -> a repeated twice, b once.
    std::stringstream ss(as_string(s.ctx(), path, *v));
    std::string item;
    while (std::getline(ss, item, ',')) {
      item = trim(item);
      if (item.empty()) continue;
      DataSource d{item, 1};
      size_t colon = item.rfind(':');
      int64_t rep = 0;
      if (colon != std::string::npos && is_int_text(item.substr(colon + 1), &rep)) {
        d.path = item.substr(0, colon);
        d.repeat = rep;
      }
      out.push_back(d);
    }
  }
  for (const auto& d : out) {
    check(!d.path.empty(), s.ctx(), path, "empty data path");
    check(d.repeat >= 1, s.ctx(), path, "repeat count for '" + d.path + "' must be >= 1, found " +
                                            std::to_string(d.repeat));
  }
  return out;
}

TrainingConfig parse_training(const Ctx& ctx, const Json* node, const Json& models) {
  Section t(ctx, node, "training");
  TrainingConfig c;
  {
    Section d = t.sub("distributed");
    auto& x = c.distributed;
    x.num_gpus = d.i64("num_gpus", 1, true);
    x.tp_size = d.i64("tp_size", 1, true);
    x.sp_size = d.i64("sp_size", x.num_gpus, true);
    x.hsdp_replicate_dim = d.i64("hsdp_replicate_dim", 1, true);
    x.hsdp_shard_dim = d.i64("hsdp_shard_dim", x.num_gpus, true);
    x.pin_cpu_memory = d.boolean("pin_cpu_memory", false);
    x.reshard_after_forward = d.boolean("reshard_after_forward", true);
    x.fsdp_modules_per_group = d.i64("fsdp_modules_per_group", 1);
    x.reduce_dtype = d.choice("reduce_dtype", {"fp32", "bf16"}, "fp32", true);
    x.fsdp_symmetric_memory = d.boolean("fsdp_symmetric_memory", false);
    d.finish();
    const std::string p = "training.distributed";
    check(x.num_gpus >= 1, ctx, p + ".num_gpus", "must be >= 1, found " + std::to_string(x.num_gpus));
    check(x.tp_size == 1, ctx, p + ".tp_size",
          "tensor parallelism is not supported; tp_size must be 1, found " + std::to_string(x.tp_size));
    check(x.sp_size >= 1 && x.num_gpus % x.sp_size == 0, ctx, p + ".sp_size",
          "must be >= 1 and divide num_gpus (" + std::to_string(x.num_gpus) + "), found " +
              std::to_string(x.sp_size));
    if (x.hsdp_shard_dim == -1 && x.hsdp_replicate_dim >= 1 && x.num_gpus % x.hsdp_replicate_dim == 0)
      x.hsdp_shard_dim = x.num_gpus / x.hsdp_replicate_dim;  // FSDP's "-1 = the rest"
    check(x.hsdp_replicate_dim >= 1, ctx, p + ".hsdp_replicate_dim",
          "must be >= 1, found " + std::to_string(x.hsdp_replicate_dim));
    check(x.hsdp_shard_dim >= 1, ctx, p + ".hsdp_shard_dim",
          "must be >= 1, found " + std::to_string(x.hsdp_shard_dim));
    check(x.hsdp_replicate_dim * x.hsdp_shard_dim == x.num_gpus, ctx, p,
          "inconsistent dims: hsdp_replicate_dim (" + std::to_string(x.hsdp_replicate_dim) +
              ") x hsdp_shard_dim (" + std::to_string(x.hsdp_shard_dim) + ") = " +
              std::to_string(x.hsdp_replicate_dim * x.hsdp_shard_dim) + " must equal num_gpus (" +
              std::to_string(x.num_gpus) + ")");
    check(x.fsdp_modules_per_group >= 1, ctx, p + ".fsdp_modules_per_group", "must be >= 1");
  }
  {
    Section d = t.sub("data");
    auto& x = c.data;
    x.data_path = parse_data_path(d);
    x.preprocessed_data_type = d.choice("preprocessed_data_type", {"t2v", "text_only"}, "t2v", true);
    x.train_batch_size = d.i64("train_batch_size", 1, true);
    x.dataloader_num_workers = d.i64("dataloader_num_workers", 0, true);
    x.training_cfg_rate = d.f64("training_cfg_rate", 0.0, true);
    x.seed = d.i64("seed", 0, true);
    x.num_height = d.i64("num_height", 0, true);
    x.num_width = d.i64("num_width", 0, true);
    x.num_latent_t = d.i64("num_latent_t", 0, true);
    x.num_frames = d.i64("num_frames", 0, true);
    d.finish();
    const std::string p = "training.data";
    check(x.train_batch_size >= 1, ctx, p + ".train_batch_size", "must be >= 1");
    check(x.dataloader_num_workers >= 0, ctx, p + ".dataloader_num_workers", "must be >= 0");
    check(x.training_cfg_rate >= 0.0 && x.training_cfg_rate <= 1.0, ctx, p + ".training_cfg_rate",
          "must be in [0, 1], found " + fmt(x.training_cfg_rate));
    for (auto [k, v] : {std::pair<const char*, int64_t>{"num_height", x.num_height},
                        {"num_width", x.num_width},
                        {"num_latent_t", x.num_latent_t},
                        {"num_frames", x.num_frames}})
      check(v >= 0, ctx, p + "." + k, "must be >= 0, found " + std::to_string(v));
  }
  {
    Section o = t.sub("optimizer");
    auto& x = c.optimizer;
    x.learning_rate = o.f64("learning_rate", 0.0, true);
    x.betas = o.betas("betas", {0.9, 0.999});
    x.weight_decay = o.f64("weight_decay", 0.0, true);
    x.eps = o.f64("eps", 1e-8, true);
    std::string sched = o.str("lr_scheduler", "constant", true);
    auto ls = parse_lr_schedule(sched);
    if (!ls)
      key_fail(ctx, "training.optimizer.lr_scheduler", "unknown LR schedule '", sched,
               "' (valid: ", lr_schedule_choices(), ")");
    x.lr_scheduler = *ls;
    x.lr_warmup_steps = o.i64("lr_warmup_steps", 0, true);
    x.lr_num_cycles = o.i64("lr_num_cycles", 0, true);
    x.lr_power = o.f64("lr_power", 0.0, true);
    x.min_lr_ratio = o.f64("min_lr_ratio", 0.5, true);
    if (o.has("fused")) x.fused = o.boolean("fused", false);
    o.finish();
    const std::string p = "training.optimizer";
    check(x.learning_rate >= 0.0, ctx, p + ".learning_rate", "must be >= 0, found " + fmt(x.learning_rate));
    check(x.weight_decay >= 0.0, ctx, p + ".weight_decay", "must be >= 0, found " + fmt(x.weight_decay));
    check(x.eps > 0.0, ctx, p + ".eps", "must be > 0, found " + fmt(x.eps));
    check(x.lr_warmup_steps >= 0, ctx, p + ".lr_warmup_steps", "must be >= 0");
    check(x.lr_num_cycles >= 0, ctx, p + ".lr_num_cycles", "must be >= 0");
    check(x.min_lr_ratio >= 0.0 && x.min_lr_ratio <= 1.0, ctx, p + ".min_lr_ratio",
          "must be in [0, 1], found " + fmt(x.min_lr_ratio));
  }
  {
    Section l = t.sub("loop");
    c.loop.max_train_steps = l.i64("max_train_steps", 0, true);
    c.loop.gradient_accumulation_steps = l.i64("gradient_accumulation_steps", 1, true);
    l.finish();
    check(c.loop.max_train_steps >= 0, ctx, "training.loop.max_train_steps", "must be >= 0");
    check(c.loop.gradient_accumulation_steps >= 1, ctx, "training.loop.gradient_accumulation_steps",
          "must be >= 1");
  }
  {
    Section k = t.sub("checkpoint");
    auto& x = c.checkpoint;
    x.output_dir = k.str("output_dir", "", true);
    x.resume_from_checkpoint = k.str("resume_from_checkpoint", "", true);
    x.training_state_checkpointing_steps = k.i64("training_state_checkpointing_steps", 0, true);
    x.checkpoints_total_limit = k.i64("checkpoints_total_limit", 0, true);
    k.finish();
    check(x.training_state_checkpointing_steps >= 0, ctx,
          "training.checkpoint.training_state_checkpointing_steps", "must be >= 0");
    check(x.checkpoints_total_limit >= 0, ctx, "training.checkpoint.checkpoints_total_limit",
          "must be >= 0");
    check(x.training_state_checkpointing_steps == 0 || !x.output_dir.empty(), ctx,
          "training.checkpoint.output_dir", "must be set when training_state_checkpointing_steps > 0");
  }
  {
    Section r = t.sub("tracker");
    auto& x = c.tracker;
    x.trackers = r.str_list("trackers", {});
    x.entity = r.str("entity", "", true);
    x.project_name = r.str("project_name", "fastvideo", true);
    x.run_name = r.str("run_name", "", true);
    r.finish();
    const std::vector<std::string> known = {"none", "jsonl", "wandb", "swanlab"};
    for (size_t i = 0; i < x.trackers.size(); ++i)
      if (std::find(known.begin(), known.end(), x.trackers[i]) == known.end())
        key_fail(ctx, "training.tracker.trackers[" + std::to_string(i) + "]", "unknown tracker '",
                 x.trackers[i], "' (valid: ", join(known), ")");
  }
  {
    Section v = t.sub("vsa");
    auto& x = c.vsa;
    x.sparsity = v.f64("sparsity", 0.0, true);
    x.cache_tile_buf = v.boolean("cache_tile_buf", false);
    x.decay_rate = v.f64("decay_rate", 0.0, true);
    x.decay_interval_steps = v.i64("decay_interval_steps", 0, true);
    x.selection = v.choice("selection", {"top-k", "top-p"}, "top-k", true);
    x.top_p = v.f64("top_p", 1.0, true);
    v.finish();
    check(x.sparsity >= 0.0 && x.sparsity < 1.0, ctx, "training.vsa.sparsity",
          "must be in [0, 1), found " + fmt(x.sparsity));
    check(x.decay_rate >= 0.0, ctx, "training.vsa.decay_rate", "must be >= 0");
    check(x.decay_interval_steps >= 0, ctx, "training.vsa.decay_interval_steps", "must be >= 0");
    check(x.decay_rate == 0.0 || x.decay_interval_steps > 0, ctx, "training.vsa.decay_interval_steps",
          "must be > 0 when decay_rate is set");
    check(x.top_p > 0.0 && x.top_p <= 1.0, ctx, "training.vsa.top_p",
          "must be in (0, 1], found " + fmt(x.top_p));
    // vqad's tiled VSA scratch lives for one call (a step-lifetime tile cache breaks
    // activation checkpointing); there is no cache to turn on.
    check(!x.cache_tile_buf, ctx, "training.vsa.cache_tile_buf",
          "vqad has no step-lifetime VSA tile cache (tiled buffers live for one call); remove the key or set false");
  }
  {
    Section m = t.sub("model");
    auto& x = c.model;
    x.weighting_scheme = m.choice("weighting_scheme", {"uniform", "logit_normal", "mode"}, "uniform", true);
    x.logit_mean = m.f64("logit_mean", 0.0, true);
    x.logit_std = m.f64("logit_std", 1.0, true);
    x.mode_scale = m.f64("mode_scale", 1.0, true);
    x.precondition_outputs = m.boolean("precondition_outputs", false);
    x.enable_gradient_checkpointing_type =
        m.choice("enable_gradient_checkpointing_type", {"", "full", "ops", "block_skip"}, "", true);
    m.finish();
    check(x.logit_std > 0.0, ctx, "training.model.logit_std", "must be > 0");
  }
  c.dit_precision = t.choice("dit_precision", {"fp32", "bf16"}, "fp32", true);
  c.model_path = t.str("model_path", "", true);
  if (c.model_path.empty() && models.is_object() && models.contains("student") &&
      models["student"].is_object() && models["student"].contains("init_from") &&
      models["student"]["init_from"].is_string())
    c.model_path = models["student"]["init_from"].get<std::string>();
  t.finish();
  return c;
}

// ---------------------------------------------------------------------------
// models
// ---------------------------------------------------------------------------
RoleConfig parse_role(const Ctx& ctx, const std::string& name, const Json& node,
                      const TrainingConfig& training, const std::string& pipeline_quant) {
  const std::string p = "models." + name;
  if (!node.is_object())
    fail("config ", ctx.source, ": key '", p, "': expected a mapping with _target_, found ", describe(node));
  Section s(ctx, &node, p);
  RoleConfig r;
  r.name = name;
  r.target = s.required_str("_target_");
  auto kind = model_kind_from_target(r.target);
  if (!kind)
    key_fail(ctx, p + "._target_", "unknown model class '", r.target, "' (valid: ", model_target_choices(), ")");
  r.model_kind = *kind;
  r.init_from = s.required_str("init_from");
  r.trainable = s.boolean("trainable", true);
  r.disable_custom_init_weights = s.boolean("disable_custom_init_weights", false);
  r.flow_shift = s.f64("flow_shift", 3.0);
  check(r.flow_shift > 0.0 && std::isfinite(r.flow_shift), ctx, p + ".flow_shift",
        "must be > 0, found " + fmt(r.flow_shift));
  r.enable_gradient_checkpointing_type = s.choice("enable_gradient_checkpointing_type",
                                                  {"", "full", "ops", "block_skip"},
                                                  training.model.enable_gradient_checkpointing_type);
  r.transformer_override_safetensor = s.str("transformer_override_safetensor", "");
  if (const Json* b = s.get("attention_backend")) {
    std::string bn = as_string(ctx, p + ".attention_backend", *b);
    auto backend = parse_attention_backend(bn);
    if (!backend)
      key_fail(ctx, p + ".attention_backend", "unknown attention backend '", bn,
               "' (valid: ", attention_backend_choices(), ")");
    r.attention_backend = *backend;
  }
  std::string inherited = name == "student" ? pipeline_quant : "none";
  r.quant_config = s.choice("quant_config", quant_configs(), inherited, true);
  {
    Section l = s.sub("lora");
    r.lora.enable = l.boolean("enable", false);
    r.lora.rank = l.i64("rank", 0);
    r.lora.alpha = l.f64("alpha", 0.0);
    r.lora.target_modules = l.str_list("target_modules", {});
    l.finish();
    check(!r.lora.enable || r.lora.rank > 0, ctx, p + ".lora.rank", "must be > 0 when lora.enable is true");
  }
  s.finish();
  return r;
}

// ---------------------------------------------------------------------------
// method
// ---------------------------------------------------------------------------
MethodConfig parse_method(const Ctx& ctx, const Json* node) {
  if (!node || node->is_null()) fail("config ", ctx.source, ": missing required section 'method'");
  Section s(ctx, node, "method");
  MethodConfig m;
  m.target = s.required_str("_target_");
  auto kind = method_from_target(m.target);
  if (!kind)
    key_fail(ctx, "method._target_", "unknown method '", m.target, "' (valid: ", method_target_choices(), ")");
  m.kind = *kind;
  switch (m.kind) {
    case MethodKind::kSft:
      m.sft.attn_kind = s.choice("attn_kind", {"", "dense", "vsa"}, "", true);
      break;
    case MethodKind::kDmd2: {
      auto& d = m.dmd2;
      const Json* rm = s.get("rollout_mode");
      if (!rm) fail("config ", ctx.source, ": missing required key 'method.rollout_mode' (valid: simulate, data_latent)");
      std::string rms = as_string(ctx, "method.rollout_mode", *rm);
      auto mode = parse_rollout_mode(rms);
      if (!mode)
        key_fail(ctx, "method.rollout_mode", "unknown rollout mode '", rms,
                 "' (valid: simulate, data_latent; aliases sim, data, vae_latent)");
      d.rollout_mode = *mode;
      if (!s.has("dmd_denoising_steps"))
        fail("config ", ctx.source, ": missing required key 'method.dmd_denoising_steps'");
      d.dmd_denoising_steps = s.f64_list("dmd_denoising_steps");
      check(!d.dmd_denoising_steps.empty(), ctx, "method.dmd_denoising_steps", "must not be empty");
      for (double t : d.dmd_denoising_steps)
        check(t > 0.0 && t <= 1000.0, ctx, "method.dmd_denoising_steps",
              "timesteps must be in (0, 1000], found " + fmt(t));
      d.generator_update_interval = s.i64("generator_update_interval", 1);
      if (d.generator_update_interval <= 0) d.generator_update_interval = 1;
      d.min_timestep_ratio = s.f64("min_timestep_ratio", 0.0);
      d.max_timestep_ratio = s.f64("max_timestep_ratio", 1.0);
      check(0.0 <= d.min_timestep_ratio && d.min_timestep_ratio <= d.max_timestep_ratio &&
                d.max_timestep_ratio <= 1.0,
            ctx, "method.min_timestep_ratio",
            "need 0 <= min_timestep_ratio <= max_timestep_ratio <= 1, found " + fmt(d.min_timestep_ratio) +
                " and " + fmt(d.max_timestep_ratio));
      d.real_score_guidance_scale = s.f64("real_score_guidance_scale", 1.0);
      d.warp_denoising_step = s.boolean("warp_denoising_step", false);
      if (!s.has("fake_score_learning_rate"))
        fail("config ", ctx.source, ": missing required key 'method.fake_score_learning_rate'");
      d.fake_score_learning_rate = s.f64("fake_score_learning_rate", 0.0);
      check(d.fake_score_learning_rate > 0.0, ctx, "method.fake_score_learning_rate",
            "must be > 0, found " + fmt(d.fake_score_learning_rate));
      d.fake_score_betas = s.betas("fake_score_betas", {0.9, 0.999}, true);
      if (!s.has("fake_score_lr_scheduler"))
        fail("config ", ctx.source, ": missing required key 'method.fake_score_lr_scheduler' (valid: ",
             lr_schedule_choices(), ")");
      std::string sched = s.str("fake_score_lr_scheduler", "constant");
      auto ls = parse_lr_schedule(sched);
      if (!ls)
        key_fail(ctx, "method.fake_score_lr_scheduler", "unknown LR schedule '", sched,
                 "' (valid: ", lr_schedule_choices(), ")");
      d.fake_score_lr_scheduler = *ls;
      if (s.has("cfg_uncond")) {
        Section u = s.sub("cfg_uncond");
        CfgUncondConfig cu;
        cu.on_missing = u.choice("on_missing", {"error", "ignore"}, "error");
        cu.text = u.str("text", "keep");
        if (cu.text == "drop")
          key_fail(ctx, "method.cfg_uncond.text", "'drop' is not supported for Wan (valid: keep, zero, negative_prompt)");
        u.choice("text", {"keep", "zero", "negative_prompt"}, "keep");
        u.finish();
        d.cfg_uncond = cu;
      }
      d.negative_prompt_embedding = s.str("negative_prompt_embedding", "");
      if (s.has("shifted_ode_schedule")) {
        Section o = s.sub("shifted_ode_schedule");
        auto& so = d.shifted_ode_schedule;
        so.present = true;
        so.flow_shift = o.f64("flow_shift", 0.0);
        so.teacher_steps = o.i64("teacher_steps", 0);
        so.student_steps = o.i64("student_steps", 0);
        so.version = o.i64("version", 1);
        so.indices = o.i64_list("indices");
        so.sigmas = o.f64_list("sigmas");
        so.timesteps = o.f64_list("timesteps");
        o.finish();
        check(so.flow_shift > 0.0, ctx, "method.shifted_ode_schedule.flow_shift", "must be > 0");
        check(so.teacher_steps > 0, ctx, "method.shifted_ode_schedule.teacher_steps", "must be > 0");
        check(so.indices.size() == static_cast<size_t>(so.student_steps), ctx,
              "method.shifted_ode_schedule.indices", "must have student_steps entries");
        for (auto i : so.indices)
          check(i >= 0 && i < so.teacher_steps, ctx, "method.shifted_ode_schedule.indices",
                "entries must be in [0, teacher_steps), found " + std::to_string(i));
      }
      break;
    }
    case MethodKind::kLayerRecon: {
      auto& l = m.layer_recon;
      l.group_size = s.i64("group_size", l.group_size);
      l.energy_floor = s.f64("energy_floor", l.energy_floor);
      l.input_source = s.choice("input_source", {"ode_start"}, l.input_source);
      l.propagation = s.choice("propagation", {"teacher"}, l.propagation);
      l.loss = s.choice("loss", {"mse"}, l.loss);
      l.trainable_scope = s.choice("trainable_scope", {"quantized_path"}, l.trainable_scope);
      l.checkpoint_blocks = s.boolean("checkpoint_blocks", l.checkpoint_blocks);
      l.trainable_modules = s.str_list("trainable_modules", l.trainable_modules);
      check(l.group_size >= 1, ctx, "method.group_size", "must be >= 1");
      check(l.energy_floor > 0.0, ctx, "method.energy_floor", "must be > 0");
      check(!l.trainable_modules.empty(), ctx, "method.trainable_modules", "must not be empty");
      break;
    }
    case MethodKind::kReconOde: {
      auto& r = m.recon_ode;
      r.attention_weight = s.f64("attention_weight", r.attention_weight);
      r.mlp_weight = s.f64("mlp_weight", r.mlp_weight);
      r.ode_weight = s.f64("ode_weight", r.ode_weight);
      r.student_steps = s.i64("student_steps", r.student_steps);
      r.loss = s.choice("loss", {"mse"}, r.loss);
      r.trainable_scope = s.choice("trainable_scope", {"quantized_path"}, r.trainable_scope);
      r.checkpoint_blocks = s.boolean("checkpoint_blocks", r.checkpoint_blocks);
      r.trainable_modules = s.str_list("trainable_modules", r.trainable_modules);
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

// ---------------------------------------------------------------------------
// callbacks and pipeline
// ---------------------------------------------------------------------------
CallbacksConfig parse_callbacks(const Ctx& ctx, const Json* node) {
  CallbacksConfig c;
  if (!node || node->is_null()) return c;
  if (!node->is_object())
    fail("config ", ctx.source, ": key 'callbacks': expected a mapping, found ", describe(*node));
  for (auto it = node->begin(); it != node->end(); ++it) {
    const std::string name = it.key();
    const std::string p = "callbacks." + name;
    Section s(ctx, &it.value(), p);
    std::string kind;
    std::string target = s.str("_target_", "");
    if (!target.empty()) {
      for (const auto& ct : kCallbackTargets)
        if (target == ct.target) kind = ct.kind;
      if (kind.empty())
        key_fail(ctx, p + "._target_", "unknown callback class '", target, "' (valid: ",
                 callback_target_choices(), ")");
    } else if (name == "grad_clip" || name == "ema" || name == "validation") {
      kind = name;
    } else {
      key_fail(ctx, p, "unknown callback without _target_ (valid names: grad_clip, validation, ema)");
    }
    auto once = [&](bool& enabled) {
      check(!enabled, ctx, p, "a second " + kind + " callback is not supported");
      enabled = true;
    };
    if (kind == "grad_clip") {
      once(c.grad_clip.enabled);
      c.grad_clip.max_grad_norm = s.f64("max_grad_norm", 1.0);
      c.grad_clip.log_grad_norms = s.boolean("log_grad_norms", true);
      check(c.grad_clip.max_grad_norm >= 0.0, ctx, p + ".max_grad_norm", "must be >= 0 (0 = no clipping)");
    } else if (kind == "ema") {
      once(c.ema.enabled);
      c.ema.decay = s.f64("decay", 0.9999);
      c.ema.start_iter = s.i64("start_iter", 0);
      check(c.ema.decay > 0.0 && c.ema.decay < 1.0, ctx, p + ".decay", "must be in (0, 1)");
    } else {
      once(c.validation.enabled);
      auto& v = c.validation;
      v.target = target;
      v.pipeline_target = s.str("pipeline_target", "");
      v.dataset_file = s.str("dataset_file", "");
      v.output_dir = s.str("output_dir", "");
      v.every_steps = s.i64("every_steps", 0);
      v.sampling_steps = s.i64_list("sampling_steps");
      v.sampling_timesteps = s.f64_list("sampling_timesteps");
      v.guidance_scale = s.f64("guidance_scale", 5.0);
      v.run_at_start = s.boolean("run_at_start", true);
      v.height = s.i64("height", 0);
      v.width = s.i64("width", 0);
      v.num_frames = s.i64("num_frames", 0);
      v.offload_training_state = s.boolean("offload_training_state", false);
      v.unload_pipeline_after_validation = s.boolean("unload_pipeline_after_validation", false);
      v.attn_qat_infer = s.boolean("attn_qat_infer", false);
      v.use_validation_media_conditioning = s.boolean("use_validation_media_conditioning", false);
      check(v.every_steps >= 0, ctx, p + ".every_steps", "must be >= 0");
      if (v.every_steps > 0) {
        check(!v.dataset_file.empty(), ctx, p + ".dataset_file", "must be set when every_steps > 0");
        check(!v.sampling_steps.empty(), ctx, p + ".sampling_steps", "must be set when every_steps > 0");
      }
      for (auto n : v.sampling_steps) check(n >= 1, ctx, p + ".sampling_steps", "entries must be >= 1");
    }
    s.finish();
    c.order.push_back(name);
  }
  return c;
}

PipelineConfig parse_pipeline(const Ctx& ctx, const Json* node) {
  PipelineConfig c;
  if (node && node->is_string())
    key_fail(ctx, "pipeline", "a pipeline config file path is not supported; write its keys inline");
  Section s(ctx, node, "pipeline");
  if (s.has("flow_shift")) {
    c.flow_shift = s.f64("flow_shift", 0.0);
    check(*c.flow_shift > 0.0, ctx, "pipeline.flow_shift", "must be > 0, found " + fmt(*c.flow_shift));
  }
  {
    Section d = s.sub("dit_config");
    c.quant_config = d.choice("quant_config", quant_configs(), "none", true);
    d.finish();
  }
  c.dmd_denoising_steps = s.f64_list("dmd_denoising_steps");
  c.warp_denoising_step = s.boolean("warp_denoising_step", false);
  c.negative_prompt = s.str("negative_prompt", "");
  s.finish();
  return c;
}

// ---------------------------------------------------------------------------
// Resolved config (every value, defaults filled in, loadable again)
// ---------------------------------------------------------------------------
Json str_or_null(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }

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
  if (r.lora.enable)
    j["lora"] = {{"enable", true}, {"rank", r.lora.rank}, {"alpha", r.lora.alpha},
                 {"target_modules", r.lora.target_modules}};
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

Json callbacks_to_json(const CallbacksConfig& c, const Json& raw_callbacks) {
  Json j = Json::object();
  for (const auto& name : c.order) {
    const Json& raw = raw_callbacks[name];
    std::string target = raw.is_object() && raw.contains("_target_") && raw["_target_"].is_string()
                             ? raw["_target_"].get<std::string>()
                             : "";
    Json e = Json::object();
    if (!target.empty()) e["_target_"] = target;
    std::string kind = target.empty() ? name : "";
    for (const auto& ct : kCallbackTargets)
      if (target == ct.target) kind = ct.kind;
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

// ---------------------------------------------------------------------------
// Cross-section rules
// ---------------------------------------------------------------------------
void validate_roles(const Ctx& ctx, const RunConfig& c, const Json& raw_models) {
  std::vector<std::string> need = c.method.roles();
  const char* mname = method_name(c.method.kind);
  for (const auto& r : need)
    if (!c.models.count(r))
      fail("config ", ctx.source, ": key 'models.", r, "': method ", mname, " needs roles ", join(need),
           "; '", r, "' is missing");
  for (auto it = raw_models.begin(); it != raw_models.end(); ++it)
    if (std::find(need.begin(), need.end(), it.key()) == need.end())
      key_fail(ctx, "models." + it.key(), "method ", mname, " uses roles ", join(need),
               "; remove the unused role '", it.key(), "'");
  auto want_trainable = [&](const std::string& role, bool trainable) {
    const RoleConfig& r = c.models.at(role);
    if (r.trainable != trainable)
      key_fail(ctx, "models." + role + ".trainable", "method ", mname, " needs ", role,
               trainable ? " trainable (true)" : " frozen (false)", ", found ", r.trainable ? "true" : "false");
  };
  want_trainable("student", true);
  if (c.method.kind == MethodKind::kDmd2) {
    want_trainable("teacher", false);
    want_trainable("critic", true);
    if (c.training.data.preprocessed_data_type == "text_only" &&
        c.method.dmd2.rollout_mode != RolloutMode::kSimulate)
      key_fail(ctx, "method.rollout_mode", "training.data.preprocessed_data_type text_only has no latents; "
               "rollout_mode must be simulate, found ", rollout_mode_name(c.method.dmd2.rollout_mode));
  } else if (c.method.kind != MethodKind::kSft) {
    want_trainable("teacher", false);
  }
  check(c.training.optimizer.learning_rate > 0.0, ctx, "training.optimizer.learning_rate",
          std::string("method ") + mname + " trains the student; learning_rate must be > 0, found " +
              fmt(c.training.optimizer.learning_rate));
}

}  // namespace

// ===========================================================================
// Entry points
// ===========================================================================
RunConfig parse_run_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                           const std::string& source_name) {
  Ctx ctx{source_name.empty() ? std::string("<string>") : source_name};
  RunConfig c;
  c.source_sha256 = sha256_hex(yaml_text);
  c.overrides = overrides;
  Json raw = yaml_to_json(yaml_text, ctx.source);
  if (raw.is_null())
    fail("config ", ctx.source, ": empty; expected a mapping with models, method, training");
  if (!raw.is_object())
    fail("config ", ctx.source, ": top level must be a mapping (models, method, training, callbacks, "
         "pipeline), found ", describe(raw));
  for (const auto& [key, value] : parse_overrides(overrides)) apply_override(raw, key, value);
  c.raw = raw;

  Section top(ctx, &c.raw, "");
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

  c.pipeline = parse_pipeline(ctx, pipeline);
  c.training = parse_training(ctx, training, *models);
  for (auto it = models->begin(); it != models->end(); ++it)
    c.models.emplace(it.key(), parse_role(ctx, it.key(), it.value(), c.training, c.pipeline.quant_config));
  c.method = parse_method(ctx, method);
  c.callbacks = parse_callbacks(ctx, callbacks);
  validate_roles(ctx, c, *models);

  c.resolved = Json::object();
  Json rm = Json::object();
  for (auto it = models->begin(); it != models->end(); ++it) rm[it.key()] = to_json(c.models.at(it.key()));
  c.resolved["models"] = rm;
  c.resolved["method"] = to_json(c.method);
  c.resolved["training"] = to_json(c.training);
  c.resolved["callbacks"] = callbacks_to_json(c.callbacks, callbacks ? *callbacks : Json::object());
  c.resolved["pipeline"] = to_json(c.pipeline);
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
