#include "vqad/train/finite_guard.h"

#include "vqad/data/parquet_dataset.h"

namespace vqad::train {

std::vector<std::string> nonfinite_tensors(const NamedTensors& tensors, size_t limit, size_t* count) {
  std::vector<torch::Tensor> flags;
  std::vector<size_t> which;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i].second;
      if (!t.defined() || t.numel() == 0 || !t.is_floating_point()) continue;
      flags.push_back(torch::isfinite(t.detach()).all());
      which.push_back(i);
    }
  }
  std::vector<std::string> bad;
  if (count) *count = 0;
  if (flags.empty()) return bad;
  auto all = torch::stack(flags).to(torch::kCPU);  // the one sync
  const bool* ok = all.data_ptr<bool>();
  for (size_t k = 0; k < which.size(); ++k) {
    if (ok[k]) continue;
    if (count) ++*count;
    if (bad.size() < limit) bad.push_back(tensors[which[k]].first);
  }
  return bad;
}

std::vector<std::string> nonfinite_batch_rows(const data::Batch& batch, const data::Dataset& dataset) {
  std::vector<std::string> rows;
  const int64_t B = static_cast<int64_t>(batch.indices.size());
  auto row_flags = [&](const torch::Tensor& t) -> torch::Tensor {
    if (!t.defined() || t.numel() == 0 || t.size(0) != B || !t.is_floating_point()) return {};
    return torch::isfinite(t.detach()).reshape({B, -1}).all(1).to(torch::kCPU);
  };
  torch::NoGradGuard ng;
  const std::vector<std::pair<const char*, torch::Tensor>> parts{{"latent", row_flags(batch.latent)},
                                                                 {"text embedding", row_flags(batch.text)},
                                                                 {"ODE start state", row_flags(batch.ode_start)},
                                                                 {"ODE target", row_flags(batch.ode_target)}};
  const auto* parquet = dynamic_cast<const data::ParquetDataset*>(&dataset);
  for (int64_t b = 0; b < B; ++b) {
    std::string what;
    for (const auto& [name, flags] : parts)
      if (flags.defined() && !flags[b].item<bool>()) what += (what.empty() ? "" : " and ") + std::string(name);
    if (what.empty()) continue;
    std::string where = "dataset index " + std::to_string(batch.indices[b]);
    if (parquet) {
      try {
        const auto loc = parquet->locate(batch.indices[b]);
        where = "file " + parquet->files().at(loc.file).path + " row " + std::to_string(loc.row_in_file);
      } catch (const std::exception&) {
      }
    }
    if (b < static_cast<int64_t>(batch.ids.size()) && !batch.ids[b].empty()) where += " (id " + batch.ids[b] + ")";
    rows.push_back(where + ": " + what);
  }
  return rows;
}

std::string last_good_checkpoint_text(const std::string& last_good, const std::string& output_dir) {
  if (last_good.empty())
    return "no checkpoint of this run has been written (nothing was saved under " + output_dir + ")";
  return "the last good checkpoint is " + last_good;
}

}  // namespace vqad::train
