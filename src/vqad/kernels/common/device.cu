#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/common/launch.h"

namespace vqad::kernels {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

DeviceInfo device_info(int device) {
  if (device < 0) VQAD_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp p{};
  VQAD_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  DeviceInfo d;
  d.index = device;
  d.sm_major = p.major;
  d.sm_minor = p.minor;
  d.num_sms = p.multiProcessorCount;
  d.smem_optin_bytes = p.sharedMemPerBlockOptin;
  d.name = p.name;
  return d;
}

std::string current_device_str() {
  try {
    int device = -1;
    cudaError_t err = cudaGetDevice(&device);
    cudaDeviceProp prop{};
    if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("no CUDA device: ") + cudaGetErrorString(err);
    }
    return "device " + std::to_string(device) + " " + prop.name + " (sm_" + std::to_string(prop.major) +
           std::to_string(prop.minor) + ")";
  } catch (...) {  // std::bad_alloc while building the text
    return "device unknown";
  }
}

bool kernel_family_available(const char* family, const void* probe, int device, std::string* why) {
  // Device properties are slow to query and cannot change: one check per family and device.
  struct Entry {
    bool available = false;
    std::string reason;
  };
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, Entry> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) VQAD_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_pair(std::string(family), device);
  auto it = cache.find(key);
  if (it == cache.end()) {
    cudaDeviceProp prop{};
    VQAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    int previous = 0;
    VQAD_CUDA_CHECK(cudaGetDevice(&previous));
    VQAD_CUDA_CHECK(cudaSetDevice(device));
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, probe);
    VQAD_CUDA_CHECK(cudaSetDevice(previous));
    Entry e;
    e.available = err == cudaSuccess;
    if (!e.available) {
      (void)cudaGetLastError();
      e.reason = std::string("device ") + std::to_string(device) + " (" + prop.name + ", sm_" +
                 std::to_string(prop.major) + std::to_string(prop.minor) + ") has no " + family +
                 " kernel in this build (" + cudaGetErrorString(err) +
                 "); rebuild with its arch in VQAD_CUDA_ARCHS";
    }
    it = cache.emplace(key, std::move(e)).first;
  }
  if (!it->second.available && why) *why = it->second.reason;
  return it->second.available;
}

}  // namespace vqad::kernels
