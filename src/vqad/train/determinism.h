// Bitwise-reproducible GPU training by default.
//
// Sources of run-to-run differences on a GPU, and what is done about them:
//  - cuBLAS picks split-K / stream-K reductions whose order depends on the workspace it
//    gets; CUBLAS_WORKSPACE_CONFIG=:4096:8 fixes the workspace (set before the first cuBLAS
//    handle, i.e. at process start).
//  - cuDNN convolution backward (the patch embedding's Conv3d) may choose algorithms that
//    accumulate with atomics, and benchmark mode picks algorithms by timing:
//    deterministic cuDNN, no benchmarking.
//  - torch ops with atomics in their CUDA backward (index_add, scatter_add, embedding
//    backward, SDPA's flash / memory-efficient backward): torch's deterministic-algorithms
//    mode selects their deterministic variants; an op without one logs a warning naming it
//    (warn-only, so a run is never refused for it).
//  - vqad's own kernels (attention forward/backward, NVFP4 quantizers, fused block ops)
//    reduce in a fixed order; their only atomics are max reductions, which are exact.
// Uninitialized-memory filling (a side effect of torch's deterministic mode) stays off:
// every vqad output buffer is written in full, and the fill costs a pass over memory.
#pragma once

namespace vqad {

// Sets CUBLAS_WORKSPACE_CONFIG unless the environment already has it. Call first in main.
void set_cublas_workspace_default();
// Deterministic algorithms on (true) or torch's defaults (false).
void set_deterministic_algorithms(bool on);

}  // namespace vqad
