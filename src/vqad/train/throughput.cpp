#include "vqad/train/throughput.h"

#include <fstream>
#include <string_view>

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace vqad::train {

double peak_memory_gib(torch::Device device) {
#ifdef VQAD_WITH_TORCH_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);
  }
#else
  (void)device;
#endif
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);
  return 0.0;
}

double step_flops(const model::WanConfig& c, int64_t tokens_per_sample, int64_t batch, int64_t text_len) {
  const double dim = static_cast<double>(c.dim()), L = static_cast<double>(tokens_per_sample);
  const double per_block_params = 4 * dim * dim /*self*/ + 2 * dim * dim + 2 * dim * dim /*cross*/ +
                                  2 * dim * static_cast<double>(c.ffn_dim);
  const double linear = 6.0 * per_block_params * c.num_layers * L * batch;
  const double self_attn = 3.5 * 4.0 * L * L * dim * c.num_layers * batch;
  const double cross_attn = 3.5 * 4.0 * L * static_cast<double>(text_len) * dim * c.num_layers * batch;
  return linear + self_attn + cross_attn;
}

namespace {
struct PeakRow {
  const char* name_part;  // substring of the CUDA device name
  int major, minor;       // compute capability the row applies to
  double flops;
};
// Dense BF16 tensor-core peaks from the vendors' data sheets (SXM / HBM parts unless named;
// H100 / H200 keep the 989e12 that earlier MFU numbers were computed with).
constexpr PeakRow kPeaks[] = {
    {"H100 PCIe", 9, 0, 756e12}, {"H100 NVL", 9, 0, 835e12}, {"H200", 9, 0, 989e12},
    {"H100", 9, 0, 989e12},      {"H800", 9, 0, 989e12},     {"GB200", 10, 0, 2500e12},
    {"B200", 10, 0, 2250e12},    {"B300", 10, 3, 2250e12},   {"A100", 8, 0, 312e12},
    {"A800", 8, 0, 312e12},      {"L40S", 8, 9, 362e12},     {"RTX PRO 6000", 12, 0, 504e12},
};
}  // namespace

std::optional<DevicePeak> device_peak_flops(const std::string& name, int major, int minor) {
  // Rows whose name contains another row's name come first (H100 PCIe before H100).
  for (const auto& r : kPeaks)
    if (name.find(r.name_part) != std::string::npos && r.major == major && r.minor == minor)
      return DevicePeak{r.name_part, r.flops};
  return std::nullopt;
}

std::optional<DevicePeak> device_peak_flops(torch::Device device) {
#ifdef VQAD_WITH_TORCH_CUDA
  if (device.is_cuda()) {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
    return device_peak_flops(p->name, p->major, p->minor);
  }
#else
  (void)device;
#endif
  return std::nullopt;
}

}  // namespace vqad::train
