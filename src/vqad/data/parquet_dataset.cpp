#include "vqad/data/parquet_dataset.h"

#include <atomic>

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/schema.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <list>
#include <set>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/data/arrow_util.h"
#include "vqad/data/latent_norm.h"
#include "vqad/data/py_random.h"

namespace fs = std::filesystem;

namespace vqad::data {

static_assert(std::endian::native == std::endian::little,
              "the FastVideo parquet format stores little-endian float32; a big-endian host "
              "would need byte swapping");

DataKind parse_data_kind(const std::string& name) {
  if (name == "t2v") return DataKind::T2V;
  if (name == "text_only") return DataKind::TextOnly;
  fail("preprocessed_data_type: expected one of t2v, text_only, found '", name, "'");
}

std::string to_string(DataKind kind) { return kind == DataKind::T2V ? "t2v" : "text_only"; }

const std::vector<std::string>& schema_columns(DataKind kind) {
  static const std::vector<std::string> t2v = {
      "id", "vae_latent_bytes", "vae_latent_shape", "vae_latent_dtype", "text_embedding_bytes",
      "text_embedding_shape", "text_embedding_dtype", "file_name", "caption", "media_type",
      "width", "height", "num_frames", "duration_sec", "fps"};
  static const std::vector<std::string> text_only = {
      "id", "text_embedding_bytes", "text_embedding_shape", "text_embedding_dtype", "caption"};
  return kind == DataKind::T2V ? t2v : text_only;
}

const std::vector<std::string>& required_columns(DataKind kind) {
  static const std::vector<std::string> t2v = {"id",
                                               "caption",
                                               "vae_latent_bytes",
                                               "vae_latent_shape",
                                               "text_embedding_bytes",
                                               "text_embedding_shape"};
  static const std::vector<std::string> text_only = {"id", "caption", "text_embedding_bytes",
                                                     "text_embedding_shape"};
  return kind == DataKind::T2V ? t2v : text_only;
}

std::vector<std::string> find_parquet_files(const std::string& root) {
  std::error_code ec;
  VQAD_CHECK(fs::exists(root, ec), "parquet dataset: root '", root, "' does not exist");
  std::vector<std::string> out;
  auto is_parquet = [](const fs::path& p) { return p.extension() == ".parquet"; };
  if (fs::is_regular_file(root)) {
    VQAD_CHECK(is_parquet(root), "parquet dataset: '", root, "' is a file but not a *.parquet file");
    out.push_back(fs::weakly_canonical(root).string());
    return out;
  }
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::follow_directory_symlink);
       it != fs::recursive_directory_iterator(); ++it) {
    if (it->is_regular_file() && is_parquet(it->path()))
      out.push_back(fs::weakly_canonical(it->path()).string());
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  VQAD_CHECK(!out.empty(), "parquet dataset: no *.parquet files under '", root, "'");
  return out;
}

// ---------------------------------------------------------------------------

struct ParquetDataset::Impl {
  // Per file: top-level column name -> parquet leaf column indices.
  std::vector<std::map<std::string, std::vector<int>>> leaves;
  // Row-group cache (most recently used first).
  struct Cached {
    size_t file;
    int row_group;
    std::shared_ptr<arrow::Table> table;
  };
  mutable std::mutex mu;
  mutable std::list<Cached> cache;
};

ParquetDataset::~ParquetDataset() = default;

std::shared_ptr<ParquetDataset> ParquetDataset::open(const std::string& root, DatasetOptions options) {
  return open_sources({{root, 1}}, std::move(options));
}

std::shared_ptr<ParquetDataset> ParquetDataset::open_sources(const std::vector<std::pair<std::string, int64_t>>& sources,
                                                             DatasetOptions options) {
  VQAD_CHECK(!sources.empty(), "parquet dataset: no data path given");
  std::string root;
  for (const auto& [path, repeat] : sources) {
    VQAD_CHECK(repeat >= 1, "parquet dataset: repeat count of '", path, "' must be >= 1, found ", repeat);
    root += (root.empty() ? "" : ",") + path + (repeat > 1 ? ":" + std::to_string(repeat) : "");
  }
  VQAD_CHECK(options.text_len > 0, "parquet dataset: text_len must be positive, found ",
             options.text_len);
  VQAD_CHECK(options.num_latent_t >= 0, "parquet dataset: num_latent_t must be >= 0, found ",
             options.num_latent_t);
  VQAD_CHECK(options.cfg_rate >= 0.0 && options.cfg_rate <= 1.0,
             "parquet dataset: training_cfg_rate must lie in [0, 1], found ", options.cfg_rate);
  std::shared_ptr<ParquetDataset> ds(new ParquetDataset());
  ds->root_ = root;
  ds->options_ = options;
  ds->impl_ = std::make_unique<Impl>();
  const auto& required = required_columns(options.kind);
  // Every source's files, `repeat` times over, in the order given: global rows run over
  // the first source's copies, then the next source's.
  std::vector<std::string> paths;
  for (const auto& [src, repeat] : sources) {
    const auto files = find_parquet_files(src);
    for (int64_t r = 0; r < repeat; ++r) paths.insert(paths.end(), files.begin(), files.end());
  }
  for (const auto& path : paths) {
    FileEntry entry;
    entry.path = path;
    entry.first_global_row = ds->total_rows_;
    std::shared_ptr<parquet::FileMetaData> meta;
    try {
      auto reader = parquet::ParquetFileReader::OpenFile(path, /*memory_map=*/false);
      meta = reader->metadata();
    } catch (const std::exception& e) {
      fail("parquet dataset: file '", path, "' is not a readable parquet file (corrupt or truncated): ",
           e.what());
    }
    std::map<std::string, std::vector<int>> leaves;
    const parquet::SchemaDescriptor* schema = meta->schema();
    for (int c = 0; c < schema->num_columns(); ++c) {
      auto dotted = schema->Column(c)->path()->ToDotVector();
      if (!dotted.empty()) leaves[dotted[0]].push_back(c);
    }
    for (const auto& col : required) {
      if (!leaves.count(col)) {
        std::string have;
        for (const auto& [name, _] : leaves) have += (have.empty() ? "" : ", ") + name;
        fail("parquet dataset: file '", path, "' has no column '", col, "' required by the ",
             to_string(options.kind), " schema (columns present: ", have, ")");
      }
    }
    int64_t first = 0;
    for (int g = 0; g < meta->num_row_groups(); ++g) {
      int64_t n = meta->RowGroup(g)->num_rows();
      entry.row_groups.push_back({first, n});
      first += n;
    }
    VQAD_CHECK(first == meta->num_rows(), "parquet dataset: file '", path, "': row groups hold ",
               first, " rows but the footer says ", meta->num_rows(), " (corrupt footer)");
    entry.num_rows = first;
    ds->total_rows_ += first;
    ds->files_.push_back(std::move(entry));
    ds->impl_->leaves.push_back(std::move(leaves));
  }
  VQAD_CHECK(ds->total_rows_ > 0, "parquet dataset: the ", ds->files_.size(),
             " parquet file(s) under '", root, "' hold no rows");
  return ds;
}

RowLocation ParquetDataset::locate(int64_t index) const {
  VQAD_CHECK(index >= 0 && index < total_rows_, "parquet dataset '", root_, "': row ", index,
             " is out of range (the dataset has ", total_rows_, " rows)");
  auto it = std::upper_bound(files_.begin(), files_.end(), index,
                             [](int64_t i, const FileEntry& f) { return i < f.first_global_row; });
  --it;
  // Files with zero rows share first_global_row with their successor; skip them.
  while (index >= it->first_global_row + it->num_rows) ++it;
  RowLocation loc;
  loc.file = size_t(it - files_.begin());
  loc.row_in_file = index - it->first_global_row;
  auto g = std::upper_bound(it->row_groups.begin(), it->row_groups.end(), loc.row_in_file,
                            [](int64_t r, const RowGroupSpan& s) { return r < s.first_row; });
  --g;
  while (loc.row_in_file >= g->first_row + g->num_rows) ++g;
  loc.row_group = int(g - it->row_groups.begin());
  loc.row_in_group = loc.row_in_file - g->first_row;
  return loc;
}

namespace {

struct RowContext {
  std::string where;  // "parquet dataset: file 'x', row 3 (global row 17)"
  std::string col(const std::string& name) const { return where + ", column '" + name + "'"; }
};

int64_t numel_of(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (auto d : shape) {
    VQAD_CHECK(d >= 0, what, ": negative dimension in shape");
    n *= d;
  }
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The bytes/shape pair of one tensor column, validated as float32.
struct RawTensor {
  std::string_view bytes;
  std::vector<int64_t> shape;
};

RawTensor raw_tensor(const arrow::Table& t, int64_t r, const std::string& prefix,
                     const RowContext& ctx) {
  auto bytes_col = t.GetColumnByName(prefix + "_bytes");
  auto shape_col = t.GetColumnByName(prefix + "_shape");
  auto dtype_col = t.GetColumnByName(prefix + "_dtype");
  auto bytes = arrow_util::binary_at(*bytes_col, r, ctx.col(prefix + "_bytes"));
  auto shape = arrow_util::int_list_at(*shape_col, r, ctx.col(prefix + "_shape"));
  VQAD_CHECK(bytes.has_value(), ctx.col(prefix + "_bytes"), ": value is null");
  VQAD_CHECK(shape.has_value(), ctx.col(prefix + "_shape"), ": value is null");
  std::string dtype = "(no dtype column)";
  if (dtype_col) {
    auto d = arrow_util::binary_at(*dtype_col, r, ctx.col(prefix + "_dtype"));
    dtype = d ? "'" + std::string(*d) + "'" : "(null)";
  }
  int64_t numel = numel_of(*shape, ctx.col(prefix + "_shape"));
  int64_t expected = numel * 4;
  if (int64_t(bytes->size()) != expected) {
    if (int64_t(bytes->size()) == numel * 2)
      fail(ctx.col(prefix + "_bytes"), ": ", bytes->size(), " bytes hold 2-byte elements for shape ",
           shape_str(*shape), " (dtype ", dtype,
           "); the FastVideo format is read as float32, which needs ", expected, " bytes");
    fail(ctx.col(prefix + "_bytes"), ": byte count does not match the shape: shape ",
         shape_str(*shape), " as float32 needs ", expected, " bytes, found ", bytes->size(),
         " (dtype ", dtype, ")");
  }
  return {*bytes, *shape};
}

torch::Tensor decode_latent(const RawTensor& raw, const DatasetOptions& o, const RowContext& ctx) {
  const auto& s = raw.shape;
  VQAD_CHECK(s.size() == 4, ctx.col("vae_latent_shape"),
             ": expected a video latent [C, T, H, W], found shape ", shape_str(s));
  const int64_t C = s[0], T = s[1], H = s[2], W = s[3];
  VQAD_CHECK(C > 0 && T > 0 && H > 0 && W > 0, ctx.col("vae_latent_shape"),
             ": empty video latent (a zero-length dimension in shape ", shape_str(s), ")");
  if (o.normalize_latents)
    VQAD_CHECK(C == kWanLatentChannels, ctx.col("vae_latent_shape"),
               ": Wan VAE normalization needs 16 channels, found shape ", shape_str(s));
  const int64_t Tk = o.num_latent_t > 0 ? o.num_latent_t : T;
  VQAD_CHECK(Tk <= T, ctx.col("vae_latent_shape"), ": num_latent_t = ", o.num_latent_t,
             " exceeds the stored ", T, " latent frames (shape ", shape_str(s), ")");
  auto out = torch::empty({C, Tk, H, W}, torch::kFloat32);
  float* dst = out.data_ptr<float>();
  const int64_t plane = Tk * H * W;
  for (int64_t c = 0; c < C; ++c)
    std::memcpy(dst + c * plane, raw.bytes.data() + size_t(c * T * H * W) * 4, size_t(plane) * 4);
  return finish_latent(out, o);
}

}  // namespace

torch::Tensor finish_latent(torch::Tensor out, const DatasetOptions& o) {
  if (!o.normalize_latents) return o.bf16_latents ? out.to(torch::kBFloat16) : out;
  if (o.bf16_latents) {
    // FastVideo's order: cast to bf16, normalize in fp32, store bf16.
    return normalize_wan_latents(out.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16);
  }
  VQAD_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 4 &&
                 out.size(0) == kWanLatentChannels,
             "dataset: a latent to normalize must be a contiguous float32 [16, T, H, W] tensor, found ",
             out.sizes());
  const int64_t C = out.size(0), plane = out[0].numel();
  float* dst = out.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    const float m = kWanLatentMean[size_t(c)], sd = kWanLatentStd[size_t(c)];
    float* p = dst + c * plane;
    for (int64_t k = 0; k < plane; ++k) p[k] = (p[k] - m) / sd;
  }
  return out;
}

void fill_text(Sample& s, const void* data, int64_t L, int64_t D, const DatasetOptions& o) {
  const int64_t keep = std::min(L, o.text_len);
  s.text_tokens = L;
  s.text_dropped = cfg_drop(o.seed, s.index, o.cfg_rate);
  s.text = torch::zeros({o.text_len, D}, torch::kFloat32);
  if (!s.text_dropped && keep > 0) std::memcpy(s.text.data_ptr<float>(), data, size_t(keep * D) * 4);
  // A dropped row keeps the mask of its real tokens (FastVideo zeroes only the values).
  s.text_mask = torch::zeros({o.text_len}, torch::kFloat32);
  if (keep > 0) s.text_mask.narrow(0, 0, keep).fill_(1.0f);
}

Sample ParquetDataset::get(int64_t index) const {
  const RowLocation loc = locate(index);
  const FileEntry& file = files_[loc.file];
  RowContext ctx{"parquet dataset: file '" + file.path + "', row " + std::to_string(loc.row_in_file) +
                 " (global row " + std::to_string(index) + ")"};

  std::shared_ptr<arrow::Table> table;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (auto it = impl_->cache.begin(); it != impl_->cache.end(); ++it) {
      if (it->file == loc.file && it->row_group == loc.row_group) {
        table = it->table;
        impl_->cache.splice(impl_->cache.begin(), impl_->cache, it);
        break;
      }
    }
  }
  if (!table) {
    const auto& leaves = impl_->leaves[loc.file];
    std::vector<int> columns;
    for (const auto& name : schema_columns(options_.kind)) {
      auto it = leaves.find(name);
      if (it != leaves.end()) columns.insert(columns.end(), it->second.begin(), it->second.end());
    }
    std::sort(columns.begin(), columns.end());
    const auto& span = file.row_groups[size_t(loc.row_group)];
    const std::string what = "parquet dataset: file '" + file.path + "', row group " +
                             std::to_string(loc.row_group) + " (rows " +
                             std::to_string(span.first_row) + ".." +
                             std::to_string(span.first_row + span.num_rows - 1) + ", requested row " +
                             std::to_string(loc.row_in_file) + "): read failed (corrupt file?)";
    try {
      auto input = arrow_util::unwrap(arrow::io::ReadableFile::Open(file.path), what);
      auto reader = arrow_util::unwrap(parquet::arrow::OpenFile(input, arrow::default_memory_pool()), what);
      reader->set_use_threads(true);
      table = arrow_util::unwrap(reader->ReadRowGroup(loc.row_group, columns), what);
    } catch (const vqad::Error&) {
      throw;
    } catch (const std::exception& e) {
      fail(what, ": ", e.what());
    }
    VQAD_CHECK(table->num_rows() == span.num_rows, what, ": decoded ", table->num_rows(),
               " rows, the footer says ", span.num_rows);
    if (options_.row_group_cache > 0) {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->cache.push_front({loc.file, loc.row_group, table});
      while (impl_->cache.size() > options_.row_group_cache) impl_->cache.pop_back();
    }
  }

  const int64_t r = loc.row_in_group;
  Sample s;
  s.index = index;
  auto str = [&](const char* name) -> std::string {
    auto col = table->GetColumnByName(name);
    if (!col) return {};
    auto v = arrow_util::binary_at(*col, r, ctx.col(name));
    return v ? std::string(*v) : std::string();
  };
  auto i64 = [&](const char* name) -> int64_t {
    auto col = table->GetColumnByName(name);
    if (!col) return -1;
    return arrow_util::int_at(*col, r, ctx.col(name)).value_or(-1);
  };
  auto f64 = [&](const char* name) -> double {
    auto col = table->GetColumnByName(name);
    if (!col) return -1.0;
    return arrow_util::double_at(*col, r, ctx.col(name)).value_or(-1.0);
  };
  s.id = str("id");
  s.caption = str("caption");
  s.info.file_name = str("file_name");
  s.info.media_type = str("media_type");
  s.info.width = i64("width");
  s.info.height = i64("height");
  s.info.num_frames = i64("num_frames");
  s.info.duration_sec = f64("duration_sec");
  s.info.fps = f64("fps");

  if (options_.kind == DataKind::T2V)
    s.latent = decode_latent(raw_tensor(*table, r, "vae_latent", ctx), options_, ctx);

  RawTensor text = raw_tensor(*table, r, "text_embedding", ctx);
  VQAD_CHECK(text.shape.size() == 2, ctx.col("text_embedding_shape"),
             ": expected a text embedding [L, D], found shape ", shape_str(text.shape));
  const int64_t L = text.shape[0], D = text.shape[1];
  if (options_.text_dim > 0)
    VQAD_CHECK(D == options_.text_dim, ctx.col("text_embedding_shape"), ": expected width ",
               options_.text_dim, ", found shape ", shape_str(text.shape));
  if (L > options_.text_len) {
    // Longer than the model's text length: truncated (as FastVideo does), and said so once.
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true))
      log::warn(ctx.col("text_embedding"), ": ", L, " text tokens, the model takes ", options_.text_len,
                "; keeping the first ", options_.text_len, " (further truncated rows are not reported)");
  }
  fill_text(s, text.bytes.data(), L, D, options_);
  return s;
}

Batch collate(std::vector<Sample> samples) {
  VQAD_CHECK(!samples.empty(), "parquet dataset: cannot collate an empty batch");
  Batch b;
  std::vector<torch::Tensor> lat, txt, msk;
  const bool has_latent = samples[0].latent.defined();
  for (auto& s : samples) {
    if (has_latent) {
      VQAD_CHECK(s.latent.sizes() == samples[0].latent.sizes(), "parquet dataset: batch rows ",
                 samples[0].index, " and ", s.index, " have different latent shapes ",
                 samples[0].latent.sizes(), " and ", s.latent.sizes(),
                 " (set num_latent_t or batch rows of one geometry)");
      lat.push_back(s.latent);
    }
    VQAD_CHECK(s.text.sizes() == samples[0].text.sizes(), "parquet dataset: batch rows ",
               samples[0].index, " and ", s.index, " have different text embedding shapes ",
               samples[0].text.sizes(), " and ", s.text.sizes());
    txt.push_back(s.text);
    msk.push_back(s.text_mask);
    b.indices.push_back(s.index);
    b.ids.push_back(std::move(s.id));
    b.captions.push_back(std::move(s.caption));
    b.infos.push_back(std::move(s.info));
    b.text_dropped.push_back(s.text_dropped);
  }
  if (has_latent) b.latent = torch::stack(lat);
  b.text = torch::stack(txt);
  b.text_mask = torch::stack(msk);
  return b;
}

Batch ParquetDataset::get_batch(const std::vector<int64_t>& indices) const {
  std::vector<Sample> samples;
  samples.reserve(indices.size());
  for (auto i : indices) samples.push_back(get(i));
  return collate(std::move(samples));
}

}  // namespace vqad::data

namespace vqad::data {

std::string ParquetDataset::description() const {
  return "parquet " + to_string(options_.kind) + ", " + std::to_string(files_.size()) + " files, " +
         std::to_string(total_rows_) + " rows under " + root_;
}

nlohmann::json ParquetDataset::identity() const {
  return {{"kind", "parquet"},
          {"schema", to_string(options_.kind)},
          {"root", root_},
          {"files", files_.size()},
          {"rows", total_rows_},
          {"text_len", options_.text_len},
          {"num_latent_t", options_.num_latent_t},
          {"normalize_latents", options_.normalize_latents},
          {"cfg_rate", options_.cfg_rate},
          {"seed", options_.seed}};
}

}  // namespace vqad::data
