#include "vqad/train/determinism.h"

#include <ATen/Context.h>

#include <cstdlib>

namespace vqad {

void set_cublas_workspace_default() { ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0); }

void set_deterministic_algorithms(bool on) {
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(on, /*warn_only=*/true);
  ctx.setDeterministicFillUninitializedMemory(false);
  ctx.setDeterministicCuDNN(on);
  ctx.setBenchmarkCuDNN(false);
}

}  // namespace vqad
