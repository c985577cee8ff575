// `vqad bench vae`: decode time and peak memory of the Wan2.1 VAE decoder (the real Wan2.1
// config with seeded random weights) at the validation geometry of a 480p clip
// (default 21 latent frames of 60 x 104 -> 81 frames of 480 x 832), next to a plain
// device copy of the output's bytes in the same run. Runs on CPU or CUDA.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/media/wan_vae.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace vqad::cli {

namespace {

struct VaeBenchOptions {
  std::string device = "auto", dtype = "float32", out_dir = "out/bench_vae";
  int64_t frames = 21, height = 60, width = 104;
  int repeats = 2;
  uint64_t seed = 7;
};

int run_bench(const VaeBenchOptions& o) {
  torch::Device dev = o.device == "cpu" ? torch::Device(torch::kCPU)
                      : (o.device == "cuda" || (o.device == "auto" && torch::cuda::is_available()))
                          ? torch::Device(torch::kCUDA, 0)
                          : torch::Device(torch::kCPU);
  VQAD_CHECK(o.dtype == "float32" || o.dtype == "bfloat16", "--dtype: expected float32 or bfloat16, found '",
             o.dtype, "'");
  VQAD_CHECK(o.frames >= 1 && o.height >= 1 && o.width >= 1 && o.repeats >= 1,
             "bench vae: frames, height, width and repeats must be positive");
  const auto dtype = o.dtype == "float32" ? torch::kFloat32 : torch::kBFloat16;
  const auto config = media::WanVaeConfig::wan21();
  torch::manual_seed(o.seed);
  std::map<std::string, torch::Tensor> state;
  for (const auto& [k, shape] : media::WanVaeDecoder::expected_shapes(config)) {
    const double fan_in = shape.size() > 1 ? double(torch::empty(shape).numel() / shape[0]) : 1.0;
    state[k] = k.find("gamma") != std::string::npos ? 1.0 + 0.1 * torch::randn(shape)
                                                     : torch::randn(shape) * (0.5 / std::sqrt(fan_in));
  }
  media::WanVaeDecoder vae(config, state, dev, dtype, "bench vae (random Wan2.1 weights)");
  torch::Tensor z = torch::randn({1, config.z_dim, o.frames, o.height, o.width});
  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize();
  };
  // Warm-up on two latent frames (kernel selection, allocator).
  vae.decode(z.narrow(2, 0, std::min<int64_t>(2, o.frames)));
  sync();
#ifdef VQAD_WITH_TORCH_CUDA
  if (dev.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  std::vector<double> ms;
  torch::Tensor video;
  for (int r = 0; r < o.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    video = vae.decode(z);
    sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  double peak_gib = 0;
#ifdef VQAD_WITH_TORCH_CUDA
  if (dev.is_cuda())
    peak_gib = double(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak) / double(1ull << 30);
#endif
  // Baseline in the same run: one device copy of the decoded video's bytes.
  torch::Tensor copy_dst = torch::empty_like(video);
  sync();
  const auto c0 = std::chrono::steady_clock::now();
  copy_dst.copy_(video);
  sync();
  const double copy_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c0).count();
  const double med = bench::median(ms);
  std::printf("vqad bench vae on %s (%s): latents [1, 16, %lld, %lld, %lld] -> video [%lld, %lld, %lld, %lld, %lld]\n",
              dev.str().c_str(), o.dtype.c_str(), (long long)o.frames, (long long)o.height, (long long)o.width,
              (long long)video.size(0), (long long)video.size(1), (long long)video.size(2), (long long)video.size(3),
              (long long)video.size(4));
  std::printf("decode: median %.1f ms over %d runs (%.2f ms per video frame); peak allocated %.2f GiB; "
              "device copy of the output %.3f ms\n",
              med, o.repeats, med / double(video.size(2)), peak_gib, copy_ms);
  nlohmann::json j{{"device", dev.str()},          {"dtype", o.dtype},
                   {"latent_shape", {1, 16, o.frames, o.height, o.width}},
                   {"video_shape", video.sizes().vec()}, {"decode_ms", ms},
                   {"decode_median_ms", med},      {"peak_allocated_gib", peak_gib},
                   {"output_copy_ms", copy_ms}};
  std::printf("wrote %s\n", bench::write_json(o.out_dir, "bench_vae.json", j).c_str());
  return 0;
}

}  // namespace

void register_bench_vae_commands(CLI::App& app) {
  auto o = std::make_shared<VaeBenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "vae", "Wan2.1 VAE decode time and memory (random weights, default 21 latent frames at 480 x 832)");
  sub->add_option("--device", o->device, "auto | cpu | cuda")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "float32 | bfloat16")->capture_default_str();
  sub->add_option("--frames", o->frames, "latent frames")->capture_default_str();
  sub->add_option("--height", o->height, "latent height")->capture_default_str();
  sub->add_option("--width", o->width, "latent width")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "timed decodes (median)")->capture_default_str();
  sub->add_option("--out", o->out_dir, "directory for bench_vae.json")->capture_default_str();
  set_action(sub, [o] { return run_bench(*o); });
}

}  // namespace vqad::cli
