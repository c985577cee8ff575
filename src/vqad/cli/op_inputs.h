// Input checks shared by the `vqad op` tools: NaN/Inf in an input tensor is reported
// (a warning naming the file, tensor and count), or refused with --strict.
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace vqad::cli {

void check_finite_inputs(const std::string& file, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                         bool strict);

}  // namespace vqad::cli
