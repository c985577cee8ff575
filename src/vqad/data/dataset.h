// The dataset interface the loader and the trainer work with. Three kinds implement it:
// FastVideo parquet datasets (parquet_dataset.h), synthetic rows generated in memory
// (synthetic.h, SyntheticDataset) and ODE-trajectory pairs (ode_dataset.h). The order
// and the resumable position belong to the sampler and the loader (sampler.h,
// loader.h), not to the dataset: a dataset maps an index in [0, size()) to a sample,
// deterministically, and that is all.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vqad/data/batch.h"

namespace vqad::data {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // Thread-safe (the loader reads ahead on another thread); deterministic in the
  // indices. Errors name the file / row / pair.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
  // One line for logs, e.g. "parquet t2v, 3 files, 128 rows under /data/mixkit".
  virtual std::string description() const = 0;
  // What the data is, for metadata and for checking a resume: kind, root(s), options.
  virtual nlohmann::json identity() const = 0;
  // Where the data lives (recorded in the loader state).
  virtual std::string root() const = 0;
};

// What training asks for (filled from training.data without looking at kinds); the
// factory decides the kind from the paths:
//   - a directory holding cache.json (an ODE-trajectory cache) -> ODE-pair dataset
//   - "synthetic://ROWS"                                        -> in-memory synthetic rows
//   - anything else                                             -> parquet files
struct DatasetSpec {
  std::vector<std::pair<std::string, int64_t>> sources;  // path, repeat ("a:2,b")
  std::string kind = "t2v";  // training.data.preprocessed_data_type: t2v | text_only
  int64_t text_len = 512, text_dim = 4096;
  int64_t num_latent_t = 0;               // parquet: keep the first T frames (0: all)
  int64_t num_height = 0, num_width = 0;  // pixels; synthetic rows: latent H = num_height / 8
  double cfg_rate = 0.0;                  // training_cfg_rate (text dropout)
  int64_t seed = 0;                       // training.data.seed
  // ODE caches: teacher step indices to train on (empty: every cached anchor).
  std::vector<int64_t> ode_anchor_indices;
  std::string anchors_key = "training.data.ode_anchor_indices";  // named in errors
};

std::shared_ptr<const Dataset> make_dataset(const DatasetSpec& spec);

// "synthetic://ROWS" -> ROWS (> 0), or -1 when `path` is not a synthetic source.
int64_t synthetic_rows(const std::string& path);

}  // namespace vqad::data
