// `vqad bench quant`: NVFP4 kernel bandwidth at Wan2.1-1.3B activation shapes
// ([31200, 1536] and [31200, 8960] BF16) against a plain device-to-device copy
// of the same bytes in the same run. Every kernel is first checked bit-exactly
// against the CPU reference on the very inputs it is timed on.
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/ops/nvfp4_fake_quant.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"
#endif

namespace vqad::cli {
namespace {

struct BenchQuantArgs {
  std::string out = "bench-results";
  int iters = 20;
  int warmup = 5;
  uint64_t seed = 20261129;
};

#ifdef VQAD_WITH_TORCH_CUDA
namespace kn = vqad::kernels::nvfp4;

void expect_equal(const torch::Tensor& gpu, const torch::Tensor& cpu, const std::string& what) {
  const torch::Tensor g = gpu.to(torch::kCPU);
  VQAD_CHECK(g.sizes() == cpu.sizes() && g.scalar_type() == cpu.scalar_type(), "bench quant: ", what,
             ": CUDA result shape/dtype differs from the CPU reference");
  // Bitwise: compare the raw bytes (no NaN is expected from normal inputs).
  const torch::Tensor gb = g.contiguous().view(torch::kUInt8), cb = cpu.contiguous().view(torch::kUInt8);
  const int64_t bad = gb.ne(cb).sum().item<int64_t>();
  VQAD_CHECK(bad == 0, "bench quant: ", what, ": CUDA differs from the CPU reference in ", bad,
             " bytes; not timing a wrong kernel");
}

int run_bench_quant(const BenchQuantArgs& a) {
  VQAD_CHECK(a.iters >= 10, "--iters: at least 10 timed iterations, got ", a.iters);
  VQAD_CHECK(torch::cuda::is_available(), "vqad bench quant: no CUDA device is visible");
  torch::manual_seed(a.seed);
  const torch::Device dev(torch::kCUDA, 0);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(0).stream();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{31200, 1536}, {31200, 8960}};

  nlohmann::json results = nlohmann::json::array();
  bench::Table table({"shape", "op", "median ms", "GB/s", "% of copy"});
  for (const auto& [M, K] : shapes) {
    const std::string shape = "[" + std::to_string(M) + ", " + std::to_string(K) + "]";
    const torch::Tensor x = (torch::randn({M, K}, torch::TensorOptions().device(dev)) * 3.0).to(torch::kBFloat16);
    const double n = static_cast<double>(M * K), in_bytes = 2.0 * n;
    torch::Tensor y = torch::empty_like(x), copy_dst = torch::empty_like(x);
    torch::Tensor amax = torch::empty({}, x.options().dtype(torch::kFloat));
    const int64_t scale_cols = K / 16, swz = kn::swizzled_size(M, scale_cols);
    const auto u8 = x.options().dtype(torch::kUInt8);
    torch::Tensor codes = torch::empty({M, K / 2}, u8), scales = torch::empty({M, scale_cols}, u8),
                  scales_swz = torch::empty({swz}, u8);
    const kn::TensorView xv = kn::dense_view(x.data_ptr(), kn::DType::kBF16, M, K);
    const kn::TensorView yv = kn::dense_view(y.data_ptr(), kn::DType::kBF16, M, K);
    kn::QuantizeOutputs qo;
    qo.packed_codes = codes.data_ptr<uint8_t>();
    qo.scales_linear = scales.data_ptr<uint8_t>();
    qo.scales_swizzled = scales_swz.data_ptr<uint8_t>();
    kn::EncodeScale unit;
    kn::EncodeScale dyn;
    dyn.amax_device = amax.data_ptr<float>();

    auto fq_unit = [&](cudaStream_t s) { kn::launch_fake_quantize(xv, yv, unit, s); };
    auto fq_dyn = [&](cudaStream_t s) {
      kn::launch_amax(xv, amax.data_ptr<float>(), s);
      kn::launch_fake_quantize(xv, yv, dyn, s);
    };
    auto amax_only = [&](cudaStream_t s) { kn::launch_amax(xv, amax.data_ptr<float>(), s); };
    auto quant = [&](cudaStream_t s) { kn::launch_quantize(xv, unit, qo, s); };
    kn::QuantizeOutputs qo_linear = qo;  // codes + linear scales only (no 128x4 layout)
    qo_linear.scales_swizzled = nullptr;
    auto quant_linear = [&](cudaStream_t s) { kn::launch_quantize(xv, unit, qo_linear, s); };
    auto copy = [&](cudaStream_t s) {
      VQAD_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data_ptr(), x.data_ptr(), static_cast<size_t>(in_bytes),
                                      cudaMemcpyDeviceToDevice, s));
    };

    // Correctness on these inputs before any timing.
    const torch::Tensor xc = x.to(torch::kCPU);
    fq_unit(stream);
    expect_equal(y, ops::nvfp4_fake_quant(xc, ops::ScaleMode::kUnit), shape + " fake-quant unit");
    fq_dyn(stream);
    expect_equal(y, ops::nvfp4_fake_quant(xc, ops::ScaleMode::kDynamic), shape + " fake-quant dynamic");
    quant(stream);
    const ops::Nvfp4Quantized ref = ops::nvfp4_quantize(xc, ops::ScaleMode::kUnit);
    expect_equal(codes, ref.packed_codes, shape + " packed codes");
    expect_equal(scales, ref.scales, shape + " linear scales");
    expect_equal(scales_swz, ref.scales_swizzled, shape + " swizzled scales");
    std::printf("%s: CUDA == CPU reference (fake-quant unit/dynamic, codes, scales)\n", shape.c_str());

    struct Case {
      const char* name;
      std::function<void(cudaStream_t)> fn;
      double bytes;  // DRAM bytes read + written
    };
    // Bytes each op must move at least: inputs read once per pass, outputs written once
    // (the dynamic fake-quant reads x twice: amax, then quantize; quantize+pack writes
    // 4-bit codes, one scale byte per 16 elements per layout, the swizzled one padded).
    const double q_bytes = in_bytes + n / 2 + n / 16 + static_cast<double>(swz);
    const std::vector<Case> cases = {
        {"copy (cudaMemcpyAsync D2D)", copy, 2 * in_bytes},
        {"fake-quant bf16->bf16 unit", fq_unit, 2 * in_bytes},
        {"fake-quant bf16->bf16 dynamic (amax + fq)", fq_dyn, 3 * in_bytes},
        {"amax (dynamic-mode reduction)", amax_only, in_bytes},
        {"quantize+pack unit (codes, linear + swizzled scales)", quant, q_bytes},
        {"quantize+pack unit (codes, linear scales)", quant_linear, in_bytes + n / 2 + n / 16},
    };
    double copy_gbps = 0;
    for (const Case& c : cases) {
      const bench::Timing t = bench::time_cuda(c.fn, stream, a.warmup, a.iters);
      const double bw = bench::gbps(c.bytes, t.median_ms);
      if (copy_gbps == 0) copy_gbps = bw;
      const double pct = 100.0 * bw / copy_gbps;
      table.add({shape, c.name, bench::fmt(t.median_ms, 4), bench::fmt(bw, 1), bench::fmt(pct, 1)});
      results.push_back({{"shape", {M, K}},
                         {"dtype", "bf16"},
                         {"op", c.name},
                         {"bytes", c.bytes},
                         {"median_ms", t.median_ms},
                         {"min_ms", t.min_ms},
                         {"max_ms", t.max_ms},
                         {"iters", t.iters},
                         {"gbps", bw},
                         {"pct_of_copy", pct}});
    }
  }
  std::printf("\n%s", table.str().c_str());
  const nlohmann::json doc = {{"bench", "quant"},
                              {"device", bench::device_json()},
                              {"warmup", a.warmup},
                              {"iters", a.iters},
                              {"note", "GB/s = DRAM bytes read + written / median time; % of copy = "
                                       "GB/s / copy GB/s of the same shape in this run"},
                              {"results", results}};
  std::printf("wrote %s\n", bench::write_json(a.out, "bench_quant.json", doc).c_str());
  return 0;
}
#else
int run_bench_quant(const BenchQuantArgs&) {
  fail("vqad bench quant needs a GPU build (LibTorch with CUDA, built on a GPU machine); this build has none");
}
#endif

}  // namespace

void register_bench_quant_commands(CLI::App& app) {
  auto args = std::make_shared<BenchQuantArgs>();
  auto* sub = bench_command(app)->add_subcommand(
      "quant", "NVFP4 fake-quant / quantize+pack / amax bandwidth vs a device copy at [31200, 1536] "
               "and [31200, 8960] BF16");
  sub->add_option("--out", args->out, "directory for bench_quant.json")->capture_default_str();
  sub->add_option("--iters", args->iters, "timed iterations (>= 10); the median is reported")
      ->capture_default_str();
  sub->add_option("--warmup", args->warmup, "untimed warm-up iterations")->capture_default_str();
  sub->add_option("--seed", args->seed, "input seed")->capture_default_str();
  set_action(sub, [args] { return run_bench_quant(*args); });
}

}  // namespace vqad::cli
