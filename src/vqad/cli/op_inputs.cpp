#include "vqad/cli/op_inputs.h"

#include <cstdio>

#include "vqad/core/error.h"

namespace vqad::cli {

void check_finite_inputs(const std::string& file, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                         bool strict) {
  for (const auto& [name, t] : tensors) {
    if (!t.defined() || !t.is_floating_point() || t.numel() == 0) continue;
    const auto f = t.detach().to(torch::kFloat32);
    const int64_t nan = torch::isnan(f).sum().item<int64_t>();
    const int64_t inf = torch::isinf(f).sum().item<int64_t>();
    if (nan == 0 && inf == 0) continue;
    const std::string what = file + ": tensor '" + name + "' holds " + std::to_string(nan) + " NaN and " +
                             std::to_string(inf) + " Inf value(s) of " + std::to_string(t.numel());
    VQAD_CHECK(!strict, what, " (--strict refuses non-finite inputs)");
    std::fprintf(stderr, "vqad: warning: %s; the outputs they reach are not meaningful (--strict refuses them)\n",
                 what.c_str());
  }
}

}  // namespace vqad::cli
