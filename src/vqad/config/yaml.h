// YAML text <-> JSON tree. Plain scalars resolve like PyYAML's safe_load (null/~,
// true/false/yes/no/on/off, ints, floats); quoted scalars stay strings. The dump
// quotes every string a reader would not read back as that same string.
#pragma once
#include <string>

#include "vqad/config/value.h"

namespace vqad::config {

Json yaml_to_json(const std::string& yaml_text, const std::string& source_name);
std::string dump_yaml(const Json& value);
// One plain (unquoted) YAML scalar -> its typed value.
Json resolve_plain_scalar(const std::string& s);

}  // namespace vqad::config
