#include "vqad/data/parquet_writer.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <parquet/arrow/writer.h>
#include <parquet/properties.h>

#include <cstdio>
#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/data/arrow_util.h"

namespace fs = std::filesystem;

namespace vqad::data {
namespace {

using arrow_util::check_status;

std::shared_ptr<arrow::Schema> arrow_schema(DataKind kind) {
  auto shape_t = arrow::list(arrow::int64());
  if (kind == DataKind::TextOnly)
    return arrow::schema({arrow::field("id", arrow::utf8()),
                          arrow::field("text_embedding_bytes", arrow::binary()),
                          arrow::field("text_embedding_shape", shape_t),
                          arrow::field("text_embedding_dtype", arrow::utf8()),
                          arrow::field("caption", arrow::utf8())});
  return arrow::schema({arrow::field("id", arrow::utf8()),
                        arrow::field("vae_latent_bytes", arrow::binary()),
                        arrow::field("vae_latent_shape", shape_t),
                        arrow::field("vae_latent_dtype", arrow::utf8()),
                        arrow::field("text_embedding_bytes", arrow::binary()),
                        arrow::field("text_embedding_shape", shape_t),
                        arrow::field("text_embedding_dtype", arrow::utf8()),
                        arrow::field("file_name", arrow::utf8()),
                        arrow::field("caption", arrow::utf8()),
                        arrow::field("media_type", arrow::utf8()),
                        arrow::field("width", arrow::int64()),
                        arrow::field("height", arrow::int64()),
                        arrow::field("num_frames", arrow::int64()),
                        arrow::field("duration_sec", arrow::float64()),
                        arrow::field("fps", arrow::float64())});
}

struct TensorColumns {
  arrow::BinaryBuilder bytes;
  arrow::ListBuilder shape{arrow::default_memory_pool(), std::make_shared<arrow::Int64Builder>()};
  arrow::StringBuilder dtype;

  void append(const torch::Tensor& t, const std::string& what) {
    VQAD_CHECK(t.defined(), "parquet writer: ", what, " is missing");
    auto f = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    check_status(bytes.Append(reinterpret_cast<const uint8_t*>(f.data_ptr<float>()),
                              int64_t(f.numel()) * 4),
                 "parquet writer: " + what);
    check_status(shape.Append(), "parquet writer: " + what);
    auto* dims = static_cast<arrow::Int64Builder*>(shape.value_builder());
    for (auto d : f.sizes()) check_status(dims->Append(d), "parquet writer: " + what);
    check_status(dtype.Append("float32"), "parquet writer: " + what);
  }
  void finish(std::vector<std::shared_ptr<arrow::Array>>& out) {
    std::shared_ptr<arrow::Array> a;
    check_status(bytes.Finish(&a), "parquet writer");
    out.push_back(a);
    check_status(shape.Finish(&a), "parquet writer");
    out.push_back(a);
    check_status(dtype.Finish(&a), "parquet writer");
    out.push_back(a);
  }
};

std::shared_ptr<arrow::Table> build_table(const std::vector<ParquetRecord>& rows, DataKind kind) {
  arrow::StringBuilder id, caption, file_name, media_type;
  arrow::Int64Builder width, height, num_frames;
  arrow::DoubleBuilder duration, fps;
  TensorColumns latent, text;
  for (const auto& r : rows) {
    check_status(id.Append(r.id), "parquet writer: id");
    check_status(caption.Append(r.caption), "parquet writer: caption");
    text.append(r.text, "text embedding of row '" + r.id + "'");
    if (kind == DataKind::T2V) {
      latent.append(r.latent, "latent of row '" + r.id + "'");
      check_status(file_name.Append(r.file_name), "parquet writer: file_name");
      check_status(media_type.Append(r.media_type), "parquet writer: media_type");
      check_status(width.Append(r.width), "parquet writer: width");
      check_status(height.Append(r.height), "parquet writer: height");
      check_status(num_frames.Append(r.num_frames), "parquet writer: num_frames");
      check_status(duration.Append(r.duration_sec), "parquet writer: duration_sec");
      check_status(fps.Append(r.fps), "parquet writer: fps");
    }
  }
  auto fin = [](arrow::ArrayBuilder& b) {
    std::shared_ptr<arrow::Array> a;
    check_status(b.Finish(&a), "parquet writer");
    return a;
  };
  std::vector<std::shared_ptr<arrow::Array>> cols;
  cols.push_back(fin(id));
  if (kind == DataKind::TextOnly) {
    text.finish(cols);
    cols.push_back(fin(caption));
  } else {
    latent.finish(cols);
    text.finish(cols);
    cols.push_back(fin(file_name));
    cols.push_back(fin(caption));
    cols.push_back(fin(media_type));
    cols.push_back(fin(width));
    cols.push_back(fin(height));
    cols.push_back(fin(num_frames));
    cols.push_back(fin(duration));
    cols.push_back(fin(fps));
  }
  return arrow::Table::Make(arrow_schema(kind), cols);
}

arrow::Compression::type codec_of(const std::string& name) {
  if (name == "zstd") return arrow::Compression::ZSTD;
  if (name == "snappy") return arrow::Compression::SNAPPY;
  if (name == "none" || name == "uncompressed") return arrow::Compression::UNCOMPRESSED;
  fail("parquet writer: compression must be one of zstd, snappy, none; found '", name, "'");
}

}  // namespace

void write_parquet_file(const std::string& path, const std::vector<ParquetRecord>& rows,
                        const WriterOptions& options) {
  VQAD_CHECK(!rows.empty(), "parquet writer: no rows for '", path, "'");
  const std::string what = "parquet writer: '" + path + "'";
  // Row groups are written one table at a time so that no binary column chunk needs
  // more than the 2 GiB that a 32-bit-offset Arrow array can hold.
  const int64_t rg = options.row_group_rows > 0 ? options.row_group_rows : int64_t(rows.size());
  auto props = parquet::WriterProperties::Builder()
                   .compression(codec_of(options.compression))
                   ->max_row_group_length(rg)
                   ->build();
  const std::string tmp = path + ".tmp";
  {
    auto out = arrow_util::unwrap(arrow::io::FileOutputStream::Open(tmp), what);
    auto writer = arrow_util::unwrap(
        parquet::arrow::FileWriter::Open(*arrow_schema(options.kind), arrow::default_memory_pool(),
                                         out, props),
        what);
    for (size_t first = 0; first < rows.size(); first += size_t(rg)) {
      size_t last = std::min(rows.size(), first + size_t(rg));
      std::vector<ParquetRecord> part(rows.begin() + long(first), rows.begin() + long(last));
      auto table = build_table(part, options.kind);
      check_status(writer->WriteTable(*table, rg), what);
    }
    check_status(writer->Close(), what);
    check_status(out->Close(), what);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  VQAD_CHECK(!ec, what, ": rename from '", tmp, "' failed: ", ec.message());
}

ParquetDatasetWriter::ParquetDatasetWriter(std::string directory, WriterOptions options)
    : directory_(std::move(directory)), options_(std::move(options)) {
  VQAD_CHECK(options_.rows_per_file > 0, "parquet writer: rows_per_file must be positive");
  std::error_code ec;
  fs::create_directories(directory_, ec);
  VQAD_CHECK(!ec, "parquet writer: cannot create directory '", directory_, "': ", ec.message());
}

ParquetDatasetWriter::~ParquetDatasetWriter() {
  if (closed_) return;
  try {
    flush();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vqad: parquet writer: rows lost on destruction: %s\n", e.what());
  }
}

void ParquetDatasetWriter::add(ParquetRecord record) {
  VQAD_CHECK(!closed_, "parquet writer: add after close");
  pending_.push_back(std::move(record));
  if (int64_t(pending_.size()) >= options_.rows_per_file) flush();
}

void ParquetDatasetWriter::flush() {
  if (pending_.empty()) return;
  char name[64];
  std::snprintf(name, sizeof(name), "data_chunk_%06zu.parquet", files_.size());
  std::string path = (fs::path(directory_) / name).string();
  write_parquet_file(path, pending_, options_);
  rows_written_ += int64_t(pending_.size());
  pending_.clear();
  files_.push_back(path);
}

std::vector<std::string> ParquetDatasetWriter::close() {
  if (!closed_) {
    flush();
    closed_ = true;
  }
  return files_;
}

}  // namespace vqad::data
