// The c10d backends vqad's process groups run on (internal to src/vqad/dist).
//
// Gloo (CPU tensors) lives in gloo_backend.cpp, the only file that includes
// ProcessGroupGloo.hpp: the wheel ships that header but not the gloo headers it includes,
// so the build compiles it against system gloo headers (libgloo-dev) when they are found.
// Only pointers to gloo types cross this file (devices, contexts), so the class layout does
// not depend on the gloo headers' version; vqad never constructs a gloo type itself (the
// device, store adapter and contexts are built inside libtorch_cpu.so). The cross-process
// tests in tests/cpu/test_dist*.cpp prove the combination.
// NCCL (CUDA tensors) lives in nccl_backend.cpp (builds with LibTorch's CUDA libraries).
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace vqad::dist {

bool gloo_available();
bool nccl_available();
// `loopback`: every rank runs on this host (the store address is a loopback address).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, bool loopback);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, int device_index);

}  // namespace vqad::dist
