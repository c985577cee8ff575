#include "vqad/data/py_random.h"

#include <algorithm>
#include <vector>

namespace vqad::data {
namespace {
constexpr int kN = 624;
constexpr int kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfU;
constexpr uint32_t kUpper = 0x80000000U;
constexpr uint32_t kLower = 0x7fffffffU;
}  // namespace

void PyRandom::init_genrand(uint32_t s) {
  mt_[0] = s;
  for (int i = 1; i < kN; ++i) mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + uint32_t(i);
  mti_ = kN;
}

PyRandom::PyRandom(int64_t seed) {
  // CPython takes |n| and splits it into little-endian 32-bit words (one word for 0).
  uint64_t n = seed < 0 ? uint64_t(0) - uint64_t(seed) : uint64_t(seed);
  std::vector<uint32_t> key;
  key.push_back(uint32_t(n & 0xffffffffU));
  if (n >> 32) key.push_back(uint32_t(n >> 32));
  init_genrand(19650218U);
  int i = 1;
  size_t j = 0;
  for (int k = std::max<int>(kN, int(key.size())); k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + uint32_t(j);
    ++i;
    ++j;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
    if (j >= key.size()) j = 0;
  }
  for (int k = kN - 1; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - uint32_t(i);
    ++i;
    if (i >= kN) {
      mt_[0] = mt_[kN - 1];
      i = 1;
    }
  }
  mt_[0] = 0x80000000U;
  mti_ = kN;
}

uint32_t PyRandom::next_u32() {
  if (mti_ >= kN) {
    int kk = 0;
    for (; kk < kN - kM; ++kk) {
      uint32_t y = (mt_[kk] & kUpper) | (mt_[kk + 1] & kLower);
      mt_[kk] = mt_[kk + kM] ^ (y >> 1) ^ ((y & 1U) ? kMatrixA : 0U);
    }
    for (; kk < kN - 1; ++kk) {
      uint32_t y = (mt_[kk] & kUpper) | (mt_[kk + 1] & kLower);
      mt_[kk] = mt_[kk + (kM - kN)] ^ (y >> 1) ^ ((y & 1U) ? kMatrixA : 0U);
    }
    uint32_t y = (mt_[kN - 1] & kUpper) | (mt_[0] & kLower);
    mt_[kN - 1] = mt_[kM - 1] ^ (y >> 1) ^ ((y & 1U) ? kMatrixA : 0U);
    mti_ = 0;
  }
  uint32_t y = mt_[mti_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= (y >> 18);
  return y;
}

double PyRandom::random() {
  uint32_t a = next_u32() >> 5, b = next_u32() >> 6;
  return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
}

bool cfg_drop(int64_t seed, int64_t global_row, double cfg_rate) {
  if (cfg_rate <= 0.0) return false;
  return PyRandom(seed ^ global_row).random() < cfg_rate;
}

}  // namespace vqad::data
