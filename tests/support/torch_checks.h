// Shared checks of the torch-level tests (tests/cpu, tests/gpu): relative L2 error against
// a reference, the BF16 noise floor of a reference (the error of one bf16 rounding of it,
// which tolerances are stated as multiples of), finiteness, NaN-poisoning of the CUDA
// caching allocator (so a kernel that leaves output elements unwritten shows NaN instead of
// stale zeros), and the seed of each random case in the failure message. The host-vector
// forms (rel_l2 of std::vector<float>, the floor, the tolerance multiple) are metrics.h's.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/support/metrics.h"

namespace vqad::test {

// ||got - want|| / ||want|| in float64 on the CPU (||got - want|| when want is zero);
// a shape mismatch is a test failure.
inline double rel_l2(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor g = got.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor w = want.detach().to(torch::kCPU, torch::kFloat64);
  EXPECT_EQ(g.sizes(), w.sizes());
  if (g.sizes() != w.sizes()) return INFINITY;
  const double den = w.norm().item<double>(), num = (g - w).norm().item<double>();
  return den > 0 ? num / den : num;
}

// rel_l2(bf16(want), want): the error one BF16 rounding of the reference makes. A result
// computed in BF16 cannot be closer than this; tolerances are small multiples of it.
inline double bf16_noise_floor(const torch::Tensor& want) {
  const torch::Tensor w = want.detach().to(torch::kCPU, torch::kFloat32);
  return rel_l2(w.to(torch::kBFloat16).to(torch::kFloat32), w);
}

inline bool all_finite(const torch::Tensor& t) { return torch::isfinite(t.detach()).all().item<bool>(); }

// Fills and frees blocks of the CUDA caching allocator's small and large pools with NaN, so
// that the next allocations of this process reuse NaN-filled memory.
inline void poison_cuda_allocator() {
  std::vector<torch::Tensor> hold;
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  for (int i = 0; i < 48; ++i) hold.push_back(torch::full({64 * 1024}, NAN, opts));       // 256 KiB
  for (int i = 0; i < 16; ++i) hold.push_back(torch::full({1024 * 1024}, NAN, opts));     // 4 MiB
  for (int i = 0; i < 4; ++i) hold.push_back(torch::full({8 * 1024 * 1024}, NAN, opts));  // 32 MiB
  torch::cuda::synchronize();
}

// Seeds torch's generator and names the seed in every failure inside the scope:
//   SeededCase c(seed++);   // "seed 101" appears in the failure output
class SeededCase {
 public:
  explicit SeededCase(uint64_t seed) : trace_(__FILE__, __LINE__, "seed " + std::to_string(seed)) {
    torch::manual_seed(seed);
  }

 private:
  ::testing::ScopedTrace trace_;
};

}  // namespace vqad::test
