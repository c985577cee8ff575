// The device a command or a recipe names: "cpu", "cuda", "cuda:N" or "auto" (the first CUDA
// device when this build and machine have one, else the CPU).
#pragma once
#include <torch/torch.h>

#include <string>

namespace vqad::io {

// `key` names the option or config key in the one-line error ("--device", "ode_cache.device").
torch::Device parse_device(const std::string& s, const std::string& key = "--device");

}  // namespace vqad::io
