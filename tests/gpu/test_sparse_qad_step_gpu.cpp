// The sparse QAD lineage's three stages at the Wan2.1-T2V-1.3B architecture on one GPU
// (issue "Must show"): 61 frames at 448x896 (latents 16 x 56 x 112 -> 16 x 28 x 56 =
// 25,088 tokens), batch 1, the shipped recipes configs/sparse_qad/stage{0,1,2}*.yaml with
// random:1.3B weights, a one-trajectory ODE cache of random states (the methods only need
// consistent pairs) and synthetic text. Each stage runs 2 optimizer steps through the
// trainer (step 1 includes the first-call warm-up); the test prints and writes
// (sparse_qad_step.json in the working directory) the step time and the peak allocated
// memory of each step:
//   S0 layer_recon  (ATTN_QAT_TRAIN + NVFP4 linears, groups of 5, block checkpointing)
//   S1 recon_ode    (VSA_QAT_TRAIN_C128 at sparsity 0.9, checkpointed taps, ODE endpoint)
//   S2 dmd2         (VSA_QAT_TRAIN_C128 student, dense teacher and critic, exact shifted schedule)
// Run on a GPU machine: build/vqad_gpu_tests --gtest_filter='SparseQadGpu.*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "vqad/data/ode_cache.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/config.h"
#include "vqad/train/config.h"
#include "vqad/train/trainer.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

namespace fs = std::filesystem;
using namespace vqad;

void write_random_cache(const fs::path& dir) {
  data::OdeCacheMeta meta;
  meta.geometry = data::OdeGeometry::wan(61, 448, 896);  // latents [16, 16, 56, 112]
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
  meta.schedule = data::OdeSchedule::shifted(8.0f, 48, anchors);
  meta.teacher.model_kind = "wan-t2v-1.3b";
  meta.text_len = 512;
  meta.text_dim = 4096;
  meta.source_kind = "random states (step benchmark)";
  data::OdeCacheWriter w(dir.string(), meta, 1);
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto f = torch::TensorOptions(torch::kFloat32);
  data::OdeTrajectory t;
  t.id = "traj0";
  t.caption = "benchmark prompt";
  t.seed = 0;
  t.start_latents = at::randn({12, 16, 16, 56, 112}, g, f).to(torch::kBFloat16);
  t.final_latent = (at::randn({16, 16, 56, 112}, g, f) * 0.5).to(torch::kBFloat16);
  t.prompt_embedding = at::randn({24, 4096}, g, f) * 0.1;
  w.write(0, t);
  ASSERT_TRUE(w.finalize_if_complete());
}

struct StageResult {
  std::string stage;
  std::vector<double> step_s, peak_gib, loss;
};

StageResult run_stage(const std::string& stage, const std::string& recipe, std::vector<std::string> overrides,
                      const fs::path& out) {
  const torch::Device dev(torch::kCUDA, 0);
  overrides.insert(overrides.end(), {"--training.data.train_batch_size", "1",
                                     "--training.distributed.num_gpus", "1",
                                     "--training.distributed.hsdp_replicate_dim", "1",
                                     "--training.loop.max_train_steps", "2",
                                     "--training.loop.gradient_accumulation_steps", "1",
                                     "--training.checkpoint.training_state_checkpointing_steps", "0",
                                     "--training.checkpoint.output_dir", out.string(),
                                     "--callbacks.validation.every_steps", "0"});
  auto run = train::load_run_config(std::string(VQAD_SOURCE_DIR) + "/configs/sparse_qad/" + recipe, overrides);
  (void)torch::zeros({1}, torch::TensorOptions().device(dev));  // the CUDA allocator exists before its stats are reset
  torch::cuda::synchronize();
#ifdef VQAD_WITH_TORCH_CUDA
  // Peak allocated memory of this stage only (the trainer reports the allocator's peak).
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  StageResult r;
  r.stage = stage;
  {
    train::TrainerOptions o;
    o.device = dev;
    o.progress = false;
    train::Trainer(run, o).run();
  }
  std::ifstream f(out / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("step_time_s")) continue;
    r.step_s.push_back(j["step_time_s"].get<double>());
    r.peak_gib.push_back(j["mem_peak_gib"].get<double>());
    r.loss.push_back(j["loss"].get<double>());
  }
  return r;
}

TEST(SparseQadGpu, OneStepOfEachStageAt13BAnd25088Tokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const fs::path root = fs::temp_directory_path() / ("vqad_sparse_qad_gpu_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  write_random_cache(root / "cache");
  io::save_safetensors((root / "neg.safetensors").string(), {{"negative_prompt", torch::randn({24, 4096}) * 0.1}});
  const std::string cache = (root / "cache").string();
  const std::vector<std::string> recon_roles = {"--models.student.init_from", "random:1.3B",
                                                "--models.teacher.init_from", "random:1.3B",
                                                "--training.data.data_path", cache};
  std::vector<StageResult> results;
  results.push_back(run_stage("S0 layer_recon (ATTN_QAT_TRAIN)", "stage0_layer_recon.yaml", recon_roles, root / "s0"));
  results.push_back(run_stage("S1 recon_ode (VSA_QAT_TRAIN_C128)", "stage1_recon_ode.yaml", recon_roles, root / "s1"));
  results.push_back(run_stage("S2 dmd2 (VSA_QAT_TRAIN_C128 student)", "stage2_dmd2.yaml",
                              {"--models.student.init_from", "random:1.3B", "--models.teacher.init_from",
                               "random:1.3B", "--models.critic.init_from", "random:1.3B",
                               "--training.data.data_path", "synthetic://4",
                               "--method.negative_prompt_embedding", (root / "neg.safetensors").string()},
                              root / "s2"));
  nlohmann::json out = nlohmann::json::array();
  std::cout << "sparse QAD, Wan2.1-1.3B architecture, 25,088 tokens, batch 1, one GPU:\n";
  for (const auto& r : results) {
    ASSERT_EQ(r.step_s.size(), 2u) << r.stage;
    for (size_t i = 0; i < r.step_s.size(); ++i) {
      EXPECT_TRUE(std::isfinite(r.loss[i])) << r.stage << " step " << i + 1;
      EXPECT_GT(r.step_s[i], 0.0) << r.stage;
      std::cout << "  " << r.stage << "  step " << i + 1 << ": " << r.step_s[i] << " s, peak allocated "
                << r.peak_gib[i] << " GiB, loss " << r.loss[i] << "\n";
    }
    out.push_back({{"stage", r.stage}, {"step_time_s", r.step_s}, {"mem_peak_gib", r.peak_gib}, {"loss", r.loss}});
  }
  std::ofstream("sparse_qad_step.json") << out.dump(2) << "\n";
  fs::remove_all(root);
}

}  // namespace
