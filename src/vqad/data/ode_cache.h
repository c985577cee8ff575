// ODE-trajectory cache: the supervision of the layer_recon and recon_ode methods.
//
// A teacher solves the shifted flow-matching ODE from noise for each prompt; the cache
// keeps, per trajectory, the state at the student anchor steps (start latents) and the
// final clean latent, plus the prompt embedding. Training pairs are anchors x
// trajectories: input = start latent at its sigma (no re-noising), target = clean latent.
//
// Layout of a cache directory:
//   cache.json                         metadata (schema vqad.ode_cache v1): geometry,
//                                      schedule, teacher identity and file hashes,
//                                      conditioning, runtime, counts
//   trajectories/<8 digits>.safetensors  start_latents [A, C, T, H, W], final_latent
//                                      [C, T, H, W], prompt_embedding [L, D] (real
//                                      tokens only); __metadata__ id/caption/seed
//   COMPLETE                           written last; readers refuse a cache without it
// A generator that stops early can be restarted: the writer reopens a cache with the
// same identity and continues after the last complete trajectory file.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace vqad::data {

struct OdeSchedule {
  double flow_shift = 8.0;
  int64_t teacher_steps = 48;
  std::vector<double> sigmas;             // teacher_steps + 1 values, 1 -> 0
  std::vector<int64_t> student_indices;   // anchors: teacher step of each start latent
  std::string solver = "shifted_euler_bf16_state";

  // sigma(s) = S s / (1 + (S - 1) s), s = linspace(1, 0, N + 1)  (spec: training.md).
  static OdeSchedule shifted(double flow_shift, int64_t teacher_steps,
                             std::vector<int64_t> student_indices);
  std::vector<double> timesteps() const;  // 1000 sigma for each of the teacher steps
};

struct OdeGeometry {
  int64_t num_frames = 0, num_height = 0, num_width = 0, num_latent_t = 0;
  std::vector<int64_t> latent_shape;  // [C, T, H, W]
};

struct OdeTeacher {
  std::string model_kind;            // e.g. wan-t2v-1.3b
  std::string init_from;             // model id or path
  std::string backend = "TORCH_SDPA";
  std::string compute_dtype = "bfloat16";
  std::string state_dtype = "bfloat16";
  double guidance_scale = 6.0;
  std::string negative_prompt;
  nlohmann::json architecture = nlohmann::json::object();
  std::map<std::string, std::string> file_sha256;  // relative path -> sha256 (hex)
};

struct OdeCacheMeta {
  OdeGeometry geometry;
  OdeSchedule schedule;
  OdeTeacher teacher;
  std::string conditioning = "teacher_cfg";
  std::string pair_sampling = "all_anchors_to_clean";
  std::string source_kind;             // free text: where the prompts came from
  int64_t text_len = 512, text_dim = 4096;
  std::string latent_dtype = "bfloat16";  // dtype the latents are stored in
  nlohmann::json runtime = nlohmann::json::object();  // device, torch/cuda versions, ...

  nlohmann::json to_json() const;
  static OdeCacheMeta from_json(const nlohmann::json& j, const std::string& where);
};

struct OdeTrajectory {
  std::string id, caption;
  int64_t seed = 0;
  torch::Tensor start_latents;     // [A, C, T, H, W]
  torch::Tensor final_latent;      // [C, T, H, W]
  torch::Tensor prompt_embedding;  // [L, D], L <= text_len (padded by the reader of pairs)
};

struct OdePair {
  int64_t trajectory = 0, anchor = 0;
  int64_t teacher_step = 0;  // student_indices[anchor]
  double sigma = 0.0, timestep = 0.0;
  torch::Tensor start_latent;  // [C, T, H, W]
  torch::Tensor target_latent; // [C, T, H, W] final clean latent
  torch::Tensor text;          // [text_len, D] zero padded
  torch::Tensor text_mask;     // [text_len]
  std::string caption;
};

class OdeCacheWriter {
 public:
  // Creates the cache, or reopens an unfinished one with an identical identity
  // (geometry, schedule, teacher, conditioning, text geometry, dtype).
  OdeCacheWriter(std::string directory, OdeCacheMeta meta);
  int64_t num_written() const { return next_; }
  void add(const OdeTrajectory& trajectory);
  // Writes the final metadata (counts, runtime seconds) and the COMPLETE marker.
  void finalize(double generation_seconds);

 private:
  std::string dir_;
  OdeCacheMeta meta_;
  int64_t next_ = 0;
  bool finalized_ = false;
};

class OdeCache {
 public:
  static OdeCache open(const std::string& directory);
  const OdeCacheMeta& meta() const { return meta_; }
  const nlohmann::json& metadata_json() const { return json_; }
  int64_t num_trajectories() const { return trajectories_; }
  int64_t num_anchors() const { return int64_t(meta_.schedule.student_indices.size()); }
  int64_t num_pairs() const { return trajectories_ * num_anchors(); }
  std::string trajectory_path(int64_t i) const;
  OdeTrajectory trajectory(int64_t i) const;
  // Pair p = trajectory p / A, anchor p % A.
  OdePair pair(int64_t p) const;

 private:
  std::string dir_;
  OdeCacheMeta meta_;
  nlohmann::json json_;
  int64_t trajectories_ = 0;
  // The last trajectory read: pairs are usually visited anchor by anchor.
  struct LastRead {
    std::mutex mu;
    int64_t index = -1;
    std::shared_ptr<OdeTrajectory> trajectory;
  };
  std::shared_ptr<LastRead> last_ = std::make_shared<LastRead>();
};

}  // namespace vqad::data
