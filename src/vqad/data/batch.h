// One training batch, whatever dataset produced it (parquet rows, synthetic rows, ODE
// pairs). A dataset fills the fields it has and leaves the others undefined / empty.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace vqad::data {

// Optional per-row metadata (absent columns / nulls leave the defaults).
struct RowInfo {
  std::string file_name, media_type;
  int64_t width = -1, height = -1, num_frames = -1;
  double duration_sec = -1.0, fps = -1.0;
};

struct Batch {
  std::vector<int64_t> indices;  // dataset indices (rows, or ODE pairs)
  std::vector<std::string> ids, captions;
  std::vector<RowInfo> infos;
  std::vector<bool> text_dropped;
  torch::Tensor latent;     // [B, 16, T, H, W] (undefined for text_only and ODE pairs)
  torch::Tensor text;       // [B, text_len, D] float32
  torch::Tensor text_mask;  // [B, text_len] float32

  // ODE-trajectory pairs (undefined / empty for other datasets).
  torch::Tensor ode_start;     // [B, 16, T, H, W] cached teacher state at the anchor
  torch::Tensor ode_target;    // [B, 16, T, H, W] cached clean endpoint x_48
  torch::Tensor ode_sigma;     // FP32 [B], the schedule's exact sigma of the anchor
  torch::Tensor ode_timestep;  // FP32 [B], fp32(1000 * sigma)
  std::vector<int64_t> ode_teacher_step;  // [B] teacher step index of each anchor

  int64_t size() const { return static_cast<int64_t>(indices.size()); }
  bool has_ode_pairs() const { return ode_start.defined(); }
};

}  // namespace vqad::data
