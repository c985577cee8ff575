// Synthetic FastVideo-schema datasets, so every method runs without downloads.
//
// Each row is a small "video" in latent space: a few Gaussian blobs that move on
// straight lines across the frames over a smooth background, mapped into raw VAE
// latent space with the Wan channel statistics (so the reader's normalization
// brings it back to unit scale). The caption names the blobs' colour word, motion
// direction and background, and the text embedding is a per-word deterministic
// vector, so captions and latents are correlated and a model can learn the pairing.
//
// Multi-modal option (modes > 0; what `vqad demo` uses): the rows share `captions`
// distinct captions, and each caption's videos come from `modes` well-separated modes:
// per (caption, mode) fixed blob start positions, speed and colour layout (the channel
// gains), so the conditional distribution of a caption has `modes` clusters. Inside a
// mode a row varies only by a small position / amplitude jitter and its per-element
// detail (`detail`, iid Gaussian in normalized latent units). The flow of such data is
// strongly curved: a few Euler steps average the modes and wash out the detail.
//
// SyntheticDataset serves the same rows from memory through the Dataset interface
// (training data_path "synthetic://ROWS"), identical to writing them with
// write_synthetic_dataset and reading them back with ParquetDataset.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vqad/data/dataset.h"
#include "vqad/data/parquet_writer.h"

namespace vqad::data {

struct SynthOptions {
  DataKind kind = DataKind::T2V;
  int64_t latent_t = 21, latent_h = 60, latent_w = 104;  // 81 x 480 x 832 video
  int64_t text_dim = 4096;
  int64_t text_tokens = 0;  // 0: one token per caption word (+1); >0: fixed L (zero padded)
  // Fill the padding tokens with noise too: benchmark rows whose text does not compress
  // away (real FastVideo rows store only the real tokens).
  bool dense_text = false;
  int64_t seed = 0;
  // Per-element detail of each row (std in normalized latent units); 0.05 is the
  // default data's.
  double detail = 0.05;
  // 0: today's data (every row draws its caption and blob layout independently).
  // > 0: multi-modal rows (see the file comment); `captions` distinct captions
  // (1..216), each with `modes` modes.
  int64_t modes = 0;
  int64_t captions = 8;
};

// Caption index and mode of row g of a multi-modal dataset (options.modes > 0).
struct SynthMode {
  int64_t caption = 0, mode = 0;
};
SynthMode synth_mode_of(const SynthOptions& options, int64_t g);

// Row g of the synthetic dataset (deterministic in (options, g)).
ParquetRecord synth_record(const SynthOptions& options, int64_t g);

// Writes `rows` synthetic rows to `directory`; returns the files.
std::vector<std::string> write_synthetic_dataset(const std::string& directory, int64_t rows,
                                                 const SynthOptions& options,
                                                 const WriterOptions& writer);

class SyntheticDataset final : public Dataset {
 public:
  // synth.kind must equal options.kind; options as for ParquetDataset (text_len,
  // num_latent_t, normalization, dropout).
  SyntheticDataset(int64_t rows, SynthOptions synth, DatasetOptions options);
  int64_t size() const override { return rows_; }
  Sample get(int64_t index) const;
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  std::string description() const override;
  nlohmann::json identity() const override;
  std::string root() const override;

 private:
  int64_t rows_;
  SynthOptions synth_;
  DatasetOptions options_;
};

}  // namespace vqad::data
