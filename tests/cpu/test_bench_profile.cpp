// The profiler helper behind `vqad bench step --profile`, on the CPU: a tiny Wan
// forward + backward shows its matmuls among the CPU ops and the Chrome trace is written.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/bench_profile.h"
#include "vqad/model/wan/model.h"

namespace fs = std::filesystem;

TEST(BenchProfile, CpuOpsAndTraceOfATinyWanStep) {
  torch::manual_seed(0);
  vqad::model::WanModel m(vqad::model::WanConfig::tiny());
  auto x = torch::randn({1, 16, 2, 4, 4}).to(torch::kBFloat16);
  auto t = torch::full({1}, 500.0f);
  auto text = torch::randn({1, 512, vqad::model::WanConfig::tiny().text_dim}).to(torch::kBFloat16);
  const fs::path trace = fs::temp_directory_path() / ("vqad_profile_" + std::to_string(::getpid()) + ".json");
  auto s = vqad::bench::profile_once([&] { m.forward(x, t, text).to(torch::kFloat32).pow(2).mean().backward(); },
                                     /*cuda=*/false, trace.string());
  EXPECT_TRUE(s.device.empty());
  bool matmul = false;
  for (const auto& r : s.cpu_ops) matmul |= (r.name == "aten::mm" || r.name == "aten::addmm" || r.name == "aten::matmul") && r.calls > 0;
  EXPECT_TRUE(matmul) << vqad::bench::profile_table(s, 20);
  std::ifstream f(trace);
  ASSERT_TRUE(f.good());
  auto j = nlohmann::json::parse(f);
  EXPECT_TRUE(j.contains("traceEvents"));
  EXPECT_FALSE(j["traceEvents"].empty());
  fs::remove(trace);
  EXPECT_EQ(vqad::bench::kernel_category("attn_qat_fwd_sm90_kernel<128>"), "attention");
  EXPECT_EQ(vqad::bench::kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32"), "gemm");
  EXPECT_EQ(vqad::bench::kernel_category("nvfp4_fake_quantize_kernel"), "nvfp4");
  EXPECT_EQ(vqad::bench::kernel_category("void at::native::vectorized_elementwise_kernel<4>"), "elementwise");
}
