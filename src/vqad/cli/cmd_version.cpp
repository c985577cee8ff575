#include <torch/torch.h>

#include <cstdio>

#include "vqad/cli/commands.h"
#include "vqad/version.h"

namespace vqad::cli {

void register_version_commands(CLI::App& app) {
  auto* sub = app.add_subcommand("env", "Print the build and runtime environment (versions, CUDA)");
  set_action(sub, [] {
    std::printf("vqad %s\n", VQAD_VERSION);
    std::printf("libtorch %s\n", TORCH_VERSION);
#ifdef VQAD_WITH_TORCH_CUDA
    std::printf("torch cuda: linked, available=%d devices=%d\n", (int)torch::cuda::is_available(),
                (int)torch::cuda::device_count());
#else
    std::printf("torch cuda: not linked (CPU build)\n");
#endif
#ifdef VQAD_WITH_CUDA
    std::printf("vqad CUDA kernels: built\n");
#else
    std::printf("vqad CUDA kernels: not built\n");
#endif
    return 0;
  });
}

}  // namespace vqad::cli
