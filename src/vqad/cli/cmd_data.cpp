// `vqad data inspect|synth|bench`: look at FastVideo parquet datasets and ODE caches,
// write synthetic datasets, and measure the reader's throughput.
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <fcntl.h>
#include <parquet/arrow/reader.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "vqad/cli/cmd_ode_cache.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/data/arrow_util.h"
#include "vqad/data/loader.h"
#include "vqad/data/ode_cache.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/synthetic.h"

namespace fs = std::filesystem;

namespace vqad::cli {
namespace {

using namespace vqad::data;

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

DataKind detect_kind(const std::string& first_file) {
  auto input = arrow_util::unwrap(arrow::io::ReadableFile::Open(first_file), "open '" + first_file + "'");
  auto reader = arrow_util::unwrap(parquet::arrow::OpenFile(input, arrow::default_memory_pool()),
                                   "parquet file '" + first_file + "'");
  std::shared_ptr<arrow::Schema> schema;
  arrow_util::check_status(reader->GetSchema(&schema), "schema of '" + first_file + "'");
  return schema->GetFieldByName("vae_latent_bytes") ? DataKind::T2V : DataKind::TextOnly;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

// A cache without COMPLETE: say how far generation got, then fail.
[[noreturn]] void incomplete_ode_cache(const std::string& path) {
  const std::string meta_path = (fs::path(path) / "cache.json").string();
  std::ifstream f(meta_path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail("ODE cache '", meta_path, "' is not valid JSON: ", e.what());
  }
  OdeCacheMeta::from_json(j, "ODE cache '" + meta_path + "'");
  const int64_t n = j.value("trajectories", int64_t(0));
  int64_t present = 0;
  for (int64_t i = 0; i < n; ++i) {
    char name[48];
    std::snprintf(name, sizeof name, "%08lld.safetensors", (long long)i);
    present += fs::exists(fs::path(path) / "trajectories" / name);
  }
  fail("ODE cache '", path, "' is incomplete: ", present, " of ", n,
       " trajectory files present and no COMPLETE marker (rerun `vqad ode-cache generate` with its recipe to "
       "continue it)");
}

int inspect_ode_cache(const std::string& path, const std::string& recipe_path) {
  if (!fs::exists(fs::path(path) / "COMPLETE")) incomplete_ode_cache(path);
  auto cache = OdeCache::open(path);
  const OdeCacheReport rep = cache.verify();
  if (!recipe_path.empty())
    sample::check_cache_against_recipe(cache.meta(), cache.num_trajectories(), load_ode_recipe(recipe_path, {}),
                                       "ODE cache '" + (fs::path(path) / "cache.json").string() + "'");
  const auto& m = cache.meta();
  const auto& g = m.geometry;
  std::printf("ODE cache %s: complete\n", path.c_str());
  std::printf("  trajectories %lld, anchors %lld, pairs %lld\n", (long long)rep.trajectories, (long long)rep.anchors,
              (long long)rep.pairs);
  std::printf("  geometry: %lld frames at %lldx%lld -> latent %s %s\n", (long long)g.num_frames,
              (long long)g.num_height, (long long)g.num_width, nlohmann::json(g.latent_shape).dump().c_str(),
              m.latent_dtype.c_str());
  std::printf("  schedule: %lld teacher steps, shift %g, solver %s, sigma[1] %.9g, anchors (teacher steps) %s\n",
              (long long)m.schedule.teacher_steps, double(m.schedule.flow_shift), m.schedule.solver.c_str(),
              double(m.schedule.sigmas.size() > 1 ? m.schedule.sigmas[1] : 0.0f),
              nlohmann::json(m.schedule.student_indices).dump().c_str());
  std::printf("  teacher: %s (%s), backend %s, compute %s, state %s, guidance %g, cfg forward %s, %zu hashed files\n",
              m.teacher.model_kind.c_str(), m.teacher.init_from.c_str(), m.teacher.backend.c_str(),
              m.teacher.compute_dtype.c_str(), m.teacher.state_dtype.c_str(), m.teacher.guidance_scale,
              m.teacher.cfg_forward.c_str(), m.teacher.file_sha256.size());
  std::printf("  negative prompt: '%s' (embedding %s)\n", m.teacher.negative_prompt.c_str(),
              m.teacher.negative_prompt_embedding.c_str());
  std::printf("  prompts: %s, seed %lld\n", m.source.dump().c_str(), (long long)m.seed);
  std::printf("  runtime: %s\n", m.runtime.dump().c_str());
  std::printf("  bytes per trajectory: %lld (min %lld, max %lld), total %s\n",
              (long long)(rep.total_bytes / std::max<int64_t>(1, rep.trajectories)), (long long)rep.min_bytes,
              (long long)rep.max_bytes, human_bytes(double(rep.total_bytes)).c_str());
  auto t = cache.trajectory(0);
  std::printf("  trajectory 0: '%s' prompt tokens %lld\n", t.caption.c_str(), (long long)t.prompt_embedding.size(0));
  if (!recipe_path.empty()) std::printf("  agrees with the recipe %s\n", recipe_path.c_str());
  return 0;
}

int inspect(const std::string& path, const std::string& kind_name, int show, const std::string& recipe) {
  if (fs::is_directory(path) && fs::exists(fs::path(path) / "cache.json")) return inspect_ode_cache(path, recipe);
  VQAD_CHECK(recipe.empty(), "data inspect --recipe: '", path, "' is not an ODE cache (no cache.json)");
  auto files = find_parquet_files(path);
  DataKind kind = kind_name == "auto" ? detect_kind(files[0]) : parse_data_kind(kind_name);
  DatasetOptions o;
  o.kind = kind;
  o.text_dim = 0;
  o.normalize_latents = false;
  auto ds = ParquetDataset::open(path, o);
  {
    auto input = arrow_util::unwrap(arrow::io::ReadableFile::Open(files[0]), "open");
    auto reader = arrow_util::unwrap(parquet::arrow::OpenFile(input, arrow::default_memory_pool()), "open");
    std::shared_ptr<arrow::Schema> schema;
    arrow_util::check_status(reader->GetSchema(&schema), "schema");
    std::printf("dataset %s (%s schema)\n", path.c_str(), to_string(kind).c_str());
    std::printf("schema of %s:\n", files[0].c_str());
    for (const auto& f : schema->fields()) std::printf("  %-22s %s\n", f->name().c_str(), f->type()->ToString().c_str());
  }
  int64_t groups = 0;
  for (const auto& f : ds->files()) groups += int64_t(f.row_groups.size());
  std::printf("files %zu, row groups %lld, rows %lld\n", ds->files().size(), (long long)groups,
              (long long)ds->size());
  const int64_t n = std::min<int64_t>(show, ds->size());
  for (int64_t i = 0; i < n; ++i) {
    auto s = ds->get(i);
    std::printf("row %lld id=%s latent=%s text=[%lld, %lld] caption=\"%s\"\n", (long long)i, s.id.c_str(),
                s.latent.defined() ? shape_of(s.latent).c_str() : "-", (long long)s.text_tokens,
                (long long)s.text.size(1), s.caption.c_str());
  }
  return 0;
}

void evict_from_page_cache(const std::vector<FileEntry>& files) {
  for (const auto& f : files) {
    int fd = ::open(f.path.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace

void register_data_commands(CLI::App& app) {
  auto* data = app.add_subcommand("data", "FastVideo parquet datasets and ODE caches");
  data->require_subcommand(1);

  {
    auto* sub = data->add_subcommand(
        "inspect",
        "Print schema, rows, shapes and captions of a dataset; for an ODE cache: counts, geometry, schedule, "
        "teacher, bytes per trajectory, and a check of every trajectory file");
    auto path = std::make_shared<std::string>();
    auto kind = std::make_shared<std::string>("auto");
    auto show = std::make_shared<int>(3);
    sub->add_option("path", *path, "dataset root, parquet file or ODE cache directory")->required();
    sub->add_option("--kind", *kind, "auto | t2v | text_only");
    sub->add_option("--rows", *show, "rows to print");
    auto recipe = std::make_shared<std::string>();
    sub->add_option("--recipe", *recipe, "ODE cache: also check geometry, schedule, anchors, guidance, seed and "
                                         "count against this ode-cache recipe");
    set_action(sub, [=] { return inspect(*path, *kind, *show, *recipe); });
  }

  {
    auto* sub = data->add_subcommand("synth", "Write a synthetic FastVideo-schema dataset (structured latent videos + captions)");
    auto out = std::make_shared<std::string>();
    auto rows = std::make_shared<int64_t>(16);
    auto kind = std::make_shared<std::string>("t2v");
    auto so = std::make_shared<SynthOptions>();
    auto wo = std::make_shared<WriterOptions>();
    sub->add_option("out", *out, "output directory")->required();
    sub->add_option("--rows", *rows, "number of rows");
    sub->add_option("--kind", *kind, "t2v | text_only");
    sub->add_option("--latent-t", so->latent_t, "latent frames (21 = 81 frames)");
    sub->add_option("--latent-h", so->latent_h, "latent height (60 = 480 px)");
    sub->add_option("--latent-w", so->latent_w, "latent width (104 = 832 px)");
    sub->add_option("--text-dim", so->text_dim, "text embedding width");
    sub->add_option("--text-tokens", so->text_tokens, "stored tokens per row (0: caption length)");
    sub->add_option("--seed", so->seed, "generator seed");
    sub->add_option("--modes", so->modes, "multi-modal rows: modes per caption (default 0: off)");
    sub->add_option("--captions", so->captions, "multi-modal rows: distinct captions (default 8)");
    sub->add_option("--detail", so->detail, "per-element detail std in normalized latent units (default 0.05)");
    sub->add_flag("--dense-text", so->dense_text, "fill padding tokens with noise (incompressible benchmark rows)");
    sub->add_option("--rows-per-file", wo->rows_per_file, "rows per parquet file");
    sub->add_option("--compression", wo->compression, "zstd | snappy | none");
    sub->add_option("--row-group-rows", wo->row_group_rows, "rows per row group (0: one per file; 1: cheapest random access)");
    set_action(sub, [=] {
      SynthOptions o = *so;
      o.kind = parse_data_kind(*kind);
      // Never mix into (or replace) what is already there.
      if (fs::exists(*out)) {
        VQAD_CHECK(fs::is_directory(*out), "data synth: ", *out, " exists and is not a directory");
        VQAD_CHECK(fs::is_empty(*out), "data synth: ", *out,
                   " is not empty; write a synthetic dataset into a new or empty directory");
      }
      auto t0 = std::chrono::steady_clock::now();
      auto files = write_synthetic_dataset(*out, *rows, o, *wo);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      uintmax_t bytes = 0;
      for (const auto& f : files) bytes += fs::file_size(f);
      std::printf("wrote %lld rows in %zu files (%.1f MB) to %s in %.1f s\n", (long long)*rows,
                  files.size(), double(bytes) / 1e6, out->c_str(), s);
      return 0;
    });
  }

  {
    auto* sub = data->add_subcommand("bench", "Measure reader throughput (rows/s, MB/s) over a dataset");
    auto path = std::make_shared<std::string>();
    auto kind = std::make_shared<std::string>("auto");
    auto batches = std::make_shared<int64_t>(0);
    auto batch_size = std::make_shared<int64_t>(1);
    auto prefetch = std::make_shared<size_t>(2);
    auto num_latent_t = std::make_shared<int64_t>(0);
    auto seed = std::make_shared<int64_t>(1000);
    auto cold = std::make_shared<bool>(false);
    auto sequential = std::make_shared<bool>(false);
    auto json_out = std::make_shared<std::string>();
    sub->add_option("path", *path, "dataset root")->required();
    sub->add_option("--kind", *kind, "auto | t2v | text_only");
    sub->add_option("--batches", *batches, "batches to read (0: one epoch)");
    sub->add_option("--batch-size", *batch_size, "rows per batch");
    sub->add_option("--prefetch", *prefetch, "read-ahead depth (0: synchronous)");
    sub->add_option("--num-latent-t", *num_latent_t, "latent frames kept (0: all)");
    sub->add_option("--seed", *seed, "permutation seed");
    sub->add_flag("--sequential", *sequential, "read rows in storage order instead of the shuffled training order");
    sub->add_flag("--cold", *cold, "evict the files from the page cache first (posix_fadvise)");
    sub->add_option("--json", *json_out, "write the result as JSON to this file");
    set_action(sub, [=] {
      auto files = find_parquet_files(*path);
      DatasetOptions o;
      o.kind = *kind == "auto" ? detect_kind(files[0]) : parse_data_kind(*kind);
      o.num_latent_t = *num_latent_t;
      o.text_dim = 0;
      o.cfg_rate = 0.1;
      o.seed = *seed;
      auto ds = ParquetDataset::open(*path, o);
      uintmax_t disk = 0;
      for (const auto& f : ds->files()) disk += fs::file_size(f.path);
      if (*cold) evict_from_page_cache(ds->files());
      SamplerOptions so;
      so.dataset_size = ds->size();
      so.batch_size = *batch_size;
      so.seed = *seed;
      DpSpBatchSampler sampler(so);
      const int64_t n = *batches > 0 ? *batches : sampler.batches_per_epoch();
      auto t0 = std::chrono::steady_clock::now();
      PrefetchLoader loader(ds, sampler, *sequential ? 0 : *prefetch);
      int64_t rows = 0;
      double payload = 0;
      for (int64_t b = 0; b < n; ++b) {
        Batch batch;
        if (*sequential) {
          std::vector<int64_t> idx;
          for (int64_t k = 0; k < *batch_size; ++k) idx.push_back((b * *batch_size + k) % ds->size());
          batch = ds->get_batch(idx);
        } else {
          batch = loader.next();
        }
        rows += int64_t(batch.indices.size());
        if (batch.latent.defined()) payload += double(batch.latent.numel()) * batch.latent.element_size();
        payload += double(batch.text.numel()) * 4;
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("dataset %s: %zu files, %lld rows, %.1f MB on disk\n", path->c_str(), ds->files().size(),
                  (long long)ds->size(), double(disk) / 1e6);
      std::printf("read %lld rows in %lld batches (%s, batch %lld, prefetch %zu, %s page cache) in %.2f s\n",
                  (long long)rows, (long long)n, *sequential ? "sequential" : "shuffled", (long long)*batch_size,
                  *sequential ? size_t(0) : *prefetch, *cold ? "cold" : "warm", s);
      std::printf("  %.2f rows/s, %.1f MB/s of decoded float32 tensors\n", double(rows) / s, payload / 1e6 / s);
      if (!json_out->empty()) {
        nlohmann::json j = {{"dataset", *path},       {"files", ds->files().size()},
                            {"rows_in_dataset", ds->size()}, {"disk_bytes", disk},
                            {"rows_read", rows},      {"batches", n},
                            {"batch_size", *batch_size}, {"prefetch", *prefetch},
                            {"cold", *cold}, {"sequential", *sequential},          {"seconds", s},
                            {"rows_per_s", double(rows) / s}, {"decoded_mb_per_s", payload / 1e6 / s}};
        std::ofstream(*json_out) << j.dump(2) << "\n";
      }
      return 0;
    });
  }
}

}  // namespace vqad::cli
