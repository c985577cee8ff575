// Synthetic FastVideo-schema datasets, so every method runs without downloads.
//
// Each row is a small "video" in latent space: a few Gaussian blobs that move on
// straight lines across the frames over a smooth background, mapped into raw VAE
// latent space with the Wan channel statistics (so the reader's normalization
// brings it back to unit scale). The caption names the blobs' colour word, motion
// direction and background, and the text embedding is a per-word deterministic
// vector, so captions and latents are correlated and a model can learn the pairing.
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
};

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
