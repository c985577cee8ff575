#include "vqad/train/determinism.h"

#include <ATen/Context.h>

#include <cstdlib>

namespace vqad {

void set_cublas_workspace_default() { ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0); }

void set_deterministic_algorithms(bool on) {
  auto& ctx = at::globalContext();
  // warn_only = false: with only a warning, LibTorch keeps non-deterministic kernels (the
  // cuDNN SDPA backward of the cross-attention made two identical 1.3B runs differ from
  // step 5). An op without a deterministic implementation now fails, naming itself;
  // --nondeterministic turns this off.
  ctx.setDeterministicAlgorithms(on, /*warn_only=*/!on);
  ctx.setDeterministicFillUninitializedMemory(false);
  ctx.setDeterministicCuDNN(on);
  ctx.setBenchmarkCuDNN(false);
}

}  // namespace vqad
