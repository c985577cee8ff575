// Host-side measures the numeric tests share (plain C++: no torch, no CUDA, no gtest):
// BF16 conversions, the relative L2 error against a reference, the BF16 noise floor of a
// reference and tolerances stated as multiples of it, and the seeds of random cases,
// printed so that a failing run names the one to replay.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace vqad::test {

// float -> bf16 bits, round to nearest even (Inf stays Inf, a NaN becomes the quiet NaN
// 0x7FC0), and back.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_round(float x) { return std::isnan(x) ? x : bf16_value(bf16_bits(x)); }
inline std::vector<uint16_t> bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_bits(x[i]);
  return b;
}
inline std::vector<float> bf16_values(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_value(b[i]);
  return x;
}

// ||got - want|| / ||want|| in float64 (||got - want|| when want is zero); infinity when
// the sizes differ, so that every tolerance check fails.
inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// rel_l2(bf16(want), want): the error one BF16 rounding of an (unrounded, fp32) reference
// makes. A result computed in BF16 cannot be closer than this.
inline double bf16_noise_floor(const std::vector<float>& want) {
  double num = 0, den = 0;
  for (float w : want) {
    const double r = double(bf16_round(w)) - double(w);
    num += r * r;
    den += double(w) * double(w);
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

// A BF16 result of a kernel against its fp32 CPU reference.
struct Closeness {
  double rel = 0;                // rel_l2(got, want) over the finite elements of got
  double floor = 0;              // bf16_noise_floor(want)
  double max_abs = 0;            // largest |got - want|
  int64_t worst = -1;            // its flat index
  int64_t first_nonfinite = -1;  // first flat index where got is not finite (unwritten or NaN)
};
inline Closeness closeness(const std::vector<float>& got, const std::vector<float>& want) {
  Closeness c;
  if (got.size() != want.size()) {
    c.rel = INFINITY;
    return c;
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (c.first_nonfinite < 0) c.first_nonfinite = static_cast<int64_t>(i);
      continue;
    }
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
    if (std::fabs(d) > c.max_abs) c.max_abs = std::fabs(d), c.worst = static_cast<int64_t>(i);
  }
  c.rel = std::sqrt(num / std::max(den, 1e-30));
  c.floor = bf16_noise_floor(want);
  return c;
}

// The tolerance of the kernel tests, a multiple of the reference's BF16 noise floor: the
// kernels accumulate in another order (tensor-core fp32 vs. the reference's dot
// products), use the hardware exp2, round P to bf16 per element, and with NVFP4 P an
// element next to a rounding boundary can move by one E2M1 step; on random inputs that
// stays within a small multiple of the floor (the attention kernels measure 1.2 - 2.5x).
// kMinFloor keeps the tolerance meaningful for an output that is exactly representable.
inline constexpr double kBf16FloorMultiple = 8.0;
inline constexpr double kMinFloor = 1e-4;
inline double floor_tolerance(const Closeness& c, double multiple = kBf16FloorMultiple) {
  return multiple * std::max(c.floor, kMinFloor);
}

// The seed of a random case: VQAD_TEST_SEED from the environment when it is set (to
// replay a printed one), else a fresh one. Printed as "seed <n> (<what>)", so the output
// of every run names it.
inline uint64_t test_seed(const std::string& what) {
  uint64_t seed = 0;
  const char* env = std::getenv("VQAD_TEST_SEED");
  if (env != nullptr && *env != '\0') {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  std::printf("seed %llu (%s)\n", static_cast<unsigned long long>(seed), what.c_str());
  std::fflush(stdout);
  return seed;
}

}  // namespace vqad::test
