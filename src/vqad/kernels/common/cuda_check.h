// CUDA error checking for vqad kernels (no torch). Every CUDA API call and
// launch is checked; failures throw std::runtime_error naming the op.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace vqad::kernels {

inline void cuda_check(cudaError_t err, const char* op, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + op + " (" + file + ":" +
                             std::to_string(line) + "): " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

}  // namespace vqad::kernels

#define VQAD_CUDA_CHECK(expr) ::vqad::kernels::cuda_check((expr), #expr, __FILE__, __LINE__)
// After a <<<...>>> launch: reports invalid configurations immediately.
#define VQAD_CUDA_CHECK_LAUNCH(name) ::vqad::kernels::cuda_check(cudaGetLastError(), name, __FILE__, __LINE__)
