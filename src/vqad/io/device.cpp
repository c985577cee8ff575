#include "vqad/io/device.h"

#include "vqad/core/error.h"

namespace vqad::io {

torch::Device parse_device(const std::string& s, const std::string& key) {
  if (s == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  torch::Device d(torch::kCPU);
  try {
    d = torch::Device(s);
  } catch (const std::exception&) {
    fail(key, ": unknown device '", s, "' (valid: cpu, cuda, cuda:N, auto)");
  }
  VQAD_CHECK(d.is_cpu() || d.is_cuda(), key, ": '", s, "' is not supported (valid: cpu, cuda, cuda:N, auto)");
  if (d.is_cuda())
    VQAD_CHECK(torch::cuda::is_available(), key, " ", s,
               ": CUDA is not available in this build or on this machine (a CPU build links LibTorch without "
               "CUDA; build on a GPU machine)");
  return d;
}

}  // namespace vqad::io
