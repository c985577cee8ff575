// The VSA autograd op (ops/vsa_attention.h) and its registry entry: the op is the
// reference (numerics/vsa_ref.h) behind torch tensors, forward and backward, with any
// strides; the backends dispatch through self_attention; errors name the call.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "tests/support/errors.h"
#include "vqad/core/attention_backend.h"
#include "vqad/core/error.h"
#include "vqad/numerics/vsa_ref.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/vsa_attention.h"

namespace {

namespace vr = vqad::vsa_ref;
namespace aq = vqad::attn_qat_ref;
using vqad::AttentionBackend;

torch::Tensor bf16_valued(torch::IntArrayRef shape, double mul = 1.0) {
  return (torch::randn(shape) * mul).to(torch::kBFloat16).to(torch::kFloat32);
}

aq::ConstView cview(const torch::Tensor& t) {
  if (!t.defined()) return {};
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
aq::View view(torch::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

using vqad::test::error_of;

struct Inputs {
  torch::Tensor q, k, v, gate, d_o;
};
Inputs inputs(int64_t B, int64_t L, int64_t H, int64_t D, int64_t seed) {
  torch::manual_seed(seed);
  return {bf16_valued({B, L, H, D}, 1.5), bf16_valued({B, L, H, D}, 1.5), bf16_valued({B, L, H, D}),
          bf16_valued({B, L, H, D}, 0.5), bf16_valued({B, L, H, D})};
}

}  // namespace

TEST(VsaOp, BackendNamesCubesAndQuantization) {
  EXPECT_EQ(vqad::parse_attention_backend("VSA_TRAIN"), AttentionBackend::kVsaTrain);
  EXPECT_EQ(vqad::parse_attention_backend("VSA_TRAIN_C64"), AttentionBackend::kVsaTrain);
  EXPECT_EQ(vqad::parse_attention_backend("VSA_TRAIN_C128"), AttentionBackend::kVsaTrainC128);
  EXPECT_STREQ(vqad::attention_backend_name(AttentionBackend::kVsaTrain), "VSA_TRAIN");
  EXPECT_STREQ(vqad::attention_backend_name(AttentionBackend::kVsaTrainC128), "VSA_TRAIN_C128");
  EXPECT_NE(vqad::attention_backend_choices().find("VSA_TRAIN_C128"), std::string::npos);
  const std::pair<AttentionBackend, std::array<int, 4>> rows[] = {
      {AttentionBackend::kVsaTrain, {4, 4, 4, 0}},
      {AttentionBackend::kVsaTrainC128, {4, 4, 8, 0}},
      {AttentionBackend::kVsaQatTrainC64, {4, 4, 4, 1}},
      {AttentionBackend::kVsaQatTrainC128, {4, 4, 8, 1}}};
  for (const auto& [b, want] : rows) {
    EXPECT_TRUE(vqad::ops::is_vsa_backend(b));
    const vr::CubeShape c = vqad::ops::vsa_cube_of(b);
    EXPECT_EQ((std::array<int, 4>{c.t, c.h, c.w, vqad::ops::vsa_quantized(b) ? 1 : 0}), want);
  }
  EXPECT_FALSE(vqad::ops::is_vsa_backend(AttentionBackend::kAttnQatTrain));
  EXPECT_THROW(vqad::ops::vsa_cube_of(AttentionBackend::kTorchSdpa), vqad::Error);
  EXPECT_EQ(vqad::ops::parse_vsa_selection("top-p", "k"), vr::Selection::kTopP);
  EXPECT_NE(error_of([] { vqad::ops::parse_vsa_selection("topk", "training.vsa.selection"); })
                .find("training.vsa.selection"),
            std::string::npos);
}

TEST(VsaOp, ForwardAndBackwardAreTheReference) {
  const std::array<int64_t, 3> grid{5, 6, 9};
  const int64_t B = 2, H = 2, D = 32, L = 5 * 6 * 9;
  for (AttentionBackend backend : {AttentionBackend::kVsaQatTrainC128, AttentionBackend::kVsaTrain}) {
    Inputs in = inputs(B, L, H, D, 3);
    vqad::ops::VsaOptions opts;
    opts.sparsity = 0.5;
    torch::Tensor q = in.q.to(torch::kBFloat16).requires_grad_(true);
    torch::Tensor k = in.k.to(torch::kBFloat16).requires_grad_(true);
    torch::Tensor v = in.v.to(torch::kBFloat16).requires_grad_(true);
    torch::Tensor g = in.gate.to(torch::kBFloat16).requires_grad_(true);
    vr::SelectionLists sel;
    torch::Tensor o = vqad::ops::vsa_attention(q, k, v, g, grid, backend, opts, &sel);
    ASSERT_EQ(o.scalar_type(), torch::kBFloat16);
    o.backward(in.d_o.to(torch::kBFloat16));

    const vr::Options ro = vqad::ops::vsa_ref_options(backend, opts);
    const vr::Tiling t = vr::make_tiling(grid[0], grid[1], grid[2], ro.cube);
    torch::Tensor ro_out = torch::empty({B, L, H, D});
    vr::Saved saved;
    vr::forward({B, H, D}, t, cview(in.q), cview(in.k), cview(in.v), cview(in.gate), ro, view(ro_out), &saved);
    torch::Tensor dq = torch::zeros_like(ro_out), dk = torch::zeros_like(ro_out), dv = torch::zeros_like(ro_out);
    torch::Tensor dg = torch::zeros_like(ro_out);
    vr::backward({B, H, D}, t, cview(in.q), cview(in.k), cview(in.v), cview(in.gate), saved, cview(in.d_o), ro,
                 view(dq), view(dk), view(dv), view(dg));
    const char* name = vqad::attention_backend_name(backend);
    EXPECT_TRUE(torch::equal(o.to(torch::kFloat32), ro_out)) << name;
    EXPECT_TRUE(torch::equal(q.grad(), dq.to(torch::kBFloat16))) << name;
    EXPECT_TRUE(torch::equal(k.grad(), dk.to(torch::kBFloat16))) << name;
    EXPECT_TRUE(torch::equal(v.grad(), dv.to(torch::kBFloat16))) << name;
    EXPECT_TRUE(torch::equal(g.grad(), dg.to(torch::kBFloat16))) << name;
    EXPECT_EQ(sel.index, saved.selection.index);
    EXPECT_EQ(sel.count, saved.selection.count);
    EXPECT_GT(g.grad().abs().sum().item<double>(), 0.0);
  }
}

TEST(VsaOp, StridedInputsAndAnUndefinedGate) {
  const std::array<int64_t, 3> grid{4, 7, 5};
  const int64_t B = 1, H = 3, D = 16, L = 4 * 7 * 5;
  Inputs in = inputs(B, L, H, D, 5);
  vqad::ops::VsaOptions opts;
  opts.sparsity = 0.4;
  opts.selection = vr::Selection::kTopP;
  opts.top_p = 0.7;
  const auto backend = AttentionBackend::kVsaQatTrainC64;
  // BHLD buffers viewed as BLHD: strides of a permutation.
  auto strided = [](const torch::Tensor& x) {
    return x.permute({0, 2, 1, 3}).contiguous().permute({0, 2, 1, 3}).requires_grad_(true);
  };
  torch::Tensor qs = strided(in.q), ks = strided(in.k), vs = strided(in.v);
  torch::Tensor o_strided = vqad::ops::vsa_attention(qs, ks, vs, {}, grid, backend, opts);
  o_strided.backward(in.d_o);
  torch::Tensor qc = in.q.clone().requires_grad_(true), kc = in.k.clone().requires_grad_(true);
  torch::Tensor vc = in.v.clone().requires_grad_(true);
  torch::Tensor zero = torch::zeros_like(in.q).requires_grad_(true);
  torch::Tensor o_zero = vqad::ops::vsa_attention(qc, kc, vc, zero, grid, backend, opts);
  o_zero.backward(in.d_o);
  EXPECT_TRUE(torch::equal(o_strided, o_zero));  // undefined gate = zero gate
  EXPECT_TRUE(torch::equal(qs.grad(), qc.grad()));
  EXPECT_TRUE(torch::equal(ks.grad(), kc.grad()));
  EXPECT_TRUE(torch::equal(vs.grad(), vc.grad()));
  EXPECT_GT(zero.grad().abs().sum().item<double>(), 0.0);  // the gate still gets its gradient
}

TEST(VsaOp, SparsityAndSelectionAreUsed) {
  const std::array<int64_t, 3> grid{8, 8, 8};  // 8 C64 cubes
  Inputs in = inputs(1, 512, 1, 32, 7);
  auto run = [&](double sparsity, vr::Selection s, double top_p, vr::SelectionLists* sel) {
    vqad::ops::VsaOptions o;
    o.sparsity = sparsity;
    o.selection = s;
    o.top_p = top_p;
    return vqad::ops::vsa_attention(in.q, in.k, in.v, in.gate, grid, AttentionBackend::kVsaTrain, o, sel);
  };
  vr::SelectionLists dense_sel, sparse_sel, p_sel;
  torch::Tensor dense = run(0.0, vr::Selection::kTopK, 1.0, &dense_sel);
  torch::Tensor sparse = run(0.75, vr::Selection::kTopK, 1.0, &sparse_sel);
  run(0.0, vr::Selection::kTopP, 0.3, &p_sel);
  EXPECT_EQ(dense_sel.max_kv, 8);
  EXPECT_EQ(sparse_sel.max_kv, 2);
  for (int32_t c : sparse_sel.count) EXPECT_EQ(c, 2);
  int64_t fewer = 0;
  for (int32_t c : p_sel.count) {
    EXPECT_GE(c, 1);
    fewer += c < 8;
  }
  EXPECT_GT(fewer, 0) << "top-p 0.3 kept every cube everywhere";
  EXPECT_GT((dense - sparse).abs().max().item<double>(), 1e-3);
}

TEST(VsaOp, DispatchThroughSelfAttention) {
  const std::array<int64_t, 3> grid{4, 4, 8};
  Inputs in = inputs(1, 128, 2, 32, 9);
  vqad::ops::AttentionSpec spec;
  spec.backend = AttentionBackend::kVsaQatTrainC128;
  spec.vsa.sparsity = 0.5;
  torch::Tensor got = vqad::ops::self_attention(in.q, in.k, in.v, spec, {in.gate, grid});
  torch::Tensor want = vqad::ops::vsa_attention(in.q, in.k, in.v, in.gate, grid, spec.backend, spec.vsa);
  EXPECT_TRUE(torch::equal(got, want));
  // Without the grid the call names the backend and what is missing.
  const std::string e = error_of([&] { vqad::ops::self_attention(in.q, in.k, in.v, spec); });
  EXPECT_NE(e.find("VSA_QAT_TRAIN_C128"), std::string::npos) << e;
  EXPECT_NE(e.find("grid"), std::string::npos) << e;
  EXPECT_NE(e.find("cpu"), std::string::npos) << e;
}

TEST(VsaOp, ErrorsNameTheCall) {
  Inputs in = inputs(1, 128, 2, 32, 11);
  const auto b = AttentionBackend::kVsaTrainC128;
  vqad::ops::VsaOptions o;
  std::string e = error_of([&] { vqad::ops::vsa_attention(in.q, in.k, in.v, {}, {4, 4, 4}, b, o); });
  EXPECT_NE(e.find("64 tokens but L = 128"), std::string::npos) << e;
  e = error_of([&] { vqad::ops::vsa_attention(in.q, in.k.narrow(1, 0, 64), in.v, {}, {4, 4, 8}, b, o); });
  EXPECT_NE(e.find("one shape"), std::string::npos) << e;
  e = error_of([&] { vqad::ops::vsa_attention(in.q, in.k, in.v, in.gate.narrow(2, 0, 1), {4, 4, 8}, b, o); });
  EXPECT_NE(e.find("gate"), std::string::npos) << e;
  o.sparsity = 1.0;
  e = error_of([&] { vqad::ops::vsa_attention(in.q, in.k, in.v, {}, {4, 4, 8}, b, o); });
  EXPECT_NE(e.find("sparsity"), std::string::npos) << e;
  e = error_of([&] {
    vqad::ops::vsa_attention(in.q, in.k, in.v, {}, {4, 4, 8}, AttentionBackend::kAttnQatTrain, {});
  });
  EXPECT_NE(e.find("not a VSA backend"), std::string::npos) << e;
}
