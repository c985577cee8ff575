// Splitting a row's keys keeps the ATTN_QAT_TRAIN forward's numerics when the later part
// starts from the running max the unsplit row has there (attn_qat_ref::forward_part /
// forward_prefix_max / forward_combine): every P tile is then quantized against the same
// maximum, so m is forward()'s bit for bit and o, o_hp, l differ only by the fp32 rounding
// of the rescale. Started from -inf instead, the quantized path changes. This is the
// reference a key-split CUDA forward is held to.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/numerics/attention_qat_ref.h"

namespace {

namespace ref = vqad::attn_qat_ref;

struct Case {
  int64_t B, H, Lq, Lkv, D;
  int block_n;
};

struct Inputs {
  ref::Dims dims;
  ref::Options opts;
  std::vector<float> q, k, v;
  ref::ConstView qv() const { return ref::contiguous_view(q.data(), dims.len_q, dims.heads, dims.head_dim); }
  ref::ConstView kv() const { return ref::contiguous_view(k.data(), dims.len_kv, dims.heads, dims.head_dim); }
  ref::ConstView vv() const { return ref::contiguous_view(v.data(), dims.len_kv, dims.heads, dims.head_dim); }
};

Inputs make_inputs(const Case& c, uint32_t seed) {
  Inputs in;
  in.dims = {c.B, c.Lq, c.Lkv, c.H, c.D};
  in.opts.block_n = c.block_n;
  in.opts.num_threads = 2;
  std::mt19937 rng(seed);
  // A drift along the keys, so that the running max keeps moving over the tiles (splits
  // then cut rows whose maximum changes after the cut).
  std::normal_distribution<float> nd(0.0f, 1.5f);
  in.q.resize(static_cast<size_t>(c.B * c.Lq * c.H * c.D));
  in.k.resize(static_cast<size_t>(c.B * c.Lkv * c.H * c.D));
  in.v.resize(in.k.size());
  for (auto& x : in.q) x = nd(rng);
  for (size_t i = 0; i < in.k.size(); ++i) {
    const int64_t key = static_cast<int64_t>(i) / (c.H * c.D) % c.Lkv;
    in.k[i] = nd(rng) * (0.6f + 0.8f * static_cast<float>(key) / static_cast<float>(c.Lkv));
    in.v[i] = nd(rng);
  }
  return in;
}

struct Out {
  std::vector<float> o, o_hp, m, l;
};

Out run_forward(const Inputs& in) {
  const auto& d = in.dims;
  Out r;
  r.o.resize(in.q.size());
  r.o_hp.resize(in.q.size());
  r.m.resize(static_cast<size_t>(d.batch * d.heads * d.len_q));
  r.l.resize(r.m.size());
  ref::forward(d, in.qv(), in.kv(), in.vv(), in.opts, ref::contiguous_view(r.o.data(), d.len_q, d.heads, d.head_dim),
               ref::contiguous_view(r.o_hp.data(), d.len_q, d.heads, d.head_dim), r.m.data(), r.l.data());
  return r;
}

// Parts at the given cuts; each later part starts from the prefix max (or -inf).
Out run_split(const Inputs& in, const std::vector<int64_t>& cuts, bool prefix_max) {
  const auto& d = in.dims;
  std::vector<int64_t> edges{0};
  edges.insert(edges.end(), cuts.begin(), cuts.end());
  edges.push_back(d.len_kv);
  std::vector<ref::ForwardPart> parts;
  const size_t rows = static_cast<size_t>(d.batch * d.heads * d.len_q);
  for (size_t p = 0; p + 1 < edges.size(); ++p) {
    const std::vector<float> m0 = prefix_max ? ref::forward_prefix_max(d, in.qv(), in.kv(), in.opts, edges[p])
                                             : std::vector<float>(rows, -std::numeric_limits<float>::infinity());
    parts.push_back(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, edges[p], edges[p + 1], m0));
  }
  Out r;
  r.o.resize(in.q.size());
  r.o_hp.resize(in.q.size());
  r.m.resize(rows);
  r.l.resize(rows);
  ref::forward_combine(d, parts, ref::contiguous_view(r.o.data(), d.len_q, d.heads, d.head_dim),
                       ref::contiguous_view(r.o_hp.data(), d.len_q, d.heads, d.head_dim), r.m.data(), r.l.data());
  return r;
}

// max |a - b| / max |b|
double rel_max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den > 0.0 ? num / den : num;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// fp32 rounding of the rescale only: a few ulp of the largest value (measured: at most 3e-7);
// a different quantization maximum shows up at 1e-3 and above (9e-3 in the test below).
constexpr double kTol = 1e-5;

const Case kCases[] = {
    {1, 2, 40, 333, 64, 64},    // ragged last tile
    {2, 1, 17, 512, 128, 128},  // whole tiles, head dim 128
    {1, 1, 24, 208, 32, 16},    // the smallest BLOCK_N
};

TEST(AttnQatRefSplit, TwoPartsAtEveryTileBoundaryKeepTheNumerics) {
  uint32_t seed = 11;
  for (const Case& c : kCases) {
    const Inputs in = make_inputs(c, seed++);
    const Out full = run_forward(in);
    for (int64_t cut = c.block_n; cut < c.Lkv; cut += c.block_n) {
      const Out split = run_split(in, {cut}, true);
      EXPECT_TRUE(same_bits(split.m, full.m)) << "Lkv " << c.Lkv << " BLOCK_N " << c.block_n << " cut " << cut;
      EXPECT_LE(rel_max_abs(split.o, full.o), kTol) << "cut " << cut;
      EXPECT_LE(rel_max_abs(split.o_hp, full.o_hp), kTol) << "cut " << cut;
      EXPECT_LE(rel_max_abs(split.l, full.l), kTol) << "cut " << cut;
    }
  }
}

TEST(AttnQatRefSplit, ThreePartsKeepTheNumerics) {
  const Case c = kCases[0];
  const Inputs in = make_inputs(c, 29);
  const Out full = run_forward(in);
  const Out split = run_split(in, {64, 192}, true);
  EXPECT_TRUE(same_bits(split.m, full.m));
  EXPECT_LE(rel_max_abs(split.o, full.o), kTol);
  EXPECT_LE(rel_max_abs(split.o_hp, full.o_hp), kTol);
  EXPECT_LE(rel_max_abs(split.l, full.l), kTol);
}

// The prefix max is what makes the split exact: a later part that starts from -inf
// quantizes its first tiles against a smaller maximum.
TEST(AttnQatRefSplit, WithoutThePrefixMaxTheQuantizedPathChanges) {
  const Case c = kCases[1];
  const Inputs in = make_inputs(c, 5);
  const Out full = run_forward(in);
  const Out split = run_split(in, {256}, false);
  EXPECT_TRUE(same_bits(split.m, full.m));  // the final max is the same either way
  EXPECT_GT(rel_max_abs(split.o, full.o), 100 * kTol);
}

TEST(AttnQatRefSplit, RejectsBadRangesAndParts) {
  const Case c = kCases[0];
  const Inputs in = make_inputs(c, 3);
  const auto& d = in.dims;
  const std::vector<float> m0(static_cast<size_t>(d.batch * d.heads * d.len_q), 0.0f);
  EXPECT_THROW(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 32, 128, m0), vqad::Error);   // not a tile start
  EXPECT_THROW(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 0, 100, m0), vqad::Error);    // not a tile end
  EXPECT_THROW(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 64, 64, m0), vqad::Error);    // empty
  EXPECT_THROW(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 0, 400, m0), vqad::Error);    // past len_kv
  EXPECT_THROW(ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 0, 64, std::vector<float>(3)), vqad::Error);
  EXPECT_THROW(ref::forward_prefix_max(d, in.qv(), in.kv(), in.opts, 65), vqad::Error);
  const ref::ForwardPart a = ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 0, 128, m0);
  const ref::ForwardPart b = ref::forward_part(d, in.qv(), in.kv(), in.vv(), in.opts, 192, d.len_kv, m0);
  std::vector<float> o(in.q.size());
  const ref::View ov = ref::contiguous_view(o.data(), d.len_q, d.heads, d.head_dim);
  EXPECT_THROW(ref::forward_combine(d, {a, b}, ov, {}, nullptr, nullptr), vqad::Error);  // gap [128, 192)
  EXPECT_THROW(ref::forward_combine(d, {a}, ov, {}, nullptr, nullptr), vqad::Error);     // ends early
  EXPECT_THROW(ref::forward_combine(d, {}, ov, {}, nullptr, nullptr), vqad::Error);
}

}  // namespace
