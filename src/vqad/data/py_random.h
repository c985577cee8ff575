// Python-compatible MT19937 (random.Random(int)) for the CFG-dropout decision.
// FastVideo drops a row's text iff random.Random(seed ^ row).random() < rate, so
// matching its draws exactly keeps dropout identical across the two stacks and
// makes the decision a pure function of (seed, row): restart- and resume-safe.
#pragma once
#include <array>
#include <cstdint>

namespace vqad::data {

class PyRandom {
 public:
  // Seeds like CPython's random.Random(n): init_by_array over the 32-bit words of |n|.
  explicit PyRandom(int64_t seed);
  uint32_t next_u32();
  // random.random(): 53-bit double in [0, 1).
  double random();

 private:
  void init_genrand(uint32_t s);
  std::array<uint32_t, 624> mt_{};
  int mti_ = 625;
};

// The FastVideo CFG-dropout rule for one row.
bool cfg_drop(int64_t seed, int64_t global_row, double cfg_rate);

}  // namespace vqad::data
