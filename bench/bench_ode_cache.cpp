// `vqad bench ode-cache`: ODE-trajectory cache generation with a random-weight Wan teacher
// (default: the 1.3B architecture at latents 16 x 56 x 112 = 25,088 tokens, 2 trajectories
// of 48 steps with CFG). In one process it times
//   - the floor: one teacher forward at batch 1 and at batch 2 (median of --repeats), so
//     48 x 2 forwards of batch 1 ("separate" CFG) vs 48 forwards of batch 2 ("batched");
//   - the generator itself (sample::generate_ode_cache on a synthetic prompt set, CFG mode
//     --cfg-forward, default the faster floor): seconds per trajectory (solve + write);
// and reports the overhead over the floor and the disk bytes per trajectory. Works on the
// CPU with --preset tiny and small latents (a CPU test runs it that way). Writes
// ode_cache.json under --out.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/device.h"
#include "vqad/io/tensors.h"
#include "vqad/sample/ode_generate.h"

namespace fs = std::filesystem;

namespace vqad::cli {
namespace {

struct OdeBenchOptions {
  std::string preset = "1.3B";
  std::string attention = "TORCH_SDPA";
  std::string device = "auto";
  std::string cfg_forward = "auto";  // auto (the faster floor) | separate | batched
  int64_t frames = 16, height = 56, width = 112;  // latent T, H, W
  int64_t trajectories = 2;
  int64_t steps = 48;
  int64_t text_tokens = 64;  // real prompt tokens of the synthetic prompts (padded to 512)
  int repeats = 3;
  int64_t seed = 0;
  std::string out_dir = "bench_out";
};

void sync(torch::Device d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

double median_of(std::vector<double> v) { return bench::median(std::move(v)); }

int run_ode_bench(const OdeBenchOptions& o) {
  VQAD_CHECK(o.frames >= 1 && o.height >= 2 && o.width >= 2 && o.height % 2 == 0 && o.width % 2 == 0,
             "bench ode-cache: --frames >= 1 and even --height / --width >= 2 (latent sizes) needed");
  VQAD_CHECK(o.trajectories >= 1 && o.steps >= 1 && o.repeats >= 1, "bench ode-cache: --trajectories, --steps and "
             "--repeats must be >= 1");
  VQAD_CHECK(o.cfg_forward == "auto" || o.cfg_forward == "separate" || o.cfg_forward == "batched",
             "bench ode-cache: --cfg-forward must be auto, separate or batched, found '", o.cfg_forward, "'");
  auto backend = parse_attention_backend(o.attention);
  VQAD_CHECK(backend && (*backend == AttentionBackend::kTorchSdpa || *backend == AttentionBackend::kFlashAttn),
             "bench ode-cache: --attention must be TORCH_SDPA or FLASH_ATTN (the teacher is dense), found '",
             o.attention, "'");
  const fs::path out = o.out_dir;
  const fs::path work = out / "ode_cache_bench";
  fs::remove_all(work);
  fs::create_directories(work);

  // The recipe the generator runs (pixels from latent sizes: T = (F - 1) / 4 + 1, H = h / 8).
  sample::OdeRecipe r;
  r.teacher.init_from = "random:" + o.preset;
  r.teacher.attention_backend = *backend;
  r.output_dir = (work / "cache").string();
  r.num_frames = (o.frames - 1) * 4 + 1;
  r.num_height = o.height * 8;
  r.num_width = o.width * 8;
  r.teacher_steps = o.steps;
  r.flow_shift = 8.0f;
  r.guidance_scale = 6.0;
  for (int64_t i = 0; i < o.steps; i += 4) r.anchors.push_back(i);
  r.trajectories = o.trajectories;
  r.seed = o.seed;
  r.device = o.device;
  r.data_kind = "text_only";
  r.source_kind = "bench (synthetic prompts)";

  // Floor: teacher forwards timed in this process.
  const torch::Device dev = io::parse_device(o.device);
  auto teacher = sample::load_ode_teacher(r.teacher, dev, uint64_t(o.seed));
  const auto& mc = teacher.model->config();
  const int64_t tokens = o.frames * (o.height / 2) * (o.width / 2);
  auto x1 = torch::randn({1, 16, o.frames, o.height, o.width}).to(dev, torch::kBFloat16);
  auto x2 = torch::cat({x1, x1}, 0);
  auto text1 = (torch::randn({1, mc.text_len, mc.text_dim}) * 0.1).to(dev, torch::kBFloat16);
  auto text2 = torch::cat({text1, text1}, 0);
  auto t1 = torch::full({1}, 999.0f, torch::TensorOptions(dev));
  auto t2 = torch::full({2}, 999.0f, torch::TensorOptions(dev));
  auto time_forward = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text) {
    torch::NoGradGuard ng;
    teacher.model->forward(x, t, text);  // warm-up
    sync(dev);
    std::vector<double> s;
    for (int k = 0; k < o.repeats; ++k) {
      const auto a = std::chrono::steady_clock::now();
      teacher.model->forward(x, t, text);
      sync(dev);
      s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    return median_of(s);
  };
  const double fwd1 = time_forward(x1, t1, text1);
  const double fwd2 = time_forward(x2, t2, text2);
  const double floor_separate = double(o.steps) * 2.0 * fwd1;
  const double floor_batched = double(o.steps) * fwd2;
  r.cfg_forward = o.cfg_forward == "auto" ? (floor_batched < floor_separate ? "batched" : "separate") : o.cfg_forward;
  const double floor_used = r.cfg_forward == "batched" ? floor_batched : floor_separate;
  teacher = {};  // the generator loads its own teacher (same seed, same weights)

  // Prompts and negative prompt: synthetic text embeddings of the model's width.
  data::SynthOptions so;
  so.kind = data::DataKind::TextOnly;
  so.text_dim = mc.text_dim;
  so.text_tokens = o.text_tokens;
  so.dense_text = true;
  so.seed = o.seed;
  data::WriterOptions wo;
  wo.kind = data::DataKind::TextOnly;
  r.data_path = (work / "prompts").string();
  data::write_synthetic_dataset(r.data_path, o.trajectories, so, wo);
  r.negative_prompt_embedding = (work / "negative.safetensors").string();
  r.negative_prompt = "(bench: random embedding)";
  io::save_safetensors(r.negative_prompt_embedding,
                       {{"negative", torch::randn({o.text_tokens, mc.text_dim}) * 0.1}});

  sample::OdeGenerateOptions go;
  go.progress = false;
  auto sum = sample::generate_ode_cache(r, go);
  VQAD_CHECK(sum.complete && sum.generated == o.trajectories, "bench ode-cache: generation did not complete");
  auto cache = data::OdeCache::open(r.output_dir);
  const auto rep = cache.verify();
  const double per_traj = median_of(sum.trajectory_seconds);
  const double bytes = double(rep.total_bytes) / double(rep.trajectories);

  std::printf("vqad bench ode-cache: %s teacher (random weights, %s) on %s, latents %lld x %lld x %lld = %lld "
              "tokens, %lld steps, guidance 6, %lld trajectories\n",
              o.preset.c_str(), o.attention.c_str(), dev.str().c_str(), (long long)o.frames, (long long)o.height,
              (long long)o.width, (long long)tokens, (long long)o.steps, (long long)o.trajectories);
  bench::Table table({"quantity", "seconds", "note"});
  char a[64], b[64], c[64], d[64], e[64];
  std::snprintf(a, sizeof a, "%.4f", fwd1);
  std::snprintf(b, sizeof b, "%.4f", fwd2);
  std::snprintf(c, sizeof c, "%.3f", floor_separate);
  std::snprintf(d, sizeof d, "%.3f", floor_batched);
  std::snprintf(e, sizeof e, "%.3f", per_traj);
  table.add({"teacher forward, batch 1", a, "median of " + std::to_string(o.repeats)});
  table.add({"teacher forward, batch 2", b, "median of " + std::to_string(o.repeats)});
  table.add({"floor: " + std::to_string(o.steps) + " x 2 forwards (separate)", c,
             r.cfg_forward == "separate" ? "used" : ""});
  table.add({"floor: " + std::to_string(o.steps) + " x 1 forward of batch 2 (batched)", d,
             r.cfg_forward == "batched" ? "used" : ""});
  char ov[64];
  std::snprintf(ov, sizeof ov, "%.1f%% over the %s floor", 100.0 * (per_traj / floor_used - 1.0),
                r.cfg_forward.c_str());
  table.add({"generator: seconds per trajectory (" + r.cfg_forward + ")", e, ov});
  std::printf("%s", table.str().c_str());
  std::printf("disk bytes per trajectory: %.0f (%.2f MiB; %lld anchors + x_%lld in %s, prompt embedding fp32)\n",
              bytes, bytes / (1024.0 * 1024.0), (long long)rep.anchors, (long long)o.steps,
              cache.meta().latent_dtype.c_str());

  nlohmann::json j = {{"bench", "ode_cache"},
                      {"preset", o.preset},
                      {"attention", o.attention},
                      {"device", dev.str()},
                      {"runtime", sample::runtime_record(dev)},
                      {"latent", {16, o.frames, o.height, o.width}},
                      {"tokens", tokens},
                      {"steps", o.steps},
                      {"trajectories", o.trajectories},
                      {"forward_batch1_s", fwd1},
                      {"forward_batch2_s", fwd2},
                      {"floor_separate_s", floor_separate},
                      {"floor_batched_s", floor_batched},
                      {"cfg_forward", r.cfg_forward},
                      {"seconds_per_trajectory", per_traj},
                      {"trajectory_seconds", sum.trajectory_seconds},
                      {"overhead_over_floor", per_traj / floor_used - 1.0},
                      {"bytes_per_trajectory", bytes}};
  std::ofstream((out / "ode_cache.json").string()) << j.dump(2) << "\n";
  std::printf("wrote %s\n", (out / "ode_cache.json").string().c_str());
  return 0;
}

}  // namespace

void register_bench_ode_cache_commands(CLI::App& app) {
  auto o = std::make_shared<OdeBenchOptions>();
  auto* sub = bench_command(app)->add_subcommand(
      "ode-cache",
      "ODE-cache generation with a random-weight Wan teacher (default 1.3B at 16 x 56 x 112 latents, 2 trajectories): "
      "seconds per trajectory vs the floor of 48 x 2 teacher forwards (batched CFG vs two forwards), disk bytes");
  sub->add_option("--preset", o->preset, "teacher architecture: 1.3B | 14B | tiny")->capture_default_str();
  sub->add_option("--attention", o->attention, "TORCH_SDPA | FLASH_ATTN")->capture_default_str();
  sub->add_option("--device", o->device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  sub->add_option("--cfg-forward", o->cfg_forward, "auto (faster floor) | separate | batched")->capture_default_str();
  sub->add_option("--frames", o->frames, "latent frames")->capture_default_str();
  sub->add_option("--height", o->height, "latent height")->capture_default_str();
  sub->add_option("--width", o->width, "latent width")->capture_default_str();
  sub->add_option("--trajectories", o->trajectories, "trajectories to generate")->capture_default_str();
  sub->add_option("--steps", o->steps, "teacher steps")->capture_default_str();
  sub->add_option("--text-tokens", o->text_tokens, "real tokens of the synthetic prompts")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "timed forwards per batch size (median)")->capture_default_str();
  sub->add_option("--seed", o->seed, "weights, noise and prompt seed")->capture_default_str();
  sub->add_option("--out", o->out_dir, "directory for ode_cache.json and the generated cache")->capture_default_str();
  set_action(sub, [o] { return run_ode_bench(*o); });
}

}  // namespace vqad::cli
