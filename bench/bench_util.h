// Small helpers shared by the `vqad bench ...` commands: CUDA-event timing with
// warm-up and a median, a plain-text table and JSON results in an output dir.
// Speed claims are ratios measured side by side in one run, so each bench
// times its baseline (e.g. a device copy) with the same helper.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#ifdef VQAD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace vqad::bench {

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int iters = 0;
  std::vector<double> samples_ms;
};

// Median of the samples (mean of the middle two for an even count); throws if empty.
double median(std::vector<double> v);
Timing summarize(std::vector<double> samples_ms);

#ifdef VQAD_WITH_CUDA
// When the timed calls synchronize: kAtEnd queues all of them and waits once (host
// launch work hides behind the previous call's kernels); kEachCall waits for each
// call before the next is queued, so a call's host work (argument checks, tensor-map
// encoding, allocator calls) lands inside its own event pair.
enum class TimingSync { kAtEnd, kEachCall };
// Runs `fn(stream)` `warmup` times, then `iters` times with a CUDA event pair
// around each launch on `stream`. iters >= 1.
Timing time_cuda(const std::function<void(cudaStream_t)>& fn, cudaStream_t stream, int warmup,
                 int iters, TimingSync sync = TimingSync::kAtEnd);
// Name, compute capability and SM count of the current device.
nlohmann::json device_json();
#endif

// GB/s for `bytes` moved in `ms` milliseconds (1 GB = 1e9 bytes).
double gbps(double bytes, double ms);

// Fixed-width text table: header row, then rows of the same width.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row);
  std::string str() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// printf-style number formatting for table cells.
std::string fmt(double v, int decimals = 2);

// Writes `j` (pretty) to dir/file, creating dir; atomic (temp file + rename).
// Returns the path written.
std::string write_json(const std::string& dir, const std::string& file, const nlohmann::json& j);

}  // namespace vqad::bench
