// `vqad bench fused`: the fused block ops of ops/fused_block.h (modulated layer norm,
// gated residual, RMSNorm + RoPE) against their composite torch definitions, forward +
// backward, at the Wan2.1 1.3B stage-1 shape [1, 31200, 1536] bf16, timed side by side in
// one run (CUDA events around each call, median after warm-up). CUDA only.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/ops/fused_block.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace vqad::cli {

namespace {

struct FusedBenchOptions {
  int64_t tokens = 31200, heads = 12, head_dim = 128;
  int warmup = 3, iters = 20;
  std::string out_dir = "out/bench_fused";
};

int run_bench(const FusedBenchOptions& o) {
#if defined(VQAD_WITH_TORCH_CUDA) && defined(VQAD_WITH_CUDA)
  VQAD_CHECK(torch::cuda::is_available(), "bench fused: needs a CUDA device (none is visible)");
  VQAD_CHECK(o.tokens >= 1 && o.heads >= 1 && o.head_dim >= 2 && o.head_dim % 2 == 0 && o.iters >= 1 && o.warmup >= 0,
             "bench fused: --tokens, --heads, --iters must be positive and --head-dim even, found tokens ", o.tokens,
             ", heads ", o.heads, ", head-dim ", o.head_dim, ", iters ", o.iters);
  const int64_t B = 1, L = o.tokens, D = o.head_dim, C = o.heads * D;
  constexpr double kEps = 1e-6;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::manual_seed(61);
  const torch::Tensor x = torch::randn({B, L, C}, cuda).to(torch::kBFloat16).requires_grad_(true);
  const torch::Tensor a = torch::randn({B, L, C}, cuda).to(torch::kBFloat16).requires_grad_(true);
  const torch::Tensor e = torch::randn({B, 6, C}, cuda).requires_grad_(true);
  const torch::Tensor w = torch::ones({C}, cuda).requires_grad_(true);
  const torch::Tensor g = torch::randn({B, L, C}, cuda).to(torch::kBFloat16);
  const torch::Tensor angle = torch::rand({L, D / 2}, cuda);
  const torch::Tensor cs = torch::cos(angle), sn = torch::sin(angle);
  // One call = forward + backward of the op into x, e, a, w.
  auto step = [&](const std::function<torch::Tensor()>& f) {
    return [&, f](cudaStream_t) {
      torch::Tensor out = f();
      torch::autograd::grad({out}, {x, e, a, w}, {g}, /*retain_graph=*/false, /*create_graph=*/false,
                            /*allow_unused=*/true);
    };
  };
  auto parts = [&] { return e.chunk(6, 1); };
  struct Row {
    const char* name;
    std::function<torch::Tensor()> fused, composite;
  };
  const std::vector<Row> rows{
      {"modulated_layer_norm",
       [&] { auto p = parts(); return ops::modulated_layer_norm(x, p[1], p[0], kEps); },
       [&] { auto p = parts(); return ops::modulated_layer_norm_composite(x, p[1], p[0], kEps); }},
      {"gated_residual", [&] { return ops::gated_residual(x, a, parts()[2]); },
       [&] { return ops::gated_residual_composite(x, a, parts()[2]); }},
      {"rms_norm_rope", [&] { return ops::rms_norm_rope(x, w, kEps, cs, sn); },
       [&] { return ops::rms_norm_rope_composite(x, w, kEps, cs, sn); }},
  };
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  bench::Table table({"op", "fused ms", "composite ms", "composite / fused"});
  nlohmann::json jrows = nlohmann::json::array();
  for (const Row& r : rows) {
    const auto tf = bench::time_cuda(step(r.fused), stream, o.warmup, o.iters);
    const auto tc = bench::time_cuda(step(r.composite), stream, o.warmup, o.iters);
    table.add({r.name, bench::fmt(tf.median_ms, 3), bench::fmt(tc.median_ms, 3),
               bench::fmt(tc.median_ms / tf.median_ms, 2) + "x"});
    jrows.push_back({{"op", r.name}, {"fused_ms", tf.median_ms}, {"composite_ms", tc.median_ms}});
  }
  std::printf("vqad bench fused: [%lld, %lld, %lld] bf16, forward + backward per call, median of %d after %d warm-up\n",
              (long long)B, (long long)L, (long long)C, o.iters, o.warmup);
  std::printf("%s", table.str().c_str());
  nlohmann::json j{{"device", bench::device_json()}, {"shape", {B, L, C}}, {"rows", jrows}};
  std::printf("wrote %s\n", bench::write_json(o.out_dir, "bench_fused.json", j).c_str());
  return 0;
#else
  fail("bench fused: this build has no CUDA (the fused block ops run on CUDA only)");
#endif
}

}  // namespace

void register_bench_fused_commands(CLI::App& app) {
  auto o = std::make_shared<FusedBenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "fused", "Fused block ops (modulated layer norm, gated residual, RMSNorm + RoPE) vs their composite definitions");
  sub->add_option("--tokens", o->tokens, "sequence length")->capture_default_str();
  sub->add_option("--heads", o->heads, "heads (channels = heads x head-dim)")->capture_default_str();
  sub->add_option("--head-dim", o->head_dim, "head dimension (RoPE tables of head-dim / 2)")->capture_default_str();
  sub->add_option("--warmup", o->warmup, "untimed calls first")->capture_default_str();
  sub->add_option("--iters", o->iters, "timed calls (median)")->capture_default_str();
  sub->add_option("--out", o->out_dir, "directory for bench_fused.json")->capture_default_str();
  set_action(sub, [o] { return run_bench(*o); });
}

}  // namespace vqad::cli
