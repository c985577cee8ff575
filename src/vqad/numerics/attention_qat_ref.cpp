#include "vqad/numerics/attention_qat_ref.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/numerics/ref_loops.h"

namespace vqad::attn_qat_ref {
namespace {

using numerics::ref::axpy;
using numerics::ref::dot;
using numerics::ref::kLog2e;
using numerics::ref::parallel_for;
using numerics::ref::resolve_threads;

void check_dims(const Dims& d, const Options& o, const char* what) {
  VQAD_CHECK(d.batch >= 1 && d.heads >= 1 && d.len_q >= 1 && d.len_kv >= 1, what,
             ": expected batch, heads, len_q, len_kv >= 1, found B=", d.batch, " H=", d.heads,
             " Lq=", d.len_q, " Lkv=", d.len_kv);
  VQAD_CHECK(d.head_dim >= 16 && d.head_dim % 16 == 0, what,
             ": head_dim must be a positive multiple of 16 (NVFP4 blocks along D), found ",
             d.head_dim);
  VQAD_CHECK(o.block_n >= 16 && o.block_n % 16 == 0, what,
             ": block_n must be a positive multiple of 16 (P is quantized in 16-key groups), found ",
             o.block_n);
  VQAD_CHECK(o.softmax_scale >= 0.0f && std::isfinite(o.softmax_scale), what,
             ": softmax_scale must be finite and >= 0 (0 = 1/sqrt(D)), found ", o.softmax_scale);
}

void check_view(const ConstView& v, const char* what, const char* name) {
  VQAD_CHECK(v.data != nullptr, what, ": tensor ", name, " is null");
}

float softmax_scale(const Dims& d, const Options& o) {
  return o.softmax_scale > 0.0f ? o.softmax_scale
                                : 1.0f / std::sqrt(static_cast<float>(d.head_dim));
}

// Per (b, h) contiguous [L, D] copies: bf16-rounded, fake-quantized along D
// when `quantize`. Index: ((b * H + h) * L + l) * D.
std::vector<float> prepare_operand(const Dims& d, ConstView x, int64_t len, bool quantize,
                                   int threads) {
  const int64_t D = d.head_dim;
  std::vector<float> out(static_cast<size_t>(d.batch * d.heads * len * D));
  parallel_for(d.batch * d.heads, threads, [&](int64_t bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    for (int64_t l = 0; l < len; ++l) {
      const float* src = x.row(b, l, h);
      float* dst = out.data() + (bh * len + l) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = bf16_round(src[c]);
      if (quantize) nvfp4::fake_quantize(dst, dst, static_cast<size_t>(D), 1.0f);
    }
  });
  return out;
}

constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kKeysPerTask = 64;  // multiple of 16: P groups never straddle tasks

}  // namespace

const char* bwd_mode_name(BwdMode m) {
  switch (m) {
    case BwdMode::kConsistent: return "consistent";
    case BwdMode::kFastVideo: return "fastvideo";
  }
  return "?";
}

ConstView contiguous_view(const float* data, int64_t len, int64_t heads, int64_t head_dim) {
  return {data, len * heads * head_dim, heads * head_dim, head_dim};
}
View contiguous_view(float* data, int64_t len, int64_t heads, int64_t head_dim) {
  return {data, len * heads * head_dim, heads * head_dim, head_dim};
}

float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float y;
  std::memcpy(&y, &u, sizeof(y));
  return y;
}

void fake_quantize_p_row(const float* x, float* y, int64_t n) {
  const int64_t full = n / nvfp4::kBlock * nvfp4::kBlock;
  if (full > 0) nvfp4::fake_quantize(x, y, static_cast<size_t>(full), 1.0f);
  if (n > full) nvfp4::fake_quantize_partial_block(x + full, y + full, static_cast<int>(n - full), 1.0f);
}

namespace {

// Scratch of one row of the forward: the tile's logits, P, P^ and the two accumulators.
struct RowScratch {
  std::vector<float> s, p, pq, acc, acch;
  RowScratch(int block_n, int64_t D) : s(block_n), p(block_n), pq(block_n), acc(D), acch(D) {}
};

// One query row qi over the KV tiles [j_begin, j_end) (j_begin a multiple of block_n; a
// tile ends at block_n keys or at j_end), continuing the running max m, l and the
// accumulators in w (not normalised): the recurrence of spec/attention.md.
void forward_row_tiles(const float* qi, const float* K, const float* V, int64_t D, int64_t j_begin,
                       int64_t j_end, const Options& opts, float c, float& m, float& l, RowScratch& w) {
  for (int64_t j0 = j_begin; j0 < j_end; j0 += opts.block_n) {
    const int64_t n = std::min<int64_t>(opts.block_n, j_end - j0);
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      w.s[t] = dot(qi, K + (j0 + t) * D, D) * c;
      tile_max = std::max(tile_max, w.s[t]);
    }
    const float m_new = std::max(m, tile_max);
    const float alpha = std::exp2(m - m_new);  // 0 on the first tile (m = -inf)
    for (int64_t t = 0; t < n; ++t) w.p[t] = std::exp2(w.s[t] - m_new);
    // j0 is a multiple of 16, so the row's 16-key groups are tile-local.
    if (opts.quant_p) {
      fake_quantize_p_row(w.p.data(), w.pq.data(), n);
    } else {
      for (int64_t t = 0; t < n; ++t) w.pq[t] = w.p[t];
    }
    float tile_sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) tile_sum += bf16_round(w.p[t]);
    l = l * alpha + tile_sum;
    for (int64_t d = 0; d < D; ++d) {
      w.acc[d] *= alpha;
      w.acch[d] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vj = V + (j0 + t) * D;
      axpy(bf16_round(w.pq[t]), vj, w.acc.data(), D);
      axpy(bf16_round(w.p[t]), vj, w.acch.data(), D);
    }
    m = m_new;
  }
}

void check_key_range(const Dims& dims, const Options& opts, int64_t key_begin, int64_t key_end, const char* what) {
  VQAD_CHECK(key_begin >= 0 && key_begin % opts.block_n == 0 && key_begin < key_end && key_end <= dims.len_kv &&
                 (key_end % opts.block_n == 0 || key_end == dims.len_kv),
             what, ": expected a key range [begin, end) of whole BLOCK_N = ", opts.block_n, " tiles within len_kv ",
             dims.len_kv, ", found [", key_begin, ", ", key_end, ")");
}

}  // namespace

void forward(const Dims& dims, ConstView q, ConstView k, ConstView v, const Options& opts,
             View o, View o_hp, float* m_out, float* l_out) {
  static const char* kWhat = "attention_qat_ref::forward";
  check_dims(dims, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  VQAD_CHECK(o.data != nullptr, kWhat, ": output o is null");
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, Lq = dims.len_q, Lkv = dims.len_kv, H = dims.heads;
  const float c = softmax_scale(dims, opts) * kLog2e;

  const std::vector<float> qh = prepare_operand(dims, q, Lq, opts.quant_qk, threads);
  const std::vector<float> kh = prepare_operand(dims, k, Lkv, opts.quant_qk, threads);
  const std::vector<float> vh = prepare_operand(dims, v, Lkv, opts.quant_v, threads);

  const int64_t row_tasks = (Lq + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(dims.batch * H * row_tasks, threads, [&](int64_t task) {
    const int64_t bh = task / row_tasks, i0 = (task % row_tasks) * kRowsPerTask;
    const int64_t b = bh / H, h = bh % H;
    const float* K = kh.data() + bh * Lkv * D;
    const float* V = vh.data() + bh * Lkv * D;
    RowScratch w(opts.block_n, D);
    for (int64_t i = i0; i < std::min(Lq, i0 + kRowsPerTask); ++i) {
      const float* qi = qh.data() + (bh * Lq + i) * D;
      float m = -std::numeric_limits<float>::infinity();
      float l = 0.0f;
      std::fill(w.acc.begin(), w.acc.end(), 0.0f);
      std::fill(w.acch.begin(), w.acch.end(), 0.0f);
      forward_row_tiles(qi, K, V, D, 0, Lkv, opts, c, m, l, w);
      float* orow = o.row(b, i, h);
      for (int64_t d = 0; d < D; ++d) orow[d] = w.acc[d] / l;
      if (o_hp.data != nullptr) {
        float* hrow = o_hp.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) hrow[d] = w.acch[d] / l;
      }
      if (m_out != nullptr) m_out[bh * Lq + i] = m;
      if (l_out != nullptr) l_out[bh * Lq + i] = l;
    }
  });
}

std::vector<float> forward_prefix_max(const Dims& dims, ConstView q, ConstView k, const Options& opts,
                                      int64_t key_end) {
  static const char* kWhat = "attention_qat_ref::forward_prefix_max";
  check_dims(dims, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  VQAD_CHECK(key_end >= 0 && key_end <= dims.len_kv && (key_end % opts.block_n == 0 || key_end == dims.len_kv),
             kWhat, ": expected key_end a multiple of BLOCK_N = ", opts.block_n, " or len_kv ", dims.len_kv,
             ", found ", key_end);
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, Lq = dims.len_q, Lkv = dims.len_kv, H = dims.heads;
  const float c = softmax_scale(dims, opts) * kLog2e;
  const std::vector<float> qh = prepare_operand(dims, q, Lq, opts.quant_qk, threads);
  const std::vector<float> kh = prepare_operand(dims, k, Lkv, opts.quant_qk, threads);
  std::vector<float> m(static_cast<size_t>(dims.batch * H * Lq), -std::numeric_limits<float>::infinity());
  parallel_for(dims.batch * H, threads, [&](int64_t bh) {
    const float* K = kh.data() + bh * Lkv * D;
    for (int64_t i = 0; i < Lq; ++i) {
      const float* qi = qh.data() + (bh * Lq + i) * D;
      float mi = -std::numeric_limits<float>::infinity();
      // Tile by tile as the recurrence forms it (max is exact: the grouping does not matter).
      for (int64_t j0 = 0; j0 < key_end; j0 += opts.block_n) {
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = j0; t < std::min<int64_t>(key_end, j0 + opts.block_n); ++t)
          tile_max = std::max(tile_max, dot(qi, K + t * D, D) * c);
        mi = std::max(mi, tile_max);
      }
      m[static_cast<size_t>(bh * Lq + i)] = mi;
    }
  });
  return m;
}

ForwardPart forward_part(const Dims& dims, ConstView q, ConstView k, ConstView v, const Options& opts,
                         int64_t key_begin, int64_t key_end, const std::vector<float>& m0) {
  static const char* kWhat = "attention_qat_ref::forward_part";
  check_dims(dims, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  check_key_range(dims, opts, key_begin, key_end, kWhat);
  const int64_t D = dims.head_dim, Lq = dims.len_q, Lkv = dims.len_kv, H = dims.heads;
  const size_t rows = static_cast<size_t>(dims.batch * H * Lq);
  VQAD_CHECK(m0.size() == rows, kWhat, ": expected a starting running max per row (", rows, " values), found ",
             m0.size());
  const int threads = resolve_threads(opts.num_threads);
  const float c = softmax_scale(dims, opts) * kLog2e;
  const std::vector<float> qh = prepare_operand(dims, q, Lq, opts.quant_qk, threads);
  const std::vector<float> kh = prepare_operand(dims, k, Lkv, opts.quant_qk, threads);
  const std::vector<float> vh = prepare_operand(dims, v, Lkv, opts.quant_v, threads);
  ForwardPart part;
  part.key_begin = key_begin;
  part.key_end = key_end;
  part.acc.assign(rows * D, 0.0f);
  part.acch.assign(rows * D, 0.0f);
  part.m.assign(rows, 0.0f);
  part.l.assign(rows, 0.0f);
  const int64_t row_tasks = (Lq + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(dims.batch * H * row_tasks, threads, [&](int64_t task) {
    const int64_t bh = task / row_tasks, i0 = (task % row_tasks) * kRowsPerTask;
    const float* K = kh.data() + bh * Lkv * D;
    const float* V = vh.data() + bh * Lkv * D;
    RowScratch w(opts.block_n, D);
    for (int64_t i = i0; i < std::min(Lq, i0 + kRowsPerTask); ++i) {
      const size_t r = static_cast<size_t>(bh * Lq + i);
      float m = m0[r], l = 0.0f;
      std::fill(w.acc.begin(), w.acc.end(), 0.0f);
      std::fill(w.acch.begin(), w.acch.end(), 0.0f);
      forward_row_tiles(qh.data() + r * D, K, V, D, key_begin, key_end, opts, c, m, l, w);
      std::copy(w.acc.begin(), w.acc.end(), part.acc.begin() + static_cast<int64_t>(r * D));
      std::copy(w.acch.begin(), w.acch.end(), part.acch.begin() + static_cast<int64_t>(r * D));
      part.m[r] = m;
      part.l[r] = l;
    }
  });
  return part;
}

void forward_combine(const Dims& dims, const std::vector<ForwardPart>& parts, View o, View o_hp, float* m_out,
                     float* l_out) {
  static const char* kWhat = "attention_qat_ref::forward_combine";
  VQAD_CHECK(o.data != nullptr, kWhat, ": output o is null");
  VQAD_CHECK(!parts.empty(), kWhat, ": expected at least one part");
  const int64_t D = dims.head_dim, Lq = dims.len_q, H = dims.heads;
  const size_t rows = static_cast<size_t>(dims.batch * H * Lq);
  int64_t next = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    VQAD_CHECK(parts[p].key_begin == next && parts[p].key_end > next, kWhat, ": part ", p, " covers keys [",
               parts[p].key_begin, ", ", parts[p].key_end, "), expected it to start at ", next,
               " (the parts in order, covering [0, len_kv))");
    VQAD_CHECK(parts[p].acc.size() == rows * D && parts[p].acch.size() == rows * D && parts[p].m.size() == rows &&
                   parts[p].l.size() == rows,
               kWhat, ": part ", p, " holds ", parts[p].m.size(), " rows, expected ", rows);
    next = parts[p].key_end;
  }
  VQAD_CHECK(next == dims.len_kv, kWhat, ": the parts end at key ", next, ", expected len_kv ", dims.len_kv);
  std::vector<float> acc(D), acch(D);
  for (int64_t bh = 0; bh < dims.batch * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < Lq; ++i) {
      const size_t r = static_cast<size_t>(bh * Lq + i);
      float m = -std::numeric_limits<float>::infinity();
      for (const ForwardPart& part : parts) m = std::max(m, part.m[r]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(acch.begin(), acch.end(), 0.0f);
      for (const ForwardPart& part : parts) {  // in key order: a fixed order of the sums
        const float scale = std::exp2(part.m[r] - m);
        l += part.l[r] * scale;
        for (int64_t d = 0; d < D; ++d) {
          acc[d] += part.acc[r * D + d] * scale;
          acch[d] += part.acch[r * D + d] * scale;
        }
      }
      float* orow = o.row(b, i, h);
      for (int64_t d = 0; d < D; ++d) orow[d] = acc[d] / l;
      if (o_hp.data != nullptr) {
        float* hrow = o_hp.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) hrow[d] = acch[d] / l;
      }
      if (m_out != nullptr) m_out[r] = m;
      if (l_out != nullptr) l_out[r] = l;
    }
  }
}

void backward(const Dims& dims, ConstView q, ConstView k, ConstView v, ConstView o_hp,
              ConstView d_o, const float* m_in, const float* l_in, const Options& opts, View dq,
              View dk, View dv) {
  static const char* kWhat = "attention_qat_ref::backward";
  check_dims(dims, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  check_view(o_hp, kWhat, "o_hp");
  check_view(d_o, kWhat, "do");
  VQAD_CHECK(m_in != nullptr && l_in != nullptr, kWhat, ": saved row statistics m and l are null");
  VQAD_CHECK(dq.data != nullptr && dk.data != nullptr && dv.data != nullptr, kWhat,
             ": an output gradient (dq, dk or dv) is null");
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, Lq = dims.len_q, Lkv = dims.len_kv, H = dims.heads;
  const float scale = softmax_scale(dims, opts);
  const float c = scale * kLog2e;

  const std::vector<float> qh = prepare_operand(dims, q, Lq, opts.quant_qk, threads);
  const std::vector<float> kh = prepare_operand(dims, k, Lkv, opts.quant_qk, threads);
  const std::vector<float> vh = prepare_operand(dims, v, Lkv, opts.quant_v, threads);
  const std::vector<float> doh = prepare_operand(dims, d_o, Lq, false, threads);

  // delta_i = rowsum(dO_i * O_hp_i): the STE-consistent choice (rowsum(dS) = 0 for O_hp).
  std::vector<float> delta(static_cast<size_t>(dims.batch * H * Lq));
  parallel_for(dims.batch * H, threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < Lq; ++i)
      delta[bh * Lq + i] = dot(doh.data() + (bh * Lq + i) * D, o_hp.row(b, i, h), D);
  });

  // dQ: one task per block of query rows.
  const int64_t row_tasks = (Lq + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(dims.batch * H * row_tasks, threads, [&](int64_t task) {
    const int64_t bh = task / row_tasks, i0 = (task % row_tasks) * kRowsPerTask;
    const int64_t b = bh / H, h = bh % H;
    const float* K = kh.data() + bh * Lkv * D;
    const float* V = vh.data() + bh * Lkv * D;
    std::vector<float> acc(D);
    for (int64_t i = i0; i < std::min(Lq, i0 + kRowsPerTask); ++i) {
      const float* qi = qh.data() + (bh * Lq + i) * D;
      const float* doi = doh.data() + (bh * Lq + i) * D;
      const float mi = m_in[bh * Lq + i], li = l_in[bh * Lq + i], di = delta[bh * Lq + i];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < Lkv; ++j) {
        const float* kj = K + j * D;
        const float p = std::exp2(dot(qi, kj, D) * c - mi) / li;
        const float ds = p * (dot(doi, V + j * D, D) - di);
        axpy(ds, kj, acc.data(), D);
      }
      float* out = dq.row(b, i, h);
      for (int64_t d = 0; d < D; ++d) out[d] = scale * acc[d];
    }
  });

  // dK, dV: one task per block of keys (a multiple of 16 keys, so the P groups
  // of the dV quantization lie inside one task).
  const int64_t key_tasks = (Lkv + kKeysPerTask - 1) / kKeysPerTask;
  parallel_for(dims.batch * H * key_tasks, threads, [&](int64_t task) {
    const int64_t bh = task / key_tasks, j0 = (task % key_tasks) * kKeysPerTask;
    const int64_t b = bh / H, h = bh % H;
    const int64_t n = std::min(kKeysPerTask, Lkv - j0);
    const float* K = kh.data() + (bh * Lkv + j0) * D;
    const float* V = vh.data() + (bh * Lkv + j0) * D;
    std::vector<float> dk_acc(n * D, 0.0f), dv_acc(n * D, 0.0f);
    std::vector<float> e(n), p(n), pb(n);
    for (int64_t i = 0; i < Lq; ++i) {
      const float* qi = qh.data() + (bh * Lq + i) * D;
      const float* doi = doh.data() + (bh * Lq + i) * D;
      const float mi = m_in[bh * Lq + i], li = l_in[bh * Lq + i], di = delta[bh * Lq + i];
      for (int64_t t = 0; t < n; ++t) {
        e[t] = std::exp2(dot(qi, K + t * D, D) * c - mi);
        p[t] = e[t] / li;
        const float ds = p[t] * (dot(doi, V + t * D, D) - di);
        axpy(ds, qi, dk_acc.data() + t * D, D);
      }
      if (!opts.quant_p) {
        std::copy(p.begin(), p.end(), pb.begin());
      } else if (opts.bwd_mode == BwdMode::kConsistent) {
        fake_quantize_p_row(e.data(), pb.data(), n);
        for (int64_t t = 0; t < n; ++t) pb[t] /= li;
      } else {
        fake_quantize_p_row(p.data(), pb.data(), n);
      }
      for (int64_t t = 0; t < n; ++t) axpy(pb[t], doi, dv_acc.data() + t * D, D);
    }
    for (int64_t t = 0; t < n; ++t) {
      float* dk_row = dk.row(b, j0 + t, h);
      float* dv_row = dv.row(b, j0 + t, h);
      for (int64_t d = 0; d < D; ++d) {
        dk_row[d] = scale * dk_acc[t * D + d];
        dv_row[d] = dv_acc[t * D + d];
      }
    }
  });
}

}  // namespace vqad::attn_qat_ref
