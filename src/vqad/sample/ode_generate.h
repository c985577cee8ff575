// Generation of an ODE-trajectory cache (data/ode_cache.h) with a frozen teacher:
// `vqad ode-cache generate RECIPE`.
//
// Per trajectory i (spec/sparse_qad.md "ODE-trajectory cache"):
//   noise  = randn([16, T, H, W]) in fp32 from a CPU generator seeded with
//            data::trajectory_seed(seed, i), cast to bf16: x_0 (on any device, any rank)
//   prompt = row i % rows of the prompt source (text_only or t2v parquet), padded to text_len
//   for step k = 0 .. N-1 of sample::shifted_schedule(flow_shift, N):
//     v_c = teacher(x_k, t_k, prompt), v_u = teacher(x_k, t_k, negative prompt)   (fp32)
//     v   = v_u + g (v_c - v_u)                                                    (fp32)
//     x_{k+1} = bf16(x_k + fp32(sigma_{k+1} - sigma_k) v)                          (fp32 math)
//   store x_k for k in the anchors (the state before step k) and x_N.
// With guidance 1 the teacher runs on the prompt only (v = v_c). cfg_forward "batched"
// evaluates v_c and v_u as one forward of batch 2 (the teacher's numbers may differ from
// two forwards in the last bits, so the choice is part of the cache's identity).
//
// Trajectory i belongs to rank i % world (RANK / WORLD_SIZE); a rank skips trajectories
// whose file exists, so a killed run continues where it stopped and the finished cache
// is byte-identical to an uninterrupted one (except sessions/, which records timings).
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vqad/core/attention_backend.h"
#include "vqad/data/ode_cache.h"
#include "vqad/model/wan/model.h"
#include "vqad/sample/schedule.h"

namespace vqad::sample {

struct OdeTeacherSpec {
  std::string target;     // models.teacher._target_ as written ("" when absent)
  std::string init_from;  // Diffusers directory, vqad export, or random:<preset> (WanConfig::preset)
  AttentionBackend attention_backend = AttentionBackend::kTorchSdpa;  // dense only
};

struct OdeRecipe {
  OdeTeacherSpec teacher;
  std::string output_dir;
  std::string data_path;               // prompt source (parquet files)
  std::string data_kind = "text_only";  // text_only | t2v
  std::string negative_prompt_embedding;  // .safetensors with one [L, D] tensor, or a parquet dataset (row 0)
  std::string negative_prompt;            // the text it encodes (recorded)
  std::string source_kind;                // free text (recorded)
  int64_t num_frames = 0, num_height = 0, num_width = 0;
  int64_t teacher_steps = 48;
  float flow_shift = 8.0f;
  double guidance_scale = 6.0;
  std::vector<int64_t> anchors;  // teacher step indices; default 0, 4, ..., 44 of 48
  int64_t trajectories = 0;
  int64_t seed = 0;
  std::string cfg_forward = "separate";  // separate | batched
  std::string device = "auto";           // auto | cpu | cuda | cuda:N
  std::string source;                    // recipe path (for messages)
};

// Reads the models.teacher and ode_cache sections of a recipe (a YAML document already
// converted to JSON, overrides applied). Unknown keys and bad values are errors naming
// the key.
OdeRecipe parse_ode_recipe(const nlohmann::ordered_json& root, const std::string& source);

struct LoadedTeacher {
  std::shared_ptr<model::WanModel> model;
  std::string model_kind;  // wan-t2v-1.3b, wan-t2v-14b, wan-t2v-tiny, wan-t2v-custom
  std::string init_kind;   // random | diffusers | vqad_export
  nlohmann::json architecture;
  std::map<std::string, std::string> file_sha256;  // relative to init_from
};

// BF16 compute, frozen, eval mode, on `device`. A random teacher is built right after
// torch::manual_seed(seed).
LoadedTeacher load_ode_teacher(const OdeTeacherSpec& spec, torch::Device device, uint64_t seed);

struct OdeSolveResult {
  torch::Tensor anchors;       // [A, C, T, H, W] bf16 (device of the input)
  torch::Tensor final_latent;  // [C, T, H, W] bf16
};

// Shifted Euler with CFG from x0 ([C, T, H, W] bf16). text / uncond: [1, text_len, D] in
// the model's compute dtype on the model's device. after_step runs after every teacher step.
OdeSolveResult solve_ode_trajectory(model::WanModel& teacher, const torch::Tensor& x0, const torch::Tensor& text,
                                    const torch::Tensor& uncond, const ShiftedSchedule& schedule, double guidance,
                                    const std::vector<int64_t>& anchors, bool batched_cfg,
                                    const std::function<void()>& after_step = {});

// x_0 of trajectory `index`: fp32 randn from trajectory_seed(seed, index) on the CPU, bf16.
torch::Tensor trajectory_noise(const std::vector<int64_t>& latent_shape, int64_t seed, int64_t index);

// device_type, device_name, capability, torch, cuda, vqad version / commit / dirty.
nlohmann::json runtime_record(torch::Device device);

struct OdeGenerateOptions {
  int64_t rank = 0, world = 1;
  bool progress = true;
  std::optional<bool> tty;         // progress output style (default: isatty)
  double log_interval_s = 30.0;    // non-TTY progress line period
};

struct OdeGenerateSummary {
  std::string directory;
  int64_t trajectories = 0;  // planned, all ranks
  int64_t generated = 0;     // by this session
  int64_t present = 0;       // of this rank's, before this session
  bool complete = false;
  double seconds = 0.0;
  std::vector<double> trajectory_seconds;  // solve + write, per generated trajectory
};

OdeGenerateSummary generate_ode_cache(const OdeRecipe& recipe, const OdeGenerateOptions& options);

// RANK / WORLD_SIZE from the environment (0 / 1 when unset); errors name the variable.
std::pair<int64_t, int64_t> rank_and_world_from_env();

// Compares a cache's metadata with what `recipe` would write (geometry, schedule,
// guidance, anchors, seed, trajectories, teacher init_from / backend, cfg_forward);
// throws naming cache.json and the field on the first disagreement.
void check_cache_against_recipe(const data::OdeCacheMeta& meta, int64_t trajectories, const OdeRecipe& recipe,
                                const std::string& where);

}  // namespace vqad::sample
