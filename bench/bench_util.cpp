#include "bench/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string_view>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"

#ifdef VQAD_WITH_CUDA
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#endif

namespace vqad::bench {

double median(std::vector<double> v) {
  VQAD_CHECK(!v.empty(), "bench::median: no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Timing summarize(std::vector<double> samples_ms) {
  Timing t;
  t.median_ms = median(samples_ms);
  t.min_ms = *std::min_element(samples_ms.begin(), samples_ms.end());
  t.max_ms = *std::max_element(samples_ms.begin(), samples_ms.end());
  t.iters = static_cast<int>(samples_ms.size());
  t.samples_ms = std::move(samples_ms);
  return t;
}

#ifdef VQAD_WITH_CUDA
Timing time_cuda(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, int warmup,
                 int iters, TimingSync sync) {
  VQAD_CHECK(iters >= 1 && warmup >= 0, "bench::time_cuda: iters ", iters, " warmup ", warmup);
  for (int i = 0; i < warmup; ++i) fn(stream);
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) VQAD_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    VQAD_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    fn(stream);
    VQAD_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
    if (sync == TimingSync::kEachCall) VQAD_CUDA_CHECK(cudaEventSynchronize(ev[2 * i + 1]));
  }
  VQAD_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> ms(iters);
  for (int i = 0; i < iters; ++i) {
    float m = 0;
    VQAD_CUDA_CHECK(cudaEventElapsedTime(&m, ev[2 * i], ev[2 * i + 1]));
    ms[i] = m;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return summarize(std::move(ms));
}

nlohmann::json device_json() {
  const kernels::DeviceInfo d = kernels::device_info();
  return {{"name", d.name}, {"index", d.index}, {"arch", "sm_" + std::to_string(d.arch())},
          {"sms", d.num_sms}};
}
#endif

double gbps(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0; }

void Table::add(std::vector<std::string> row) {
  VQAD_CHECK(row.size() == header_.size(), "bench::Table: row of ", row.size(), " cells, header has ",
             header_.size());
  rows_.push_back(std::move(row));
}

std::string Table::str() const {
  std::vector<size_t> w(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) {
    w[c] = header_[c].size();
    for (const auto& r : rows_) w[c] = std::max(w[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    std::string s;
    for (size_t c = 0; c < r.size(); ++c) {
      s += (c ? "  " : "") + r[c] + std::string(w[c] - r[c].size(), ' ');
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s + "\n";
  };
  std::string out = line(header_);
  size_t total = 0;
  for (size_t c = 0; c < w.size(); ++c) total += w[c] + (c ? 2 : 0);
  out += std::string(total, '-') + "\n";
  for (const auto& r : rows_) out += line(r);
  return out;
}

std::string fmt(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

std::string write_json(const std::string& dir, const std::string& file, const nlohmann::json& j) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  VQAD_CHECK(!ec, "bench: cannot create output directory ", dir, ": ", ec.message());
  const std::string path = (std::filesystem::path(dir) / file).string();
  const std::string text = j.dump(2) + "\n";
  st::write_file_atomic(path, {std::string_view(text)});
  return path;
}

}  // namespace vqad::bench
