// Throughput of a training step: peak memory, model FLOPs and MFU against the
// device's dense BF16 tensor-core peak (a table keyed by device name / compute
// capability; a device that is not in it gets no MFU rather than a wrong one).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

#include "vqad/model/wan/config.h"

namespace vqad::train {

// Peak allocated GiB of the CUDA caching allocator, or the process high-water mark on the CPU.
double peak_memory_gib(torch::Device device);

// Model FLOPs of one fwd+bwd step (no recompute): 6 * linear params * tokens + attention.
double step_flops(const model::WanConfig& c, int64_t tokens_per_sample, int64_t batch, int64_t text_len);

struct DevicePeak {
  std::string device;   // the name the table matched
  double bf16_dense_flops = 0;  // per second, dense (no sparsity)
};
// Dense BF16 peak of a device by its name (e.g. "NVIDIA H100 80GB HBM3") and compute
// capability; nullopt for a device that is not in the table.
std::optional<DevicePeak> device_peak_flops(const std::string& name, int major, int minor);
// The same for a torch device (nullopt on the CPU or without CUDA in the build).
std::optional<DevicePeak> device_peak_flops(torch::Device device);

}  // namespace vqad::train
