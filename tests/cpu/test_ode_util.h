// Helpers of the ODE-cache tests: a tiny prompt set, a negative-prompt embedding and a
// recipe for the tiny Wan teacher on CPU, and directory comparison.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "test_data_util.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/tensors.h"

namespace vqad::test_ode {

struct OdeFixture {
  std::filesystem::path dir;
  std::string prompts, negative, recipe;
};

// Geometry: 5 frames at 32 x 32 pixels -> latents [16, 2, 4, 4] (8 tokens for the tiny
// model); `steps` teacher steps at shift 8, guidance 6, anchors every 4th step.
inline OdeFixture make_ode_fixture(const std::string& tag, int64_t prompt_rows = 3, int64_t trajectories = 4,
                                   int64_t steps = 12, const std::string& extra = "") {
  OdeFixture f;
  f.dir = test_data::fresh_dir(tag);
  f.prompts = (f.dir / "prompts").string();
  data::SynthOptions so;
  so.kind = data::DataKind::TextOnly;
  so.text_dim = 32;
  so.seed = 5;
  data::WriterOptions wo;
  wo.kind = data::DataKind::TextOnly;
  wo.rows_per_file = 2;
  data::write_synthetic_dataset(f.prompts, prompt_rows, so, wo);
  f.negative = (f.dir / "negative.safetensors").string();
  torch::manual_seed(77);
  io::save_safetensors(f.negative, {{"negative", torch::randn({3, 32}) * 0.2}});
  f.recipe = (f.dir / "ode.yaml").string();
  std::ofstream(f.recipe) << "models:\n"
                             "  teacher:\n"
                             "    _target_: fastvideo.train.models.wan.WanModel\n"
                             "    init_from: random:tiny\n"
                             "    attention_backend: TORCH_SDPA\n"
                             "    trainable: false\n"
                             "ode_cache:\n"
                             "  output_dir: "
                          << (f.dir / "cache").string()
                          << "\n"
                             "  data_path: "
                          << f.prompts
                          << "\n"
                             "  preprocessed_data_type: text_only\n"
                             "  negative_prompt_embedding: "
                          << f.negative
                          << "\n"
                             "  negative_prompt: blurry, static\n"
                             "  num_frames: 5\n"
                             "  num_height: 32\n"
                             "  num_width: 32\n"
                             "  teacher_steps: "
                          << steps
                          << "\n"
                             "  flow_shift: 8.0\n"
                             "  guidance_scale: 6.0\n"
                             "  trajectories: "
                          << trajectories
                          << "\n"
                             "  seed: 1000\n"
                             "  device: cpu\n"
                          << extra;
  return f;
}

inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Relative path -> bytes of every file under `root`, except sessions/ (timings).
inline std::map<std::string, std::string> tree_bytes(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = std::filesystem::relative(e.path(), root).string();
    if (rel.rfind("sessions/", 0) == 0) continue;
    out[rel] = file_bytes(e.path());
  }
  return out;
}

}  // namespace vqad::test_ode
