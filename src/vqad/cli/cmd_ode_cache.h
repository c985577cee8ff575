// Reading an ODE-cache recipe from a YAML file with `--a.b value` overrides (shared by
// `vqad ode-cache generate` and `vqad data inspect --recipe`).
#pragma once
#include <string>
#include <vector>

#include "vqad/sample/ode_generate.h"

namespace vqad::cli {

sample::OdeRecipe load_ode_recipe(const std::string& path, const std::vector<std::string>& overrides);

}  // namespace vqad::cli
