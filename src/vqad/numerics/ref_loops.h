// The loops the torch-free attention references share (attention_qat_ref.cpp, vsa_ref.cpp):
// fp32 dot products and axpys in one fixed summation order, and a thread pool whose results
// do not depend on the thread count. VSA's fine stage and ATTN_QAT_TRAIN give bitwise equal
// results on equal key sequences because both use these.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace vqad::numerics::ref {

inline constexpr float kLog2e = 1.4426950408889634f;

// Eight interleaved partial sums: a fixed fp32 summation order that the compiler can
// vectorize without reassociating (n is a multiple of 16: D of the NVFP4 blocks).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < n; d += 8)
    for (int t = 0; t < 8; ++t) acc[t] += a[d + t] * b[d + t];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// y += alpha x in fixed-width inner blocks, so -O2's cheap vectorizer needs no runtime alias
// or remainder checks (n is a multiple of 16).
inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t d = 0; d < n; d += 8)
    for (int t = 0; t < 8; ++t) y[d + t] += alpha * x[d + t];
}

// `requested` threads, or the hardware's when it is <= 0.
inline int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// fn(task) for task in [0, n) on up to `threads` threads. Each task is owned by one thread,
// so results do not depend on the thread count; the first exception is rethrown here.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::min<int64_t>(threads, n));
  if (workers <= 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    try {
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      next.store(n);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace vqad::numerics::ref
