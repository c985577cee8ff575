// One call under LibTorch's Kineto profiler: where a step's time goes, per GPU kernel and
// per CPU-side op, plus a Chrome trace (chrome://tracing, Perfetto) for the details.
// Used by `vqad bench step --profile DIR`; works on the CPU too (CPU ops only).
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace vqad::bench {

struct ProfileRow {
  std::string name;
  std::string category;  // gemm, attention, nvfp4, elementwise, reduction, norm, copy, other
  int64_t calls = 0;
  double total_ms = 0;
};

struct ProfileSummary {
  std::vector<ProfileRow> device;    // GPU kernels and copies, by total time
  std::vector<ProfileRow> cpu_ops;   // CPU-side ops (inclusive times: nested ops overlap)
  std::vector<ProfileRow> categories;  // device time per category
  double device_total_ms = 0;
};

// Runs `fn` once under the profiler (CPU ops, and CUDA activity when `cuda`, waiting for the
// device before the profiler stops); writes the
// Chrome trace to `trace_path` when not empty.
ProfileSummary profile_once(const std::function<void()>& fn, bool cuda, const std::string& trace_path);
// Kernel-name category used in the summary.
std::string kernel_category(const std::string& name);
// Categories, then the `top` longest device rows (or CPU ops when there is no device time).
std::string profile_table(const ProfileSummary& s, int top);

}  // namespace vqad::bench
