// VSA CUDA pipeline (kernels/vsa/vsa_kernels.h) against the CPU reference
// (numerics/vsa_ref.h) run with the kernels' tile_blocks, on fresh random inputs:
// coarse means (bitwise), selection lists (equal, or differing only at a score tie within
// rounding), O, dQ, dK, dV, dgate within a tolerance derived from the measured BF16
// noise floor of each output, NaN-poisoned outputs fully written, sentinel gaps between
// heads and past the end untouched, ragged grids (partial cubes in t, h and w), both
// cube shapes, B > 1, H > 1, both backward modes, BF16 mode, and bitwise determinism
// across two runs. Every failure prints the largest errors and the first bad index. The
// buffers, the poison checks and the noise-floor tolerance are tests/support's.
// C128 runs on the ATTN_QAT_TRAIN wgmma kernels with visit lists (tile_blocks 2), C64 on
// the mma.sync kernels (tile_blocks 1); the hand-made-list tests pin the C128 forward's
// odd visit counts, one-block cubes and single-block lists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "tests/support/metrics.h"
#include "vqad/core/error.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/vsa/vsa_kernels.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/vsa_ref.h"

namespace {

namespace kv = vqad::kernels::vsa;
namespace vr = vqad::vsa_ref;
namespace aq = vqad::attn_qat_ref;
constexpr int kD = kv::kVsaHeadDim;

using vqad::test::bf16_bits;
using vqad::test::bf16_value;
using vqad::test::DeviceBlhd;
using vqad::test::DeviceBuffer;

struct Case {
  const char* name;
  int B, H, T, Hg, W;
  vr::CubeShape cube;
  double sparsity;
  vr::Selection selection = vr::Selection::kTopK;
  double top_p = 1.0;
  bool quantize = true, quant_p = true, quant_v = true;
  aq::BwdMode bwd = aq::BwdMode::kConsistent;
  bool gate = true;
  uint32_t seed = 1;
  bool zero_q = false;  // q = 0: every coarse score ties exactly (selection by index alone)
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << c.name << " B=" << c.B << " H=" << c.H << " grid " << c.T << "x" << c.Hg << "x" << c.W << " cube "
     << c.cube.t << "x" << c.cube.h << "x" << c.cube.w << " sparsity " << c.sparsity
     << (c.selection == vr::Selection::kTopP ? " top-p " : " top-k ") << c.top_p
     << (c.quantize ? " QAT" : " BF16") << (c.quant_p ? "" : " no-quant-p") << (c.quant_v ? "" : " no-quant-v")
     << " bwd " << aq::bwd_mode_name(c.bwd) << (c.gate ? " gate" : " no-gate") << " seed " << c.seed;
  return os.str();
}

// Outputs in raster BLHD order, as bf16 bits, with a gap of kGap elements after every
// head row and kTail elements past the end, all poisoned with 0xFF bytes (NaN).
constexpr int kGap = 8;
constexpr int kTail = 64;
DeviceBlhd raster_out(int64_t B, int64_t L, int64_t H) { return DeviceBlhd(B, L, H, kD, kGap, 0, kTail); }
// Values [B, L, H, D] of a raster output; *ok &= every gap / tail element still holds the poison.
std::vector<float> raster_values(const DeviceBlhd& t, bool* ok) {
  const std::vector<uint16_t> raw = t.raw();
  *ok = *ok && t.poison_damage(raw) == 0;
  return t.values(raw);
}

std::string where(int64_t i, int64_t L, int64_t H) {
  if (i < 0) return "-";
  std::ostringstream os;
  const int64_t d = i % kD, h = (i / kD) % H, l = (i / kD / H) % L, b = i / kD / H / L;
  os << "(b=" << b << ", l=" << l << ", h=" << h << ", d=" << d << ")";
  return os.str();
}

// The tolerance: vqad::test::floor_tolerance, kBf16FloorMultiple x the BF16 noise floor
// of the (unrounded, fp32) reference output, as for the dense ATTN_QAT_TRAIN kernels.
void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& want, int64_t L,
                  int64_t H, const std::string& ctx) {
  const vqad::test::Closeness c = vqad::test::closeness(got, want);
  const double tol = vqad::test::floor_tolerance(c);
  std::printf("  %-6s rel_l2 %.3e  floor %.3e  tol %.3e  max_abs %.3e at %s\n", what, c.rel, c.floor, tol,
              c.max_abs, where(c.worst, L, H).c_str());
  EXPECT_LT(c.first_nonfinite, 0) << what << ": element " << where(c.first_nonfinite, L, H)
                            << " is not finite (unwritten or NaN) in " << ctx;
  EXPECT_LE(c.rel, tol) << what << ": rel_l2 " << c.rel << " > " << tol << " (floor " << c.floor << "), worst "
                        << where(c.worst, L, H) << " got " << (c.worst >= 0 ? got[c.worst] : 0.0f) << " want "
                        << (c.worst >= 0 ? want[c.worst] : 0.0f) << " in " << ctx;
}

struct GpuResult {
  std::vector<uint16_t> o, dq, dk, dv, dgate;
  std::vector<float> o_v, dq_v, dk_v, dv_v, dgate_v;
  std::vector<float> q_c, k_c, v_c, probs, out_c;
  vr::SelectionLists sel;
  bool sentinels_ok = true;
  // The forward without a backward (null o_fine_hp, m, l), run first on the same inputs.
  std::vector<uint16_t> o_nograd;
  std::vector<int32_t> sel_index_nograd, sel_count_nograd;
  bool nograd_sentinels_ok = true;
};

std::vector<int32_t> i32(const std::vector<int64_t>& v) {
  std::vector<int32_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = static_cast<int32_t>(v[i]);
  return r;
}

GpuResult run_gpu(const Case& cs, const vr::Tiling& t, const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, const std::vector<float>& gate, const std::vector<float>& d_o,
                  int64_t topk) {
  const int64_t B = cs.B, H = cs.H, L = t.num_tokens(), P = t.padded_len, nc = t.num_cubes;
  DeviceBuffer<int32_t> s2t(static_cast<size_t>(P), 0), t2s(static_cast<size_t>(L), 0), ct(static_cast<size_t>(nc), 0),
      bt(t.block_tokens.size(), 0);
  s2t.upload(i32(t.slot_to_token));
  t2s.upload(i32(t.token_to_slot));
  ct.upload(t.cube_tokens);
  bt.upload(t.block_tokens);
  kv::VsaConfig c;
  c.batch = cs.B;
  c.heads = cs.H;
  c.head_dim = kD;
  c.grid_t = cs.T, c.grid_h = cs.Hg, c.grid_w = cs.W;
  c.tiling.len = static_cast<int>(L);
  c.tiling.num_cubes = static_cast<int>(nc);
  c.tiling.blocks_per_cube = static_cast<int>(t.blocks_per_cube);
  c.tiling.padded_len = static_cast<int>(P);
  c.tiling.max_cube_tokens = *std::max_element(t.cube_tokens.begin(), t.cube_tokens.end());
  c.tiling.slot_to_token = s2t.get();
  c.tiling.token_to_slot = t2s.get();
  c.tiling.cube_tokens = ct.get();
  c.tiling.block_tokens = bt.get();
  c.topk = static_cast<int>(topk);
  c.top_p_mode = cs.selection == vr::Selection::kTopP && cs.top_p < 1.0;
  c.top_p = static_cast<float>(cs.top_p);
  c.quantize = cs.quantize;
  c.quant_p = cs.quant_p;
  c.quant_v = cs.quant_v;
  c.bwd_fastvideo = cs.bwd == aq::BwdMode::kFastVideo;

  auto upload_bits = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_bits(x[i]);
    return b;
  };
  const size_t n = static_cast<size_t>(B * L * H * kD);
  DeviceBuffer<uint16_t> dq_in(n, 0), dk_in(n, 0), dv_in(n, 0), dgate_in(cs.gate ? n : 0, 0), ddo(n, 0);
  dq_in.upload(upload_bits(q));
  dk_in.upload(upload_bits(k));
  dv_in.upload(upload_bits(v));
  if (cs.gate) dgate_in.upload(upload_bits(gate));
  ddo.upload(upload_bits(d_o));
  const int64_t sh = kD, sl = H * kD, sb = L * H * kD;
  auto in = [&](const DeviceBuffer<uint16_t>& d) { return vqad::kernels::BlhdIn{d.get(), {sb, sl, sh, 1}}; };

  const size_t tiled = static_cast<size_t>(B * H * P * kD);
  DeviceBuffer<uint16_t> tq(tiled, 0xFF), tk(tiled, 0xFF), tv(tiled, 0xFF), ohp(tiled, 0xFF);
  DeviceBuffer<float> m(static_cast<size_t>(B * H * P), 0xFF), l(static_cast<size_t>(B * H * P), 0xFF);
  DeviceBuffer<int32_t> sel_index(static_cast<size_t>(B * H * nc * topk), 0xFF), sel_count(static_cast<size_t>(B * H * nc), 0xFF);
  const size_t coarse = static_cast<size_t>(B * H * nc * kD);
  DeviceBuffer<float> q_c(coarse, 0xFF), k_c(coarse, 0xFF), v_c(coarse, 0xFF), out_c(coarse, 0xFF),
      probs(static_cast<size_t>(B * H * nc * nc), 0xFF);
  DeviceBlhd o = raster_out(B, L, H), gq = raster_out(B, L, H), gk = raster_out(B, L, H), gv = raster_out(B, L, H),
             gg = raster_out(B, L, H);
  DeviceBuffer<uint8_t> wsf(kv::vsa_forward_workspace_bytes(c), 0xFF), wsb(kv::vsa_backward_workspace_bytes(c), 0xFF);
  GpuResult r;

  kv::VsaForwardArgs fa;
  fa.q = in(dq_in);
  fa.k = in(dk_in);
  fa.v = in(dv_in);
  if (cs.gate) fa.gate = in(dgate_in);
  fa.tiled_q = tq.get(), fa.tiled_k = tk.get(), fa.tiled_v = tv.get();
  fa.sel_index = sel_index.get(), fa.sel_count = sel_count.get();
  fa.q_c = q_c.get(), fa.k_c = k_c.get(), fa.v_c = v_c.get(), fa.probs = probs.get(), fa.out_c = out_c.get();
  {
    // A forward that no backward follows: o_fine_hp, m and l null (the fine stage without
    // the O_hp product), its own workspace size; o into a poisoned buffer of its own. Half
    // of the three set is refused.
    DeviceBlhd o_ng = raster_out(B, L, H);
    DeviceBuffer<uint8_t> ws_ng(kv::vsa_forward_workspace_bytes(c, /*saves=*/false), 0xFF);
    kv::VsaForwardArgs ng = fa;
    ng.o = o_ng.out();
    ng.workspace = ws_ng.get();
    kv::VsaForwardArgs partial = ng;
    partial.o_fine_hp = ohp.get();
    EXPECT_THROW(kv::vsa_forward(c, partial, nullptr), vqad::Error) << "o_fine_hp without m and l";
    partial.o_fine_hp = nullptr, partial.m = m.get(), partial.l = l.get();
    EXPECT_THROW(kv::vsa_forward(c, partial, nullptr), vqad::Error) << "m and l without o_fine_hp";
    kv::vsa_forward(c, ng, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    bool ok = true;
    (void)raster_values(o_ng, &ok);
    r.nograd_sentinels_ok = ok;
    r.o_nograd = o_ng.raw();
    r.sel_index_nograd = sel_index.download();
    r.sel_count_nograd = sel_count.download();
  }
  fa.o = o.out();
  fa.o_fine_hp = ohp.get(), fa.m = m.get(), fa.l = l.get();
  fa.workspace = wsf.get();
  kv::vsa_forward(c, fa, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());

  kv::VsaBackwardArgs ba;
  if (cs.gate) ba.gate = in(dgate_in);
  ba.d_o = in(ddo);
  ba.tiled_q = tq.get(), ba.tiled_k = tk.get(), ba.tiled_v = tv.get(), ba.o_fine_hp = ohp.get();
  ba.m = m.get(), ba.l = l.get(), ba.sel_index = sel_index.get(), ba.sel_count = sel_count.get();
  ba.q_c = q_c.get(), ba.k_c = k_c.get(), ba.v_c = v_c.get(), ba.probs = probs.get(), ba.out_c = out_c.get();
  ba.dq = gq.out();
  ba.dk = gk.out();
  ba.dv = gv.out();
  if (cs.gate) ba.dgate = gg.out();
  ba.workspace = wsb.get();
  kv::vsa_backward(c, ba, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());

  bool ok = true, all = true;
  r.o_v = raster_values(o, &ok);
  all &= ok;
  r.dq_v = raster_values(gq, &ok);
  all &= ok;
  r.dk_v = raster_values(gk, &ok);
  all &= ok;
  r.dv_v = raster_values(gv, &ok);
  all &= ok;
  if (cs.gate) {
    r.dgate_v = raster_values(gg, &ok);
    all &= ok;
    r.dgate = gg.raw();
  }
  r.sentinels_ok = all;
  r.o = o.raw(), r.dq = gq.raw(), r.dk = gk.raw(), r.dv = gv.raw();
  r.q_c = q_c.download(), r.k_c = k_c.download(), r.v_c = v_c.download();
  r.probs = probs.download(), r.out_c = out_c.download();
  r.sel.batch = B, r.sel.heads = H, r.sel.num_q_cubes = nc, r.sel.max_kv = topk;
  r.sel.index = sel_index.download();
  r.sel.count = sel_count.download();
  return r;
}

// Rows whose lists differ must differ only among cubes whose reference scores tie with
// the selection boundary within rounding (a few fp32 ulps of the row's scale), or, for
// top-p, only in the count where the cumulative probability meets top_p within rounding.
bool selection_explained(const vr::SelectionLists& got, const vr::SelectionLists& want, const vr::Coarse& coarse,
                         int64_t nc, double top_p, std::string* msg) {
  int64_t rows_differ = 0;
  bool ok = true;
  const int64_t rows = want.batch * want.heads * want.num_q_cubes;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* a = got.index.data() + r * got.max_kv;
    const int32_t* b = want.index.data() + r * want.max_kv;
    const bool same = got.count[r] == want.count[r] && std::equal(a, a + got.max_kv, b);
    if (same) continue;
    ++rows_differ;
    const float* s = coarse.scores.data() + r * nc;
    std::vector<int32_t> in_a(a, a + std::max(0, got.count[r])), in_b(b, b + want.count[r]);
    float lo_sel = INFINITY, hi_out = -INFINITY, amax = 0;
    for (int32_t j : in_b) lo_sel = std::min(lo_sel, s[j]);
    for (int64_t j = 0; j < nc; ++j) {
      amax = std::max(amax, std::fabs(s[j]));
      if (std::find(in_b.begin(), in_b.end(), j) == in_b.end()) hi_out = std::max(hi_out, s[j]);
    }
    bool tie = got.count[r] == want.count[r] && std::fabs(lo_sel - hi_out) <= 4e-6f * std::max(amax, 1e-6f);
    if (!tie && top_p < 1.0 && std::abs(got.count[r] - want.count[r]) == 1) {
      // Same order, one cube more or less: the mass after the shorter list must sit at top_p.
      const float* pr = coarse.probs.data() + r * nc;
      std::vector<int32_t> order(static_cast<size_t>(nc));
      for (int64_t j = 0; j < nc; ++j) order[j] = static_cast<int32_t>(j);
      std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return s[x] > s[y]; });
      const int32_t n = std::min(got.count[r], want.count[r]);
      double mass = 0;
      for (int32_t e = 0; e < n; ++e) mass += pr[order[e]];
      std::vector<int32_t> longer(order.begin(), order.begin() + n + 1), shorter(order.begin(), order.begin() + n);
      std::sort(longer.begin(), longer.end());
      std::sort(shorter.begin(), shorter.end());
      const std::vector<int32_t>& ga = got.count[r] > want.count[r] ? longer : shorter;
      const std::vector<int32_t>& gb = got.count[r] > want.count[r] ? shorter : longer;
      tie = std::fabs(mass - top_p) <= 1e-5 && ga == in_a && gb == in_b;
    }
    if (!tie && ok) {
      std::ostringstream os;
      os << "row " << r << " (b*H*nc + h*nc + query cube): GPU count " << got.count[r] << " list [";
      for (int32_t j : in_a) os << j << " ";
      os << "], reference count " << want.count[r] << " list [";
      for (int32_t j : in_b) os << j << " ";
      os << "], boundary scores " << lo_sel << " / " << hi_out;
      *msg = os.str();
      ok = false;
    }
  }
  if (ok && rows_differ > 0) *msg = std::to_string(rows_differ) + " rows differ at score ties";
  return ok;
}

std::vector<float> randn(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = aq::bf16_round(nd(rng));
  return x;
}

void run_case(const Case& cs) {
  ASSERT_GT(vqad::kernels::device_count(), 0) << "GPU tests need a CUDA device";
  const std::string ctx = describe(cs);
  std::printf("[%s]\n", ctx.c_str());
  const vr::Tiling t = vr::make_tiling(cs.T, cs.Hg, cs.W, cs.cube);
  const int64_t B = cs.B, H = cs.H, L = t.num_tokens(), nc = t.num_cubes;
  std::mt19937 rng(cs.seed * 7919u + 17u);
  const size_t n = static_cast<size_t>(B * L * H * kD);
  std::vector<float> q = randn(n, 1.0f, rng);
  const std::vector<float> k = randn(n, 1.0f, rng), v = randn(n, 1.0f, rng);
  if (cs.zero_q) std::fill(q.begin(), q.end(), 0.0f);
  const std::vector<float> gate = cs.gate ? randn(n, 0.5f, rng) : std::vector<float>();
  const std::vector<float> d_o = randn(n, 1.0f, rng);

  vr::Options opts;
  opts.cube = cs.cube;
  opts.sparsity = cs.sparsity;
  opts.selection = cs.selection;
  opts.top_p = cs.top_p;
  opts.quantize = cs.quantize;
  opts.quant_p = cs.quant_p;
  opts.quant_v = cs.quant_v;
  opts.bwd_mode = cs.bwd;
  opts.tile_blocks = kv::vsa_tile_blocks(static_cast<int>(t.blocks_per_cube));
  const vr::Dims dims{B, H, kD};
  const int64_t topk = vr::effective_topk(cs.sparsity, nc);
  auto view = [&](const std::vector<float>& x) {
    return x.empty() ? aq::ConstView{} : aq::contiguous_view(x.data(), L, H, kD);
  };

  const GpuResult g = run_gpu(cs, t, q, k, v, gate, d_o, topk);
  EXPECT_TRUE(g.sentinels_ok) << "a kernel wrote into the gaps between head rows or past the end, " << ctx;
  // The forward without a backward: the same output bits and selection as the full one.
  EXPECT_TRUE(g.nograd_sentinels_ok) << "the forward without O_hp wrote into the gaps or past the end, " << ctx;
  EXPECT_EQ(g.o_nograd, g.o) << "O of the forward without O_hp differs from the full forward's, " << ctx;
  EXPECT_EQ(g.sel_index_nograd, g.sel.index) << "selection of the forward without O_hp, " << ctx;
  EXPECT_EQ(g.sel_count_nograd, g.sel.count) << "selection counts of the forward without O_hp, " << ctx;

  // Reference, stage by stage (with the GPU's lists where they differ only at ties).
  vr::Saved saved;
  saved.coarse = vr::coarse_forward(dims, t, view(q), view(k), view(v), opts);
  const vr::SelectionLists ref_sel = vr::select_cubes(dims, t, saved.coarse, opts);
  {
    std::string msg;
    const bool ok = selection_explained(g.sel, ref_sel, saved.coarse, nc,
                                        cs.selection == vr::Selection::kTopP ? cs.top_p : 1.0, &msg);
    EXPECT_TRUE(ok) << "selection differs beyond score ties: " << msg << " in " << ctx;
    if (!msg.empty()) std::printf("  selection: %s\n", msg.c_str());
    if (cs.zero_q) {
      // Exact ties everywhere: the lists are the reference's, entry for entry.
      EXPECT_EQ(g.sel.count, ref_sel.count) << "selection counts with tied scores, " << ctx;
      EXPECT_EQ(g.sel.index, ref_sel.index) << "selection lists with tied scores, " << ctx;
    }
    if (!ok) return;
  }
  saved.selection = g.sel;
  auto bitwise = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    int64_t bad = -1;
    for (size_t i = 0; i < b.size() && bad < 0; ++i)
      if (std::memcmp(&a[i], &b[i], 4) != 0) bad = static_cast<int64_t>(i);
    EXPECT_LT(bad, 0) << what << " differs from the reference at flat index " << bad << " (" << a[bad] << " vs "
                      << b[bad] << ") in " << ctx;
  };
  bitwise("q_c", g.q_c, saved.coarse.q_c);
  bitwise("k_c", g.k_c, saved.coarse.k_c);
  bitwise("v_c", g.v_c, saved.coarse.v_c);
  {
    const vqad::test::Closeness cp = vqad::test::closeness(g.probs, saved.coarse.probs);
    std::printf("  probs  rel_l2 %.3e\n", cp.rel);
    EXPECT_LE(cp.rel, 1e-5) << "coarse probabilities, " << ctx;
    const vqad::test::Closeness co = vqad::test::closeness(g.out_c, saved.coarse.out_c);
    std::printf("  out_c  rel_l2 %.3e (floor %.3e)\n", co.rel, co.floor);
    // Same summation order; probabilities within an ulp can flip a rare bf16 rounding.
    EXPECT_LE(co.rel, 1e-3) << "coarse out_c, " << ctx;
  }

  std::vector<float> fine(n), hp(n);
  saved.m.assign(static_cast<size_t>(B * H * L), 0.0f);
  saved.l.assign(saved.m.size(), 0.0f);
  vr::fine_forward(dims, t, view(q), view(k), view(v), saved.selection, opts, aq::contiguous_view(fine.data(), L, H, kD),
                   aq::contiguous_view(hp.data(), L, H, kD), saved.m.data(), saved.l.data());
  saved.o_fine_hp = hp;
  std::vector<float> o_ref(n);
  const int64_t cube_slots = t.blocks_per_cube * vr::kPhysicalBlockTokens;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) {
      const int64_t cube = t.token_to_slot[i] / cube_slots;
      for (int64_t h = 0; h < H; ++h)
        for (int d = 0; d < kD; ++d) {
          const size_t e = static_cast<size_t>(((b * L + i) * H + h) * kD + d);
          const float oc = saved.coarse.out_c[static_cast<size_t>(((b * H + h) * nc + cube) * kD + d)];
          // Unrounded: the comparison's noise floor is the bf16 rounding of this value.
          o_ref[e] = cs.gate ? oc * gate[e] + fine[e] : fine[e];
        }
    }
  std::vector<float> dq(n), dk(n), dv(n), dgate(cs.gate ? n : 0);
  vr::backward(dims, t, view(q), view(k), view(v), view(gate), saved, view(d_o), opts,
               aq::contiguous_view(dq.data(), L, H, kD), aq::contiguous_view(dk.data(), L, H, kD),
               aq::contiguous_view(dv.data(), L, H, kD),
               cs.gate ? aq::contiguous_view(dgate.data(), L, H, kD) : aq::View{});

  expect_close("O", g.o_v, o_ref, L, H, ctx);
  expect_close("dQ", g.dq_v, dq, L, H, ctx);
  expect_close("dK", g.dk_v, dk, L, H, ctx);
  expect_close("dV", g.dv_v, dv, L, H, ctx);
  if (cs.gate) expect_close("dgate", g.dgate_v, dgate, L, H, ctx);

  // Bitwise determinism: a second run on the same inputs.
  const GpuResult g2 = run_gpu(cs, t, q, k, v, gate, d_o, topk);
  EXPECT_EQ(g.o, g2.o) << "O differs between two runs, " << ctx;
  EXPECT_EQ(g.dq, g2.dq) << "dQ differs between two runs, " << ctx;
  EXPECT_EQ(g.dk, g2.dk) << "dK differs between two runs, " << ctx;
  EXPECT_EQ(g.dv, g2.dv) << "dV differs between two runs, " << ctx;
  EXPECT_EQ(g.dgate, g2.dgate) << "dgate differs between two runs, " << ctx;
  EXPECT_EQ(g.sel.index, g2.sel.index) << "selection differs between two runs, " << ctx;
}

// The pipeline cases, each against the CPU reference (run_case); the test name is the
// case's (TEST_P VsaCuda/Pipeline.Case/<name>).
Case with(Case c, void (*edit)(Case&)) {
  edit(c);
  return c;
}
const Case kPipelineCases[] = {
    // t: 5 = 4 + 1, h: 6 = 4 + 2, w: 10 = 8 + 2 -> partial cubes in every direction,
    // empty second physical blocks in the small border cubes.
    {"QatC128RaggedBatchHeads", 2, 2, 5, 6, 10, vr::kCubeC128, 0.5},
    with({"QatC64RaggedTopPFastVideo", 1, 3, 6, 5, 7, vr::kCubeC64, 0.4},
         [](Case& c) { c.selection = vr::Selection::kTopP, c.top_p = 0.5, c.bwd = aq::BwdMode::kFastVideo, c.seed = 2; }),
    with({"Bf16C128FullCubesNoGate", 1, 2, 8, 8, 16, vr::kCubeC128, 0.75},
         [](Case& c) { c.quantize = false, c.gate = false, c.seed = 3; }),
    with({"Bf16C64RaggedGate", 2, 1, 5, 7, 9, vr::kCubeC64, 0.6}, [](Case& c) { c.quantize = false, c.seed = 4; }),
    with({"QatC64NoQuantVNoGate", 1, 2, 4, 9, 9, vr::kCubeC64, 0.7},
         [](Case& c) { c.quant_v = false, c.gate = false, c.seed = 5; }),
    with({"QatC128NoQuantP", 1, 2, 4, 8, 12, vr::kCubeC128, 0.5}, [](Case& c) { c.quant_p = false, c.seed = 6; }),
    // The Wan grid's border pattern (h 30 = 7 * 4 + 2, w 52 = 6 * 8 + 4) on fewer frames.
    with({"QatC128WanLikeBorders", 1, 2, 4, 30, 52, vr::kCubeC128, 0.9}, [](Case& c) { c.seed = 7; }),
    // Sparsity 0: every query cube visits all 12 cubes (24 blocks, 12 KV tiles of the
    // wgmma forward), so the list prefetch runs over many tiles.
    with({"QatC128DenseLists", 1, 1, 8, 8, 24, vr::kCubeC128, 0.0}, [](Case& c) { c.seed = 8; }),
    // q = 0: all coarse scores are exactly 0, so top-k keeps the lowest cube indices.
    with({"Bf16C128TiedScores", 1, 2, 5, 6, 10, vr::kCubeC128, 0.6},
         [](Case& c) { c.quantize = false, c.zero_q = true, c.seed = 9; }),
    // Uniform coarse probabilities: top-p keeps the first ceil(top_p * nc) cubes by index.
    with({"QatC64TiedScoresTopP", 2, 1, 6, 5, 7, vr::kCubeC64, 0.3},
         [](Case& c) { c.selection = vr::Selection::kTopP, c.top_p = 0.35, c.zero_q = true, c.seed = 10; }),
    // 1 x 7 x 28 = 196 cubes of 32 tokens: the coarse kernels' dynamic shared memory is
    // just under 48 KiB, their static memory takes the block past it (the launch must opt
    // in); partial cubes in t.
    with({"Bf16C128ManyCubesOneFrame", 1, 1, 1, 28, 224, vr::kCubeC128, 0.9},
         [](Case& c) { c.quantize = false, c.seed = 11; }),
    // 1 x 25 x 40 = 1000 cubes (a 121-frame 720p Wan latent has 960): the coarse kernels'
    // shared memory must not grow with the cube count past what a block may have.
    with({"Bf16C128ThousandCubesOneFrame", 1, 1, 1, 100, 320, vr::kCubeC128, 0.97},
         [](Case& c) { c.quantize = false, c.seed = 12; }),
    // h 6 = 4 + 2, w 12 = 8 + 4: the border cubes hold one physical block, so their dK/dV
    // tiles split the query list between the two warpgroups (odd and even list lengths),
    // here with the FastVideo backward mode.
    with({"QatC128OneBlockCubesFastVideo", 1, 2, 5, 6, 12, vr::kCubeC128, 0.3},
         [](Case& c) { c.bwd = aq::BwdMode::kFastVideo, c.seed = 13; }),
};

// How gtest shows a case (test listings, failures).
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

class Pipeline : public ::testing::TestWithParam<Case> {};
TEST_P(Pipeline, Case) { run_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(VsaCuda, Pipeline, ::testing::ValuesIn(kPipelineCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// The C128 fine forward (the attention visit-list wgmma kernel, tile_blocks 2) on
// hand-made lists against vsa_ref::fine_forward at tile_blocks 2: lists of one
// one-block cube (a single tile, second half empty), odd visit counts, one-block cubes
// in the middle of a list (block pairs that straddle cubes), the full list, and query
// cubes of one physical block (the CTA's second warpgroup on padding rows). O, O_hp,
// m and l of every valid tiled row; padding rows are not compared.
void run_fine_lists(bool quant_p, uint32_t seed) {
  const int64_t B = 1, H = 2;
  const vr::Tiling t = vr::make_tiling(5, 6, 10, vr::kCubeC128);  // 8 cubes, border ones of 1 block
  const int64_t L = t.num_tokens(), P = t.padded_len, nc = t.num_cubes, bpc = t.blocks_per_cube;
  ASSERT_EQ(kv::vsa_fine_forward_kernel(static_cast<int>(bpc)), kv::VsaFineForward::kWgmmaPairs);
  std::vector<int64_t> one_block;
  for (int64_t cb = 0; cb < nc; ++cb)
    if (t.cube_tokens[cb] <= vr::kPhysicalBlockTokens) one_block.push_back(cb);
  ASSERT_GE(one_block.size(), 2u) << "the grid must have one-block cubes";
  std::mt19937 rng(seed);
  const size_t n = static_cast<size_t>(B * L * H * kD);
  const std::vector<float> q = randn(n, 1.0f, rng), k = randn(n, 1.0f, rng), v = randn(n, 1.0f, rng);

  vr::SelectionLists sel;
  sel.batch = B, sel.heads = H, sel.num_q_cubes = nc, sel.max_kv = nc;
  sel.index.assign(static_cast<size_t>(B * H * nc * nc), -1);
  sel.count.assign(static_cast<size_t>(B * H * nc), 0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t qc = 0; qc < nc; ++qc) {
      std::vector<int32_t> cubes;
      const int64_t kind = (qc + h * 3) % 5;
      if (kind == 0) {
        cubes = {static_cast<int32_t>(one_block[qc % one_block.size()])};  // one block in total
      } else if (kind == 1) {
        for (int64_t cb = 0; cb < nc; ++cb) cubes.push_back(static_cast<int32_t>(cb));  // full list
      } else {
        // a one-block cube between full ones, and a random subset
        std::vector<int32_t> all;
        for (int64_t cb = 0; cb < nc; ++cb) all.push_back(static_cast<int32_t>(cb));
        std::shuffle(all.begin(), all.end(), rng);
        const int64_t cnt = 2 + static_cast<int64_t>(rng() % static_cast<uint32_t>(nc - 2));
        cubes.assign(all.begin(), all.begin() + cnt);
        if (std::find(cubes.begin(), cubes.end(), one_block[0]) == cubes.end())
          cubes.push_back(static_cast<int32_t>(one_block[0]));
        std::sort(cubes.begin(), cubes.end());
      }
      const int64_t row = h * nc + qc;
      for (size_t e = 0; e < cubes.size(); ++e) sel.index[static_cast<size_t>(row * nc) + e] = cubes[e];
      sel.count[static_cast<size_t>(row)] = static_cast<int32_t>(cubes.size());
    }

  vr::Options opts;
  opts.cube = vr::kCubeC128;
  opts.quantize = true;
  opts.quant_p = quant_p;
  opts.tile_blocks = kv::vsa_tile_blocks(static_cast<int>(bpc));
  ASSERT_EQ(opts.tile_blocks, 2);
  const vr::Dims dims{B, H, kD};
  std::vector<float> o_ref(n), hp_ref(n), m_ref(static_cast<size_t>(B * H * L)), l_ref(m_ref.size());
  vr::fine_forward(dims, t, aq::contiguous_view(q.data(), L, H, kD), aq::contiguous_view(k.data(), L, H, kD),
                   aq::contiguous_view(v.data(), L, H, kD), sel, opts, aq::contiguous_view(o_ref.data(), L, H, kD),
                   aq::contiguous_view(hp_ref.data(), L, H, kD), m_ref.data(), l_ref.data());

  // Device side: tiling tables, tiled (quantized) operands, the lists, the forward.
  DeviceBuffer<int32_t> s2t(static_cast<size_t>(P), 0), t2s(static_cast<size_t>(L), 0), ct(static_cast<size_t>(nc), 0),
      bt(t.block_tokens.size(), 0);
  s2t.upload(i32(t.slot_to_token));
  t2s.upload(i32(t.token_to_slot));
  ct.upload(t.cube_tokens);
  bt.upload(t.block_tokens);
  kv::VsaConfig c;
  c.batch = static_cast<int>(B);
  c.heads = static_cast<int>(H);
  c.grid_t = 5, c.grid_h = 6, c.grid_w = 10;
  c.tiling.len = static_cast<int>(L);
  c.tiling.num_cubes = static_cast<int>(nc);
  c.tiling.blocks_per_cube = static_cast<int>(bpc);
  c.tiling.padded_len = static_cast<int>(P);
  c.tiling.max_cube_tokens = *std::max_element(t.cube_tokens.begin(), t.cube_tokens.end());
  c.tiling.slot_to_token = s2t.get();
  c.tiling.token_to_slot = t2s.get();
  c.tiling.cube_tokens = ct.get();
  c.tiling.block_tokens = bt.get();
  c.topk = static_cast<int>(nc);
  c.quantize = true;
  c.quant_p = quant_p;
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_bits(x[i]);
    return b;
  };
  DeviceBuffer<uint16_t> rq(n, 0), rk(n, 0), rv(n, 0);
  rq.upload(bits(q));
  rk.upload(bits(k));
  rv.upload(bits(v));
  const int64_t sh = kD, sl = H * kD, sb = L * H * kD;
  const size_t tiled = static_cast<size_t>(B * H * P * kD);
  DeviceBuffer<uint16_t> tq(tiled, 0xFF), tk(tiled, 0xFF), tv(tiled, 0xFF), o(tiled, 0xFF), ohp(tiled, 0xFF);
  DeviceBuffer<float> m(static_cast<size_t>(B * H * P), 0xFF), l(static_cast<size_t>(B * H * P), 0xFF);
  DeviceBuffer<int32_t> si(sel.index.size(), 0), sc(sel.count.size(), 0);
  si.upload(sel.index);
  sc.upload(sel.count);
  DeviceBuffer<uint8_t> scratch(std::max<size_t>(kv::fine_forward_scratch_bytes(c), 256), 0xFF);
  const vqad::kernels::BlhdStrides rs{sb, sl, sh, 1};
  kv::launch_tile(c, {rq.get(), rs}, tq.get(), true, nullptr);
  kv::launch_tile(c, {rk.get(), rs}, tk.get(), true, nullptr);
  kv::launch_tile(c, {rv.get(), rs}, tv.get(), true, nullptr);
  kv::launch_fine_forward(c, tq.get(), tk.get(), tv.get(), si.get(), sc.get(), o.get(), ohp.get(), m.get(), l.get(), scratch.get(),
                          nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> o_t = o.download(), hp_t = ohp.download();
  const std::vector<float> m_t = m.download(), l_t = l.download();

  // Tiled rows -> raster order (valid slots only).
  std::vector<float> o_got(n, NAN), hp_got(n, NAN);
  double m_err = 0, l_err = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t slot = 0; slot < P; ++slot) {
      const int64_t tok = t.slot_to_token[slot];
      if (tok < 0) continue;
      const size_t trow = static_cast<size_t>((h * P + slot) * kD);
      for (int d = 0; d < kD; ++d) {
        const size_t e = static_cast<size_t>((tok * H + h) * kD + d);
        o_got[e] = bf16_value(o_t[trow + d]);
        hp_got[e] = bf16_value(hp_t[trow + d]);
      }
      const float mg = m_t[static_cast<size_t>(h * P + slot)], mr = m_ref[static_cast<size_t>(h * L + tok)];
      const float lg = l_t[static_cast<size_t>(h * P + slot)], lr = l_ref[static_cast<size_t>(h * L + tok)];
      m_err = std::max(m_err, std::fabs(static_cast<double>(mg) - mr) / std::max(1.0, std::fabs(static_cast<double>(mr))));
      l_err = std::max(l_err, std::fabs(static_cast<double>(lg) - lr) / std::fabs(static_cast<double>(lr)));
      if (!std::isfinite(mg) || !std::isfinite(lg)) m_err = INFINITY;
    }
  const std::string ctx = std::string("fine lists C128 ") + (quant_p ? "quant-p" : "no-quant-p");
  std::printf("[%s] m rel err %.3e, l rel err %.3e\n", ctx.c_str(), m_err, l_err);
  expect_close("O", o_got, o_ref, L, H, ctx);
  expect_close("O_hp", hp_got, hp_ref, L, H, ctx);
  EXPECT_LE(m_err, 1e-5) << "row max m, " << ctx;
  EXPECT_LE(l_err, 2e-3) << "row sum l, " << ctx;
}

TEST(VsaCuda, FineForwardC128HandListsQuantP) { run_fine_lists(true, 11); }
TEST(VsaCuda, FineForwardC128HandListsNoQuantP) { run_fine_lists(false, 12); }

TEST(VsaCuda, RefusesUnsupportedShapes) {
  ASSERT_GT(vqad::kernels::device_count(), 0) << "GPU tests need a CUDA device";
  kv::VsaConfig c;
  c.batch = 1;
  c.heads = 1;
  c.head_dim = 64;
  kv::VsaForwardArgs a;
  EXPECT_THROW(kv::vsa_forward(c, a, nullptr), vqad::Error);
  c.head_dim = kD;
  EXPECT_THROW(kv::vsa_forward(c, a, nullptr), vqad::Error);  // empty tiling
}

}  // namespace
