// FastVideo preprocessed parquet datasets (t2v and text_only schemas).
//
// A dataset is every *.parquet file under a root (recursive, sorted by path).
// Rows are addressed by one global index through the per-file, per-row-group row
// counts of the parquet footers, so opening a dataset reads no tensor data. Each
// row's *_bytes columns are raw little-endian float32 reshaped by *_shape (as
// FastVideo decodes them); text embeddings are zero-padded or cropped to text_len
// with a float mask; latents can be cut to num_latent_t frames and normalized per
// channel with the Wan VAE statistics; the text of a row is dropped (zeroed) for
// classifier-free guidance by a deterministic function of (seed, row).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vqad/data/batch.h"
#include "vqad/data/dataset.h"

namespace vqad::data {

enum class DataKind { T2V, TextOnly };
DataKind parse_data_kind(const std::string& name);  // "t2v" | "text_only"
std::string to_string(DataKind kind);

// Column names of FastVideo's pyarrow_schema_t2v / pyarrow_schema_text_only.
const std::vector<std::string>& schema_columns(DataKind kind);
// Columns the reader cannot work without.
const std::vector<std::string>& required_columns(DataKind kind);

struct DatasetOptions {
  DataKind kind = DataKind::T2V;
  int64_t text_len = 512;      // embeddings are padded/cropped to this many tokens
  int64_t text_dim = 4096;     // expected embedding width; 0 accepts any
  int64_t num_latent_t = 0;    // keep the first T latent frames; 0 keeps all stored frames
  bool normalize_latents = true;
  // FastVideo casts the latent to bf16 before normalizing and keeps the result in
  // bf16; bf16_latents reproduces that bit for bit, otherwise the result is float32.
  bool bf16_latents = false;
  double cfg_rate = 0.0;       // text dropout probability (training_cfg_rate)
  int64_t seed = 0;            // dropout seed (training.data.seed)
  size_t row_group_cache = 2;  // decoded row groups kept for reuse by neighbouring rows
};

struct RowGroupSpan {
  int64_t first_row = 0;  // within the file
  int64_t num_rows = 0;
};

struct FileEntry {
  std::string path;
  int64_t first_global_row = 0;
  int64_t num_rows = 0;
  std::vector<RowGroupSpan> row_groups;
};

struct RowLocation {
  size_t file = 0;
  int row_group = 0;
  int64_t row_in_file = 0;
  int64_t row_in_group = 0;
};

struct Sample {
  int64_t index = -1;           // global row
  std::string id, caption;
  RowInfo info;
  torch::Tensor latent;         // [16, T, H, W] (undefined for text_only)
  torch::Tensor text;           // [text_len, D] float32
  torch::Tensor text_mask;      // [text_len] float32
  int64_t text_tokens = 0;      // stored token count before padding/cropping
  bool text_dropped = false;
};

// Batch (batch.h) is included from here so that older includes keep working.

// Sorted list of *.parquet files under root (root may also be one file).
std::vector<std::string> find_parquet_files(const std::string& root);

class ParquetDataset final : public Dataset {
 public:
  static std::shared_ptr<ParquetDataset> open(const std::string& root, DatasetOptions options);
  // Several roots, each repeated `repeat` times (FastVideo's "a:2,b" data_path): one
  // global row space over the roots' files in order, a root's files listed once per repeat.
  static std::shared_ptr<ParquetDataset> open_sources(const std::vector<std::pair<std::string, int64_t>>& sources,
                                                      DatasetOptions options);

  int64_t size() const override { return total_rows_; }
  const std::vector<FileEntry>& files() const { return files_; }
  const DatasetOptions& options() const { return options_; }
  std::string root() const override { return root_; }
  std::string description() const override;
  nlohmann::json identity() const override;

  RowLocation locate(int64_t index) const;
  // Thread-safe; errors name the file and the row.
  Sample get(int64_t index) const;
  // Stacks the rows; all rows of a batch must share the latent shape.
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  ParquetDataset(const ParquetDataset&) = delete;
  ParquetDataset& operator=(const ParquetDataset&) = delete;
  ~ParquetDataset() override;

  struct Impl;

 private:
  ParquetDataset() = default;
  std::string root_;
  DatasetOptions options_;
  std::vector<FileEntry> files_;
  int64_t total_rows_ = 0;
  std::unique_ptr<Impl> impl_;
};

// Stacks samples (used by get_batch and by callers that assemble rows themselves).
Batch collate(std::vector<Sample> samples);

// The reader's last steps, shared with datasets that produce rows in memory (synthetic):
// a raw float32 [16, T, H, W] latent (contiguous, already cut to num_latent_t) -> the
// normalized training latent; a raw [L, D] float32 text embedding -> s.text / s.text_mask
// padded or cropped to text_len, with the row's dropout (cfg_drop(seed, s.index, cfg_rate)).
torch::Tensor finish_latent(torch::Tensor raw, const DatasetOptions& options);
void fill_text(Sample& s, const void* data, int64_t L, int64_t D, const DatasetOptions& options);

}  // namespace vqad::data
