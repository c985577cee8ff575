// VSA CPU reference (numerics/vsa_ref.h) against an independent float64 formula.
//
// The formula works on raster tokens directly: a token's cube and its rank inside the
// cube come from its (t, h, w) coordinates, not from make_tiling. Per query cube it
// gathers the keys of the selected KV cubes (ascending cube, raster order inside a cube:
// the cube-major order the spec fixes), computes every logit in float64, the running max
// each 64-key block (tile) saw, and rescales afterwards (no online recurrence). It rounds
// only where the spec fixes a rounding: bf16 inputs, cube means, out_c, bf16(P) / bf16(P^),
// the output, and the NVFP4 quantizer (nvfp4::fake_quantize, the fp32 definition). The
// coarse backward comes from torch autograd in float64 (straight-through through the bf16
// roundings); the fine backward is written out as in the ATTN_QAT_TRAIN test.
//
// Inputs are multiples of 1/16 in [-4, 4): bf16 values whose fp32 cube sums are exact,
// so the reference's cube means equal the formula's bit for bit and selections can be
// compared exactly (ties aside). Tolerances as in the ATTN_QAT_TRAIN test: max-abs errors
// relative to the largest value, 1e-5 (float64 vs fp32 accumulation, a rare E2M1 / bf16
// boundary flip); the bf16-rounded output is compared per element within one bf16 step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <set>
#include <vector>

#include "tests/support/float64_oracle.h"
#include "vqad/core/error.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/numerics/vsa_ref.h"

namespace {

namespace vr = vqad::vsa_ref;
namespace aq = vqad::attn_qat_ref;
using torch::indexing::Slice;

using vqad::test::bf16_f64;
using vqad::test::kLog2e;
using vqad::test::nvfp4_last_f64;

// A softmax scale whose fp32 c = scale * log2(e) is exactly 1/4: with grid-valued
// (and NVFP4) operands the logits are then exact in fp32 and float64 alike, so bf16(P)
// cannot flip between the two (a flip moves one P by 2^-8 and shows up at ~1e-4).
float exact_scale() {
  float s = 0.25f / 1.4426950408889634f;
  while (s * 1.4426950408889634f > 0.25f) s = std::nextafter(s, 0.0f);
  while (s * 1.4426950408889634f < 0.25f) s = std::nextafter(s, 1.0f);
  return s;
}

// Multiples of 1/16 in [-4, 4), as float32 (exact bf16 values).
torch::Tensor grid_values(torch::IntArrayRef shape, double mul = 1.0) {
  return torch::clamp(torch::round(torch::randn(shape, torch::kDouble) * mul * 16.0), -64, 63)
      .div(16.0)
      .to(torch::kFloat32);
}

struct Problem {
  int64_t B = 1, H = 1, D = 32, T = 1, Hg = 1, Wg = 1;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(D)
  vr::CubeShape cube = vr::kCubeC128;
  torch::Tensor q, k, v, gate, d_o;  // float32 [B, L, H, D]; gate undefined = zero gate
  int64_t L() const { return T * Hg * Wg; }
};

Problem make_problem(int64_t B, int64_t H, int64_t D, std::array<int64_t, 3> g, vr::CubeShape cube,
                     bool with_gate, int64_t seed, double mul = 1.0) {
  torch::manual_seed(seed);
  Problem p;
  p.B = B;
  p.H = H;
  p.D = D;
  p.T = g[0];
  p.Hg = g[1];
  p.Wg = g[2];
  p.cube = cube;
  p.softmax_scale = exact_scale();
  const int64_t L = p.L();
  p.q = grid_values({B, L, H, D}, mul);
  p.k = grid_values({B, L, H, D}, mul);
  p.v = grid_values({B, L, H, D});
  p.d_o = grid_values({B, L, H, D});
  if (with_gate) p.gate = grid_values({B, L, H, D}, 0.5);
  return p;
}

// Cube geometry from coordinates only.
struct Geo {
  int64_t nc = 0;
  std::vector<int64_t> cube_of;                // [L]
  std::vector<std::vector<int64_t>> members;   // tokens of each cube, raster order
};
Geo geometry(const Problem& p) {
  Geo g;
  const int64_t ct = p.cube.t, ch = p.cube.h, cw = p.cube.w;
  const int64_t nT = (p.T + ct - 1) / ct, nH = (p.Hg + ch - 1) / ch, nW = (p.Wg + cw - 1) / cw;
  g.nc = nT * nH * nW;
  g.members.resize(g.nc);
  for (int64_t n = 0; n < p.L(); ++n) {
    const int64_t t = n / (p.Hg * p.Wg), h = (n / p.Wg) % p.Hg, w = n % p.Wg;
    const int64_t c = ((t / ct) * nH + h / ch) * nW + w / cw;
    g.cube_of.push_back(c);
    g.members[c].push_back(n);
  }
  return g;
}

torch::Tensor idx(const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong); }

struct FCfg {
  bool quantize = false, quant_p = true, quant_v = true, fastvideo = false;
  int tile_blocks = 1;
};

// Selected KV cubes per (b, h, qc), taken from the reference (verified separately).
using Sel = std::vector<std::vector<std::vector<std::vector<int64_t>>>>;  // [b][h][qc] -> list
Sel sel_of(const vr::SelectionLists& s) {
  Sel out(s.batch, std::vector<std::vector<std::vector<int64_t>>>(s.heads));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t qc = 0; qc < s.num_q_cubes; ++qc) {
        const int32_t* r = s.row(b, h, qc);
        out[b][h].emplace_back(r, r + s.count[(b * s.heads + h) * s.num_q_cubes + qc]);
      }
  return out;
}

// Keys of one query cube in visiting order, and per key: its visited block and tile.
struct KeyList {
  std::vector<int64_t> keys, block, tile;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [begin, end) into keys
};
KeyList key_list(const Geo& g, const std::vector<int64_t>& cubes, int tile_blocks) {
  KeyList kl;
  int64_t nb = 0;
  for (int64_t kc : cubes) {
    const auto& m = g.members[kc];
    for (size_t r0 = 0; r0 < m.size(); r0 += 64) {
      const size_t r1 = std::min(m.size(), r0 + 64);
      kl.blocks.emplace_back(static_cast<int64_t>(kl.keys.size()), static_cast<int64_t>(kl.keys.size() + r1 - r0));
      for (size_t r = r0; r < r1; ++r) {
        kl.keys.push_back(m[r]);
        kl.block.push_back(nb);
        kl.tile.push_back(nb / tile_blocks);
      }
      ++nb;
    }
  }
  return kl;
}

// P^ of a [rows, keys] matrix: 16-key groups from each block's first key (a partial
// group zero-padded, which cannot change its amax since P >= 0).
torch::Tensor fq_groups(const torch::Tensor& p, const KeyList& kl) {
  const int64_t nk = p.size(1);
  std::vector<int64_t> slots;  // 16 per group; nk = the zero column
  for (auto [b0, b1] : kl.blocks)
    for (int64_t g0 = b0; g0 < b1; g0 += 16)
      for (int64_t j = g0; j < g0 + 16; ++j) slots.push_back(j < b1 ? j : nk);
  const torch::Tensor ix = idx(slots);
  const torch::Tensor ext = torch::cat({p, torch::zeros({p.size(0), 1}, p.options())}, 1);
  const torch::Tensor q = nvfp4_last_f64(ext.index_select(1, ix));
  torch::Tensor out = torch::zeros_like(ext);
  out.index_put_({Slice(), ix}, q);
  return out.index({Slice(), Slice(0, nk)});
}

struct Formula {
  // double, [B, L, H, D] / [B, H, L]
  torch::Tensor o, o_fine, o_fine_q, o_hp, m, l, dq, dk, dv, dgate;
  torch::Tensor scores, probs;  // [B, H, nc, nc]
  torch::Tensor q_c, out_c;     // [B, H, nc, D]
};

// Per (b, h) operand: [L, D] double.
torch::Tensor bh_slice(const torch::Tensor& x, int64_t b, int64_t h) {
  return x.index({b, Slice(), h, Slice()}).to(torch::kDouble);
}

Formula formula(const Problem& p, const Sel& sel, const FCfg& cfg) {
  const Geo g = geometry(p);
  const int64_t B = p.B, H = p.H, D = p.D, L = p.L(), nc = g.nc;
  // The spec's constants are fp32: scale and c = scale * log2(e).
  const float scale_f = p.softmax_scale > 0 ? p.softmax_scale : 1.0f / std::sqrt(static_cast<float>(D));
  const double scale = scale_f, c = static_cast<double>(scale_f * static_cast<float>(kLog2e));
  auto d64 = torch::TensorOptions().dtype(torch::kDouble);
  Formula f;
  f.o = torch::zeros({B, L, H, D}, d64);
  f.o_fine = torch::zeros({B, L, H, D}, d64);
  f.o_hp = torch::zeros({B, L, H, D}, d64);
  f.m = torch::zeros({B, H, L}, d64);
  f.l = torch::zeros({B, H, L}, d64);
  f.dq = torch::zeros({B, L, H, D}, d64);
  f.dk = torch::zeros({B, L, H, D}, d64);
  f.dv = torch::zeros({B, L, H, D}, d64);
  f.dgate = torch::zeros({B, L, H, D}, d64);
  f.scores = torch::zeros({B, H, nc, nc}, d64);
  f.probs = torch::zeros({B, H, nc, nc}, d64);
  f.q_c = torch::zeros({B, H, nc, D}, d64);
  f.out_c = torch::zeros({B, H, nc, D}, d64);
  const torch::Tensor cube_idx = idx(g.cube_of);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const torch::Tensor qb = bf16_f64(bh_slice(p.q, b, h)), kb = bf16_f64(bh_slice(p.k, b, h));
      const torch::Tensor vb = bf16_f64(bh_slice(p.v, b, h)), dob = bf16_f64(bh_slice(p.d_o, b, h));
      const torch::Tensor fq = cfg.quantize ? nvfp4_last_f64(qb) : qb, fk = cfg.quantize ? nvfp4_last_f64(kb) : kb;
      const torch::Tensor fv = cfg.quantize && cfg.quant_v ? nvfp4_last_f64(vb) : vb;
      // Coarse stage with autograd (straight-through bf16 roundings).
      {
        torch::Tensor ql = qb.clone().requires_grad_(true), kl = kb.clone().requires_grad_(true);
        torch::Tensor vl = vb.clone().requires_grad_(true);
        torch::Tensor gl = p.gate.defined() ? bf16_f64(bh_slice(p.gate, b, h)).requires_grad_(true)
                                            : torch::zeros({L, D}, d64).requires_grad_(true);
        auto ste = [](const torch::Tensor& x) { return x + (bf16_f64(x.detach()) - x.detach()); };
        std::vector<torch::Tensor> qm, km, vm;
        for (int64_t cc = 0; cc < nc; ++cc) {
          const torch::Tensor mi = idx(g.members[cc]);
          qm.push_back(ste(ql.index_select(0, mi).mean(0)));
          km.push_back(ste(kl.index_select(0, mi).mean(0)));
          vm.push_back(ste(vl.index_select(0, mi).mean(0)));
        }
        const torch::Tensor qc = torch::stack(qm), kc = torch::stack(km), vc = torch::stack(vm);
        const torch::Tensor sc = torch::matmul(qc, kc.t()) * scale;
        const torch::Tensor pr = torch::softmax(sc, -1);
        const torch::Tensor oc = ste(torch::matmul(pr, vc));
        const torch::Tensor y = oc.index_select(0, cube_idx) * gl;
        (y * dob).sum().backward();
        torch::NoGradGuard ng;
        f.scores.index_put_({b, h}, sc.detach());
        f.probs.index_put_({b, h}, pr.detach());
        f.q_c.index_put_({b, h}, qc.detach());
        f.out_c.index_put_({b, h}, oc.detach());
        f.o.index_put_({b, Slice(), h}, y.detach());  // coarse part; the fine part is added below
        f.dq.index_put_({b, Slice(), h}, ql.grad());
        f.dk.index_put_({b, Slice(), h}, kl.grad());
        f.dv.index_put_({b, Slice(), h}, vl.grad());
        f.dgate.index_put_({b, Slice(), h}, gl.grad());
      }
      torch::NoGradGuard ng;
      for (int64_t qc = 0; qc < nc; ++qc) {
        const KeyList kl = key_list(g, sel[b][h][qc], cfg.tile_blocks);
        const torch::Tensor R = idx(g.members[qc]), K = idx(kl.keys);
        const torch::Tensor s = torch::matmul(fq.index_select(0, R), fk.index_select(0, K).t()) * c;
        const int64_t nk = s.size(1);
        torch::Tensor m_run = torch::empty_like(s);
        torch::Tensor run = torch::full({s.size(0)}, -INFINITY, d64);
        for (int64_t j0 = 0; j0 < nk;) {
          int64_t j1 = j0;
          while (j1 < nk && kl.tile[j1] == kl.tile[j0]) ++j1;
          run = torch::maximum(run, std::get<0>(s.index({Slice(), Slice(j0, j1)}).max(1)));
          m_run.index_put_({Slice(), Slice(j0, j1)}, run.unsqueeze(1).expand({-1, j1 - j0}));
          j0 = j1;
        }
        // P is an fp32 value (the spec's exp2 in fp32).
        auto f32 = [](const torch::Tensor& x) { return x.to(torch::kFloat32).to(torch::kDouble); };
        const torch::Tensor pmat = f32(torch::exp2(s - m_run));
        const bool qp = cfg.quantize && cfg.quant_p;
        const torch::Tensor pq = qp ? fq_groups(pmat, kl) : pmat;
        const torch::Tensor mfin = run;
        const torch::Tensor w = torch::exp2(m_run - mfin.unsqueeze(1));
        const torch::Tensor l = (bf16_f64(pmat) * w).sum(1);
        const torch::Tensor VK = fv.index_select(0, K);
        const torch::Tensor o = torch::matmul(bf16_f64(pq) * w, VK) / l.unsqueeze(1);
        const torch::Tensor o_hp = torch::matmul(bf16_f64(pmat) * w, VK) / l.unsqueeze(1);
        f.o_fine.index_put_({b, R, h}, o);
        f.o_hp.index_put_({b, R, h}, o_hp);
        f.m.index_put_({b, h, R}, mfin);
        f.l.index_put_({b, h, R}, l);
        // Fine backward (straight-through).
        const torch::Tensor e = f32(torch::exp2(s - mfin.unsqueeze(1)));
        const torch::Tensor pn = e / l.unsqueeze(1);
        const torch::Tensor doR = dob.index_select(0, R);
        const torch::Tensor delta = (doR * o_hp).sum(1, true);
        const torch::Tensor ds = pn * (torch::matmul(doR, VK.t()) - delta);
        f.dq.index_put_({b, R, h}, f.dq.index({b, R, h}) + scale * torch::matmul(ds, fk.index_select(0, K)));
        f.dk.index({b, Slice(), h}).index_add_(0, K, scale * torch::matmul(ds.t(), fq.index_select(0, R)));
        torch::Tensor pb = pn;
        if (qp) pb = cfg.fastvideo ? fq_groups(f32(pn), kl) : fq_groups(e, kl) / l.unsqueeze(1);
        f.dv.index({b, Slice(), h}).index_add_(0, K, torch::matmul(pb.t(), doR));
      }
    }
  f.o = bf16_f64(f.o + f.o_fine);
  return f;
}

vr::Options ref_opts(const Problem& p, double sparsity, const FCfg& cfg) {
  vr::Options o;
  o.cube = p.cube;
  o.sparsity = sparsity;
  o.quantize = cfg.quantize;
  o.quant_p = cfg.quant_p;
  o.quant_v = cfg.quant_v;
  o.bwd_mode = cfg.fastvideo ? aq::BwdMode::kFastVideo : aq::BwdMode::kConsistent;
  o.tile_blocks = cfg.tile_blocks;
  o.softmax_scale = p.softmax_scale;
  return o;
}

aq::ConstView cview(const torch::Tensor& t) {
  if (!t.defined()) return {};
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
aq::View view(torch::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

struct RefRun {
  torch::Tensor o, dq, dk, dv, dgate;  // float32 [B, L, H, D]
  vr::Saved saved;
};

RefRun run_ref(const Problem& p, const vr::Options& opts, bool backward = true) {
  const vr::Tiling t = vr::make_tiling(p.T, p.Hg, p.Wg, p.cube);
  const vr::Dims dims{p.B, p.H, p.D};
  const float nan = std::nanf("");
  RefRun r;
  r.o = torch::full({p.B, p.L(), p.H, p.D}, nan);
  vr::forward(dims, t, cview(p.q), cview(p.k), cview(p.v), cview(p.gate), opts, view(r.o), &r.saved);
  if (!backward) return r;
  r.dq = torch::full_like(r.o, nan);
  r.dk = torch::full_like(r.o, nan);
  r.dv = torch::full_like(r.o, nan);
  r.dgate = torch::full_like(r.o, nan);
  vr::backward(dims, t, cview(p.q), cview(p.k), cview(p.v), cview(p.gate), r.saved, cview(p.d_o), opts,
               view(r.dq), view(r.dk), view(r.dv), view(r.dgate));
  return r;
}

torch::Tensor from_vec(const std::vector<float>& v, std::vector<int64_t> shape) {
  return torch::from_blob(const_cast<float*>(v.data()), shape, torch::kFloat32).clone();
}

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double den = b.to(torch::kDouble).abs().max().item<double>();
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / std::max(den, 1e-300);
}

// Rows whose formula top-k differs from the reference must sit on a near tie.
void expect_selection_consistent(const vr::SelectionLists& s, const Formula& f, const vr::Options& o) {
  const int64_t nc = s.num_q_cubes, k = vr::effective_topk(o.sparsity, nc);
  int64_t mismatched = 0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t qc = 0; qc < nc; ++qc) {
        const torch::Tensor sc = f.scores.index({b, h, qc});
        const torch::Tensor pr = f.probs.index({b, h, qc});
        std::vector<int64_t> order(nc);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
          return sc[x].item<double>() > sc[y].item<double>();
        });
        int64_t n = k;
        if (o.selection == vr::Selection::kTopP && o.top_p < 1.0) {
          double mass = 0;
          n = 0;
          while (n < k) {
            mass += pr[order[n]].item<double>();
            ++n;
            if (mass >= o.top_p) break;
          }
        }
        std::vector<int64_t> want(order.begin(), order.begin() + n);
        std::sort(want.begin(), want.end());
        const int32_t* r = s.row(b, h, qc);
        const int32_t cnt = s.count[(b * s.heads + h) * nc + qc];
        std::vector<int64_t> got(r, r + cnt);
        for (int64_t e = cnt; e < s.max_kv; ++e) EXPECT_EQ(r[e], -1) << "list padding must be -1";
        if (got == want) continue;
        ++mismatched;
        // A near tie at the cut: the last kept and the first dropped score agree closely.
        const double s_in = sc[order[n - 1]].item<double>();
        const double s_out = n < nc ? sc[order[n]].item<double>() : -INFINITY;
        EXPECT_LT(std::abs(s_in - s_out), 1e-5 * std::max(1.0, std::abs(s_in)))
            << "selection differs at b" << b << " h" << h << " qc" << qc;
      }
  EXPECT_LE(mismatched, 1) << "selections differ in more than one row";
}

struct Errs {
  double o, fine, hp, m, l, dq, dk, dv, dgate;
};

// Reference vs formula on one problem; returns the errors for printing.
Errs check_against_formula(const Problem& p, double sparsity, const FCfg& cfg, double tol) {
  const vr::Options opts = ref_opts(p, sparsity, cfg);
  RefRun r = run_ref(p, opts);
  for (const auto* t : {&r.o, &r.dq, &r.dk, &r.dv})
    EXPECT_TRUE(torch::isfinite(*t).all().item<bool>()) << "unwritten or non-finite output";
  if (p.gate.defined()) {
    EXPECT_TRUE(torch::isfinite(r.dgate).all().item<bool>());
  }
  const Formula f = formula(p, sel_of(r.saved.selection), cfg);
  expect_selection_consistent(r.saved.selection, f, opts);

  // The fine stage alone, unrounded (o and o_hp).
  const vr::Tiling t = vr::make_tiling(p.T, p.Hg, p.Wg, p.cube);
  torch::Tensor fine = torch::full({p.B, p.L(), p.H, p.D}, std::nanf(""));
  vr::fine_forward({p.B, p.H, p.D}, t, cview(p.q), cview(p.k), cview(p.v), r.saved.selection, opts, view(fine),
                   {}, nullptr, nullptr);
  Errs e{};
  const int64_t nc = r.saved.selection.num_q_cubes;
  EXPECT_TRUE(torch::equal(from_vec(r.saved.coarse.q_c, {p.B, p.H, nc, p.D}).to(torch::kDouble), f.q_c))
      << "cube means differ";
  // out_c is bf16(probs . v_c): fp32 and float64 sums may round a value near a bf16
  // midpoint differently, by one bf16 step (2^-7 relative at most), rarely.
  const torch::Tensor oc_ref = from_vec(r.saved.coarse.out_c, {p.B, p.H, nc, p.D}).to(torch::kDouble);
  const torch::Tensor oc_diff = (oc_ref - f.out_c).abs();
  const int64_t oc_flips = (oc_diff > 0).sum().item<int64_t>();
  EXPECT_TRUE((oc_diff <= f.out_c.abs() * std::ldexp(1.0, -7) + 1e-30).all().item<bool>()) << "out_c off by more than a bf16 step";
  EXPECT_LE(oc_flips, std::max<int64_t>(2, oc_diff.numel() / 256)) << "too many out_c roundings differ";
  e.fine = rel_err(fine, f.o_fine);
  e.hp = rel_err(from_vec(r.saved.o_fine_hp, {p.B, p.L(), p.H, p.D}), f.o_hp);
  e.m = rel_err(from_vec(r.saved.m, {p.B, p.H, p.L()}), f.m);
  e.l = rel_err(from_vec(r.saved.l, {p.B, p.H, p.L()}), f.l);
  // The returned output is bf16: one bf16 step per element (2^-7 relative at most), plus
  // the gate times one step of out_c where out_c rounded differently, plus the fine error.
  const torch::Tensor od = (r.o.to(torch::kDouble) - f.o).abs();
  torch::Tensor gate_oc = torch::zeros_like(f.o);
  if (p.gate.defined()) {
    const Geo g = geometry(p);
    const torch::Tensor oc_tok = f.out_c.index_select(2, idx(g.cube_of)).permute({0, 2, 1, 3});  // [B, L, H, D]
    gate_oc = (oc_tok * p.gate.to(torch::kDouble)).abs();
  }
  const torch::Tensor step = (torch::maximum(r.o.to(torch::kDouble).abs(), f.o.abs()) + gate_oc) * std::ldexp(1.0, -7) +
                             tol * f.o.abs().max().item<double>();
  EXPECT_TRUE((od <= step).all().item<bool>()) << "output off by more than one bf16 step, max " << od.max().item<double>();
  e.o = rel_err(r.o, f.o);
  e.dq = rel_err(r.dq, f.dq);
  e.dk = rel_err(r.dk, f.dk);
  e.dv = rel_err(r.dv, f.dv);
  e.dgate = rel_err(r.dgate, f.dgate);
  EXPECT_LT(e.fine, tol);
  EXPECT_LT(e.hp, tol);
  EXPECT_LT(e.m, 1e-6);
  EXPECT_LT(e.l, tol);
  EXPECT_LT(e.dq, tol);
  EXPECT_LT(e.dk, tol);
  EXPECT_LT(e.dv, tol);
  EXPECT_LT(e.dgate, oc_flips == 0 ? tol : std::ldexp(1.0, -7));  // dgate = bf16(dO) * out_c
  return e;
}

void print_errs(const Problem& p, const char* what, const Errs& e) {
  std::printf("  %s B%lld H%lld D%lld grid %lldx%lldx%lld cube %dx%dx%d: o %.1e fine %.1e hp %.1e m %.1e l %.1e dq %.1e "
              "dk %.1e dv %.1e dgate %.1e\n",
              what, (long long)p.B, (long long)p.H, (long long)p.D, (long long)p.T, (long long)p.Hg, (long long)p.Wg,
              p.cube.t, p.cube.h, p.cube.w, e.o, e.fine, e.hp, e.m, e.l, e.dq, e.dk, e.dv, e.dgate);
}

// Every combination of full / partial cubes along t, h and w for one cube shape.
std::vector<std::array<int64_t, 3>> partial_grids(vr::CubeShape c) {
  std::vector<std::array<int64_t, 3>> out;
  for (int pt = 0; pt < 2; ++pt)
    for (int ph = 0; ph < 2; ++ph)
      for (int pw = 0; pw < 2; ++pw)
        out.push_back({pt ? c.t + 1 : c.t, ph ? 2 * c.h - 1 : 2 * c.h, pw ? c.w + 3 : 2 * c.w});
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Tiling, effective_topk, selection.

TEST(VsaRefTiling, RoundTripsAndCubeContents) {
  for (vr::CubeShape cube : {vr::kCubeC64, vr::kCubeC128})
    for (auto g : partial_grids(cube)) {
      Problem p;
      p.T = g[0];
      p.Hg = g[1];
      p.Wg = g[2];
      p.cube = cube;
      const vr::Tiling t = vr::make_tiling(g[0], g[1], g[2], cube);
      const Geo geo = geometry(p);
      ASSERT_EQ(t.num_cubes, geo.nc);
      EXPECT_EQ(t.blocks_per_cube, cube.volume() / 64);
      EXPECT_EQ(t.padded_len, t.num_cubes * t.blocks_per_cube * 64);
      std::vector<int> seen(p.L(), 0);
      for (int64_t c = 0; c < t.num_cubes; ++c) {
        ASSERT_EQ(t.cube_tokens[c], static_cast<int32_t>(geo.members[c].size()));
        const int64_t base = c * t.blocks_per_cube * 64;
        for (int64_t i = 0; i < t.blocks_per_cube * 64; ++i) {
          const int64_t tok = t.slot_to_token[base + i];
          if (i < t.cube_tokens[c]) {
            ASSERT_EQ(tok, geo.members[c][i]) << "cube " << c << " slot " << i;
            ASSERT_EQ(t.token_to_slot[tok], base + i);
            ++seen[tok];
          } else {
            ASSERT_EQ(tok, -1) << "padding slot must be -1";
          }
        }
        for (int64_t bl = 0; bl < t.blocks_per_cube; ++bl)
          EXPECT_EQ(t.block_tokens[c * t.blocks_per_cube + bl],
                    std::clamp<int64_t>(t.cube_tokens[c] - 64 * bl, 0, 64));
      }
      for (int s : seen) ASSERT_EQ(s, 1) << "every token in exactly one slot";
    }
  EXPECT_THROW(vr::make_tiling(0, 4, 4, vr::kCubeC64), vqad::Error);
}

TEST(VsaRefTiling, WanShapesMatchTheResearchTable) {
  // research/wave2_vsa_dist_export.md A.2: cubes, padded length, empty / partial 64-blocks.
  struct Row {
    std::array<int64_t, 3> g;
    vr::CubeShape c;
    int64_t cubes, padded, empty, partial, topk;
  };
  const Row rows[] = {{{20, 30, 52}, vr::kCubeC64, 520, 33280, 0, 65, 52},
                      {{20, 30, 52}, vr::kCubeC128, 280, 35840, 70, 5, 28},
                      {{21, 30, 52}, vr::kCubeC64, 624, 39936, 0, 169, 63},
                      {{21, 30, 52}, vr::kCubeC128, 336, 43008, 126, 61, 34},
                      {{20, 28, 52}, vr::kCubeC128, 245, 31360, 35, 0, 25},
                      {{21, 45, 80}, vr::kCubeC128, 720, 92160, 170, 170, 72}};
  for (const Row& r : rows) {
    const vr::Tiling t = vr::make_tiling(r.g[0], r.g[1], r.g[2], r.c);
    int64_t empty = 0, partial = 0;
    for (int32_t n : t.block_tokens) {
      empty += n == 0;
      partial += n > 0 && n < 64;
    }
    EXPECT_EQ(t.num_cubes, r.cubes);
    EXPECT_EQ(t.padded_len, r.padded);
    EXPECT_EQ(empty, r.empty);
    EXPECT_EQ(partial, r.partial);
    EXPECT_EQ(vr::effective_topk(0.9, t.num_cubes), r.topk);
  }
}

TEST(VsaRefSelection, EffectiveTopk) {
  EXPECT_EQ(vr::effective_topk(0.0, 17), 17);
  EXPECT_EQ(vr::effective_topk(0.5, 17), 9);
  EXPECT_EQ(vr::effective_topk(0.9, 10), 1);
  EXPECT_EQ(vr::effective_topk(0.99, 10), 1);  // never below 1
  EXPECT_EQ(vr::effective_topk(0.9, 1), 1);
  EXPECT_EQ(vr::effective_topk(0.75, 4), 1);
  EXPECT_THROW(vr::effective_topk(1.0, 4), vqad::Error);
  EXPECT_THROW(vr::effective_topk(-0.1, 4), vqad::Error);
}

namespace {
// Coarse stage with given scores (softmax probs), one (b, h), for selection tests.
vr::Coarse coarse_with_scores(const std::vector<float>& s, int64_t nc) {
  vr::Coarse c;
  c.scores = s;
  c.probs.resize(s.size());
  for (int64_t i = 0; i < nc; ++i) {
    float mx = -INFINITY, tot = 0;
    for (int64_t j = 0; j < nc; ++j) mx = std::max(mx, s[i * nc + j]);
    for (int64_t j = 0; j < nc; ++j) tot += c.probs[i * nc + j] = std::exp(s[i * nc + j] - mx);
    for (int64_t j = 0; j < nc; ++j) c.probs[i * nc + j] /= tot;
  }
  return c;
}
std::vector<int32_t> row_of(const vr::SelectionLists& s, int64_t qc) {
  const int32_t* r = s.row(0, 0, qc);
  return std::vector<int32_t>(r, r + s.count[qc]);
}
}  // namespace

TEST(VsaRefSelection, TiesGoToTheLowerIndexAndListsAscend) {
  // Grid 4x4x16 with C64: 4 cubes. Row scores with ties.
  const vr::Tiling t = vr::make_tiling(4, 4, 16, vr::kCubeC64);
  ASSERT_EQ(t.num_cubes, 4);
  const std::vector<float> s = {1, 2, 2, 2,   // 2-way cut through a 3-way tie
                                5, 5, 5, 5,   // all equal
                                3, 1, 3, 0,   // tie for the top
                                0, 9, 1, 9};  // tie at the top, then a clear third
  vr::Options o;
  o.cube = vr::kCubeC64;
  o.sparsity = 0.5;  // topk 2
  const vr::SelectionLists sel = vr::select_cubes({1, 1, 16}, t, coarse_with_scores(s, 4), o);
  EXPECT_EQ(sel.max_kv, 2);
  EXPECT_EQ(row_of(sel, 0), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(row_of(sel, 1), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(row_of(sel, 2), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(row_of(sel, 3), (std::vector<int32_t>{1, 3}));
  o.sparsity = 0.7;  // topk ceil(0.3 * 4) = 2
  EXPECT_EQ(vr::select_cubes({1, 1, 16}, t, coarse_with_scores(s, 4), o).max_kv,
            vr::effective_topk(0.7, 4));
  o.sparsity = 0.0;
  const vr::SelectionLists all = vr::select_cubes({1, 1, 16}, t, coarse_with_scores(s, 4), o);
  for (int64_t qc = 0; qc < 4; ++qc) EXPECT_EQ(row_of(all, qc), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(VsaRefSelection, TopPStopsAtTheMassWithinOneAndTopk) {
  const vr::Tiling t = vr::make_tiling(4, 4, 16, vr::kCubeC64);
  // probs of row 0 ~ {0.64, 0.24, 0.09, 0.03}: ln ratios.
  const std::vector<float> s = {3.0f, 2.0f, 1.0f, 0.0f,  0.0f, 0.0f, 0.0f, 0.0f,
                                0.0f, 0.0f, 0.0f, 10.0f, 1.0f, 3.0f, 0.0f, 2.0f};
  const vr::Coarse c = coarse_with_scores(s, 4);
  vr::Options o;
  o.cube = vr::kCubeC64;
  o.selection = vr::Selection::kTopP;
  o.sparsity = 0.0;  // at most 4 cubes
  o.top_p = 0.8;
  vr::SelectionLists sel = vr::select_cubes({1, 1, 16}, t, c, o);
  EXPECT_EQ(row_of(sel, 0), (std::vector<int32_t>{0, 1}));        // 0.64 + 0.24 >= 0.8
  EXPECT_EQ(row_of(sel, 1), (std::vector<int32_t>{0, 1, 2, 3}));  // uniform: 4 x 0.25
  EXPECT_EQ(row_of(sel, 2), (std::vector<int32_t>{3}));           // one cube holds the mass
  EXPECT_EQ(row_of(sel, 3), (std::vector<int32_t>{1, 3}));
  o.sparsity = 0.5;  // at most 2
  sel = vr::select_cubes({1, 1, 16}, t, c, o);
  EXPECT_EQ(row_of(sel, 1), (std::vector<int32_t>{0, 1}));
  // top_p 1.0 selects exactly the top-k set.
  o.top_p = 1.0;
  vr::Options k = o;
  k.selection = vr::Selection::kTopK;
  const vr::SelectionLists a = vr::select_cubes({1, 1, 16}, t, c, o), b = vr::select_cubes({1, 1, 16}, t, c, k);
  EXPECT_EQ(a.index, b.index);
  EXPECT_EQ(a.count, b.count);
}

// ---------------------------------------------------------------------------------------
// Whole op vs the float64 formula.

TEST(VsaRef, BF16MatchesFormulaOnEveryPartialCubeCombination) {
  int64_t seed = 1000;
  for (vr::CubeShape cube : {vr::kCubeC64, vr::kCubeC128})
    for (auto g : partial_grids(cube)) {
      const Problem p = make_problem(2, 2, 32, g, cube, /*gate=*/true, seed++);
      print_errs(p, "bf16", check_against_formula(p, 0.5, FCfg{}, 1e-5));
    }
}

TEST(VsaRef, QuantizedMatchesFormulaOnEveryPartialCubeCombination) {
  int64_t seed = 2000;
  FCfg cfg;
  cfg.quantize = true;
  for (vr::CubeShape cube : {vr::kCubeC64, vr::kCubeC128})
    for (auto g : partial_grids(cube)) {
      const Problem p = make_problem(2, 2, 32, g, cube, true, seed++, 1.5);
      print_errs(p, "nvfp4", check_against_formula(p, 0.6, cfg, 1e-5));
    }
}

TEST(VsaRef, QuantizationVariantsAndTiles) {
  int64_t seed = 3000;
  FCfg fast;
  fast.quantize = true;
  fast.fastvideo = true;
  FCfg no_p;
  no_p.quantize = true;
  no_p.quant_p = false;
  FCfg no_v;
  no_v.quantize = true;
  no_v.quant_v = false;
  FCfg tiles2;
  tiles2.quantize = true;
  tiles2.tile_blocks = 2;
  FCfg tiles3_bf16;
  tiles3_bf16.tile_blocks = 3;
  const std::array<int64_t, 3> g{5, 7, 11};  // partial along every axis for both cubes
  for (const FCfg& cfg : {fast, no_p, no_v, tiles2, tiles3_bf16})
    for (vr::CubeShape cube : {vr::kCubeC64, vr::kCubeC128}) {
      const Problem p = make_problem(1, 3, 16, g, cube, true, seed++, 2.0);
      print_errs(p, "variant", check_against_formula(p, 0.3, cfg, 1e-5));
    }
}

TEST(VsaRef, DefaultSoftmaxScale) {
  // With c = log2(e) / sqrt(D) the fp32 and float64 logits differ in their last bits, so
  // bf16(P) and the E2M1 rounding of P flip for a few of the ~10^5 probabilities (each
  // flip moves the output by ~1e-4 of its range): a looser bound, still far below what a
  // wrong mask, tile or group gives (1e-2 and up).
  FCfg cfg;
  cfg.quantize = true;
  Problem p = make_problem(2, 2, 32, {5, 7, 11}, vr::kCubeC128, true, 4000, 1.5);
  p.softmax_scale = 0.0f;
  print_errs(p, "default scale", check_against_formula(p, 0.5, cfg, 2e-3));
}

TEST(VsaRef, NullGateIsAZeroGate) {
  const Problem p = make_problem(2, 1, 32, {5, 6, 9}, vr::kCubeC64, /*gate=*/false, 77);
  FCfg cfg;
  cfg.quantize = true;
  print_errs(p, "no gate", check_against_formula(p, 0.5, cfg, 1e-5));
  Problem z = p;
  z.gate = torch::zeros_like(p.q);
  const vr::Options o = ref_opts(p, 0.5, cfg);
  RefRun a = run_ref(p, o), b = run_ref(z, o);
  EXPECT_TRUE(torch::equal(a.o, b.o));
  EXPECT_TRUE(torch::equal(a.dq, b.dq));
  EXPECT_TRUE(torch::equal(a.dk, b.dk));
  EXPECT_TRUE(torch::equal(a.dv, b.dv));
  EXPECT_TRUE(torch::equal(a.dgate, b.dgate));  // dgate of a null gate: the zero gate's
}

TEST(VsaRef, SparsityZeroIsDenseAttentionPlusTheCoarseBranch) {
  // Every cube selected: the fine stage is dense attention over all tokens (in cube
  // order); with quantization off it equals softmax attention to bf16(P) precision.
  const Problem p = make_problem(1, 2, 32, {5, 6, 7}, vr::kCubeC64, false, 81);
  const vr::Options o = ref_opts(p, 0.0, FCfg{});
  RefRun r = run_ref(p, o, false);
  for (int32_t c : r.saved.selection.count) ASSERT_EQ(c, r.saved.selection.num_q_cubes);
  torch::Tensor qb = p.q.to(torch::kDouble).permute({0, 2, 1, 3}), kb = p.k.to(torch::kDouble).permute({0, 2, 1, 3});
  torch::Tensor vb = p.v.to(torch::kDouble).permute({0, 2, 1, 3});
  torch::Tensor dense =
      torch::matmul(torch::softmax(torch::matmul(qb, kb.transpose(-1, -2)) * p.softmax_scale, -1), vb)
          .permute({0, 2, 1, 3});
  const double e = rel_err(r.o, dense);
  std::printf("  sparsity 0 vs dense softmax attention: %.2e\n", e);
  EXPECT_LT(e, 1e-2);
}

TEST(VsaRef, EqualsAttnQatRefOverTheGatheredKeys) {
  // Where a query cube's visited blocks are full except possibly the last, the fine
  // stage is ATTN_QAT_TRAIN at block_n = 64 over the gathered keys, bit for bit (the
  // same summation orders); with all blocks full and tile_blocks = 2, block_n = 128.
  int64_t checked = 0;
  // 6 x 8 x 16: the t-partial cubes hold 64 tokens, one full block and one empty (skipped)
  // block; 6 x 8 x 13 adds partial blocks.
  for (std::array<int64_t, 3> grid : {std::array<int64_t, 3>{6, 8, 16}, {6, 8, 13}})
  for (int tile_blocks : {1, 2})
    for (bool quantize : {true, false}) {
      const Problem p = make_problem(1, 2, 32, grid, vr::kCubeC128, false, 90 + tile_blocks, 1.5);
      FCfg cfg;
      cfg.quantize = quantize;
      cfg.tile_blocks = tile_blocks;
      const vr::Options o = ref_opts(p, 0.5, cfg);
      const vr::Tiling t = vr::make_tiling(p.T, p.Hg, p.Wg, p.cube);
      RefRun r = run_ref(p, o);
      const Geo g = geometry(p);
      torch::Tensor fine = torch::empty_like(r.o), fine_hp = torch::empty_like(r.o), dq = torch::empty_like(r.o);
      torch::Tensor dk = torch::empty_like(r.o), dv = torch::empty_like(r.o);
      std::vector<float> m(p.B * p.H * p.L()), l(m.size());
      vr::fine_forward({p.B, p.H, p.D}, t, cview(p.q), cview(p.k), cview(p.v), r.saved.selection, o, view(fine),
                       view(fine_hp), m.data(), l.data());
      vr::fine_backward({p.B, p.H, p.D}, t, cview(p.q), cview(p.k), cview(p.v), cview(fine_hp), cview(p.d_o),
                        m.data(), l.data(), r.saved.selection, o, view(dq), view(dk), view(dv));
      const Sel sel = sel_of(r.saved.selection);
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t h = 0; h < p.H; ++h)
          for (int64_t qc = 0; qc < g.nc; ++qc) {
            const KeyList kl = key_list(g, sel[b][h][qc], 1);
            bool eligible = true;
            for (size_t i = 0; i + 1 < kl.blocks.size(); ++i)
              eligible &= kl.blocks[i].second - kl.blocks[i].first == 64;
            if (tile_blocks == 2) eligible &= kl.blocks.back().second - kl.blocks.back().first == 64;
            if (!eligible) continue;
            ++checked;
            const torch::Tensor R = idx(g.members[qc]), K = idx(kl.keys);
            auto gather = [&](const torch::Tensor& x, const torch::Tensor& rows) {
              return x.index({b, rows, h}).reshape({1, rows.size(0), 1, p.D}).contiguous();
            };
            torch::Tensor qg = gather(p.q, R), kg = gather(p.k, K), vg = gather(p.v, K), dog = gather(p.d_o, R);
            aq::Options ao;
            ao.block_n = 64 * tile_blocks;
            ao.softmax_scale = p.softmax_scale;
            ao.quant_p = ao.quant_v = ao.quant_qk = quantize;
            const aq::Dims d{1, R.size(0), K.size(0), 1, p.D};
            torch::Tensor o2 = torch::empty_like(qg), hp2 = torch::empty_like(qg), dq2 = torch::empty_like(qg);
            torch::Tensor dk2 = torch::empty_like(kg), dv2 = torch::empty_like(kg);
            std::vector<float> m2(R.size(0)), l2(R.size(0));
            aq::forward(d, cview(qg), cview(kg), cview(vg), ao, view(o2), view(hp2), m2.data(), l2.data());
            aq::backward(d, cview(qg), cview(kg), cview(vg), cview(hp2), cview(dog), m2.data(), l2.data(), ao,
                         view(dq2), view(dk2), view(dv2));
            ASSERT_TRUE(torch::equal(gather(fine, R), o2)) << "o, qc " << qc;
            ASSERT_TRUE(torch::equal(gather(fine_hp, R), hp2)) << "o_hp, qc " << qc;
            ASSERT_TRUE(torch::equal(gather(dq, R), dq2)) << "dq, qc " << qc;
            for (int64_t i = 0; i < R.size(0); ++i) {
              const int64_t tok = R[i].item<int64_t>();
              ASSERT_EQ(m[(b * p.H + h) * p.L() + tok], m2[i]);
              ASSERT_EQ(l[(b * p.H + h) * p.L() + tok], l2[i]);
            }
          }
    }
  std::printf("  query cubes compared bit for bit with attention_qat_ref: %lld\n", (long long)checked);
  EXPECT_GE(checked, 32);
}

TEST(VsaRef, DkDvSumThePerQueryCubeAttnQatGradients) {
  // dK / dV of a key = the sum over the query cubes that selected its cube of the
  // ATTN_QAT_TRAIN gradients of those cubes' attention over their gathered keys.
  const Problem p = make_problem(1, 2, 32, {4, 8, 16}, vr::kCubeC128, false, 95, 1.5);  // all cubes full
  FCfg cfg;
  cfg.quantize = true;
  const vr::Options o = ref_opts(p, 0.5, cfg);
  const vr::Tiling t = vr::make_tiling(p.T, p.Hg, p.Wg, p.cube);
  RefRun r = run_ref(p, o);
  const Geo g = geometry(p);
  torch::Tensor fine_hp = from_vec(r.saved.o_fine_hp, {p.B, p.L(), p.H, p.D});
  torch::Tensor dq = torch::empty_like(r.o), dk = torch::empty_like(r.o), dv = torch::empty_like(r.o);
  vr::fine_backward({p.B, p.H, p.D}, t, cview(p.q), cview(p.k), cview(p.v), cview(fine_hp), cview(p.d_o),
                    r.saved.m.data(), r.saved.l.data(), r.saved.selection, o, view(dq), view(dk), view(dv));
  torch::Tensor dk_sum = torch::zeros({p.B, p.L(), p.H, p.D}, torch::kDouble), dv_sum = torch::zeros_like(dk_sum);
  const Sel sel = sel_of(r.saved.selection);
  for (int64_t h = 0; h < p.H; ++h)
    for (int64_t qc = 0; qc < g.nc; ++qc) {
      const KeyList kl = key_list(g, sel[0][h][qc], 1);
      const torch::Tensor R = idx(g.members[qc]), K = idx(kl.keys);
      auto gather = [&](const torch::Tensor& x, const torch::Tensor& rows) {
        return x.index({0, rows, h}).reshape({1, rows.size(0), 1, p.D}).contiguous();
      };
      torch::Tensor qg = gather(p.q, R), kg = gather(p.k, K), vg = gather(p.v, K), dog = gather(p.d_o, R);
      aq::Options ao;
      ao.block_n = 64;
      ao.softmax_scale = p.softmax_scale;
      const aq::Dims d{1, R.size(0), K.size(0), 1, p.D};
      torch::Tensor o2 = torch::empty_like(qg), hp2 = torch::empty_like(qg), dq2 = torch::empty_like(qg);
      torch::Tensor dk2 = torch::empty_like(kg), dv2 = torch::empty_like(kg);
      std::vector<float> m2(R.size(0)), l2(R.size(0));
      aq::forward(d, cview(qg), cview(kg), cview(vg), ao, view(o2), view(hp2), m2.data(), l2.data());
      aq::backward(d, cview(qg), cview(kg), cview(vg), cview(hp2), cview(dog), m2.data(), l2.data(), ao,
                   view(dq2), view(dk2), view(dv2));
      dk_sum.index({0, Slice(), h}).index_add_(0, K, dk2.reshape({-1, p.D}).to(torch::kDouble));
      dv_sum.index({0, Slice(), h}).index_add_(0, K, dv2.reshape({-1, p.D}).to(torch::kDouble));
    }
  const double edk = rel_err(dk, dk_sum), edv = rel_err(dv, dv_sum);
  std::printf("  dk %.2e dv %.2e vs summed attention_qat_ref gradients\n", edk, edv);
  EXPECT_LT(edk, 1e-5);
  EXPECT_LT(edv, 1e-5);
}

// ---------------------------------------------------------------------------------------
// Gradients by central differences of a float64 recomputation without roundings.

namespace {

// F = <dO, out> with out = out_c * gate + attention over the selected cubes, all in
// float64 without any rounding; the fine stage reads (fq, fk, fv), the coarse stage
// (cq, ck, cv), both [B, L, H, D].
double exact_objective(const Problem& p, const Sel& sel, const torch::Tensor& fq, const torch::Tensor& fk,
                       const torch::Tensor& fv, const torch::Tensor& cq, const torch::Tensor& ck,
                       const torch::Tensor& cv, const torch::Tensor& gate, const torch::Tensor& d_o) {
  const Geo g = geometry(p);
  const double scale = p.softmax_scale > 0 ? p.softmax_scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  double total = 0;
  const torch::Tensor cube_idx = idx(g.cube_of);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h) {
      auto sl = [&](const torch::Tensor& x) { return x.index({b, Slice(), h}); };
      const torch::Tensor dob = sl(d_o);
      std::vector<torch::Tensor> qm, km, vm;
      for (int64_t c = 0; c < g.nc; ++c) {
        const torch::Tensor mi = idx(g.members[c]);
        qm.push_back(sl(cq).index_select(0, mi).mean(0));
        km.push_back(sl(ck).index_select(0, mi).mean(0));
        vm.push_back(sl(cv).index_select(0, mi).mean(0));
      }
      const torch::Tensor oc =
          torch::matmul(torch::softmax(torch::matmul(torch::stack(qm), torch::stack(km).t()) * scale, -1),
                        torch::stack(vm));
      total += (oc.index_select(0, cube_idx) * sl(gate) * dob).sum().item<double>();
      for (int64_t qc = 0; qc < g.nc; ++qc) {
        std::vector<int64_t> keys;
        for (int64_t kc : sel[b][h][qc]) keys.insert(keys.end(), g.members[kc].begin(), g.members[kc].end());
        const torch::Tensor R = idx(g.members[qc]), K = idx(keys);
        const torch::Tensor pr =
            torch::softmax(torch::matmul(sl(fq).index_select(0, R), sl(fk).index_select(0, K).t()) * scale, -1);
        total += (torch::matmul(pr, sl(fv).index_select(0, K)) * dob.index_select(0, R)).sum().item<double>();
      }
    }
  return total;
}

void check_central_differences(const FCfg& cfg, int64_t seed) {
  const Problem p = make_problem(1, 2, 16, {5, 6, 9}, vr::kCubeC64, true, seed, 1.5);
  const vr::Options o = ref_opts(p, 0.5, cfg);
  RefRun r = run_ref(p, o);
  const Sel sel = sel_of(r.saved.selection);
  torch::NoGradGuard ng;
  auto d = [](const torch::Tensor& x) { return x.to(torch::kDouble); };
  auto fqd = [&](const torch::Tensor& x, bool quant) {
    torch::Tensor b = bf16_f64(d(x));
    return quant ? nvfp4_last_f64(b) : b;
  };
  // Straight-through: the fine stage sees the quantized operands, the coarse stage the
  // bf16 ones; a perturbation of q moves both.
  torch::Tensor x[7] = {fqd(p.q, cfg.quantize), fqd(p.k, cfg.quantize), fqd(p.v, cfg.quantize && cfg.quant_v),
                        bf16_f64(d(p.q)), bf16_f64(d(p.k)), bf16_f64(d(p.v)), bf16_f64(d(p.gate))};
  const torch::Tensor dob = bf16_f64(d(p.d_o));
  const torch::Tensor grads[4] = {r.dq, r.dk, r.dv, r.dgate};
  const double eps = 1e-4;
  torch::manual_seed(seed + 1);
  for (int which = 0; which < 4; ++which) {
    const torch::Tensor g = grads[which].to(torch::kDouble).reshape(-1);
    const double gmax = g.abs().max().item<double>();
    // Coordinates: the largest gradient entries plus random ones.
    std::vector<int64_t> coords;
    torch::Tensor top = std::get<1>(g.abs().topk(4));
    for (int64_t i = 0; i < 4; ++i) coords.push_back(top[i].item<int64_t>());
    torch::Tensor rnd = torch::randint(g.numel(), {8}, torch::kLong);
    for (int64_t i = 0; i < 8; ++i) coords.push_back(rnd[i].item<int64_t>());
    double worst = 0, fd_norm2 = 0, ref_norm2 = 0;
    for (int64_t cidx : coords) {
      auto eval = [&](double delta) {
        torch::Tensor y[7];
        for (int i = 0; i < 7; ++i) y[i] = x[i].clone();
        auto bump = [&](int i) { y[i].view(-1)[cidx] += delta; };
        if (which < 3) {
          bump(which);
          bump(which + 3);
        } else {
          bump(6);
        }
        return exact_objective(p, sel, y[0], y[1], y[2], y[3], y[4], y[5], y[6], dob);
      };
      const double fd = (eval(eps) - eval(-eps)) / (2 * eps);
      const double got = g[cidx].item<double>();
      worst = std::max(worst, std::abs(got - fd) / gmax);
      fd_norm2 += fd * fd;
      ref_norm2 += got * got;
    }
    const bool p_quantized_dv = which == 2 && cfg.quantize && cfg.quant_p;
    std::printf("  central differences (%s), d%s: max err / max|g| %.2e, |g| / |fd| %.3f\n",
                cfg.quantize ? "nvfp4" : "bf16", which == 3 ? "gate" : which == 0 ? "q" : which == 1 ? "k" : "v",
                worst, std::sqrt(ref_norm2 / fd_norm2));
    if (p_quantized_dv) {
      // dV uses P^ (spec: ||dV|| / ||dV_STE|| within [0.9, 1.1]).
      EXPECT_NEAR(std::sqrt(ref_norm2 / fd_norm2), 1.0, 0.1);
    } else {
      // bf16(P) in the reference's forward sums: about 2^-9 relative per term.
      EXPECT_LT(worst, 2e-2) << "gradient " << which;
    }
  }
}

}  // namespace

TEST(VsaRefGradients, CentralDifferencesBf16) { check_central_differences(FCfg{}, 500); }

TEST(VsaRefGradients, CentralDifferencesStraightThroughQuantized) {
  FCfg cfg;
  cfg.quantize = true;
  check_central_differences(cfg, 600);
  cfg.quant_p = false;
  check_central_differences(cfg, 700);
}

// ---------------------------------------------------------------------------------------

TEST(VsaRef, ResultsDoNotDependOnTheThreadCount) {
  const Problem p = make_problem(2, 2, 32, {6, 5, 11}, vr::kCubeC128, true, 42, 1.5);
  FCfg cfg;
  cfg.quantize = true;
  vr::Options a = ref_opts(p, 0.6, cfg), b = a;
  a.num_threads = 1;
  b.num_threads = 3;
  RefRun ra = run_ref(p, a), rb = run_ref(p, b);
  const std::vector<std::pair<torch::Tensor*, torch::Tensor*>> pairs = {
      {&ra.o, &rb.o}, {&ra.dq, &rb.dq}, {&ra.dk, &rb.dk}, {&ra.dv, &rb.dv}, {&ra.dgate, &rb.dgate}};
  for (auto [x, y] : pairs) EXPECT_TRUE(torch::equal(*x, *y));
}

TEST(VsaRef, RejectsBadInput) {
  const Problem p = make_problem(1, 1, 16, {4, 4, 8}, vr::kCubeC64, false, 1);
  const vr::Tiling t = vr::make_tiling(4, 4, 8, vr::kCubeC64);
  torch::Tensor o = torch::empty_like(p.q);
  auto run = [&](const vr::Options& opts, vr::Dims d) {
    vr::forward(d, t, cview(p.q), cview(p.k), cview(p.v), {}, opts, view(o), nullptr);
  };
  vr::Options ok;
  ok.cube = vr::kCubeC64;
  EXPECT_NO_THROW(run(ok, {1, 1, 16}));
  vr::Options wrong_cube = ok;
  wrong_cube.cube = vr::kCubeC128;
  EXPECT_THROW(run(wrong_cube, {1, 1, 16}), vqad::Error);
  vr::Options bad_sparsity = ok;
  bad_sparsity.sparsity = 1.0;
  EXPECT_THROW(run(bad_sparsity, {1, 1, 16}), vqad::Error);
  vr::Options bad_top_p = ok;
  bad_top_p.top_p = 0.0;
  EXPECT_THROW(run(bad_top_p, {1, 1, 16}), vqad::Error);
  vr::Options bad_tiles = ok;
  bad_tiles.tile_blocks = 0;
  EXPECT_THROW(run(bad_tiles, {1, 1, 16}), vqad::Error);
  EXPECT_THROW(run(ok, {1, 1, 24}), vqad::Error);  // D not a multiple of 16
}
