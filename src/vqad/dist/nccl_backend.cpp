// NCCL for CUDA collectives (builds with LibTorch's CUDA libraries, USE_C10D_NCCL).
// ProcessGroupNCCL::Options embeds ncclConfig_t, so the nccl.h found at build time must be
// the NCCL generation the wheel was built with (2.2x); the GPU test suite exercises this file.
#include "vqad/dist/backend.h"

#include "vqad/core/error.h"

#if defined(VQAD_WITH_TORCH_CUDA) && defined(USE_C10D_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace vqad::dist {

#if defined(VQAD_WITH_TORCH_CUDA) && defined(USE_C10D_NCCL)
bool nccl_available() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout, int device_index) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
#else
bool nccl_available() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds, int) {
  fail("distributed GPU training needs the NCCL backend, which is not part of this vqad build (build on a GPU "
       "machine with -DVQAD_TORCH_CUDA=ON)");
}
#endif

}  // namespace vqad::dist
