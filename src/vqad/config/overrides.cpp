#include "vqad/config/overrides.h"

#include <cctype>

#include "vqad/config/yaml.h"
#include "vqad/core/error.h"

namespace vqad::config {

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

}  // namespace vqad::config
