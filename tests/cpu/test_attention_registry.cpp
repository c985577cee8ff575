// Attention-backend registry: dense math against a loop reference, the ATTN_QAT_TRAIN
// route, errors for backends without kernels, config-time name validation, scopes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <thread>

#include "tests/support/errors.h"
#include "vqad/core/error.h"
#include "vqad/ops/attention.h"

namespace {

using vqad::AttentionBackend;

// o[b, i, h, :] = sum_j softmax_j(q_i . k_j / sqrt(D)) v_j, scalar loops in double.
torch::Tensor loop_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  auto qd = q.to(torch::kFloat64), kd = k.to(torch::kFloat64), vd = v.to(torch::kFloat64);
  const int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), D = q.size(3), Lk = k.size(1);
  auto o = torch::zeros({B, Lq, H, D}, torch::kFloat64);
  auto qa = qd.accessor<double, 4>(), ka = kd.accessor<double, 4>(), va = vd.accessor<double, 4>();
  auto oa = o.accessor<double, 4>();
  std::vector<double> s(Lk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < Lk; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qa[b][i][h][d] * ka[b][j][h][d];
          s[j] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < Lk; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int64_t j = 0; j < Lk; ++j)
          for (int64_t d = 0; d < D; ++d) oa[b][i][h][d] += s[j] / sum * va[b][j][h][d];
      }
  return o;
}

using vqad::test::error_of;

TEST(AttentionRegistry, DenseBackendsMatchLoopReference) {
  torch::manual_seed(1);
  // Lq != Lkv, odd lengths, strided (transposed) inputs as the model's views can be.
  auto q = torch::randn({2, 3, 37, 16}).transpose(1, 2);
  auto k = torch::randn({2, 29, 3, 16});
  auto v = torch::randn({2, 29, 3, 16});
  auto ref = loop_attention(q, k, v);
  for (auto b : {AttentionBackend::kTorchSdpa, AttentionBackend::kFlashAttn}) {
    auto o = vqad::ops::self_attention(q, k, v, b);
    ASSERT_EQ(o.sizes().vec(), (std::vector<int64_t>{2, 37, 3, 16}));
    EXPECT_LT((o.to(torch::kFloat64) - ref).abs().max().item<double>(), 2e-6)
        << vqad::attention_backend_name(b);
  }
  // bf16 in -> bf16 out, fp32 softmax inside.
  auto ob = vqad::ops::dense_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16));
  EXPECT_EQ(ob.scalar_type(), torch::kBFloat16);
  EXPECT_LT((ob.to(torch::kFloat64) - ref).abs().max().item<double>(), 0.05);
}

TEST(AttentionRegistry, DenseIsDifferentiable) {
  torch::manual_seed(2);
  auto q = torch::randn({1, 5, 2, 16}, torch::requires_grad());
  auto k = torch::randn({1, 7, 2, 16}, torch::requires_grad());
  auto v = torch::randn({1, 7, 2, 16}, torch::requires_grad());
  vqad::ops::self_attention(q, k, v, AttentionBackend::kTorchSdpa).pow(2).sum().backward();
  auto q2 = q.detach().to(torch::kFloat64).requires_grad_(), k2 = k.detach().to(torch::kFloat64).requires_grad_(),
       v2 = v.detach().to(torch::kFloat64).requires_grad_();
  auto s = torch::einsum("blhd,bmhd->bhlm", {q2, k2}) / 4.0;
  torch::einsum("bhlm,bmhd->blhd", {torch::softmax(s, -1), v2}).pow(2).sum().backward();
  EXPECT_LT((q.grad().to(torch::kFloat64) - q2.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LT((k.grad().to(torch::kFloat64) - k2.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LT((v.grad().to(torch::kFloat64) - v2.grad()).abs().max().item<double>(), 1e-5);
}

TEST(AttentionRegistry, AttnQatTrainRoutesToTheQatOp) {
  torch::manual_seed(3);
  auto q = torch::randn({1, 20, 2, 32}), k = torch::randn({1, 24, 2, 32}), v = torch::randn({1, 24, 2, 32});
  vqad::ops::AttentionSpec spec{AttentionBackend::kAttnQatTrain, {}, {}};
  spec.qat.block_n = 16;
  auto got = vqad::ops::self_attention(q, k, v, spec);
  auto want = vqad::ops::attention_qat(q, k, v, spec.qat);
  EXPECT_TRUE(torch::equal(got, want));
  // Quantization is really applied: the result differs from dense attention.
  EXPECT_GT((got - vqad::ops::dense_attention(q, k, v)).abs().max().item<float>(), 1e-3f);
}

TEST(AttentionRegistry, BadCallsFailClearly) {
  auto q = torch::randn({1, 8, 2, 16});
  // The VSA backends need the token grid, which a plain self_attention call lacks.
  for (auto b : {AttentionBackend::kVsaTrain, AttentionBackend::kVsaTrainC128, AttentionBackend::kVsaQatTrainC64,
                 AttentionBackend::kVsaQatTrainC128}) {
    auto e = error_of([&] { vqad::ops::self_attention(q, q, q, b); });
    EXPECT_NE(e.find(vqad::attention_backend_name(b)), std::string::npos) << e;
    EXPECT_NE(e.find("grid"), std::string::npos) << e;
    EXPECT_NE(e.find("cpu"), std::string::npos) << e;
    EXPECT_NE(e.find("[1, 8, 2, 16]"), std::string::npos) << e;
  }
  auto e = error_of([&] { vqad::ops::dense_attention(q, torch::randn({1, 8, 3, 16}), torch::randn({1, 8, 3, 16})); });
  EXPECT_NE(e.find("heads"), std::string::npos) << e;
  e = error_of([&] { vqad::ops::dense_attention(q, q, q.to(torch::kFloat64)); });
  EXPECT_NE(e.find("dtype"), std::string::npos) << e;
  e = error_of([&] { vqad::ops::dense_attention(q.flatten(2), q, q); });
  EXPECT_NE(e.find("BLHD"), std::string::npos) << e;
}

TEST(AttentionRegistry, NamesAreValidatedAtConfigTime) {
  EXPECT_EQ(vqad::ops::parse_attention_backend_or_throw("ATTN_QAT_TRAIN", "k"), AttentionBackend::kAttnQatTrain);
  auto e = error_of([] { vqad::ops::parse_attention_backend_or_throw("FLASH", "models.student.attention_backend"); });
  EXPECT_NE(e.find("models.student.attention_backend"), std::string::npos) << e;
  EXPECT_NE(e.find("'FLASH'"), std::string::npos) << e;
  EXPECT_NE(e.find("VSA_QAT_TRAIN_C128"), std::string::npos) << e;
}

TEST(AttentionRegistry, ScopesNestRestoreAndAreThreadLocal) {
  EXPECT_FALSE(vqad::ops::attention_scope_active());
  {
    vqad::ops::AttnQatOptions o;
    o.block_n = 64;
    vqad::ops::AttentionBackendScope outer(AttentionBackend::kAttnQatTrain, o);
    EXPECT_EQ(vqad::ops::current_attention_spec().qat.block_n, 64);
    {
      vqad::ops::AttentionBackendScope inner(AttentionBackend::kTorchSdpa);
      EXPECT_EQ(vqad::ops::current_attention_spec().backend, AttentionBackend::kTorchSdpa);
      AttentionBackend seen = AttentionBackend::kVsaTrain;
      std::thread t([&] { seen = vqad::ops::current_attention_spec().backend; });
      t.join();
      EXPECT_EQ(seen, vqad::ops::kDefaultAttentionBackend);  // other threads unaffected
    }
    EXPECT_EQ(vqad::ops::current_attention_spec().backend, AttentionBackend::kAttnQatTrain);
    EXPECT_EQ(vqad::ops::current_attention_spec().qat.block_n, 64);
  }
  EXPECT_FALSE(vqad::ops::attention_scope_active());
  EXPECT_EQ(vqad::ops::current_attention_spec().backend, vqad::ops::kDefaultAttentionBackend);
}

}  // namespace
