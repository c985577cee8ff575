// Device queries used to pick kernels and to refuse clearly when none fits.
#pragma once
#include <string>

namespace vqad::kernels {

struct DeviceInfo {
  int index = -1;
  int sm_major = 0, sm_minor = 0;  // compute capability
  int num_sms = 0;
  size_t smem_optin_bytes = 0;     // max dynamic shared memory per block (opt-in)
  std::string name;
  int arch() const { return sm_major * 10 + sm_minor; }  // 90 for H100/H200
};

// Properties of `device` (-1: the current device). Throws if there is no GPU.
DeviceInfo device_info(int device = -1);
// Number of visible CUDA devices (0 when no driver/GPU, never throws).
int device_count();

// Whether this build holds device code of a kernel family for `device` (-1: the current
// one): `probe` is one kernel of the family (its address); a build without the device's
// arch fails cudaFuncGetAttributes. Cached per (family, device). On false, *why names
// the device, its arch, the family and the fix.
bool kernel_family_available(const char* family, const void* probe, int device, std::string* why);

}  // namespace vqad::kernels
