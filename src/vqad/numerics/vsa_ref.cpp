#include "vqad/numerics/vsa_ref.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <numeric>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/numerics/ref_loops.h"

// Conventions fixed here (they refine the header and agree with it):
// - P quantization groups: a physical block's valid keys are its first slots, so its
//   16-key groups start at the block's first key; the last group of a partial block is
//   quantized over its valid keys only. A group never spans two blocks, so the groups
//   restart at every tile (a tile is a whole number of blocks). With tile_blocks = 1,
//   or whenever the blocks before the last one of a tile are full, this is exactly
//   ATTN_QAT_TRAIN at block_n = 64 * tile_blocks over the gathered keys.
// - The fine stage mirrors attention_qat_ref.cpp operation by operation (same dot
//   product and axpy summation order, same running-max update, same tile sums), so
//   that equal key sequences give bitwise equal results.
// - Selection ranks cubes by (coarse score descending, cube index ascending). probs is
//   a monotone function of the scores, so top-p walks the same order and accumulates
//   probs in fp32 until the sum reaches top_p (top_p >= 1: effective_topk cubes).
// - Gradients of the coarse path are fp32 and treat the bf16 roundings of the cube
//   means and of out_c as identity (straight-through); the final bf16 rounding of the
//   output likewise.

namespace vqad::vsa_ref {
namespace {

namespace aq = vqad::attn_qat_ref;

using numerics::ref::axpy;
using numerics::ref::dot;
using numerics::ref::kLog2e;
using numerics::ref::parallel_for;
using numerics::ref::resolve_threads;

bool same_cube(const CubeShape& a, const CubeShape& b) {
  return a.t == b.t && a.h == b.h && a.w == b.w;
}

void check_call(const Dims& d, const Tiling& tiling, const Options& o, const char* what) {
  VQAD_CHECK(d.batch >= 1 && d.heads >= 1, what, ": expected batch and heads >= 1, found B=", d.batch,
             " H=", d.heads);
  VQAD_CHECK(d.head_dim >= 16 && d.head_dim % 16 == 0, what,
             ": head_dim must be a positive multiple of 16 (NVFP4 blocks along D), found ", d.head_dim);
  VQAD_CHECK(tiling.num_cubes >= 1 && tiling.num_tokens() >= 1 &&
                 static_cast<int64_t>(tiling.slot_to_token.size()) == tiling.padded_len,
             what, ": the tiling is empty or inconsistent (build it with make_tiling)");
  VQAD_CHECK(same_cube(tiling.cube, o.cube), what, ": the tiling's cube ", tiling.cube.t, "x",
             tiling.cube.h, "x", tiling.cube.w, " differs from the options' cube ", o.cube.t, "x",
             o.cube.h, "x", o.cube.w);
  VQAD_CHECK(o.sparsity >= 0.0 && o.sparsity < 1.0, what, ": sparsity must be in [0, 1), found ",
             o.sparsity);
  VQAD_CHECK(o.top_p > 0.0 && o.top_p <= 1.0, what, ": top_p must be in (0, 1], found ", o.top_p);
  VQAD_CHECK(o.tile_blocks >= 1, what, ": tile_blocks must be >= 1, found ", o.tile_blocks);
  VQAD_CHECK(o.softmax_scale >= 0.0f && std::isfinite(o.softmax_scale), what,
             ": softmax_scale must be finite and >= 0 (0 = 1/sqrt(D)), found ", o.softmax_scale);
}

void check_view(const aq::ConstView& v, const char* what, const char* name) {
  VQAD_CHECK(v.data != nullptr, what, ": tensor ", name, " is null");
}

void check_selection(const Dims& d, const Tiling& t, const SelectionLists& s, const char* what) {
  VQAD_CHECK(s.batch == d.batch && s.heads == d.heads && s.num_q_cubes == t.num_cubes &&
                 s.max_kv >= 1 &&
                 static_cast<int64_t>(s.index.size()) == s.batch * s.heads * s.num_q_cubes * s.max_kv &&
                 static_cast<int64_t>(s.count.size()) == s.batch * s.heads * s.num_q_cubes,
             what, ": selection lists [", s.batch, ", ", s.heads, ", ", s.num_q_cubes, ", ", s.max_kv,
             "] do not match B=", d.batch, " H=", d.heads, " cubes=", t.num_cubes);
}

float scale_of(const Dims& d, const Options& o) {
  return o.softmax_scale > 0.0f ? o.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d.head_dim));
}

// Per (b, h) contiguous [L, D] raster-order copies, bf16-rounded, fake-quantized along D
// when `quantize` (unit scale). Index ((b * H + h) * L + l) * D.
std::vector<float> prepare(const Dims& d, int64_t len, aq::ConstView x, bool quantize, int threads) {
  const int64_t D = d.head_dim;
  std::vector<float> out(static_cast<size_t>(d.batch * d.heads * len * D));
  parallel_for(d.batch * d.heads, threads, [&](int64_t bh) {
    const int64_t b = bh / d.heads, h = bh % d.heads;
    for (int64_t l = 0; l < len; ++l) {
      const float* src = x.row(b, l, h);
      float* dst = out.data() + (bh * len + l) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] = aq::bf16_round(src[c]);
      if (quantize) nvfp4::fake_quantize(dst, dst, static_cast<size_t>(D), 1.0f);
    }
  });
  return out;
}

// A visited physical block: its valid tokens are slot_to_token[first_slot, first_slot + n).
struct Block {
  int64_t first_slot;
  int n;
};

// The non-empty physical blocks of a cube, in order.
void append_blocks(const Tiling& t, int64_t cube, std::vector<Block>& out) {
  for (int64_t b = 0; b < t.blocks_per_cube; ++b) {
    const int n = t.block_tokens[cube * t.blocks_per_cube + b];
    if (n > 0) out.push_back({(cube * t.blocks_per_cube + b) * kPhysicalBlockTokens, n});
  }
}

// The valid raster tokens of a cube in slot order.
const int64_t* cube_tokens(const Tiling& t, int64_t cube) {
  return t.slot_to_token.data() + cube * t.blocks_per_cube * kPhysicalBlockTokens;
}

// Inverse lists: for every (b, h, kv cube) the query cubes that selected it, ascending.
struct Inverse {
  std::vector<int64_t> offset;  // [B * H * nc + 1]
  std::vector<int32_t> q_cube;
};
Inverse invert(const SelectionLists& s, int64_t nc) {
  const int64_t rows = s.batch * s.heads;
  Inverse inv;
  inv.offset.assign(static_cast<size_t>(rows * nc + 1), 0);
  for (int64_t bh = 0; bh < rows; ++bh)
    for (int64_t qc = 0; qc < nc; ++qc) {
      const int32_t* r = s.index.data() + (bh * nc + qc) * s.max_kv;
      for (int32_t e = 0; e < s.count[bh * nc + qc]; ++e) ++inv.offset[bh * nc + r[e] + 1];
    }
  for (size_t i = 1; i < inv.offset.size(); ++i) inv.offset[i] += inv.offset[i - 1];
  inv.q_cube.resize(static_cast<size_t>(inv.offset.back()));
  std::vector<int64_t> fill(inv.offset.begin(), inv.offset.end() - 1);
  for (int64_t bh = 0; bh < rows; ++bh)
    for (int64_t qc = 0; qc < nc; ++qc) {
      const int32_t* r = s.index.data() + (bh * nc + qc) * s.max_kv;
      for (int32_t e = 0; e < s.count[bh * nc + qc]; ++e)
        inv.q_cube[fill[bh * nc + r[e]]++] = static_cast<int32_t>(qc);
    }
  return inv;
}

}  // namespace

Tiling make_tiling(int64_t grid_t, int64_t grid_h, int64_t grid_w, CubeShape cube) {
  VQAD_CHECK(grid_t >= 1 && grid_h >= 1 && grid_w >= 1, "VSA tiling: grid dimensions must be >= 1, found ",
             grid_t, "x", grid_h, "x", grid_w);
  VQAD_CHECK(cube.t >= 1 && cube.h >= 1 && cube.w >= 1, "VSA tiling: cube dimensions must be >= 1, found ",
             cube.t, "x", cube.h, "x", cube.w);
  Tiling t;
  t.grid_t = grid_t;
  t.grid_h = grid_h;
  t.grid_w = grid_w;
  t.cube = cube;
  t.cubes_t = (grid_t + cube.t - 1) / cube.t;
  t.cubes_h = (grid_h + cube.h - 1) / cube.h;
  t.cubes_w = (grid_w + cube.w - 1) / cube.w;
  t.num_cubes = t.cubes_t * t.cubes_h * t.cubes_w;
  t.blocks_per_cube = (cube.volume() + kPhysicalBlockTokens - 1) / kPhysicalBlockTokens;
  const int64_t cube_slots = t.blocks_per_cube * kPhysicalBlockTokens;
  t.padded_len = t.num_cubes * cube_slots;
  t.cube_tokens.assign(static_cast<size_t>(t.num_cubes), 0);
  t.block_tokens.assign(static_cast<size_t>(t.num_cubes * t.blocks_per_cube), 0);
  t.slot_to_token.assign(static_cast<size_t>(t.padded_len), -1);
  t.token_to_slot.assign(static_cast<size_t>(t.num_tokens()), -1);
  for (int64_t ct = 0; ct < t.cubes_t; ++ct)
    for (int64_t ch = 0; ch < t.cubes_h; ++ch)
      for (int64_t cw = 0; cw < t.cubes_w; ++cw) {
        const int64_t c = (ct * t.cubes_h + ch) * t.cubes_w + cw;
        int64_t slot = c * cube_slots;
        for (int64_t tt = ct * cube.t; tt < std::min(grid_t, (ct + 1) * cube.t); ++tt)
          for (int64_t hh = ch * cube.h; hh < std::min(grid_h, (ch + 1) * cube.h); ++hh)
            for (int64_t ww = cw * cube.w; ww < std::min(grid_w, (cw + 1) * cube.w); ++ww) {
              const int64_t token = (tt * grid_h + hh) * grid_w + ww;
              t.slot_to_token[slot] = token;
              t.token_to_slot[token] = slot;
              ++slot;
            }
        const int64_t n = slot - c * cube_slots;
        t.cube_tokens[c] = static_cast<int32_t>(n);
        for (int64_t b = 0; b < t.blocks_per_cube; ++b)
          t.block_tokens[c * t.blocks_per_cube + b] = static_cast<int32_t>(
              std::clamp<int64_t>(n - b * kPhysicalBlockTokens, 0, kPhysicalBlockTokens));
      }
  return t;
}

int64_t effective_topk(double sparsity, int64_t num_cubes) {
  VQAD_CHECK(sparsity >= 0.0 && sparsity < 1.0, "VSA effective_topk: sparsity must be in [0, 1), found ",
             sparsity);
  VQAD_CHECK(num_cubes >= 1, "VSA effective_topk: num_cubes must be >= 1, found ", num_cubes);
  const auto k = static_cast<int64_t>(std::ceil((1.0 - sparsity) * static_cast<double>(num_cubes)));
  return std::max<int64_t>(1, std::min(k, num_cubes));
}

Coarse coarse_forward(const Dims& dims, const Tiling& tiling, aq::ConstView q, aq::ConstView k,
                      aq::ConstView v, const Options& opts) {
  static const char* kWhat = "vsa_ref::coarse_forward";
  check_call(dims, tiling, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, nc = tiling.num_cubes, H = dims.heads;
  const float scale = scale_of(dims, opts);
  Coarse c;
  const size_t means = static_cast<size_t>(dims.batch * H * nc * D);
  c.q_c.assign(means, 0.0f);
  c.k_c.assign(means, 0.0f);
  c.v_c.assign(means, 0.0f);
  c.out_c.assign(means, 0.0f);
  c.scores.assign(static_cast<size_t>(dims.batch * H * nc * nc), 0.0f);
  c.probs.assign(c.scores.size(), 0.0f);
  parallel_for(dims.batch * H, threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    std::vector<float> sum(D);
    for (int which = 0; which < 3; ++which) {
      const aq::ConstView& x = which == 0 ? q : which == 1 ? k : v;
      std::vector<float>& out = which == 0 ? c.q_c : which == 1 ? c.k_c : c.v_c;
      for (int64_t cube = 0; cube < nc; ++cube) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        const int64_t* toks = cube_tokens(tiling, cube);
        const int32_t n = tiling.cube_tokens[cube];
        for (int32_t i = 0; i < n; ++i) {
          const float* row = x.row(b, toks[i], h);
          for (int64_t d = 0; d < D; ++d) sum[d] += aq::bf16_round(row[d]);
        }
        float* dst = out.data() + (bh * nc + cube) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = aq::bf16_round(sum[d] / static_cast<float>(n));
      }
    }
    for (int64_t i = 0; i < nc; ++i) {
      const float* qi = c.q_c.data() + (bh * nc + i) * D;
      float* s = c.scores.data() + (bh * nc + i) * nc;
      float* p = c.probs.data() + (bh * nc + i) * nc;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < nc; ++j) {
        const float* kj = c.k_c.data() + (bh * nc + j) * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qi[d] * kj[d];
        s[j] = acc * scale;
        mx = std::max(mx, s[j]);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < nc; ++j) {
        p[j] = std::exp(s[j] - mx);
        total += p[j];
      }
      for (int64_t j = 0; j < nc; ++j) p[j] /= total;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < nc; ++j) {
        const float* vj = c.v_c.data() + (bh * nc + j) * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += p[j] * vj[d];
      }
      float* o = c.out_c.data() + (bh * nc + i) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = aq::bf16_round(sum[d]);
    }
  });
  return c;
}

SelectionLists select_cubes(const Dims& dims, const Tiling& tiling, const Coarse& coarse,
                            const Options& opts) {
  static const char* kWhat = "vsa_ref::select_cubes";
  check_call(dims, tiling, opts, kWhat);
  const int64_t nc = tiling.num_cubes, rows = dims.batch * dims.heads;
  VQAD_CHECK(static_cast<int64_t>(coarse.scores.size()) == rows * nc * nc &&
                 coarse.probs.size() == coarse.scores.size(),
             kWhat, ": coarse scores/probs must hold B*H*cubes*cubes = ", rows * nc * nc, " values, found ",
             coarse.scores.size(), " / ", coarse.probs.size());
  const int64_t topk = effective_topk(opts.sparsity, nc);
  SelectionLists s;
  s.batch = dims.batch;
  s.heads = dims.heads;
  s.num_q_cubes = nc;
  s.max_kv = topk;
  s.index.assign(static_cast<size_t>(rows * nc * topk), -1);
  s.count.assign(static_cast<size_t>(rows * nc), 0);
  parallel_for(rows * nc, resolve_threads(opts.num_threads), [&](int64_t r) {
    const float* sc = coarse.scores.data() + r * nc;
    const float* pr = coarse.probs.data() + r * nc;
    auto key = [&](int64_t j) {
      const float x = sc[j];
      return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x;
    };
    std::vector<int32_t> order(static_cast<size_t>(nc));
    std::iota(order.begin(), order.end(), 0);
    // (score descending, index ascending); only the first topk positions are needed.
    std::partial_sort(order.begin(), order.begin() + topk, order.end(), [&](int32_t a, int32_t b) {
      const float ka = key(a), kb = key(b);
      return ka > kb || (ka == kb && a < b);
    });
    int64_t n = topk;
    if (opts.selection == Selection::kTopP && opts.top_p < 1.0) {
      const float target = static_cast<float>(opts.top_p);
      float mass = 0.0f;
      n = 0;
      while (n < topk) {
        mass += pr[order[n]];
        ++n;
        if (mass >= target) break;
      }
    }
    std::sort(order.begin(), order.begin() + n);
    std::copy(order.begin(), order.begin() + n, s.index.begin() + r * topk);
    s.count[r] = static_cast<int32_t>(n);
  });
  return s;
}

void fine_forward(const Dims& dims, const Tiling& tiling, aq::ConstView q, aq::ConstView k, aq::ConstView v,
                  const SelectionLists& sel, const Options& opts, aq::View o, aq::View o_hp, float* m_out,
                  float* l_out) {
  static const char* kWhat = "vsa_ref::fine_forward";
  check_call(dims, tiling, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  check_selection(dims, tiling, sel, kWhat);
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, H = dims.heads, L = tiling.num_tokens(), nc = tiling.num_cubes;
  const float c = scale_of(dims, opts) * kLog2e;
  const bool quant_qk = opts.quantize, quant_v = opts.quantize && opts.quant_v;
  const bool quant_p = opts.quantize && opts.quant_p;
  const std::vector<float> qh = prepare(dims, L, q, quant_qk, threads);
  const std::vector<float> kh = prepare(dims, L, k, quant_qk, threads);
  const std::vector<float> vh = prepare(dims, L, v, quant_v, threads);
  const int64_t tile_keys = static_cast<int64_t>(opts.tile_blocks) * kPhysicalBlockTokens;

  parallel_for(dims.batch * H * nc, threads, [&](int64_t task) {
    const int64_t bh = task / nc, qc = task % nc;
    const int64_t b = bh / H, h = bh % H;
    std::vector<Block> blocks;
    const int32_t* row = sel.row(b, h, qc);
    for (int32_t e = 0; e < sel.count[bh * nc + qc]; ++e) append_blocks(tiling, row[e], blocks);
    const float* K = kh.data() + bh * L * D;
    const float* V = vh.data() + bh * L * D;
    std::vector<float> s(tile_keys), p(tile_keys), pq(tile_keys), acc(D), acch(D);
    std::vector<const float*> krow(tile_keys), vrow(tile_keys);
    const int64_t* qtoks = cube_tokens(tiling, qc);
    for (int32_t qi_idx = 0; qi_idx < tiling.cube_tokens[qc]; ++qi_idx) {
      const int64_t i = qtoks[qi_idx];
      const float* qi = qh.data() + (bh * L + i) * D;
      float m = -std::numeric_limits<float>::infinity();
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(acch.begin(), acch.end(), 0.0f);
      for (size_t b0 = 0; b0 < blocks.size(); b0 += static_cast<size_t>(opts.tile_blocks)) {
        const size_t b1 = std::min(blocks.size(), b0 + static_cast<size_t>(opts.tile_blocks));
        // The tile's keys, block after block.
        int64_t n = 0;
        for (size_t bi = b0; bi < b1; ++bi)
          for (int t = 0; t < blocks[bi].n; ++t) {
            const int64_t tok = tiling.slot_to_token[blocks[bi].first_slot + t];
            krow[n] = K + tok * D;
            vrow[n] = V + tok * D;
            ++n;
          }
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) {
          s[t] = dot(qi, krow[t], D) * c;
          tile_max = std::max(tile_max, s[t]);
        }
        const float m_new = std::max(m, tile_max);
        const float alpha = std::exp2(m - m_new);  // 0 on the first tile (m = -inf)
        for (int64_t t = 0; t < n; ++t) p[t] = std::exp2(s[t] - m_new);
        if (quant_p) {
          int64_t off = 0;
          for (size_t bi = b0; bi < b1; ++bi) {
            aq::fake_quantize_p_row(p.data() + off, pq.data() + off, blocks[bi].n);
            off += blocks[bi].n;
          }
        } else {
          std::copy(p.begin(), p.begin() + n, pq.begin());
        }
        float tile_sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) tile_sum += aq::bf16_round(p[t]);
        l = l * alpha + tile_sum;
        for (int64_t d = 0; d < D; ++d) {
          acc[d] *= alpha;
          acch[d] *= alpha;
        }
        for (int64_t t = 0; t < n; ++t) {
          axpy(aq::bf16_round(pq[t]), vrow[t], acc.data(), D);
          axpy(aq::bf16_round(p[t]), vrow[t], acch.data(), D);
        }
        m = m_new;
      }
      if (o.data != nullptr) {
        float* orow = o.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) orow[d] = acc[d] / l;
      }
      if (o_hp.data != nullptr) {
        float* hrow = o_hp.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) hrow[d] = acch[d] / l;
      }
      if (m_out != nullptr) m_out[bh * L + i] = m;
      if (l_out != nullptr) l_out[bh * L + i] = l;
    }
  });
}

void fine_backward(const Dims& dims, const Tiling& tiling, aq::ConstView q, aq::ConstView k, aq::ConstView v,
                   aq::ConstView o_hp, aq::ConstView d_o, const float* m_in, const float* l_in,
                   const SelectionLists& sel, const Options& opts, aq::View dq, aq::View dk, aq::View dv) {
  static const char* kWhat = "vsa_ref::fine_backward";
  check_call(dims, tiling, opts, kWhat);
  check_view(q, kWhat, "q");
  check_view(k, kWhat, "k");
  check_view(v, kWhat, "v");
  check_view(o_hp, kWhat, "o_hp");
  check_view(d_o, kWhat, "do");
  check_selection(dims, tiling, sel, kWhat);
  VQAD_CHECK(m_in != nullptr && l_in != nullptr, kWhat, ": saved row statistics m and l are null");
  VQAD_CHECK(dq.data != nullptr && dk.data != nullptr && dv.data != nullptr, kWhat,
             ": an output gradient (dq, dk or dv) is null");
  const int threads = resolve_threads(opts.num_threads);
  const int64_t D = dims.head_dim, H = dims.heads, L = tiling.num_tokens(), nc = tiling.num_cubes;
  const float scale = scale_of(dims, opts);
  const float c = scale * kLog2e;
  const bool quant_qk = opts.quantize, quant_v = opts.quantize && opts.quant_v;
  const bool quant_p = opts.quantize && opts.quant_p;
  const std::vector<float> qh = prepare(dims, L, q, quant_qk, threads);
  const std::vector<float> kh = prepare(dims, L, k, quant_qk, threads);
  const std::vector<float> vh = prepare(dims, L, v, quant_v, threads);
  const std::vector<float> doh = prepare(dims, L, d_o, false, threads);

  // delta_i = rowsum(dO_i * O_hp_i), as ATTN_QAT_TRAIN.
  std::vector<float> delta(static_cast<size_t>(dims.batch * H * L));
  parallel_for(dims.batch * H, threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < L; ++i) delta[bh * L + i] = dot(doh.data() + (bh * L + i) * D, o_hp.row(b, i, h), D);
  });

  // dQ: one task per (b, h, query cube), keys in the forward's visiting order.
  parallel_for(dims.batch * H * nc, threads, [&](int64_t task) {
    const int64_t bh = task / nc, qc = task % nc;
    const int64_t b = bh / H, h = bh % H;
    std::vector<Block> blocks;
    const int32_t* row = sel.row(b, h, qc);
    for (int32_t e = 0; e < sel.count[bh * nc + qc]; ++e) append_blocks(tiling, row[e], blocks);
    const float* K = kh.data() + bh * L * D;
    const float* V = vh.data() + bh * L * D;
    std::vector<float> acc(D);
    const int64_t* qtoks = cube_tokens(tiling, qc);
    for (int32_t qi_idx = 0; qi_idx < tiling.cube_tokens[qc]; ++qi_idx) {
      const int64_t i = qtoks[qi_idx];
      const float* qi = qh.data() + (bh * L + i) * D;
      const float* doi = doh.data() + (bh * L + i) * D;
      const float mi = m_in[bh * L + i], li = l_in[bh * L + i], di = delta[bh * L + i];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const Block& blk : blocks)
        for (int t = 0; t < blk.n; ++t) {
          const int64_t tok = tiling.slot_to_token[blk.first_slot + t];
          const float* kj = K + tok * D;
          const float p = std::exp2(dot(qi, kj, D) * c - mi) / li;
          const float ds = p * (dot(doi, V + tok * D, D) - di);
          axpy(ds, kj, acc.data(), D);
        }
      float* out = dq.row(b, i, h);
      for (int64_t d = 0; d < D; ++d) out[d] = scale * acc[d];
    }
  });

  // dK, dV: one task per (b, h, kv physical block) over the query cubes that selected
  // its cube (ascending), their tokens in slot order. A block holds whole P groups.
  const Inverse inv = invert(sel, nc);
  const int64_t bpc = tiling.blocks_per_cube;
  parallel_for(dims.batch * H * nc * bpc, threads, [&](int64_t task) {
    const int64_t bh = task / (nc * bpc), kc = (task / bpc) % nc, blk = task % bpc;
    const int64_t b = bh / H, h = bh % H;
    const int n = tiling.block_tokens[kc * bpc + blk];
    if (n == 0) return;
    const int64_t first_slot = (kc * bpc + blk) * kPhysicalBlockTokens;
    std::vector<const float*> krow(n), vrow(n);
    std::vector<int64_t> ktok(n);
    for (int t = 0; t < n; ++t) {
      ktok[t] = tiling.slot_to_token[first_slot + t];
      krow[t] = kh.data() + (bh * L + ktok[t]) * D;
      vrow[t] = vh.data() + (bh * L + ktok[t]) * D;
    }
    std::vector<float> dk_acc(static_cast<size_t>(n * D), 0.0f), dv_acc(static_cast<size_t>(n * D), 0.0f);
    std::vector<float> e(n), p(n), pb(n);
    for (int64_t r = inv.offset[bh * nc + kc]; r < inv.offset[bh * nc + kc + 1]; ++r) {
      const int64_t qc = inv.q_cube[r];
      const int64_t* qtoks = cube_tokens(tiling, qc);
      for (int32_t qi_idx = 0; qi_idx < tiling.cube_tokens[qc]; ++qi_idx) {
        const int64_t i = qtoks[qi_idx];
        const float* qi = qh.data() + (bh * L + i) * D;
        const float* doi = doh.data() + (bh * L + i) * D;
        const float mi = m_in[bh * L + i], li = l_in[bh * L + i], di = delta[bh * L + i];
        for (int t = 0; t < n; ++t) {
          e[t] = std::exp2(dot(qi, krow[t], D) * c - mi);
          p[t] = e[t] / li;
          const float ds = p[t] * (dot(doi, vrow[t], D) - di);
          axpy(ds, qi, dk_acc.data() + t * D, D);
        }
        if (!quant_p) {
          std::copy(p.begin(), p.end(), pb.begin());
        } else if (opts.bwd_mode == aq::BwdMode::kConsistent) {
          aq::fake_quantize_p_row(e.data(), pb.data(), n);
          for (int t = 0; t < n; ++t) pb[t] /= li;
        } else {
          aq::fake_quantize_p_row(p.data(), pb.data(), n);
        }
        for (int t = 0; t < n; ++t) axpy(pb[t], doi, dv_acc.data() + t * D, D);
      }
    }
    for (int t = 0; t < n; ++t) {
      float* dk_row = dk.row(b, ktok[t], h);
      float* dv_row = dv.row(b, ktok[t], h);
      for (int64_t d = 0; d < D; ++d) {
        dk_row[d] = scale * dk_acc[t * D + d];
        dv_row[d] = dv_acc[t * D + d];
      }
    }
  });
}

void forward(const Dims& dims, const Tiling& tiling, aq::ConstView q, aq::ConstView k, aq::ConstView v,
             aq::ConstView gate, const Options& opts, aq::View o, Saved* saved) {
  static const char* kWhat = "vsa_ref::forward";
  check_call(dims, tiling, opts, kWhat);
  VQAD_CHECK(o.data != nullptr, kWhat, ": output o is null");
  const int64_t D = dims.head_dim, H = dims.heads, L = tiling.num_tokens(), nc = tiling.num_cubes;
  Saved local;
  Saved& sv = saved != nullptr ? *saved : local;
  sv.coarse = coarse_forward(dims, tiling, q, k, v, opts);
  sv.selection = select_cubes(dims, tiling, sv.coarse, opts);
  const size_t elems = static_cast<size_t>(dims.batch * L * H * D);
  std::vector<float> fine(elems);
  sv.o_fine_hp.assign(saved != nullptr ? elems : 0, 0.0f);
  sv.m.assign(saved != nullptr ? static_cast<size_t>(dims.batch * H * L) : 0, 0.0f);
  sv.l.assign(sv.m.size(), 0.0f);
  aq::View fine_view = aq::contiguous_view(fine.data(), L, H, D);
  aq::View hp_view{};
  if (saved != nullptr) hp_view = aq::contiguous_view(sv.o_fine_hp.data(), L, H, D);
  fine_forward(dims, tiling, q, k, v, sv.selection, opts, fine_view, hp_view,
               saved != nullptr ? sv.m.data() : nullptr, saved != nullptr ? sv.l.data() : nullptr);
  parallel_for(dims.batch * L, resolve_threads(opts.num_threads), [&](int64_t bl) {
    const int64_t b = bl / L, i = bl % L;
    const int64_t cube = tiling.token_to_slot[i] / (tiling.blocks_per_cube * kPhysicalBlockTokens);
    for (int64_t h = 0; h < H; ++h) {
      const float* f = fine_view.row(b, i, h);
      float* out = o.row(b, i, h);
      if (gate.data == nullptr) {
        for (int64_t d = 0; d < D; ++d) out[d] = aq::bf16_round(f[d]);
      } else {
        const float* oc = sv.coarse.out_c.data() + ((b * H + h) * nc + cube) * D;
        const float* g = gate.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) out[d] = aq::bf16_round(oc[d] * aq::bf16_round(g[d]) + f[d]);
      }
    }
  });
}

void backward(const Dims& dims, const Tiling& tiling, aq::ConstView q, aq::ConstView k, aq::ConstView v,
              aq::ConstView gate, const Saved& saved, aq::ConstView d_o, const Options& opts, aq::View dq,
              aq::View dk, aq::View dv, aq::View dgate) {
  static const char* kWhat = "vsa_ref::backward";
  check_call(dims, tiling, opts, kWhat);
  check_view(d_o, kWhat, "do");
  const int64_t D = dims.head_dim, H = dims.heads, L = tiling.num_tokens(), nc = tiling.num_cubes;
  const size_t elems = static_cast<size_t>(dims.batch * L * H * D);
  VQAD_CHECK(saved.o_fine_hp.size() == elems && saved.m.size() == static_cast<size_t>(dims.batch * H * L) &&
                 saved.l.size() == saved.m.size() &&
                 saved.coarse.out_c.size() == static_cast<size_t>(dims.batch * H * nc * D) &&
                 saved.coarse.probs.size() == static_cast<size_t>(dims.batch * H * nc * nc),
             kWhat, ": the saved forward state does not match B=", dims.batch, " L=", L, " H=", H, " D=", D,
             " (pass the Saved filled by forward for the same call)");
  const int threads = resolve_threads(opts.num_threads);
  fine_backward(dims, tiling, q, k, v, aq::contiguous_view(saved.o_fine_hp.data(), L, H, D), d_o,
                saved.m.data(), saved.l.data(), saved.selection, opts, dq, dk, dv);

  const int64_t cube_slots = tiling.blocks_per_cube * kPhysicalBlockTokens;
  if (dgate.data != nullptr) {
    parallel_for(dims.batch * L, threads, [&](int64_t bl) {
      const int64_t b = bl / L, i = bl % L;
      const int64_t cube = tiling.token_to_slot[i] / cube_slots;
      for (int64_t h = 0; h < H; ++h) {
        const float* oc = saved.coarse.out_c.data() + ((b * H + h) * nc + cube) * D;
        const float* g = d_o.row(b, i, h);
        float* out = dgate.row(b, i, h);
        for (int64_t d = 0; d < D; ++d) out[d] = aq::bf16_round(g[d]) * oc[d];
      }
    });
  }
  if (gate.data == nullptr) return;  // zero gate: the coarse path has no gradient

  // Coarse path: d out_c per cube = sum over its tokens of dO * gate; then the softmax
  // attention over cubes; then the means (1 / count to every valid token).
  const float scale = scale_of(dims, opts);
  const Coarse& cs = saved.coarse;
  parallel_for(dims.batch * H, threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    std::vector<float> d_oc(static_cast<size_t>(nc * D), 0.0f), dq_c(static_cast<size_t>(nc * D), 0.0f),
        dk_c(static_cast<size_t>(nc * D), 0.0f), dv_c(static_cast<size_t>(nc * D), 0.0f), dp(nc), dsc(nc);
    for (int64_t cube = 0; cube < nc; ++cube) {
      const int64_t* toks = cube_tokens(tiling, cube);
      float* acc = d_oc.data() + cube * D;
      for (int32_t t = 0; t < tiling.cube_tokens[cube]; ++t) {
        const float* g = gate.row(b, toks[t], h);
        const float* dor = d_o.row(b, toks[t], h);
        for (int64_t d = 0; d < D; ++d) acc[d] += aq::bf16_round(dor[d]) * aq::bf16_round(g[d]);
      }
    }
    const float* qc_ = cs.q_c.data() + bh * nc * D;
    const float* kc_ = cs.k_c.data() + bh * nc * D;
    const float* vc_ = cs.v_c.data() + bh * nc * D;
    for (int64_t i = 0; i < nc; ++i) {
      const float* p = cs.probs.data() + (bh * nc + i) * nc;
      const float* g = d_oc.data() + i * D;
      float pdp = 0.0f;
      for (int64_t j = 0; j < nc; ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += g[d] * vc_[j * D + d];
        dp[j] = acc;
        pdp += p[j] * acc;
        for (int64_t d = 0; d < D; ++d) dv_c[j * D + d] += p[j] * g[d];
      }
      for (int64_t j = 0; j < nc; ++j) dsc[j] = p[j] * (dp[j] - pdp) * scale;
      for (int64_t j = 0; j < nc; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          dq_c[i * D + d] += dsc[j] * kc_[j * D + d];
          dk_c[j * D + d] += dsc[j] * qc_[i * D + d];
        }
      }
    }
    for (int64_t cube = 0; cube < nc; ++cube) {
      const int64_t* toks = cube_tokens(tiling, cube);
      const float count = static_cast<float>(tiling.cube_tokens[cube]);
      for (int32_t t = 0; t < tiling.cube_tokens[cube]; ++t) {
        float* rq = dq.row(b, toks[t], h);
        float* rk = dk.row(b, toks[t], h);
        float* rv = dv.row(b, toks[t], h);
        for (int64_t d = 0; d < D; ++d) {
          rq[d] += dq_c[cube * D + d] / count;
          rk[d] += dk_c[cube * D + d] / count;
          rv[d] += dv_c[cube * D + d] / count;
        }
      }
    }
  });
}

}  // namespace vqad::vsa_ref
