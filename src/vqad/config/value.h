// Scalars of a config tree: Python-compatible number text, YAML-style float text,
// and the one-line description of a value that config errors print.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace vqad::config {

using Json = nlohmann::ordered_json;  // insertion-ordered, as the YAML was written

// Python int(): optional sign, decimal digits with single '_' between digits.
bool is_int_text(std::string_view s, int64_t* out);
// Python float(): decimal or exponent notation, inf/infinity/nan (any case).
bool is_float_text(std::string_view s, double* out);
std::string trim(std::string_view s);
// Shortest round-trip text that every YAML reader reads back as a float.
std::string format_double(double v);
// "5 (an integer)", "'x' (a string)", "a mapping", ... for error messages.
std::string describe(const Json& v);
// Python truthiness (FastVideo's `x or default` reading).
bool falsy(const Json& v);
std::string join(const std::vector<std::string>& v, const char* sep = ", ");

}  // namespace vqad::config
