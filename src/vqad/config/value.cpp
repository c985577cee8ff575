#include "vqad/config/value.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace vqad::config {

bool is_int_text(std::string_view s, int64_t* out) {
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

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) {
    if (!s.empty()) s += sep;
    s += x;
  }
  return s;
}

}  // namespace vqad::config
