#include "vqad/config/schema.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace vqad::config {

const char* key_type_name(KeyType t) {
  switch (t) {
    case KeyType::kBool: return "bool";
    case KeyType::kInt: return "int";
    case KeyType::kFloat: return "float";
    case KeyType::kString: return "string";
    case KeyType::kChoice: return "choice";
    case KeyType::kIntList: return "list of int";
    case KeyType::kFloatList: return "list of float";
    case KeyType::kStringList: return "list of string";
    case KeyType::kPair: return "pair of float";
    case KeyType::kMapping: return "mapping";
    case KeyType::kAny: return "any";
  }
  return "?";
}

const char* key_status_name(KeyStatus s) {
  switch (s) {
    case KeyStatus::kImplemented: return "implemented";
    case KeyStatus::kNotSupportedYet: return "not_supported_yet";
    case KeyStatus::kPlanned: return "planned";
  }
  return "?";
}

const KeyDesc* SectionSchema::find(const std::string& key) const {
  for (const auto& k : keys)
    if (k.key == key) return &k;
  return nullptr;
}

std::vector<std::string> SectionSchema::key_names() const {
  std::vector<std::string> v;
  for (const auto& k : keys) v.push_back(k.key);
  return v;
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

Section::Section(const Ctx& ctx, const Json* node, const SectionSchema& schema, std::string path)
    : ctx_(ctx), node_(node), schema_(schema), path_(std::move(path)) {
  if (node_ && node_->is_null()) node_ = nullptr;
  if (node_ && !node_->is_object())
    fail("config ", ctx_.source, ": key '", path_, "': expected a mapping, found ", describe(*node_));
  if (!node_) return;
  for (const auto& d : schema_.keys) {
    if (d.status != KeyStatus::kNotSupportedYet) continue;
    auto it = node_->find(d.key);
    if (it == node_->end() || it->is_null() || *it == d.inert) continue;
    if ((it->is_object() || it->is_array()) && it->empty()) continue;
    std::string hint = d.inert.is_null() ? "remove it" : "remove it or set it to " + d.inert.dump();
    fail("config ", ctx_.source, ": key '", key_path(d.key), "' is not supported yet (", d.help, "); found ",
         describe(*it), ": ", hint);
  }
}

const KeyDesc& Section::desc(const std::string& key) const {
  const KeyDesc* d = schema_.find(key);
  // A key read by the parser but missing from its table is a vqad bug, not a user error.
  if (!d) fail("config schema ", schema_.path, ": key '", key, "' has no descriptor");
  return *d;
}

const Json* Section::get(const std::string& key) const {
  desc(key);
  if (!node_) return nullptr;
  auto it = node_->find(key);
  if (it == node_->end() || it->is_null()) return nullptr;
  return &*it;
}

int64_t Section::i64(const std::string& key) const {
  const KeyDesc& d = desc(key);
  if (!d.default_value.is_number_integer()) fail("config schema ", schema_.path, ": key '", key, "' has no integer default");
  return i64(key, d.default_value.get<int64_t>());
}
int64_t Section::i64(const std::string& key, int64_t def) const {
  const Json* v = get(key);
  return use_default(desc(key), v) ? def : as_int(ctx_, key_path(key), *v);
}
double Section::f64(const std::string& key) const {
  const KeyDesc& d = desc(key);
  if (!d.default_value.is_number()) fail("config schema ", schema_.path, ": key '", key, "' has no numeric default");
  return f64(key, d.default_value.get<double>());
}
double Section::f64(const std::string& key, double def) const {
  const Json* v = get(key);
  return use_default(desc(key), v) ? def : as_double(ctx_, key_path(key), *v);
}
bool Section::boolean(const std::string& key) const {
  const KeyDesc& d = desc(key);
  if (!d.default_value.is_boolean()) fail("config schema ", schema_.path, ": key '", key, "' has no bool default");
  const Json* v = get(key);
  return v ? as_bool(ctx_, key_path(key), *v) : d.default_value.get<bool>();
}
std::string Section::str(const std::string& key) const {
  const KeyDesc& d = desc(key);
  return str(key, d.default_value.is_string() ? d.default_value.get<std::string>() : std::string());
}
std::string Section::str(const std::string& key, const std::string& def) const {
  const Json* v = get(key);
  return use_default(desc(key), v) ? def : as_string(ctx_, key_path(key), *v);
}
std::string Section::required_str(const std::string& key) const {
  const Json* v = get(key);
  if (!v) fail("config ", ctx_.source, ": missing required key '", key_path(key), "'");
  std::string s = as_string(ctx_, key_path(key), *v);
  if (trim(s).empty()) key_fail(ctx_, key_path(key), "must not be empty");
  return s;
}
std::string Section::choice(const std::string& key) const {
  const KeyDesc& d = desc(key);
  return choice(key, d.default_value.is_string() ? d.default_value.get<std::string>() : std::string());
}
std::string Section::choice(const std::string& key, const std::string& def) const {
  const KeyDesc& d = desc(key);
  std::string s = str(key, def);
  if (std::find(d.choices.begin(), d.choices.end(), s) == d.choices.end())
    key_fail(ctx_, key_path(key), "unknown value '", s, "' (valid: ", join(d.choices), ")");
  return s;
}
std::vector<std::string> Section::str_list(const std::string& key) const {
  const KeyDesc& d = desc(key);
  const Json* v = get(key);
  if (!v) {
    std::vector<std::string> def;
    if (d.default_value.is_array())
      for (const auto& x : d.default_value) def.push_back(x.get<std::string>());
    return def;
  }
  if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of strings, found ", describe(*v));
  std::vector<std::string> out;
  for (size_t i = 0; i < v->size(); ++i)
    out.push_back(as_string(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
  return out;
}
std::vector<double> Section::f64_list(const std::string& key) const {
  const Json* v = get(key);
  if (!v) return {};
  if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of numbers, found ", describe(*v));
  std::vector<double> out;
  for (size_t i = 0; i < v->size(); ++i)
    out.push_back(as_double(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
  return out;
}
std::vector<int64_t> Section::i64_list(const std::string& key) const {
  const Json* v = get(key);
  if (!v) return {};
  if (!v->is_array()) key_fail(ctx_, key_path(key), "expected a list of integers, found ", describe(*v));
  std::vector<int64_t> out;
  for (size_t i = 0; i < v->size(); ++i)
    out.push_back(as_int(ctx_, key_path(key) + "[" + std::to_string(i) + "]", (*v)[i]));
  return out;
}
std::array<double, 2> Section::betas(const std::string& key, bool required) const {
  const KeyDesc& d = desc(key);
  const Json* v = get(key);
  if (!v) {
    if (required) fail("config ", ctx_.source, ": missing required key '", key_path(key), "'");
    return {d.default_value.at(0).get<double>(), d.default_value.at(1).get<double>()};
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
  if (parts.size() != 2) key_fail(ctx_, key_path(key), "expected two betas, found ", describe(*v));
  std::array<double, 2> b{as_double(ctx_, key_path(key), parts[0]), as_double(ctx_, key_path(key), parts[1])};
  for (double x : b)
    if (!(x >= 0.0 && x < 1.0)) key_fail(ctx_, key_path(key), "betas must be in [0, 1), found ", v->dump());
  return b;
}
Section Section::sub(const std::string& key, const SectionSchema& schema) const {
  return Section(ctx_, get(key), schema, key_path(key));
}

void Section::finish() const {
  if (!node_) return;
  for (auto it = node_->begin(); it != node_->end(); ++it) {
    if (!schema_.find(it.key()))
      fail("config ", ctx_.source, ": unknown key '", key_path(it.key()), "' (found value ", describe(it.value()),
           "; valid keys of ", path_.empty() ? "the top level" : path_, ": ", join(schema_.key_names()), ")");
  }
}

}  // namespace vqad::config
