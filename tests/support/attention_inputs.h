// Random attention inputs of the dense attention kernel tests (plain C++): BF16-valued
// Q, K, V as contiguous [B, L, H, D] float vectors, either normal or "peaky".
//
// Peaky: every query row has a few logits far above the others. Each query gets a shared
// direction u (entries +-1, per head) on top of N(0, sigma^2) noise, and the keys
// [spike_key, spike_key + spikes) are alpha * u, with alpha chosen so that their logits
// (log2 domain, c = log2(e) / sqrt(D)) sit about `margin` above the largest of the other
// keys. With the spikes inside a middle KV tile, P of the tiles before them is quantized
// against a row max about `margin` lower than the final one, and most 16-key groups of
// the tiles after them are zero blocks. A kernel that quantizes P against another max
// (the final one, a tile-local one, the one before the tile) loses or keeps a few
// percent of the probability mass, far more than a noise-floor tolerance.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tests/support/metrics.h"

namespace vqad::test {

struct AttentionInputs {
  int64_t B = 0, H = 0, Lq = 0, Lkv = 0, D = 0;
  std::vector<float> q, k, v;  // bf16-valued, contiguous [B, L, H, D]
};

inline std::vector<float> normal_bf16(size_t n, float sd, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = bf16_round(nd(rng));
  return x;
}

// N(0, scale^2) entries.
inline AttentionInputs normal_attention_inputs(int64_t B, int64_t H, int64_t Lq, int64_t Lkv, int64_t D, float scale,
                                               uint64_t seed) {
  std::mt19937_64 rng(seed);
  AttentionInputs in{B, H, Lq, Lkv, D, {}, {}, {}};
  in.q = normal_bf16(static_cast<size_t>(B * Lq * H * D), scale, rng);
  in.k = normal_bf16(static_cast<size_t>(B * Lkv * H * D), scale, rng);
  in.v = normal_bf16(static_cast<size_t>(B * Lkv * H * D), scale, rng);
  return in;
}

struct PeakySpec {
  int64_t spike_key = 0;  // first spike key (the same for every row)
  int spikes = 3;         // spike keys per row
  float margin = 9.0f;    // their logits above the others' largest, log2 domain
  float sigma = 0.5f;     // noise of q and of the other keys
};

inline AttentionInputs peaky_attention_inputs(int64_t B, int64_t H, int64_t Lq, int64_t Lkv, int64_t D,
                                              const PeakySpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  AttentionInputs in{B, H, Lq, Lkv, D, {}, {}, {}};
  std::vector<float> u(static_cast<size_t>(H * D));
  std::bernoulli_distribution coin(0.5);
  for (float& e : u) e = coin(rng) ? 1.0f : -1.0f;
  in.q = normal_bf16(static_cast<size_t>(B * Lq * H * D), spec.sigma, rng);
  in.k = normal_bf16(static_cast<size_t>(B * Lkv * H * D), spec.sigma, rng);
  in.v = normal_bf16(static_cast<size_t>(B * Lkv * H * D), 1.0f, rng);
  // Logits of the other keys: c (u + n_i) . k_j ~ N(0, (log2 e)^2 (1 + sigma^2) sigma^2);
  // their largest over Lkv keys is about 3.3 standard deviations.
  const double kLog2e = 1.4426950408889634;
  const double others = 3.3 * kLog2e * std::sqrt(1.0 + spec.sigma * spec.sigma) * spec.sigma;
  // A spike's logit: c alpha (u . u + u . n_i) = log2(e) alpha (sqrt(D) + N(0, sigma^2)).
  const float alpha = static_cast<float>((others + spec.margin) / (kLog2e * std::sqrt(static_cast<double>(D))));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < Lq; ++l)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          float& e = in.q[static_cast<size_t>(((b * Lq + l) * H + h) * D + d)];
          e = bf16_round(e + u[static_cast<size_t>(h * D + d)]);
        }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = spec.spike_key; j < spec.spike_key + spec.spikes && j < Lkv; ++j)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d)
          in.k[static_cast<size_t>(((b * Lkv + j) * H + h) * D + d)] = bf16_round(alpha * u[static_cast<size_t>(h * D + d)]);
  return in;
}

}  // namespace vqad::test
