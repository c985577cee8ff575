// The key-split plan of the ATTN_QAT_TRAIN forward's last wave (plain C++, no CUDA: the
// CPU tests check it). The grid has `tiles` query tiles over `kv_tiles` KV tiles; `sms`
// CTAs run at once, so the last wave runs tiles % sms of them while the other SMs idle.
// A split tile runs as two CTAs: the earlier KV tiles [0, key_tile) and the later ones
// [key_tile, kv_tiles), the later part first taking the running max over the earlier
// tiles by Q^ K^T alone. With a tile costing 1, a part over a fraction x of the KV tiles
// costs x, the later part also kAttnQatFwdMaxOnlyCost per earlier tile. The CTAs of the
// later parts come first in the grid, then those of the earlier parts, so with at most
// one later part per SM an SM runs one later part or up to two earlier parts:
//   2 * tail <= sms:   every part has its SM; x = 1 / (2 - q), makespan 1 - (1 - q) x
//   otherwise, when 2 * tail - sms <= sms - tail: x = 1 / (3 - q), makespan max(2 x, ...)
//   else no split (three earlier parts on an SM would cost more than the unsplit tile).
// A split is planned only when it lowers the last wave's makespan below 1.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace vqad::kernels::attention {

// Cost of a Q^ K^T + row-max KV tile against a full one: one of the three products, none
// of the exp2 / quantization work. Measured 0.256 on an H200 (the forward playground's
// `time` prints it as the max_only row; docs/performance.md, "Key split of the forward's
// last wave").
inline constexpr double kAttnQatFwdMaxOnlyCost = 0.25;

struct AttnQatFwdSplit {
  int tiles = 0;           // the last `tiles` query tiles of the grid are split (0: none)
  int key_tile = 0;        // the later part's first KV tile
  double makespan = 1.0;   // of the last wave, in tile times (1: unsplit)
};

// Makespan of the last wave when `tail` tiles split at KV tile k of kv run on `sms` SMs.
inline double attn_qat_fwd_split_makespan(int64_t tail, int64_t sms, int64_t k, int64_t kv,
                                          double q = kAttnQatFwdMaxOnlyCost) {
  const double x = static_cast<double>(k) / static_cast<double>(kv);
  const double later = 1.0 - x + q * x, earlier = x;
  if (2 * tail <= sms) return std::max(later, earlier);
  if (2 * tail - sms <= sms - tail) return std::max(later, 2.0 * earlier);
  return 3.0 * earlier > later ? std::max(later, 3.0 * earlier) : later;  // not planned
}

inline AttnQatFwdSplit attn_qat_fwd_split_plan(int64_t tiles, int64_t kv_tiles, int sms,
                                               double q = kAttnQatFwdMaxOnlyCost) {
  AttnQatFwdSplit plan;
  if (tiles <= 0 || kv_tiles < 2 || sms <= 0) return plan;
  const int64_t tail = tiles % sms;
  if (tail == 0 || 2 * tail - sms > sms - tail) return plan;
  const double x = 2 * tail <= sms ? 1.0 / (2.0 - q) : 1.0 / (3.0 - q);
  // The nearest whole KV tile, and its neighbours (a short key range rounds coarsely).
  const int64_t k0 = std::clamp<int64_t>(std::llround(x * static_cast<double>(kv_tiles)), 1, kv_tiles - 1);
  int64_t best_k = 0;
  double best = 1.0;
  for (int64_t k = std::max<int64_t>(1, k0 - 1); k <= std::min(kv_tiles - 1, k0 + 1); ++k) {
    const double m = attn_qat_fwd_split_makespan(tail, sms, k, kv_tiles, q);
    if (m < best - 1e-12) best = m, best_k = k;
  }
  if (best_k == 0) return plan;
  plan.tiles = static_cast<int>(tail);
  plan.key_tile = static_cast<int>(best_k);
  plan.makespan = best;
  return plan;
}

}  // namespace vqad::kernels::attention
