// Training pairs over an ODE-trajectory cache (Dataset interface): index p = trajectory
// p / A, selected anchor p % A, where the selected anchors are a subset of the cache's
// (by teacher step index, e.g. {0, 16, 32}; default: all of them). A batch carries the
// cached state at the anchor (ode_start), the clean endpoint (ode_target), the anchor's
// exact fp32 sigma and timestep, its teacher step, and the prompt embedding padded to
// text_len with its mask. Text dropout is the parquet dataset's (cfg_drop(seed, p,
// cfg_rate): the text is zeroed, the mask kept). Order and position are the sampler's.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "vqad/data/dataset.h"
#include "vqad/data/ode_cache.h"

namespace vqad::data {

struct OdeDatasetOptions {
  std::vector<int64_t> anchor_teacher_steps;  // empty: every anchor of the cache
  std::string anchors_key = "training.data.ode_anchor_indices";  // named in errors
  int64_t text_len = 512;
  int64_t text_dim = 0;  // expected embedding width; 0 accepts the cache's
  double cfg_rate = 0.0;
  int64_t seed = 0;
};

class OdeDataset final : public Dataset {
 public:
  static std::shared_ptr<OdeDataset> open(const std::string& directory, OdeDatasetOptions options);
  int64_t size() const override { return cache_.num_trajectories() * int64_t(anchors_.size()); }
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  std::string description() const override;
  nlohmann::json identity() const override;
  std::string root() const override { return cache_.directory(); }

  const OdeCache& cache() const { return cache_; }
  // Cache anchor positions of the selected anchors, in teacher-step order.
  const std::vector<int64_t>& anchors() const { return anchors_; }
  std::vector<int64_t> anchor_teacher_steps() const;
  OdePair pair(int64_t index) const;

 private:
  OdeDataset(OdeCache cache, OdeDatasetOptions options) : cache_(std::move(cache)), options_(std::move(options)) {}
  OdeCache cache_;
  OdeDatasetOptions options_;
  std::vector<int64_t> anchors_;
};

}  // namespace vqad::data
