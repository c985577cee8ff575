#include "vqad/data/dataset.h"

#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/data/ode_dataset.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/synthetic.h"

namespace fs = std::filesystem;

namespace vqad::data {

int64_t synthetic_rows(const std::string& path) {
  const std::string prefix = "synthetic://";
  if (path.rfind(prefix, 0) != 0) return -1;
  const std::string n = path.substr(prefix.size());
  int64_t rows = 0;
  size_t used = 0;
  try {
    rows = std::stoll(n, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  VQAD_CHECK(used == n.size() && !n.empty() && rows > 0, "training.data.data_path: '", path,
             "': a synthetic source is synthetic://ROWS with ROWS > 0");
  return rows;
}

std::shared_ptr<const Dataset> make_dataset(const DatasetSpec& spec) {
  VQAD_CHECK(!spec.sources.empty(), "training.data.data_path: no dataset path given");
  const bool is_text_only = spec.kind == "text_only";
  VQAD_CHECK(is_text_only || spec.kind == "t2v", "training.data.preprocessed_data_type: '", spec.kind,
             "' is not a dataset kind (t2v, text_only)");
  const auto& [first, first_repeat] = spec.sources.front();
  auto single = [&](const char* what) {
    VQAD_CHECK(spec.sources.size() == 1 && first_repeat == 1, "training.data.data_path: ", what,
               " cannot be combined with other sources or repeated (found ", spec.sources.size(), " sources)");
  };
  VQAD_CHECK(spec.ode_anchor_indices.empty() || fs::exists(fs::path(first) / "cache.json"), spec.anchors_key,
             ": anchors select pairs of an ODE-trajectory cache, but training.data.data_path '", first,
             "' is not one (no cache.json)");

  // An ODE-trajectory cache.
  if (fs::is_directory(first) && fs::exists(fs::path(first) / "cache.json")) {
    single("an ODE-trajectory cache");
    OdeDatasetOptions o;
    o.anchor_teacher_steps = spec.ode_anchor_indices;
    o.anchors_key = spec.anchors_key;
    o.text_len = spec.text_len;
    o.text_dim = spec.text_dim;
    o.cfg_rate = spec.cfg_rate;
    o.seed = spec.seed;
    return OdeDataset::open(first, o);
  }

  DatasetOptions dopt;
  dopt.kind = is_text_only ? DataKind::TextOnly : DataKind::T2V;
  dopt.text_len = spec.text_len;
  dopt.text_dim = spec.text_dim;
  dopt.num_latent_t = spec.num_latent_t;
  dopt.cfg_rate = spec.cfg_rate;
  dopt.seed = spec.seed;

  // Synthetic rows generated in memory.
  const int64_t rows = synthetic_rows(first);
  if (rows > 0) {
    single("a synthetic source");
    SynthOptions so;
    so.kind = dopt.kind;
    so.text_dim = spec.text_dim;
    so.seed = spec.seed;
    if (dopt.kind == DataKind::T2V) {
      VQAD_CHECK(spec.num_latent_t > 0 && spec.num_height > 0 && spec.num_width > 0 && spec.num_height % 8 == 0 &&
                     spec.num_width % 8 == 0,
                 "training.data.data_path '", first,
                 "': synthetic t2v rows need training.data.num_latent_t > 0 and num_height / num_width "
                 "(pixels, multiples of 8), found ",
                 spec.num_latent_t, ", ", spec.num_height, ", ", spec.num_width);
      so.latent_t = spec.num_latent_t;
      so.latent_h = spec.num_height / 8;
      so.latent_w = spec.num_width / 8;
    }
    return std::make_shared<SyntheticDataset>(rows, so, dopt);
  }

  for (const auto& [path, repeat] : spec.sources) {
    VQAD_CHECK(synthetic_rows(path) < 0, "training.data.data_path: a synthetic source cannot be combined with others");
    VQAD_CHECK(!(fs::is_directory(path) && fs::exists(fs::path(path) / "cache.json")),
               "training.data.data_path: the ODE-trajectory cache '", path, "' cannot be combined with other sources");
  }
  return ParquetDataset::open_sources(spec.sources, dopt);
}

}  // namespace vqad::data
