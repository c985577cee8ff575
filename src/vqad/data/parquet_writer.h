// Writer for FastVideo-schema parquet datasets (t2v and text_only), used by the
// synthetic generator, tests and benchmarks. Files are named data_chunk_<n>.parquet
// (zero-padded so that path order is write order) and written atomically.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "vqad/data/parquet_dataset.h"

namespace vqad::data {

struct ParquetRecord {
  std::string id, caption, file_name, media_type = "video";
  torch::Tensor latent;  // [C, T, H, W], stored as float32 bytes (t2v only)
  torch::Tensor text;    // [L, D], stored as float32 bytes (trimmed to the real tokens)
  int64_t width = 0, height = 0, num_frames = 0;
  double duration_sec = 0.0, fps = 0.0;
};

struct WriterOptions {
  DataKind kind = DataKind::T2V;
  int64_t rows_per_file = 8;     // FastVideo's samples_per_file for MixKit
  int64_t row_group_rows = 0;    // 0: one row group per file
  std::string compression = "zstd";  // zstd | snappy | none
};

// Writes one parquet file with the rows (atomically: temp file + rename).
void write_parquet_file(const std::string& path, const std::vector<ParquetRecord>& rows,
                        const WriterOptions& options);

class ParquetDatasetWriter {
 public:
  ParquetDatasetWriter(std::string directory, WriterOptions options);
  ~ParquetDatasetWriter();  // flushes buffered rows (errors are reported by close())
  void add(ParquetRecord record);
  // Writes the buffered rows; returns every file written.
  std::vector<std::string> close();
  int64_t rows_written() const { return rows_written_; }

 private:
  void flush();
  std::string directory_;
  WriterOptions options_;
  std::vector<ParquetRecord> pending_;
  std::vector<std::string> files_;
  int64_t rows_written_ = 0;
  bool closed_ = false;
};

}  // namespace vqad::data
