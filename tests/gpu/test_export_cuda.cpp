// GPU test of the packed NVFP4 export at Wan2.1-1.3B linear shapes: a linear packed
// (export/packed.h), written and read back through the loader (model/wan/weights.h)
// and run as a packed linear on the GPU equals the trained fake-quant linear's CUDA
// forward bit for bit, for dynamic, static and unit activation scales; and the GPU
// packed linear equals the CPU packed linear's reference within the GEMM's accumulation
// order (the CPU and GPU fake-quant linears differ the same way).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

#include "vqad/export/packed.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/packed_weights.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"

#ifdef VQAD_WITH_TORCH_CUDA

namespace {

namespace fs = std::filesystem;
using vqad::nvfp4::ScaleMode;

#define REQUIRE_GPU()                                                   \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

TEST(ExportCuda, PackedLinearEqualsFakeQuantLinearAt13BShapes) {
  REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / ("export_cuda_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const torch::Device dev(torch::kCUDA, 0);
  struct Shape {
    int64_t n, k;
    const char* name;
  };
  // dim 1536, ffn 8960 (to_q/k/v/out, ffn.net.0.proj, ffn.net.2), and 1000 tokens x 2.
  for (const Shape s : {Shape{1536, 1536, "blocks.0.attn1.to_q"}, Shape{8960, 1536, "blocks.0.ffn.net.0.proj"},
                        Shape{1536, 8960, "blocks.0.ffn.net.2"}}) {
    torch::manual_seed(s.n + s.k);
    const torch::Tensor w = torch::randn({s.n, s.k}) * 0.02;
    const torch::Tensor b = torch::randn({s.n}) * 0.01;
    for (ScaleMode mode : {ScaleMode::kDynamic, ScaleMode::kStatic, ScaleMode::kUnit}) {
      const float amax = mode == ScaleMode::kStatic ? 4.5f : 0.0f;
      const auto p = vqad::deploy::pack_linear(s.name, w, mode, mode == ScaleMode::kStatic ? std::optional<float>(amax)
                                                                                        : std::nullopt,
                                               false);
      const fs::path file = dir / "diffusion_pytorch_model.safetensors";
      std::vector<std::pair<std::string, torch::Tensor>> t = {{std::string(s.name) + ".weight", p.weight},
                                                              {std::string(s.name) + ".weight_scale", p.weight_scale},
                                                              {std::string(s.name) + ".weight_scale_2", p.weight_scale_2},
                                                              {std::string(s.name) + ".bias", b}};
      if (p.input_scale.defined()) t.emplace_back(std::string(s.name) + ".input_scale", p.input_scale);
      vqad::io::save_safetensors(file.string(), t);
      auto state = vqad::model::read_weights(file.string());
      const auto packed_linears = vqad::model::read_packed_nvfp4_linears(file.string());
      ASSERT_EQ(packed_linears.size(), 1u);
      const auto& lin = packed_linears.at(s.name);
      vqad::ops::Nvfp4PackedLinear packed(s.name, lin.unit_weight, lin.weight_scale_2, mode, amax);
      torch::NoGradGuard no_grad;
      torch::manual_seed(7);
      const torch::Tensor x = (torch::randn({2, 1000, s.k}) * 2.0).to(dev, torch::kBFloat16);
      const torch::Tensor wd = w.to(dev), bd = b.to(dev);
      const torch::Tensor want = vqad::ops::nvfp4_linear(x, wd, bd, mode, amax);
      const torch::Tensor got = packed.forward(x, state.tensors.at(std::string(s.name) + ".weight").to(dev), bd);
      EXPECT_TRUE(torch::equal(got, want)) << s.name << " " << vqad::nvfp4::scale_mode_name(mode) << ": max diff "
                                           << (got.to(torch::kFloat32) - want.to(torch::kFloat32)).abs().max().item<float>();
      // The CPU packed linear (reference): same operands, fp32 accumulation in another order.
      const torch::Tensor cpu = packed.forward(x.cpu(), torch::Tensor(), b);
      const torch::Tensor cpu_fq = vqad::ops::nvfp4_linear(x.cpu(), w, b, mode, amax);
      EXPECT_TRUE(torch::equal(cpu, cpu_fq)) << s.name;
      const double rel = ((got.cpu().to(torch::kFloat32) - cpu.to(torch::kFloat32)).norm() /
                          cpu.to(torch::kFloat32).norm()).item<double>();
      EXPECT_LT(rel, 1e-2) << s.name;
    }
  }
  fs::remove_all(dir);
}

}  // namespace

#endif  // VQAD_WITH_TORCH_CUDA
