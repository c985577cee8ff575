#include "bench/bench_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "vqad/core/error.h"

namespace vqad::bench {

namespace {
bool has(const std::string& s, const char* sub) { return s.find(sub) != std::string::npos; }

std::vector<ProfileRow> sorted_rows(const std::map<std::string, ProfileRow>& m) {
  std::vector<ProfileRow> v;
  for (const auto& [k, r] : m) v.push_back(r);
  std::sort(v.begin(), v.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.total_ms > b.total_ms; });
  return v;
}
}  // namespace

std::string kernel_category(const std::string& n) {
  if (has(n, "attn_qat") || has(n, "flash") || has(n, "fmha") || has(n, "cudnn") || has(n, "attention"))
    return "attention";
  if (has(n, "nvfp4") || has(n, "fake_quant") || has(n, "amax") || has(n, "quantize") || has(n, "linear_scales"))
    return "nvfp4";
  if (has(n, "gemm") || has(n, "xmma") || has(n, "cutlass") || has(n, "nvjet") || has(n, "cublas") ||
      has(n, "Gemm"))
    return "gemm";
  if (has(n, "Memcpy") || has(n, "Memset") || has(n, "memcpy") || has(n, "copy_kernel")) return "copy";
  if (has(n, "norm") || has(n, "Norm")) return "norm";
  if (has(n, "reduce") || has(n, "Reduce")) return "reduction";
  if (has(n, "elementwise") || has(n, "vectorized") || has(n, "unrolled") || has(n, "Elementwise"))
    return "elementwise";
  return "other";
}

ProfileSummary profile_once(const std::function<void()>& fn, bool cuda, const std::string& trace_path) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  std::unique_ptr<prof::ProfilerResult> result;
  try {
    fn();
    // Kernels still running when the profiler stops are not recorded: wait for them.
    if (cuda) torch::cuda::synchronize();
    result = prof::disableProfiler();
  } catch (...) {
    prof::disableProfiler();
    throw;
  }
  VQAD_CHECK(result != nullptr, "profiler: no result");
  if (!trace_path.empty()) result->save(trace_path);

  std::map<std::string, ProfileRow> device, cpu, cats;
  ProfileSummary s;
  for (const auto& e : result->events()) {
    const double ms = static_cast<double>(e.durationNs()) * 1e-6;
    const std::string name = e.name();
    if (e.deviceType() == c10::DeviceType::CUDA) {
      auto& r = device[name];
      r.name = name;
      r.category = kernel_category(name);
      r.calls += 1;
      r.total_ms += ms;
      auto& c = cats[r.category];
      c.name = c.category = r.category;
      c.calls += 1;
      c.total_ms += ms;
      s.device_total_ms += ms;
    } else {
      auto& r = cpu[name];
      r.name = name;
      r.category = "cpu";
      r.calls += 1;
      r.total_ms += ms;
    }
  }
  s.device = sorted_rows(device);
  s.cpu_ops = sorted_rows(cpu);
  s.categories = sorted_rows(cats);
  return s;
}

std::string profile_table(const ProfileSummary& s, int top) {
  std::string out;
  char buf[512];
  const bool dev = !s.device.empty();
  if (dev) {
    std::snprintf(buf, sizeof(buf), "GPU time %.3f ms by category:\n", s.device_total_ms);
    out += buf;
    for (const auto& c : s.categories) {
      std::snprintf(buf, sizeof(buf), "  %-12s %10.3f ms %6.1f%% %7lld launches\n", c.name.c_str(), c.total_ms,
                    100.0 * c.total_ms / std::max(1e-9, s.device_total_ms), static_cast<long long>(c.calls));
      out += buf;
    }
  }
  const auto& rows = dev ? s.device : s.cpu_ops;
  out += dev ? "longest GPU kernels:\n" : "longest CPU ops (inclusive):\n";
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i) {
    std::string name = rows[i].name.size() > 100 ? rows[i].name.substr(0, 97) + "..." : rows[i].name;
    std::snprintf(buf, sizeof(buf), "  %10.3f ms %7lld x  %-11s %s\n", rows[i].total_ms,
                  static_cast<long long>(rows[i].calls), rows[i].category.c_str(), name.c_str());
    out += buf;
  }
  return out;
}

}  // namespace vqad::bench
