// `vqad bench dmd2`: stage-2 DMD2 iterations (critic step + generator step) with three
// Wan models of one architecture on one device, run by the real trainer: student
// ATTN_QAT_TRAIN + NVFP4 dynamic linears, teacher and critic FLASH_ATTN, per-block
// activation checkpointing on the trainable roles, AdamW on fp32 master weights.
// generator_update_interval is 1, so every iteration has both steps. Random weights,
// synthetic latents and text (one row per sample); reports the median iteration time
// after the warm-up and the peak allocated memory, per rollout mode; writes JSON.
#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/device.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/config.h"
#include "vqad/train/config.h"
#include "vqad/train/trainer.h"

namespace fs = std::filesystem;

namespace vqad::cli {
namespace {

struct Dmd2BenchOptions {
  std::string rollout = "both";  // data_latent | simulate | both
  std::string preset = "1.3B";
  std::string device = "auto";
  int steps = 2, warmup = 1;
  // Latent frames, height, width: 20 x 60 x 104 -> 20 x 30 x 52 = 31,200 tokens.
  int64_t frames = 20, height = 60, width = 104;
  std::string out_dir = "bench_out";
};

std::string recipe(const Dmd2BenchOptions& o, const std::string& rollout, const fs::path& work) {
  const std::string role_head = "    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:" + o.preset + "\n";
  return "models:\n"
         "  student:\n" + role_head + "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n"
         "  teacher:\n" + role_head + "    trainable: false\n    disable_custom_init_weights: true\n"
         "    attention_backend: FLASH_ATTN\n"
         "  critic:\n" + role_head + "    trainable: true\n    disable_custom_init_weights: true\n"
         "    attention_backend: FLASH_ATTN\n"
         "method:\n  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method\n"
         "  rollout_mode: " + rollout + "\n  generator_update_interval: 1\n"
         "  dmd_denoising_steps: [1000, 757, 522]\n  min_timestep_ratio: 0.02\n  max_timestep_ratio: 0.98\n"
         "  real_score_guidance_scale: 3.0\n  fake_score_learning_rate: 2.0e-6\n"
         "  fake_score_betas: [0.9, 0.999]\n  fake_score_lr_scheduler: constant\n"
         "  negative_prompt_embedding: " + (work / "negative.safetensors").string() + "\n"
         "training:\n  data:\n    data_path: " + (work / "data").string() + "\n"
         "    train_batch_size: 1\n    seed: 1000\n"
         "    num_latent_t: " + std::to_string(o.frames) + "\n    num_height: " + std::to_string(o.height * 8) +
         "\n    num_width: " + std::to_string(o.width * 8) + "\n"
         "  optimizer:\n    learning_rate: 2.0e-6\n    weight_decay: 0.01\n    lr_scheduler: constant\n"
         "  loop:\n    max_train_steps: " + std::to_string(o.warmup + o.steps) + "\n"
         "  checkpoint:\n    output_dir: " + (work / ("run_" + rollout)).string() + "\n"
         "  model:\n    enable_gradient_checkpointing_type: full\n"
         "  dit_precision: fp32\n"
         "callbacks:\n  grad_clip:\n    max_grad_norm: 1.0\n"
         "pipeline:\n  flow_shift: 3\n  dit_config:\n    quant_config: nvfp4_qat_train\n";
}

int run_bench(const Dmd2BenchOptions& o) {
  VQAD_CHECK(o.rollout == "both" || o.rollout == "data_latent" || o.rollout == "simulate",
             "bench dmd2 --rollout: unknown '", o.rollout, "' (valid: data_latent, simulate, both)");
  VQAD_CHECK(o.steps >= 1 && o.warmup >= 0, "bench dmd2: --steps must be >= 1 and --warmup >= 0");
  VQAD_CHECK(o.frames >= 1 && o.height >= 2 && o.width >= 2 && o.height % 2 == 0 && o.width % 2 == 0,
             "bench dmd2: latent ", o.frames, " x ", o.height, " x ", o.width,
             " must be positive with even height and width");
  const torch::Device device = io::parse_device(o.device);
  const model::WanConfig wc = model::WanConfig::preset(o.preset);
  const fs::path work = fs::temp_directory_path() / ("vqad_bench_dmd2_" + std::to_string(::getpid()));
  fs::remove_all(work);
  data::SynthOptions so;
  so.latent_t = o.frames;
  so.latent_h = o.height;
  so.latent_w = o.width;
  so.text_dim = wc.text_dim;
  so.text_tokens = wc.text_len;
  so.dense_text = true;
  data::write_synthetic_dataset((work / "data").string(), 2, so, data::WriterOptions{});
  io::save_safetensors((work / "negative.safetensors").string(),
                       {{"negative_prompt", torch::randn({wc.text_len, wc.text_dim}) * 0.05}});
  const int64_t tokens = o.frames * (o.height / 2) * (o.width / 2);

  std::vector<std::string> modes = o.rollout == "both" ? std::vector<std::string>{"data_latent", "simulate"}
                                                       : std::vector<std::string>{o.rollout};
  nlohmann::json results = nlohmann::json::array();
  bench::Table table({"rollout", "iteration (s)", "min (s)", "peak mem (GiB)", "tokens"});
  for (const auto& mode : modes) {
    train::RunConfig run = train::parse_run_config(recipe(o, mode, work), {}, "bench dmd2 (" + mode + ")");
    train::TrainerOptions topt;
    topt.device = device;
    topt.progress = false;
    std::vector<double> times;
    double peak = 0;
    {
      train::Trainer trainer(run, topt);
      trainer.run();
    }
    const auto metrics = read_metrics((work / ("run_" + mode) / "metrics.jsonl").string());
    for (size_t i = 0; i < metrics.size(); ++i) {
      peak = std::max(peak, metrics[i].at("mem_peak_gib").get<double>());
      if (static_cast<int>(i) >= o.warmup) times.push_back(metrics[i].at("step_time_s").get<double>());
    }
    VQAD_CHECK(!times.empty(), "bench dmd2: no timed iterations were recorded");
    const double med = bench::median(times);
    const double mn = *std::min_element(times.begin(), times.end());
    table.add({mode, bench::fmt(med, 3), bench::fmt(mn, 3), bench::fmt(peak, 1), std::to_string(tokens)});
    results.push_back({{"rollout", mode},
                       {"iteration_s_median", med},
                       {"iteration_s", times},
                       {"peak_allocated_gib", peak},
                       {"tokens_per_sample", tokens},
                       {"last_metrics", metrics.back()}});
  }
  fs::remove_all(work);
  std::printf("== vqad bench dmd2: 3 x Wan %s (student ATTN_QAT_TRAIN + NVFP4 linears, teacher/critic "
              "FLASH_ATTN), critic + generator step per iteration, device %s ==\n%s",
              o.preset.c_str(), device.str().c_str(), table.str().c_str());
  nlohmann::json j{{"bench", "dmd2"},
                   {"preset", o.preset},
                   {"device", device.str()},
                   {"latent", {o.frames, o.height, o.width}},
                   {"warmup", o.warmup},
                   {"results", results}};
#ifdef VQAD_WITH_CUDA
  if (device.is_cuda()) j["gpu"] = bench::device_json();
#endif
  std::printf("wrote %s\n", bench::write_json(o.out_dir, "dmd2.json", j).c_str());
  return 0;
}

}  // namespace

void register_bench_dmd2_commands(CLI::App& app) {
  auto opts = std::make_shared<Dmd2BenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "dmd2",
      "stage-2 DMD2 iterations (critic + generator step) with three Wan models (random weights, 31,200 "
      "tokens by default) through the trainer: iteration time and peak memory per rollout mode");
  sub->add_option("--rollout", opts->rollout, "data_latent | simulate | both")->capture_default_str();
  sub->add_option("--preset", opts->preset, "model architecture: 1.3B | 14B | tiny")->capture_default_str();
  sub->add_option("--device", opts->device, "cpu | cuda | cuda:N | auto")->capture_default_str();
  sub->add_option("--steps", opts->steps, "timed iterations (median reported)")->capture_default_str();
  sub->add_option("--warmup", opts->warmup, "untimed iterations first")->capture_default_str();
  sub->add_option("--frames", opts->frames, "latent frames")->capture_default_str();
  sub->add_option("--height", opts->height, "latent height")->capture_default_str();
  sub->add_option("--width", opts->width, "latent width")->capture_default_str();
  sub->add_option("--out", opts->out_dir, "directory for dmd2.json")->capture_default_str();
  set_action(sub, [opts] { return run_bench(*opts); });
}

}  // namespace vqad::cli
