// `vqad bench wan-forward`: forward (and optionally forward + backward) of a Wan2.1
// architecture with random weights at a video-sized token grid, BF16 compute, on one GPU.
// Reports the median time per pass and the peak allocated memory; writes JSON.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace vqad::cli {
namespace {

struct WanForwardBenchOptions {
  std::string preset = "1.3B";
  std::string backend = "FLASH_ATTN";
  // Latent frames, height, width (before the 1x2x2 patch): 20x60x104 = 480x832, 77 frames,
  // 20 x 30 x 52 = 31,200 tokens.
  int64_t frames = 20, height = 60, width = 104;
  int64_t batch = 1;
  int warmup = 1;
  int iters = 3;
  bool backward = false;
  bool checkpointing = false;
  std::string out_dir = "bench_out";
};

#ifdef VQAD_WITH_TORCH_CUDA
int run_bench(const WanForwardBenchOptions& o) {
  VQAD_CHECK(torch::cuda::is_available(), "bench wan-forward: no CUDA device is available");
  const auto backend = ops::parse_attention_backend_or_throw(o.backend, "--backend");
  const torch::Device dev(torch::kCUDA, 0);
  model::WanConfig cfg = model::WanConfig::preset(o.preset);
  model::WanModelOptions mo;
  mo.device = dev;
  mo.compute_dtype = torch::kBFloat16;
  mo.gradient_checkpointing = o.checkpointing;
  std::shared_ptr<model::WanModel> m;
  {
    ops::AttentionBackendScope scope(backend);
    m = std::make_shared<model::WanModel>(cfg, mo);
  }
  if (!o.backward)
    for (auto& p : m->parameters()) p.requires_grad_(false);
  torch::manual_seed(0);
  auto x = torch::randn({o.batch, cfg.in_channels, o.frames, o.height, o.width},
                        torch::TensorOptions().device(dev).dtype(torch::kBFloat16));
  auto t = torch::full({o.batch}, 500.0f, torch::TensorOptions().device(dev));
  auto text = torch::randn({o.batch, cfg.text_len, cfg.text_dim},
                           torch::TensorOptions().device(dev).dtype(torch::kBFloat16));
  const int64_t tokens = (o.frames / cfg.patch_size[0]) * (o.height / cfg.patch_size[1]) *
                         (o.width / cfg.patch_size[2]);
  const double param_gib = [&] {
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    return n * 4.0 / (1 << 30);
  }();

  auto pass = [&] {
    if (o.backward) {
      auto out = m->forward(x, t, text);
      out.to(torch::kFloat32).pow(2).mean().backward();
    } else {
      torch::NoGradGuard ng;
      (void)m->forward(x, t, text);
    }
  };
  for (int i = 0; i < o.warmup; ++i) pass();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) {
    m->zero_grad();
    torch::cuda::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    pass();
    torch::cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const double peak_gib = stats.allocated_bytes[0].peak / double(1 << 30);
  const double median = ms[ms.size() / 2];
  const char* what = o.backward ? "forward+backward" : "forward";
  std::printf("| model | backend | tokens | batch | pass | median ms | peak GiB (params %.2f) |\n", param_gib);
  std::printf("|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %s | %lld | %lld | %s%s | %.1f | %.2f |\n", o.preset.c_str(), o.backend.c_str(),
              (long long)tokens, (long long)o.batch, what, o.checkpointing ? " (ckpt)" : "", median, peak_gib);
  nlohmann::json j = {{"bench", "wan-forward"},
                      {"preset", o.preset},
                      {"backend", o.backend},
                      {"latent", {o.frames, o.height, o.width}},
                      {"tokens", tokens},
                      {"batch", o.batch},
                      {"pass", what},
                      {"gradient_checkpointing", o.checkpointing},
                      {"compute_dtype", "bf16"},
                      {"ms_median", median},
                      {"ms_all", ms},
                      {"peak_allocated_gib", peak_gib},
                      {"param_fp32_gib", param_gib},
                      {"device", torch::cuda::device_count() > 0 ? "cuda:0" : "?"}};
  std::printf("wrote %s\n", vqad::bench::write_json(o.out_dir, "wan_forward.json", j).c_str());
  return 0;
}
#else
int run_bench(const WanForwardBenchOptions&) {
  fail("bench wan-forward needs a GPU build (LibTorch CUDA libraries linked, VQAD_TORCH_CUDA=ON)");
}
#endif

}  // namespace

void register_bench_wan_commands(CLI::App& app) {
  auto opts = std::make_shared<WanForwardBenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "wan-forward", "Wan2.1 DiT forward (random weights, BF16) at a video token grid: time and peak memory");
  sub->add_option("--preset", opts->preset, "1.3B | 14B | tiny")->capture_default_str();
  sub->add_option("--backend", opts->backend, "self-attention backend")->capture_default_str();
  sub->add_option("--frames", opts->frames, "latent frames")->capture_default_str();
  sub->add_option("--height", opts->height, "latent height")->capture_default_str();
  sub->add_option("--width", opts->width, "latent width")->capture_default_str();
  sub->add_option("--batch", opts->batch)->capture_default_str();
  sub->add_option("--warmup", opts->warmup)->capture_default_str();
  sub->add_option("--iters", opts->iters)->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_flag("--backward", opts->backward, "time forward + backward (loss = mean(out^2))");
  sub->add_flag("--checkpointing", opts->checkpointing, "per-block activation checkpointing");
  sub->add_option("--out", opts->out_dir, "directory for wan_forward.json")->capture_default_str();
  set_action(sub, [opts] { return run_bench(*opts); });
}

}  // namespace vqad::cli
