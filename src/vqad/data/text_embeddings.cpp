#include "vqad/data/text_embeddings.h"

#include <algorithm>
#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/io/tensors.h"

namespace fs = std::filesystem;

namespace vqad::data {

torch::Tensor fit_text_embedding(const torch::Tensor& t, int64_t text_len, int64_t text_dim, const std::string& where) {
  VQAD_CHECK(t.dim() == 2 || (t.dim() == 3 && t.size(0) == 1), where,
             ": expected a text embedding [L, D] or [1, L, D], found ", t.sizes());
  auto e = (t.dim() == 3 ? t[0] : t).to(torch::kFloat32);
  VQAD_CHECK(e.size(1) == text_dim, where, ": embedding width ", e.size(1), " does not match the model's text_dim ",
             text_dim);
  auto out = torch::zeros({text_len, text_dim});
  const int64_t n = std::min(text_len, e.size(0));
  out.narrow(0, 0, n).copy_(e.narrow(0, 0, n));
  return out;
}

torch::Tensor read_text_embedding_file(const std::string& path, int64_t text_len, int64_t text_dim,
                                       const std::string& where) {
  VQAD_CHECK(fs::is_regular_file(path), where, ": embedding file '", path, "' not found");
  auto tensors = io::load_safetensors(path);
  VQAD_CHECK(tensors.size() == 1, where, ": '", path, "' must hold exactly one tensor, found ", tensors.size());
  return fit_text_embedding(tensors.begin()->second, text_len, text_dim, where);
}

TextEmbeddings read_text_embedding_rows(const std::string& path, int64_t text_len, int64_t text_dim,
                                        const std::string& where) {
  DatasetOptions o;
  o.kind = DataKind::TextOnly;  // the text columns are common to both schemas
  o.text_len = text_len;
  o.text_dim = text_dim;
  std::shared_ptr<ParquetDataset> ds;
  try {
    ds = ParquetDataset::open(path, o);
  } catch (const Error& e) {
    fail(where, ": not a readable parquet dataset: ", e.what());
  }
  VQAD_CHECK(ds->size() > 0, where, ": the dataset has no rows");
  TextEmbeddings out;
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < ds->size(); ++i) {
    auto s = ds->get(i);
    rows.push_back(s.text.to(torch::kFloat32));
    out.captions.push_back(s.caption);
  }
  out.text = torch::stack(rows);
  return out;
}

}  // namespace vqad::data
