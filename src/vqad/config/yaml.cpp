#include "vqad/config/yaml.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cstdlib>
#include <limits>
#include <set>

#include "vqad/core/error.h"

namespace vqad::config {

// Follows PyYAML's safe_load resolver (YAML 1.1 booleans included); exponent floats
// without a dot are read as floats too, which only matters for values that are cast anyway.
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

namespace {

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

}  // namespace vqad::config
