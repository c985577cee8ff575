// `vqad bench linear`: the NVFP4 QAT linear (dynamic W4A4, fused quantize-dequantize +
// cuBLASLt BF16 GEMM) against the BF16 linear at the Wan FFN shapes, forward and
// forward + backward, side by side in one run. Before timing, the CUDA result is
// checked against the CPU reference on a slice of rows. Prints a table and writes JSON.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/ops/nvfp4_linear.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace vqad::cli {
namespace {

struct LinearBenchOptions {
  int64_t m = 31200;
  std::vector<std::string> shapes = {"1536x8960", "8960x1536"};  // KxN
  int warmup = 5;
  int iters = 20;
  std::string out_dir = "bench_out";
};

#ifdef VQAD_WITH_TORCH_CUDA
// Median of the calls' CUDA-event times on the current LibTorch stream, each call
// synchronized before the next (its host work inside its own event pair).
template <class Fn>
double time_ms(Fn&& fn, int warmup, int iters) {
  return vqad::bench::time_cuda([&](cudaStream_t) { fn(); }, at::cuda::getCurrentCUDAStream().stream(), warmup,
                                iters, vqad::bench::TimingSync::kEachCall)
      .median_ms;
}

// CUDA forward vs the CPU reference on a slice of rows (static activation scale so the
// slice shares the scale with the whole tensor) and the dynamic amax vs the CPU amax.
void check_against_cpu(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  const int64_t m = x.size(0);
  const torch::Tensor rows = torch::tensor({int64_t{0}, std::min<int64_t>(127, m - 1), m / 2, m - 1}).to(x.device());
  const float amax = 3.0f;
  const torch::Tensor gpu =
      vqad::ops::nvfp4_linear(x, w, b, nvfp4::ScaleMode::kStatic, amax).index_select(0, rows).cpu().to(torch::kFloat32);
  const torch::Tensor cpu =
      vqad::ops::nvfp4_linear(x.index_select(0, rows).cpu(), w.cpu(), b.cpu(), nvfp4::ScaleMode::kStatic, amax)
          .to(torch::kFloat32);
  const torch::Tensor tol = cpu.abs() * (1.0 / 128) + 1e-5 * cpu.abs().max();
  VQAD_CHECK(((gpu - cpu).abs() <= tol).all().item<bool>(), "bench linear: CUDA output differs from the CPU reference (max abs err ",
             (gpu - cpu).abs().max().item<float>(), ") at M=", m, " K=", x.size(1), " N=", w.size(0));
  const float amax_gpu = vqad::ops::bf16_amax_cuda(x).item<float>();
  const float amax_cpu = vqad::ops::bf16_amax_cpu(x.cpu());
  VQAD_CHECK(amax_gpu == amax_cpu, "bench linear: CUDA amax ", amax_gpu, " != CPU amax ", amax_cpu);
}

nlohmann::json bench_shape(int64_t m, int64_t k, int64_t n, const LinearBenchOptions& o) {
  torch::manual_seed(1234 + k);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor x0 = torch::randn({m, k}, cuda.dtype(torch::kBFloat16));
  const torch::Tensor w0 = torch::randn({n, k}, cuda) * (1.0 / std::sqrt(double(k)));  // fp32 master
  const torch::Tensor b0 = torch::randn({n}, cuda) * 0.1;
  const torch::Tensor g = torch::randn({m, n}, cuda.dtype(torch::kBFloat16));
  check_against_cpu(x0, w0, b0);

  const torch::Tensor x = x0.detach().requires_grad_(true);
  const torch::Tensor w = w0.detach().requires_grad_(true);
  const torch::Tensor b = b0.detach().requires_grad_(true);
  const torch::Tensor w_bf16 = w0.to(torch::kBFloat16).detach().requires_grad_(true);
  const torch::Tensor b_bf16 = b0.to(torch::kBFloat16).detach().requires_grad_(true);

  auto nvfp4_fwd = [&] {
    torch::NoGradGuard ng;
    vqad::ops::nvfp4_linear(x0, w0, b0, nvfp4::ScaleMode::kDynamic);
  };
  auto nvfp4_fwd_bwd = [&] {
    const torch::Tensor y = vqad::ops::nvfp4_linear(x, w, b, nvfp4::ScaleMode::kDynamic);
    torch::autograd::grad({y}, {x, w, b}, {g});
  };
  auto bf16_fwd = [&] {
    torch::NoGradGuard ng;
    torch::nn::functional::linear(x0, w_bf16, b_bf16);
  };
  auto bf16_fwd_bwd = [&] {
    const torch::Tensor y = torch::nn::functional::linear(x, w_bf16, b_bf16);
    torch::autograd::grad({y}, {x, w_bf16, b_bf16}, {g});
  };
  // The unquantized model::Linear on fp32 masters (weight cast per call).
  auto master_fwd_bwd = [&] {
    const torch::Tensor y = vqad::ops::dense_linear(x, w, b);
    torch::autograd::grad({y}, {x, w, b}, {g});
  };
  const double t_q_f = time_ms(nvfp4_fwd, o.warmup, o.iters);
  const double t_q_fb = time_ms(nvfp4_fwd_bwd, o.warmup, o.iters);
  const double t_d_f = time_ms(bf16_fwd, o.warmup, o.iters);
  const double t_d_fb = time_ms(bf16_fwd_bwd, o.warmup, o.iters);
  const double t_m_fb = time_ms(master_fwd_bwd, o.warmup, o.iters);
  const double flop = 2.0 * double(m) * double(k) * double(n);
  nlohmann::json j = {{"M", m},
                      {"K", k},
                      {"N", n},
                      {"nvfp4_fwd_ms", t_q_f},
                      {"nvfp4_fwd_bwd_ms", t_q_fb},
                      {"bf16_fwd_ms", t_d_f},
                      {"bf16_fwd_bwd_ms", t_d_fb},
                      {"bf16_fp32master_fwd_bwd_ms", t_m_fb},
                      {"bf16_fwd_tflops", flop / (t_d_f * 1e9)},
                      {"nvfp4_fwd_tflops", flop / (t_q_f * 1e9)},
                      {"ratio_fwd", t_q_f / t_d_f},
                      {"ratio_fwd_bwd", t_q_fb / t_d_fb},
                      {"ratio_fwd_bwd_vs_fp32master", t_q_fb / t_m_fb},
                      {"target_ratio_fwd_bwd", 1.25},
                      {"meets_target", t_q_fb / t_d_fb <= 1.25}};
  return j;
}

int run_linear_bench(const LinearBenchOptions& o) {
  VQAD_CHECK(torch::cuda::is_available(), "bench linear: needs a CUDA GPU, none is visible");
  VQAD_CHECK(o.iters >= 1 && o.warmup >= 0 && o.m >= 1, "bench linear: need --iters >= 1, --warmup >= 0, --m >= 1");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, at::cuda::current_device());
  nlohmann::json results = nlohmann::json::array();
  std::printf("vqad bench linear on %s (sm_%d%d), median of %d after %d warm-up\n", prop.name, prop.major,
              prop.minor, o.iters, o.warmup);
  std::printf("%7s %6s %6s | %9s %9s %6s | %12s %12s %6s | %s\n", "M", "K", "N", "fq fwd", "bf16 fwd", "ratio",
              "fq fwd+bwd", "bf16 fwd+bwd", "ratio", "fp32-master fwd+bwd");
  for (const std::string& s : o.shapes) {
    const auto x = s.find('x');
    VQAD_CHECK(x != std::string::npos, "bench linear: --shape '", s, "' must be KxN, e.g. 1536x8960");
    int64_t k = 0, n = 0;
    try {
      k = std::stoll(s.substr(0, x));
      n = std::stoll(s.substr(x + 1));
    } catch (const std::exception&) {
      fail("bench linear: --shape '", s, "' must be KxN with integers, e.g. 1536x8960");
    }
    VQAD_CHECK(k > 0 && n > 0 && k % 16 == 0, "bench linear: --shape '", s, "': K must be a positive multiple of 16");
    nlohmann::json r = bench_shape(o.m, k, n, o);
    std::printf("%7lld %6lld %6lld | %7.3fms %7.3fms %5.2fx | %10.3fms %10.3fms %5.2fx | %.3fms (%.2fx)\n",
                (long long)o.m, (long long)k, (long long)n, r["nvfp4_fwd_ms"].get<double>(),
                r["bf16_fwd_ms"].get<double>(), r["ratio_fwd"].get<double>(), r["nvfp4_fwd_bwd_ms"].get<double>(),
                r["bf16_fwd_bwd_ms"].get<double>(), r["ratio_fwd_bwd"].get<double>(),
                r["bf16_fp32master_fwd_bwd_ms"].get<double>(), r["ratio_fwd_bwd_vs_fp32master"].get<double>());
    results.push_back(std::move(r));
  }
  const nlohmann::json doc = {{"bench", "linear"},
                              {"device", prop.name},
                              {"sm", prop.major * 10 + prop.minor},
                              {"warmup", o.warmup},
                              {"iters", o.iters},
                              {"statistic", "median"},
                              {"results", results}};
  std::printf("wrote %s\n", vqad::bench::write_json(o.out_dir, "bench_linear.json", doc).c_str());
  return 0;
}
#else
int run_linear_bench(const LinearBenchOptions&) {
  fail("bench linear: this build has no LibTorch CUDA (configure on a GPU machine)");
}
#endif

}  // namespace

void register_bench_linear_commands(CLI::App& app) {
  CLI::App* bench = bench_command(app);
  auto opts = std::make_shared<LinearBenchOptions>();
  CLI::App* sub = bench->add_subcommand(
      "linear", "NVFP4 QAT linear (dynamic W4A4) vs the BF16 linear, forward and forward+backward");
  sub->add_option("--m", opts->m, "rows of X (tokens)")->capture_default_str();
  sub->add_option("--shape", opts->shapes, "KxN, repeatable")->capture_default_str();
  sub->add_option("--warmup", opts->warmup, "warm-up calls")->capture_default_str();
  sub->add_option("--iters", opts->iters, "timed calls (median reported)")->capture_default_str();
  sub->add_option("--out", opts->out_dir, "directory for bench_linear.json")->capture_default_str();
  set_action(sub, [opts] { return run_linear_bench(*opts); });
}

}  // namespace vqad::cli
