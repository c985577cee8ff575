// `vqad bench vsa`: the VSA CUDA path (ops/vsa_attention_cuda.h: tiling, coarse stage,
// selection, fine stage, combine; forward and backward) at the Wan grids, side by side
// in one run with the dense ATTN_QAT_TRAIN kernels and LibTorch SDPA (cuDNN) at the same
// number of tokens. Before timing, each VSA variant is checked against the CPU reference
// (numerics/vsa_ref.h) on a small ragged grid. TFLOP/s of the VSA rows count the
// visited 64 x 64 (query block, key block) pairs of the actual selection (4 * 64 * 64 * D
// flops each forward, 2.5x that backward); the dense rows count the full L x L.
// Prints a table and writes bench_vsa.json.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_profile.h"
#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/numerics/vsa_ref.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>

#include "vqad/kernels/vsa/vsa_kernels.h"
#include "vqad/ops/attention_qat.h"
#include "vqad/ops/attention_qat_cuda.h"
#include "vqad/ops/vsa_attention_cuda.h"
#endif

namespace vqad::cli {
namespace {

struct VsaBenchOptions {
  std::vector<std::string> grids = {"20,30,52", "16,28,56"};  // T,H,W
  int batch = 1;
  int heads = 12;
  double sparsity = 0.9;
  int warmup = 3;
  int iters = 10;
  bool dense = true;   // also time dense ATTN_QAT_TRAIN and cuDNN SDPA
  bool check = true;   // CPU-reference check before timing
  std::string out_dir = "bench_out";
  std::string profile_dir;  // non-empty: one more forward + backward per row under the profiler
};

struct Grid {
  int64_t t = 0, h = 0, w = 0;
};

Grid parse_grid(const std::string& s) {
  Grid g;
  char c1 = 0, c2 = 0;
  std::istringstream is(s);
  if (!(is >> g.t >> c1 >> g.h >> c2 >> g.w) || c1 != ',' || c2 != ',' || !is.eof() || g.t < 1 || g.h < 1 ||
      g.w < 1)
    fail("bench vsa: --grid '", s, "' must be T,H,W with positive integers, e.g. 20,30,52");
  return g;
}

struct Variant {
  const char* name;
  vsa_ref::CubeShape cube;
  bool quantize;
};
constexpr Variant kVariants[] = {
    {"VSA_TRAIN_C128", vsa_ref::kCubeC128, false},
    {"VSA_QAT_TRAIN_C128", vsa_ref::kCubeC128, true},
    {"VSA_TRAIN_C64", vsa_ref::kCubeC64, false},
    {"VSA_QAT_TRAIN_C64", vsa_ref::kCubeC64, true},
};

#ifdef VQAD_WITH_TORCH_CUDA
namespace vc = vqad::ops::vsa_cuda;
namespace kv = vqad::kernels::vsa;
constexpr int64_t kD = kv::kVsaHeadDim;

// Median of the calls' CUDA-event times on the current LibTorch stream, each call
// synchronized before the next (its host work inside its own event pair).
template <class Fn>
double time_ms(Fn&& fn, int warmup, int iters) {
  return vqad::bench::time_cuda([&](cudaStream_t) { fn(); }, at::cuda::getCurrentCUDAStream().stream(), warmup,
                                iters, vqad::bench::TimingSync::kEachCall)
      .median_ms;
}

vsa_ref::Options options_of(const Variant& v, double sparsity) {
  vsa_ref::Options o;
  o.cube = v.cube;
  o.sparsity = sparsity;
  o.quantize = v.quantize;
  o.tile_blocks = kv::vsa_tile_blocks((v.cube.volume() + kv::kVsaBlockTokens - 1) / kv::kVsaBlockTokens);
  return o;
}

double rel_l2(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor g = got.to(torch::kCPU, torch::kFloat64), w = want.to(torch::kCPU, torch::kFloat64);
  return ((g - w).norm() / w.norm().clamp_min(1e-30)).item<double>();
}

attn_qat_ref::ConstView cview(const torch::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
attn_qat_ref::View view(torch::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

// The CUDA path vs vsa_ref on a ragged 5x6x10 grid (B=1, H=2, gate on): rel_l2 of o,
// dq, dk, dv, dgate and whether the selections agree. Throws when a value is off.
nlohmann::json check_variant(const Variant& var) {
  const int64_t B = 1, H = 2;
  const vsa_ref::Tiling t = vsa_ref::make_tiling(5, 6, 10, var.cube);
  const int64_t L = t.num_tokens();
  const vsa_ref::Options opts = options_of(var, 0.5);
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q = torch::randn({B, L, H, kD}, bf), k = torch::randn({B, L, H, kD}, bf),
                      v = torch::randn({B, L, H, kD}, bf), gate = 0.5 * torch::randn({B, L, H, kD}, bf),
                      d_o = torch::randn({B, L, H, kD}, bf);
  vc::Saved saved;
  const torch::Tensor o = vc::forward(q, k, v, gate, t, opts, &saved);
  const vc::Grads g = vc::backward(q, k, v, gate, saved, d_o, t, opts);
  auto cpu = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kFloat32).contiguous(); };
  torch::Tensor qc = cpu(q), kc = cpu(k), vcpu = cpu(v), gc = cpu(gate), dc = cpu(d_o);
  torch::Tensor ro = torch::empty_like(qc), rdq = torch::empty_like(qc), rdk = torch::empty_like(qc),
                rdv = torch::empty_like(qc), rdg = torch::empty_like(qc);
  const vsa_ref::Dims dims{B, H, kD};
  vsa_ref::Saved rs;
  vsa_ref::forward(dims, t, cview(qc), cview(kc), cview(vcpu), cview(gc), opts, view(ro), &rs);
  vsa_ref::backward(dims, t, cview(qc), cview(kc), cview(vcpu), cview(gc), rs, cview(dc), opts, view(rdq), view(rdk),
                    view(rdv), view(rdg));
  const vsa_ref::SelectionLists sel = vc::selection_to_host(saved);
  nlohmann::json j = {{"grid", {5, 6, 10}}, {"B", B}, {"H", H}, {"sparsity", 0.5}};
  j["selection_equal"] = sel.index == rs.selection.index && sel.count == rs.selection.count;
  j["o_rel_l2"] = rel_l2(o, ro);
  j["dq_rel_l2"] = rel_l2(g.dq, rdq);
  j["dk_rel_l2"] = rel_l2(g.dk, rdk);
  j["dv_rel_l2"] = rel_l2(g.dv, rdv);
  j["dgate_rel_l2"] = rel_l2(g.dgate, rdg);
  bool ok = j["selection_equal"].get<bool>();
  for (const char* key : {"o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "dgate_rel_l2"})
    ok = ok && j[key].get<double>() <= 2e-2;
  VQAD_CHECK(ok, "bench vsa: ", var.name, " disagrees with the CPU reference on grid 5x6x10: ", j.dump());
  return j;
}

// Visited (query block, key block) pairs of a selection: sum over rows of the non-empty
// query blocks of the query cube times the non-empty key blocks of its selected cubes.
int64_t visited_block_pairs(const vsa_ref::SelectionLists& s, const vsa_ref::Tiling& t) {
  auto blocks = [&](int64_t cube) { return (t.cube_tokens[cube] + 63) / 64; };
  int64_t pairs = 0;
  for (int64_t r = 0; r < s.batch * s.heads * s.num_q_cubes; ++r) {
    int64_t kb = 0;
    for (int32_t e = 0; e < s.count[r]; ++e) kb += blocks(s.index[r * s.max_kv + e]);
    pairs += blocks(r % s.num_q_cubes) * kb;
  }
  return pairs;
}

nlohmann::json bench_variant(const Variant& var, const Grid& gr, const VsaBenchOptions& o) {
  const vsa_ref::Tiling t = vsa_ref::make_tiling(gr.t, gr.h, gr.w, var.cube);
  const int64_t B = o.batch, H = o.heads, L = t.num_tokens();
  const vsa_ref::Options opts = options_of(var, o.sparsity);
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q = torch::randn({B, L, H, kD}, bf), k = torch::randn({B, L, H, kD}, bf),
                      v = torch::randn({B, L, H, kD}, bf), gate = 0.5 * torch::randn({B, L, H, kD}, bf),
                      d_o = torch::randn({B, L, H, kD}, bf);
  nlohmann::json r = {{"variant", var.name}, {"grid", {gr.t, gr.h, gr.w}}, {"B", B}, {"H", H}, {"L", L},
                      {"D", kD}, {"sparsity", o.sparsity}, {"cubes", t.num_cubes},
                      {"topk", vsa_ref::effective_topk(o.sparsity, t.num_cubes)}};
  vc::Saved saved;
  r["fwd_ms"] = time_ms([&] { vc::forward(q, k, v, gate, t, opts, &saved); }, o.warmup, o.iters);
  // The forward of a call without a graph (no O_hp product, no m, l): timed, and its
  // output checked against the full forward's, bit for bit.
  vc::Saved nograd;
  r["fwd_nograd_ms"] =
      time_ms([&] { vc::forward(q, k, v, gate, t, opts, &nograd, /*for_backward=*/false); }, o.warmup, o.iters);
  const torch::Tensor o_nograd = vc::forward(q, k, v, gate, t, opts, &nograd, /*for_backward=*/false);
  const torch::Tensor o_full = vc::forward(q, k, v, gate, t, opts, &saved);
  VQAD_CHECK(torch::equal(o_nograd, o_full), "bench vsa ", var.name,
             ": the forward without a graph gave other output bits than the full forward");
  r["bwd_ms"] = time_ms([&] { vc::backward(q, k, v, gate, saved, d_o, t, opts); }, o.warmup, o.iters);
  r["fwd_bwd_ms"] = time_ms(
      [&] {
        vc::Saved s2;
        vc::forward(q, k, v, gate, t, opts, &s2);
        vc::backward(q, k, v, gate, s2, d_o, t, opts);
      },
      o.warmup, o.iters);
  const int64_t pairs = visited_block_pairs(vc::selection_to_host(saved), t);
  const double flops = 4.0 * 64.0 * 64.0 * kD * static_cast<double>(pairs);
  r["visited_block_pairs"] = pairs;
  r["fwd_flops_visited"] = flops;
  r["fwd_tflops"] = flops / (r["fwd_ms"].get<double>() * 1e9);
  r["bwd_tflops"] = 2.5 * flops / (r["bwd_ms"].get<double>() * 1e9);
  r["fwd_bwd_tflops"] = 3.5 * flops / (r["fwd_bwd_ms"].get<double>() * 1e9);
  if (!o.profile_dir.empty()) {
    // Where the time of one forward + backward goes, kernel by kernel (after the timed calls).
    std::filesystem::create_directories(o.profile_dir);
    const std::string tag = std::to_string(gr.t) + "x" + std::to_string(gr.h) + "x" + std::to_string(gr.w) + "_" +
                            var.name;
    const std::string base = (std::filesystem::path(o.profile_dir) / ("vsa_" + tag)).string();
    const auto prof = bench::profile_once(
        [&] {
          vc::Saved s2;
          vc::forward(q, k, v, gate, t, opts, &s2);
          vc::backward(q, k, v, gate, s2, d_o, t, opts);
        },
        true, base + ".trace.json");
    const std::string table = bench::profile_table(prof, 30);
    std::ofstream(base + ".txt") << table;
    std::printf("[%s] profile of one forward + backward (trace: %s.trace.json)\n%s", tag.c_str(), base.c_str(),
                table.c_str());
    r["profile_device_ms"] = prof.device_total_ms;
  }
  return r;
}

// Dense ATTN_QAT_TRAIN (vqad kernels) and cuDNN SDPA at B, H, L tokens, fwd + bwd.
nlohmann::json bench_dense(int64_t B, int64_t H, int64_t L, const VsaBenchOptions& o) {
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q = torch::randn({B, L, H, kD}, bf), k = torch::randn({B, L, H, kD}, bf),
                      v = torch::randn({B, L, H, kD}, bf), d_o = torch::randn({B, L, H, kD}, bf);
  const double flops = 4.0 * B * H * static_cast<double>(L) * L * kD;
  nlohmann::json r = {{"B", B}, {"H", H}, {"L", L}, {"fwd_flops", flops}};
  try {
    ops::AttnQatOptions qo;
    r["attn_qat_fwd_ms"] = time_ms([&] { ops::attention_qat_cuda_forward(q, k, v, qo); }, o.warmup, o.iters);
    const ops::AttnQatCudaForward f = ops::attention_qat_cuda_forward(q, k, v, qo);
    r["attn_qat_bwd_ms"] = time_ms(
        [&] {
          ops::attention_qat_cuda_backward(d_o, f.q_hat, f.k_hat, f.v_hat, f.o_hp, f.m, f.l, qo, torch::kBFloat16,
                                           torch::kBFloat16, torch::kBFloat16);
        },
        o.warmup, o.iters);
    r["attn_qat_fwd_bwd_ms"] = r["attn_qat_fwd_ms"].get<double>() + r["attn_qat_bwd_ms"].get<double>();
  } catch (const std::exception& e) {
    r["attn_qat_error"] = std::string(e.what()).substr(0, 300);
  }
  auto& ctx = at::globalContext();
  const bool flash = ctx.userEnabledFlashSDP(), mem = ctx.userEnabledMemEfficientSDP(),
             math = ctx.userEnabledMathSDP(), cudnn = ctx.userEnabledCuDNNSDP();
  ctx.setSDPUseFlash(false);
  ctx.setSDPUseMemEfficient(false);
  ctx.setSDPUseMath(false);
  ctx.setSDPUseCuDNN(true);
  try {
    const torch::Tensor qt = q.transpose(1, 2).contiguous(), kt = k.transpose(1, 2).contiguous(),
                        vt = v.transpose(1, 2).contiguous(), dt = d_o.transpose(1, 2).contiguous();
    {
      torch::NoGradGuard no_grad;
      r["cudnn_fwd_ms"] = time_ms([&] { at::scaled_dot_product_attention(qt, kt, vt); }, o.warmup, o.iters);
    }
    torch::Tensor qg = qt.detach().requires_grad_(true), kg = kt.detach().requires_grad_(true),
                  vg = vt.detach().requires_grad_(true);
    torch::Tensor out = at::scaled_dot_product_attention(qg, kg, vg);
    r["cudnn_bwd_ms"] = time_ms(
        [&] {
          qg.mutable_grad() = torch::Tensor();
          kg.mutable_grad() = torch::Tensor();
          vg.mutable_grad() = torch::Tensor();
          torch::autograd::backward({out}, {dt}, /*retain_graph=*/true);
        },
        o.warmup, o.iters);
    r["cudnn_fwd_bwd_ms"] = r["cudnn_fwd_ms"].get<double>() + r["cudnn_bwd_ms"].get<double>();
  } catch (const std::exception& e) {
    r["cudnn_error"] = std::string(e.what()).substr(0, 300);
  }
  ctx.setSDPUseFlash(flash);
  ctx.setSDPUseMemEfficient(mem);
  ctx.setSDPUseMath(math);
  ctx.setSDPUseCuDNN(cudnn);
  for (const char* key : {"attn_qat_fwd", "cudnn_fwd"})
    if (r.contains(std::string(key) + "_ms"))
      r[std::string(key) + "_tflops"] = flops / (r[std::string(key) + "_ms"].get<double>() * 1e9);
  for (const char* key : {"attn_qat_bwd", "cudnn_bwd"})
    if (r.contains(std::string(key) + "_ms"))
      r[std::string(key) + "_tflops"] = 2.5 * flops / (r[std::string(key) + "_ms"].get<double>() * 1e9);
  return r;
}

std::string cell(const nlohmann::json& r, const std::string& key, int decimals = 3) {
  if (!r.contains(key)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, r[key].get<double>());
  return buf;
}

int run_vsa_bench(const VsaBenchOptions& o) {
  VQAD_CHECK(torch::cuda::is_available(), "bench vsa: needs a CUDA GPU, none is visible");
  VQAD_CHECK(o.iters >= 1 && o.warmup >= 0 && o.batch >= 1 && o.heads >= 1,
             "bench vsa: need --iters >= 1, --warmup >= 0, --batch >= 1 and --heads >= 1");
  VQAD_CHECK(o.sparsity >= 0.0 && o.sparsity < 1.0, "bench vsa: --sparsity must be in [0, 1), found ", o.sparsity);
  std::vector<Grid> grids;
  for (const std::string& s : o.grids) grids.push_back(parse_grid(s));
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, at::cuda::current_device());
  std::printf("vqad bench vsa on %s (sm_%d%d), B=%d H=%d D=%lld sparsity %.3f, tile_blocks C128 %d / C64 %d, median of %d after %d "
              "warm-up\n",
              prop.name, prop.major, prop.minor, o.batch, o.heads, static_cast<long long>(kD), o.sparsity,
              kv::kVsaTileBlocksC128, kv::kVsaTileBlocksC64, o.iters, o.warmup);
  nlohmann::json checks = nlohmann::json::object();
  if (o.check) {
    for (const Variant& v : kVariants) {
      checks[v.name] = check_variant(v);
      std::printf("check %-19s vs CPU reference (5x6x10): %s\n", v.name, checks[v.name].dump().c_str());
    }
  }
  nlohmann::json results = nlohmann::json::array(), dense = nlohmann::json::array();
  std::printf("%-10s %-19s | %8s %8s %8s %9s | %8s %8s %8s | %s\n", "grid", "backend", "fwd ms", "no-grad", "bwd ms",
              "fwd+bwd", "fwd TF/s", "bwd TF/s", "f+b TF/s", "visited 64x64 block pairs");
  for (const Grid& g : grids) {
    char gname[48];
    std::snprintf(gname, sizeof(gname), "%lldx%lldx%lld", (long long)g.t, (long long)g.h, (long long)g.w);
    for (const Variant& v : kVariants) {
      nlohmann::json r = bench_variant(v, g, o);
      std::printf("%-10s %-19s | %8s %8s %8s %9s | %8s %8s %8s | %lld\n", gname, v.name, cell(r, "fwd_ms").c_str(),
                  cell(r, "fwd_nograd_ms").c_str(), cell(r, "bwd_ms").c_str(), cell(r, "fwd_bwd_ms").c_str(),
                  cell(r, "fwd_tflops", 1).c_str(),
                  cell(r, "bwd_tflops", 1).c_str(), cell(r, "fwd_bwd_tflops", 1).c_str(),
                  static_cast<long long>(r["visited_block_pairs"].get<int64_t>()));
      results.push_back(std::move(r));
    }
    if (o.dense) {
      nlohmann::json r = bench_dense(o.batch, o.heads, g.t * g.h * g.w, o);
      r["grid"] = {g.t, g.h, g.w};
      std::printf("%-10s %-19s | %8s %8s %8s %9s | %8s %8s %8s | dense\n", gname, "ATTN_QAT_TRAIN",
                  cell(r, "attn_qat_fwd_ms").c_str(), "-", cell(r, "attn_qat_bwd_ms").c_str(),
                  cell(r, "attn_qat_fwd_bwd_ms").c_str(), cell(r, "attn_qat_fwd_tflops", 1).c_str(),
                  cell(r, "attn_qat_bwd_tflops", 1).c_str(), "-");
      std::printf("%-10s %-19s | %8s %8s %8s %9s | %8s %8s %8s | dense\n", gname, "cuDNN SDPA (BF16)",
                  cell(r, "cudnn_fwd_ms").c_str(), "-", cell(r, "cudnn_bwd_ms").c_str(), cell(r, "cudnn_fwd_bwd_ms").c_str(),
                  cell(r, "cudnn_fwd_tflops", 1).c_str(), cell(r, "cudnn_bwd_tflops", 1).c_str(), "-");
      dense.push_back(std::move(r));
    }
  }
  const nlohmann::json doc = {{"bench", "vsa"},
                              {"device", prop.name},
                              {"sm", prop.major * 10 + prop.minor},
                              {"tile_blocks", {{"C128", kv::kVsaTileBlocksC128}, {"C64", kv::kVsaTileBlocksC64}}},
                              {"block_tokens", kv::kVsaBlockTokens},
                              {"warmup", o.warmup},
                              {"iters", o.iters},
                              {"statistic", "median"},
                              {"check", checks},
                              {"results", results},
                              {"dense", dense}};
  std::printf("wrote %s\n", vqad::bench::write_json(o.out_dir, "bench_vsa.json", doc).c_str());
  return 0;
}
#else
int run_vsa_bench(const VsaBenchOptions& o) {
  for (const std::string& s : o.grids) parse_grid(s);  // bad input is reported first
  fail("bench vsa: this build has no LibTorch CUDA (configure on a GPU machine)");
}
#endif

}  // namespace

void register_bench_vsa_commands(CLI::App& app) {
  CLI::App* bench = bench_command(app);
  auto opts = std::make_shared<VsaBenchOptions>();
  CLI::App* sub = bench->add_subcommand(
      "vsa", "VSA CUDA path (VSA_TRAIN / VSA_QAT_TRAIN, C128 / C64) vs dense ATTN_QAT_TRAIN and cuDNN, fwd + bwd");
  sub->add_option("--grid", opts->grids, "T,H,W latent grid, repeatable")->capture_default_str();
  sub->add_option("--batch", opts->batch, "batch size")->capture_default_str();
  sub->add_option("--heads", opts->heads, "attention heads (D = 128)")->capture_default_str();
  sub->add_option("--sparsity", opts->sparsity, "VSA sparsity in [0, 1)")->capture_default_str();
  sub->add_option("--warmup", opts->warmup, "warm-up calls")->capture_default_str();
  sub->add_option("--iters", opts->iters, "timed calls (median reported)")->capture_default_str();
  sub->add_flag("!--no-dense", opts->dense, "skip the dense ATTN_QAT_TRAIN and cuDNN rows");
  sub->add_flag("!--no-check", opts->check, "skip the CPU-reference check");
  sub->add_option("--out", opts->out_dir, "directory for bench_vsa.json")->capture_default_str();
  sub->add_option("--profile", opts->profile_dir,
                  "directory: one more forward + backward of each VSA row under the profiler (kernel table printed "
                  "and written there, with a Chrome trace)");
  set_action(sub, [opts] { return run_vsa_bench(*opts); });
}

}  // namespace vqad::cli
