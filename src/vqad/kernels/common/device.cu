#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"

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

}  // namespace vqad::kernels
