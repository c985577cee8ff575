// `--a.b.c value` command-line overrides with FastVideo's casting rules.
#pragma once
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vqad/config/value.h"

namespace vqad::config {

// Override tokens (`--a.b v` / `--a.b=v`) -> (dotted key, value cast by FastVideo's
// rules): true/false (any case) -> bool, none/null -> null, int, float, "[...]" -> YAML
// list, else string. A null value removes what the key names where a section allows it
// (e.g. `--callbacks.validation none` removes the validation callback).
std::vector<std::pair<std::string, Json>> parse_overrides(const std::vector<std::string>& tokens);
Json cast_override_value(std::string_view text);
// Sets a dotted key, creating intermediate maps (replacing non-map ones).
void apply_override(Json& root, const std::string& dotted_key, const Json& value);

}  // namespace vqad::config
