// `vqad bench step`: one stage-1 training step of the Wan2.1 architecture (random
// weights) on one GPU - flow-matching MSE in fp32, backward with per-block activation
// checkpointing, AdamW on the fp32 master weights - timed for the Attn-QAT
// configuration (ATTN_QAT_TRAIN self-attention + NVFP4 dynamic linears) and the BF16
// baseline (TORCH_SDPA + dense linears) side by side in one process.
// Reports median step time, tokens/s, MFU and peak allocated memory; writes JSON.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_profile.h"
#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/attention_backend.h"
#include "vqad/core/error.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/vsa_attention.h"
#include "vqad/train/throughput.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace vqad::cli {
namespace {


struct StepBenchOptions {
  std::string attention;  // empty: the default pair of configurations
  std::string linears;    // empty: the default pair of configurations
  bool no_baseline = false;
  bool qat_full_nograd = false;  // also the QAT backends with the full forward in calls without a graph
  double sparsity = 0.9;  // VSA backends: fraction of KV cubes skipped
  int warmup = 1;
  int steps = 3;
  int64_t layers = 0;  // 0: the preset's 30 blocks
  // Latent frames, height, width: 20 x 60 x 104 -> 20 x 30 x 52 = 31,200 tokens.
  int64_t frames = 20, height = 60, width = 104;
  double lr = 1e-5;
  uint64_t seed = 0;
  std::string out_dir = "bench_out";
  std::string profile_dir;  // non-empty: one extra step per configuration under the profiler
};

struct StepConfig {
  std::string attention;  // backend name
  bool nvfp4 = false;     // NVFP4 dynamic linears (nvfp4_qat_train plan)
  bool full_nograd = false;  // QAT backends: the full forward (O_hp) also without a graph
  std::string label() const {
    return attention + (nvfp4 ? " + nvfp4" : " + dense") + (full_nograd ? " (full fwd w/o grad)" : "");
  }
  bool operator==(const StepConfig&) const = default;
};

const StepConfig kQatConfig{"ATTN_QAT_TRAIN", true};
const StepConfig kBaselineConfig{"TORCH_SDPA", false};

AttentionBackend parse_step_attention(const std::string& name) {
  const AttentionBackend b = ops::parse_attention_backend_or_throw(name, "bench step --attention");
  VQAD_CHECK(b == AttentionBackend::kAttnQatTrain || b == AttentionBackend::kTorchSdpa ||
                 b == AttentionBackend::kFlashAttn || ops::is_vsa_backend(b),
             "bench step --attention: '", name,
             "' is not a backend this bench runs (valid: ATTN_QAT_TRAIN, TORCH_SDPA, FLASH_ATTN, "
             "VSA_TRAIN, VSA_TRAIN_C128, VSA_QAT_TRAIN_C64, VSA_QAT_TRAIN_C128)");
  return b;
}

bool parse_linears(const std::string& v) {
  if (v == "nvfp4") return true;
  if (v == "dense") return false;
  fail("bench step --linears: unknown value '", v, "' (valid: nvfp4, dense)");
}

// What runs, in order: the chosen configuration first, then the baseline for the ratio.
std::vector<StepConfig> configs_of(const StepBenchOptions& o) {
  if (o.attention.empty() && o.linears.empty())
    return o.no_baseline ? std::vector<StepConfig>{kQatConfig}
                         : std::vector<StepConfig>{kQatConfig, kBaselineConfig};
  StepConfig chosen = kQatConfig;
  if (!o.attention.empty()) {
    parse_step_attention(o.attention);
    chosen.attention = o.attention;
  }
  if (!o.linears.empty()) chosen.nvfp4 = parse_linears(o.linears);
  std::vector<StepConfig> out{chosen};
  if (!o.no_baseline && !(chosen == kBaselineConfig)) out.push_back(kBaselineConfig);
  return out;
}

// The backends whose CUDA forward has a form without O_hp for calls that record no graph:
// ATTN_QAT_TRAIN and VSA_QAT_TRAIN_C64 / _C128.
bool has_nograd_forward(const StepConfig& c) {
  const AttentionBackend b = parse_step_attention(c.attention);
  return b == AttentionBackend::kAttnQatTrain || ops::vsa_quantized(b);
}

// --qat-full-nograd-forward: the QAT configurations again with the full forward (O_hp,
// m, l) in the first pass of every checkpointed block, right after them.
std::vector<StepConfig> all_configs_of(const StepBenchOptions& o) {
  std::vector<StepConfig> out;
  for (const StepConfig& c : configs_of(o)) {
    out.push_back(c);
    if (o.qat_full_nograd && has_nograd_forward(c)) {
      StepConfig f = c;
      f.full_nograd = true;
      out.push_back(f);
    }
  }
  return out;
}

void validate(const StepBenchOptions& o) {
  VQAD_CHECK(o.steps >= 1, "bench step --steps: expected >= 1, found ", o.steps);
  VQAD_CHECK(o.warmup >= 0, "bench step --warmup: expected >= 0, found ", o.warmup);
  VQAD_CHECK(o.sparsity >= 0.0 && o.sparsity < 1.0, "bench step --sparsity: expected in [0, 1), found ",
             o.sparsity);
  VQAD_CHECK(o.layers >= 0, "bench step --layers: expected >= 0 (0: all 30), found ", o.layers);
  VQAD_CHECK(o.frames >= 1 && o.height >= 2 && o.width >= 2 && o.height % 2 == 0 &&
                 o.width % 2 == 0,
             "bench step: latent ", o.frames, " x ", o.height, " x ", o.width,
             " must be positive with even height and width (patch 1 x 2 x 2)");
  const std::vector<StepConfig> configs = configs_of(o);  // rejects bad --attention / --linears first
  VQAD_CHECK(!o.qat_full_nograd ||
                 std::any_of(configs.begin(), configs.end(), has_nograd_forward),
             "bench step --qat-full-nograd-forward: no configuration runs ATTN_QAT_TRAIN or VSA_QAT_TRAIN_* "
             "(--attention ", o.attention, ")");
}

#ifdef VQAD_WITH_TORCH_CUDA

struct StepResult {
  StepConfig config;
  std::vector<double> step_ms, fwd_bwd_ms, optim_ms, losses;
  double peak_gib = 0;
  int64_t linears_quantized = 0;
};

// Model FLOPs of one step (forward 2 + backward 4 per multiply-add, checkpoint
// recompute not counted): every linear at the number of tokens it actually sees
// (video tokens, text tokens for cross-attention K/V and the text embedder, one
// row per sample for the time embedder), the patch embedding as a matmul, and
// attention at 4 * Lq * Lkv * dim per layer forward, 2.5x that backward.
struct FlopCount {
  double linear = 0, attention = 0;
  double total() const { return linear + attention; }
};

FlopCount model_flops(model::WanModel& m, int64_t batch, int64_t tokens) {
  const model::WanConfig& c = m.config();
  FlopCount f;
  for (const auto& [name, lin] : m.named_linears()) {
    const double macs = static_cast<double>(lin->in_features) * lin->out_features;
    double rows = static_cast<double>(batch) * tokens;
    if (name.find("attn2.to_k") != std::string::npos || name.find("attn2.to_v") != std::string::npos ||
        name.find("text_embedder") != std::string::npos)
      rows = static_cast<double>(batch) * c.text_len;
    else if (name.rfind("condition_embedder", 0) == 0)
      rows = static_cast<double>(batch);
    f.linear += 6.0 * macs * rows;
  }
  for (const auto& p : m.patch_embedding->parameters())
    if (p.dim() > 1) f.linear += 6.0 * static_cast<double>(p.numel()) * batch * tokens;
  const double dim = static_cast<double>(c.dim());
  const double layers = static_cast<double>(m.num_blocks());
  const double L = static_cast<double>(tokens);
  f.attention = 3.5 * 4.0 * batch * layers * dim * (L * L + L * static_cast<double>(c.text_len));
  return f;
}

struct Inputs {
  torch::Tensor x_t, timestep, text, target;
};

StepResult run_config(const StepConfig& sc, const StepBenchOptions& o, const torch::Device dev,
                      int64_t tokens, FlopCount* flops) {
  StepResult r;
  r.config = sc;
  model::WanConfig cfg = model::WanConfig::wan_1_3b();
  if (o.layers > 0) cfg.num_layers = o.layers;
  // Same seed for every configuration: identical weights and inputs.
  torch::manual_seed(o.seed);
  model::WanModelOptions mo;
  mo.device = dev;
  mo.compute_dtype = torch::kBFloat16;
  mo.gradient_checkpointing = true;
  std::shared_ptr<model::WanModel> m;
  {
    ops::AttentionSpec spec;
    spec.backend = parse_step_attention(sc.attention);
    spec.vsa.sparsity = o.sparsity;  // read by the VSA backends only
    spec.qat.full_forward_without_grad = sc.full_nograd;
    spec.vsa.full_forward_without_grad = sc.full_nograd;
    ops::AttentionBackendScope scope(spec);
    m = std::make_shared<model::WanModel>(cfg, mo);
  }
  if (sc.nvfp4) {
    model::QuantConfig qc;
    qc.method = model::QuantMethod::kNvfp4QatTrain;
    std::vector<std::string> names;
    for (const auto& item : m->named_linears()) names.push_back(item.first);
    const model::QuantPlan plan = model::build_quant_plan(names, qc);
    r.linears_quantized = static_cast<int64_t>(model::apply_quant_plan(*m, plan, qc).size());
  }
  *flops = model_flops(*m, 1, tokens);

  Inputs in;
  {
    const auto bf = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
    const auto f32 = torch::TensorOptions().device(dev).dtype(torch::kFloat32);
    const torch::Tensor x0 = torch::randn({1, cfg.in_channels, o.frames, o.height, o.width}, f32);
    const torch::Tensor noise = torch::randn_like(x0);
    const double sigma = 0.5;  // timestep 500 of 1000
    in.x_t = ((1.0 - sigma) * x0 + sigma * noise).to(torch::kBFloat16);
    in.target = noise - x0;  // flow-matching velocity
    in.timestep = torch::full({1}, 500.0f, f32);
    in.text = torch::randn({1, cfg.text_len, cfg.text_dim}, bf);
  }
  auto opt = std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(o.lr));

  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  };
  auto step = [&](int index, bool timed) {
    opt->zero_grad();
    torch::cuda::synchronize();
    const auto t0 = clock::now();
    const torch::Tensor v = m->forward(in.x_t, in.timestep, in.text);
    const torch::Tensor loss = torch::mse_loss(v.to(torch::kFloat32), in.target);
    loss.backward();
    torch::cuda::synchronize();
    const double fb = ms_since(t0);
    const auto t1 = clock::now();
    opt->step();
    torch::cuda::synchronize();
    const double op = ms_since(t1);
    const double total = ms_since(t0);
    const double lv = loss.item<double>();
    VQAD_CHECK(std::isfinite(lv), "bench step [", sc.label(), "]: loss is ", lv, " at step ",
               index, " (", timed ? "timed" : "warm-up", ")");
    if (timed) {
      r.step_ms.push_back(total);
      r.fwd_bwd_ms.push_back(fb);
      r.optim_ms.push_back(op);
      r.losses.push_back(lv);
    }
  };
  std::printf("[%s] %lld blocks, %lld tokens, %lld NVFP4 linears: %d warm-up + %d timed steps\n",
              sc.label().c_str(), static_cast<long long>(m->num_blocks()),
              static_cast<long long>(tokens), static_cast<long long>(r.linears_quantized), o.warmup,
              o.steps);
  std::fflush(stdout);
  for (int i = 0; i < o.warmup; ++i) step(i, false);
  torch::cuda::synchronize();
  const c10::DeviceIndex di = dev.index();
  c10::cuda::CUDACachingAllocator::resetPeakStats(di);
  for (int i = 0; i < o.steps; ++i) step(o.warmup + i, true);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(di);
  r.peak_gib = static_cast<double>(stats.allocated_bytes[0].peak) / double(1ull << 30);
  if (!o.profile_dir.empty()) {
    // One more step under the profiler (after the timed ones, so the timings are clean).
    std::filesystem::create_directories(o.profile_dir);
    std::string tag = sc.label();
    for (char& ch : tag)
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    const std::string trace = (std::filesystem::path(o.profile_dir) / ("step_" + tag + ".trace.json")).string();
    const auto prof = bench::profile_once([&] { step(o.warmup + o.steps, false); }, true, trace);
    std::printf("[%s] profile of one step (trace: %s)\n%s", sc.label().c_str(), trace.c_str(),
                bench::profile_table(prof, 25).c_str());
    std::fflush(stdout);
  }
  // Release this configuration's model, optimizer state and cached blocks before
  // the next one is built, so each peak is its own.
  in = Inputs{};
  opt.reset();
  m.reset();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  return r;
}

int run_bench(const StepBenchOptions& o) {
  validate(o);
  VQAD_CHECK(torch::cuda::is_available(), "bench step: no CUDA device is available");
  const torch::Device dev(torch::kCUDA, 0);
  const model::WanConfig cfg = model::WanConfig::wan_1_3b();
  const int64_t tokens = (o.frames / cfg.patch_size[0]) * (o.height / cfg.patch_size[1]) *
                         (o.width / cfg.patch_size[2]);
  const std::vector<StepConfig> configs = all_configs_of(o);

  std::vector<StepResult> results;
  FlopCount flops;
  for (const StepConfig& sc : configs) results.push_back(run_config(sc, o, dev, tokens, &flops));
  // The MFU denominator: the device's dense BF16 peak from train/throughput.h's table
  // (a device that is not in it gets no MFU).
  const auto peak = train::device_peak_flops(dev);
  const double peak_flops = peak ? peak->bf16_dense_flops : std::nan("");

  bench::Table table({"configuration", "step s (median)", "fwd+bwd s", "AdamW s", "tokens/s",
                      "MFU %", "peak GiB", "loss"});
  nlohmann::json runs = nlohmann::json::array();
  for (const StepResult& r : results) {
    const double step_s = bench::median(r.step_ms) / 1e3;
    const double tps = tokens / step_s;
    const double mfu = flops.total() / step_s / peak_flops;
    table.add({r.config.label(), bench::fmt(step_s, 3), bench::fmt(bench::median(r.fwd_bwd_ms) / 1e3, 3),
               bench::fmt(bench::median(r.optim_ms) / 1e3, 3), bench::fmt(tps, 0),
               bench::fmt(100.0 * mfu, 1), bench::fmt(r.peak_gib, 2),
               bench::fmt(r.losses.back(), 4)});
    runs.push_back({{"configuration", r.config.label()},
                    {"attention", r.config.attention},
                    {"vsa_sparsity", ops::is_vsa_backend(ops::parse_attention_backend_or_throw(
                                         r.config.attention, "bench step --attention"))
                                         ? nlohmann::json(o.sparsity)
                                         : nlohmann::json(nullptr)},
                    {"linears", r.config.nvfp4 ? "nvfp4" : "dense"},
                    {"linears_quantized", r.linears_quantized},
                    {"step_s_median", step_s},
                    {"step_ms", r.step_ms},
                    {"fwd_bwd_ms", r.fwd_bwd_ms},
                    {"optimizer_ms", r.optim_ms},
                    {"tokens_per_s", tps},
                    {"mfu", mfu},
                    {"peak_allocated_gib", r.peak_gib},
                    {"losses", r.losses}});
  }
  const int64_t layers = o.layers > 0 ? o.layers : cfg.num_layers;
  std::printf("\nWan2.1 1.3B architecture, %lld blocks, latent 16 x %lld x %lld x %lld -> %lld tokens, "
              "text 512 x 4096, bf16 compute, fp32 masters, per-block checkpointing, AdamW\n",
              static_cast<long long>(layers), static_cast<long long>(o.frames),
              static_cast<long long>(o.height), static_cast<long long>(o.width),
              static_cast<long long>(tokens));
  std::printf("%s", table.str().c_str());
  std::printf("model FLOPs per step %.3e (linears %.3e, attention %.3e); MFU against %.0f TFLOP/s\n",
              flops.total(), flops.linear, flops.attention, peak_flops / 1e12);
  nlohmann::json j = {{"bench", "step"},
                      {"model", "Wan2.1 1.3B architecture (random weights)"},
                      {"layers", layers},
                      {"latent", {1, cfg.in_channels, o.frames, o.height, o.width}},
                      {"tokens", tokens},
                      {"text", {1, cfg.text_len, cfg.text_dim}},
                      {"timestep", 500},
                      {"compute_dtype", "bf16"},
                      {"master_dtype", "fp32"},
                      {"gradient_checkpointing", "per block"},
                      {"optimizer", {{"name", "AdamW"}, {"lr", o.lr}}},
                      {"warmup_steps", o.warmup},
                      {"timed_steps", o.steps},
                      {"timing", "host clock between torch::cuda::synchronize() calls; median"},
                      {"model_flops", flops.total()},
                      {"model_flops_linear", flops.linear},
                      {"model_flops_attention", flops.attention},
                      {"flops_convention",
                       "6 x multiply-adds of every linear at the tokens it sees + attention "
                       "3.5 x 4 x L x (L + 512) x dim x layers; checkpoint recompute not counted"},
                      {"peak_flops", peak ? nlohmann::json(peak_flops) : nlohmann::json(nullptr)},
                      {"device", bench::device_json()},
                      {"runs", runs}};
  // Every configuration against the last one (the baseline), the first's under "ratio".
  if (results.size() >= 2) {
    const StepResult& base = results.back();
    const double b = bench::median(base.step_ms);
    nlohmann::json ratios = nlohmann::json::array();
    for (size_t i = 0; i + 1 < results.size(); ++i) {
      const double a = bench::median(results[i].step_ms);
      std::printf("step time %s / %s = %.2fx; peak memory %.2fx\n", results[i].config.label().c_str(),
                  base.config.label().c_str(), a / b, results[i].peak_gib / base.peak_gib);
      ratios.push_back({{"of", results[i].config.label()},
                        {"to", base.config.label()},
                        {"step_time", a / b},
                        {"peak_memory", results[i].peak_gib / base.peak_gib}});
    }
    j["ratio"] = ratios[0];
    if (ratios.size() > 1) j["ratios"] = ratios;
  }
  const std::string path = bench::write_json(o.out_dir, "step.json", j);
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

#else

int run_bench(const StepBenchOptions& o) {
  validate(o);
  fail("bench step needs a GPU build (LibTorch CUDA libraries linked, VQAD_WITH_TORCH_CUDA); "
       "this build has CPU LibTorch only");
}

#endif  // VQAD_WITH_TORCH_CUDA

}  // namespace

void register_bench_step_commands(CLI::App& app) {
  auto opts = std::make_shared<StepBenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "step",
      "one stage-1 training step of the Wan 1.3B architecture (random weights, 31,200 tokens): "
      "Attn-QAT + NVFP4 linears vs the BF16 baseline; time, tokens/s, MFU, peak memory");
  sub->add_option("--attention", opts->attention,
                  "self-attention backend: ATTN_QAT_TRAIN | TORCH_SDPA | FLASH_ATTN "
                  "(default: ATTN_QAT_TRAIN + nvfp4 and the TORCH_SDPA + dense baseline)");
  sub->add_option("--sparsity", opts->sparsity,
                  "VSA backends: fraction of KV cubes skipped (model FLOPs and MFU stay dense-equivalent)")
      ->capture_default_str();
  sub->add_option("--linears", opts->linears, "nvfp4 (dynamic NVFP4 QAT linears) | dense");
  sub->add_flag("--qat-full-nograd-forward", opts->qat_full_nograd,
                "also time ATTN_QAT_TRAIN / VSA_QAT_TRAIN_* with the full forward (O_hp) in the first pass of each "
                "checkpointed block, as before the forward without O_hp");
  sub->add_flag("--no-baseline", opts->no_baseline,
                "skip the TORCH_SDPA + dense baseline (no ratio)");
  sub->add_option("--steps", opts->steps, "timed steps (median reported)")->capture_default_str();
  sub->add_option("--warmup", opts->warmup, "untimed steps first")->capture_default_str();
  sub->add_option("--layers", opts->layers, "transformer blocks (0: all 30; fewer for a smoke test)")
      ->capture_default_str();
  sub->add_option("--frames", opts->frames, "latent frames")->capture_default_str();
  sub->add_option("--height", opts->height, "latent height")->capture_default_str();
  sub->add_option("--width", opts->width, "latent width")->capture_default_str();
  sub->add_option("--lr", opts->lr, "AdamW learning rate")->capture_default_str();
  sub->add_option("--seed", opts->seed, "weights and inputs seed")->capture_default_str();
  sub->add_option("--out", opts->out_dir, "directory for step.json")->capture_default_str();
  sub->add_option("--profile", opts->profile_dir,
                  "also run one step per configuration under the profiler: GPU time per kernel category and "
                  "the longest kernels, Chrome trace in this directory");
  set_action(sub, [opts] { return run_bench(*opts); });
}

}  // namespace vqad::cli
