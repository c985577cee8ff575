// The ATTN_QAT_TRAIN autograd op on CUDA tensors (Hopper kernels behind
// ops/attention_qat_cuda.h) against the same op on CPU tensors (the scalar
// reference at BLOCK_N 128), on fresh random inputs: non-contiguous views cut from
// a packed qkv tensor, ragged self and cross lengths, fp32 and bf16 inputs, both
// backward P modes, head dims 128 and 64; quantization off against the fp32 softmax
// math; unsupported head dims and block sizes are clear errors. The caching allocator is filled
// with NaN before each CUDA call so any output element a kernel skips shows up.
#ifdef VQAD_WITH_TORCH_CUDA

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/errors.h"
#include "tests/support/metrics.h"
#include "tests/support/torch_checks.h"
#include "vqad/core/error.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/attention_qat.h"

namespace {

using vqad::test::all_finite;
using vqad::test::error_of;
using vqad::test::rel_l2;

using vqad::ops::AttnQatBwdMode;
using vqad::ops::AttnQatOptions;

void require_gpu() {
  ASSERT_TRUE(torch::cuda::is_available()) << "the GPU tests need a CUDA device";
}

struct Grads {
  torch::Tensor o, dq, dk, dv;
};

// Runs the op on leaves q, k, v (already on their device, any layout) with upstream
// gradient d_o and returns the output and the three gradients.
Grads run_op(torch::Tensor q, torch::Tensor k, torch::Tensor v, const torch::Tensor& d_o,
             const AttnQatOptions& opts) {
  q.requires_grad_(true);
  k.requires_grad_(true);
  v.requires_grad_(true);
  torch::Tensor o = vqad::ops::attention_qat(q, k, v, opts);
  o.backward(d_o.to(o.device(), o.scalar_type()));
  if (q.is_cuda()) torch::cuda::synchronize();
  return {o.detach(), q.grad(), k.grad(), v.grad()};
}

// A leaf that keeps the (possibly non-contiguous) strides of `view`.
torch::Tensor leaf(const torch::Tensor& view) { return view.detach(); }

struct Case {
  int64_t batch, len_q, len_kv, heads;
  torch::ScalarType dtype;
  AttnQatBwdMode mode;
  float q_scale;  // > 1 sharpens the softmax
  int64_t head_dim = 128;
};

void expect_cuda_matches_cpu(const Case& c, uint64_t seed) {
  SCOPED_TRACE("B=" + std::to_string(c.batch) + " Lq=" + std::to_string(c.len_q) + " Lkv=" +
               std::to_string(c.len_kv) + " H=" + std::to_string(c.heads) + " dtype=" +
               std::string(c10::toString(c.dtype)) + " mode=" +
               (c.mode == AttnQatBwdMode::kFastVideo ? "fastvideo" : "consistent") + " D=" +
               std::to_string(c.head_dim));
  torch::manual_seed(seed);
  const int64_t D = c.head_dim;
  const torch::Tensor q = (torch::randn({c.batch, c.len_q, c.heads, D}) * c.q_scale).to(c.dtype);
  const torch::Tensor k = torch::randn({c.batch, c.len_kv, c.heads, D}).to(c.dtype);
  const torch::Tensor v = torch::randn({c.batch, c.len_kv, c.heads, D}).to(c.dtype);
  const torch::Tensor d_o = torch::randn({c.batch, c.len_q, c.heads, D}).to(c.dtype);
  AttnQatOptions opts;
  opts.bwd_mode = c.mode;

  const Grads cpu = run_op(leaf(q), leaf(k), leaf(v), d_o, opts);
  vqad::test::poison_cuda_allocator();
  const Grads gpu = run_op(leaf(q.cuda()), leaf(k.cuda()), leaf(v.cuda()), d_o.cuda(), opts);

  EXPECT_EQ(gpu.o.scalar_type(), c.dtype);
  EXPECT_EQ(gpu.dq.scalar_type(), c.dtype);
  EXPECT_EQ(gpu.dk.scalar_type(), c.dtype);
  EXPECT_EQ(gpu.dv.scalar_type(), c.dtype);
  for (const auto* t : {&gpu.o, &gpu.dq, &gpu.dk, &gpu.dv}) EXPECT_TRUE(all_finite(*t));
  const double e_o = rel_l2(gpu.o, cpu.o), e_dq = rel_l2(gpu.dq, cpu.dq);
  const double e_dk = rel_l2(gpu.dk, cpu.dk), e_dv = rel_l2(gpu.dv, cpu.dv);
  std::printf("  rel L2 vs CPU op: O %.2e dQ %.2e dK %.2e dV %.2e\n", e_o, e_dq, e_dk, e_dv);
  EXPECT_LE(e_o, 1e-2);
  EXPECT_LE(e_dq, 1e-2);
  EXPECT_LE(e_dk, 1e-2);
  EXPECT_LE(e_dv, 1e-2);
}

TEST(AttentionQatOpCuda, SelfAttentionFromPackedQkvMatchesCpuOp) {
  require_gpu();
  torch::manual_seed(11);
  // q, k, v are strided views of one [B, L, 3, H, D] tensor, as a fused qkv
  // projection produces them: row stride 3*H*D, no copy needed by the kernels.
  const int64_t B = 2, L = 300, H = 3, D = 128;
  const torch::Tensor qkv = torch::randn({B, L, 3, H, D}).to(torch::kBFloat16);
  const torch::Tensor d_o = torch::randn({B, L, H, D}).to(torch::kBFloat16);
  const AttnQatOptions opts;
  const Grads cpu =
      run_op(leaf(qkv.select(2, 0)), leaf(qkv.select(2, 1)), leaf(qkv.select(2, 2)), d_o, opts);
  vqad::test::poison_cuda_allocator();
  const torch::Tensor qkv_gpu = qkv.cuda();
  const torch::Tensor qv = leaf(qkv_gpu.select(2, 0));
  ASSERT_FALSE(qv.is_contiguous());
  const Grads gpu = run_op(qv, leaf(qkv_gpu.select(2, 1)), leaf(qkv_gpu.select(2, 2)), d_o, opts);
  for (const auto* t : {&gpu.o, &gpu.dq, &gpu.dk, &gpu.dv}) EXPECT_TRUE(all_finite(*t));
  const double e_o = rel_l2(gpu.o, cpu.o), e_dq = rel_l2(gpu.dq, cpu.dq);
  const double e_dk = rel_l2(gpu.dk, cpu.dk), e_dv = rel_l2(gpu.dv, cpu.dv);
  std::printf("  packed qkv, rel L2 vs CPU op: O %.2e dQ %.2e dK %.2e dV %.2e\n", e_o, e_dq, e_dk,
              e_dv);
  EXPECT_LE(e_o, 1e-2);
  EXPECT_LE(e_dq, 1e-2);
  EXPECT_LE(e_dk, 1e-2);
  EXPECT_LE(e_dv, 1e-2);

  // The backward has no atomics: a second run gives the same bits.
  vqad::test::poison_cuda_allocator();
  const Grads again = run_op(leaf(qkv_gpu.select(2, 0)), leaf(qkv_gpu.select(2, 1)),
                             leaf(qkv_gpu.select(2, 2)), d_o, opts);
  EXPECT_TRUE(torch::equal(again.o, gpu.o));
  EXPECT_TRUE(torch::equal(again.dq, gpu.dq));
  EXPECT_TRUE(torch::equal(again.dk, gpu.dk));
  EXPECT_TRUE(torch::equal(again.dv, gpu.dv));
}

TEST(AttentionQatOpCuda, RaggedCrossLengthsFp32InputsMatchCpuOp) {
  require_gpu();
  expect_cuda_matches_cpu({1, 300, 200, 2, torch::kFloat32, AttnQatBwdMode::kConsistent, 1.0f}, 21);
}

TEST(AttentionQatOpCuda, RaggedLongerKvBf16MatchesCpuOp) {
  require_gpu();
  expect_cuda_matches_cpu({2, 129, 385, 2, torch::kBFloat16, AttnQatBwdMode::kConsistent, 2.0f},
                          22);
}

TEST(AttentionQatOpCuda, FastVideoBackwardModeMatchesCpuOp) {
  require_gpu();
  expect_cuda_matches_cpu({1, 257, 300, 2, torch::kBFloat16, AttnQatBwdMode::kFastVideo, 1.0f}, 23);
}

TEST(AttentionQatOpCuda, QuantizationOffMatchesSoftmaxMath) {
  require_gpu();
  torch::manual_seed(31);
  const int64_t B = 1, Lq = 300, Lkv = 200, H = 2, D = 128;
  const auto bf = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor q = torch::randn({B, Lq, H, D}, bf) * 1.5;
  const torch::Tensor k = torch::randn({B, Lkv, H, D}, bf);
  const torch::Tensor v = torch::randn({B, Lkv, H, D}, bf);
  const torch::Tensor d_o = torch::randn({B, Lq, H, D}, bf);
  AttnQatOptions opts;
  opts.quant_p = false;
  opts.quant_v = false;
  opts.quant_qk = false;
  vqad::test::poison_cuda_allocator();
  const Grads got = run_op(leaf(q), leaf(k), leaf(v), d_o, opts);

  // softmax(q k^T / sqrt(D)) v in fp32 on the same bf16 values (SDPA's math path).
  torch::Tensor qf = q.to(torch::kFloat32).requires_grad_(true);
  torch::Tensor kf = k.to(torch::kFloat32).requires_grad_(true);
  torch::Tensor vf = v.to(torch::kFloat32).requires_grad_(true);
  torch::Tensor of = vqad::ops::dense_attention_reference(qf, kf, vf);
  of.backward(d_o.to(torch::kFloat32));
  for (const auto* t : {&got.o, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(all_finite(*t));
  const double e_o = rel_l2(got.o, of), e_dq = rel_l2(got.dq, qf.grad());
  const double e_dk = rel_l2(got.dk, kf.grad()), e_dv = rel_l2(got.dv, vf.grad());
  std::printf("  quant off, rel L2 vs fp32 softmax math: O %.2e dQ %.2e dK %.2e dV %.2e\n", e_o,
              e_dq, e_dk, e_dv);
  EXPECT_LE(e_o, 1e-2);
  EXPECT_LE(e_dq, 1e-2);
  EXPECT_LE(e_dk, 1e-2);
  EXPECT_LE(e_dv, 1e-2);
  // The quantized path must differ from plain attention, or the flags do nothing.
  const torch::Tensor o_qat = vqad::ops::attention_qat(q, k, v, AttnQatOptions{});
  EXPECT_GT(rel_l2(o_qat, of), 1e-2);
}

TEST(AttentionQatOpCuda, HeadDim64MatchesCpuOp) {
  require_gpu();
  expect_cuda_matches_cpu({2, 300, 211, 3, torch::kBFloat16, AttnQatBwdMode::kConsistent, 1.0f, 64}, 31);
  expect_cuda_matches_cpu({1, 97, 520, 2, torch::kFloat32, AttnQatBwdMode::kFastVideo, 2.0f, 64}, 32);
}

// Without a graph (grad mode off: the first pass of a checkpointed block, sampling; or no
// input that needs a gradient) the op runs the kernel without the high-precision P.V
// product and saves nothing; the output must be the graph-recording call's bit for bit.
TEST(AttentionQatOpCuda, NoGradForwardIsTheSameBits) {
  require_gpu();
  struct C {
    int64_t B, Lq, Lkv, H, D;
    torch::ScalarType dtype;
    bool quant_p;
  };
  const C cases[] = {{1, 1000, 1000, 2, 128, torch::kBFloat16, true},
                     {2, 333, 1100, 3, 128, torch::kFloat32, true},
                     {1, 700, 777, 2, 64, torch::kBFloat16, true},
                     {1, 500, 500, 2, 128, torch::kBFloat16, false}};
  for (const C& c : cases) {
    SCOPED_TRACE("B=" + std::to_string(c.B) + " Lq=" + std::to_string(c.Lq) + " Lkv=" + std::to_string(c.Lkv) +
                 " D=" + std::to_string(c.D) + (c.quant_p ? "" : " quant_p off"));
    torch::manual_seed(vqad::test::test_seed("NoGradForwardIsTheSameBits") + c.Lq);
    const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(c.dtype);
    // q, k, v as views of one packed projection (the model's layout)
    const torch::Tensor qkv = torch::randn({c.B, std::max(c.Lq, c.Lkv), 3, c.H, c.D}, opt);
    const torch::Tensor q = qkv.select(2, 0).narrow(1, 0, c.Lq);
    const torch::Tensor k = qkv.select(2, 1).narrow(1, 0, c.Lkv), v = qkv.select(2, 2).narrow(1, 0, c.Lkv);
    AttnQatOptions opts;
    opts.quant_p = c.quant_p;
    vqad::test::poison_cuda_allocator();
    const Grads with_graph = run_op(leaf(q), leaf(k), leaf(v), torch::randn_like(q), opts);
    vqad::test::poison_cuda_allocator();
    torch::Tensor o_nograd;
    {
      torch::NoGradGuard no_grad;
      o_nograd = vqad::ops::attention_qat(leaf(q).requires_grad_(true), leaf(k).requires_grad_(true),
                                          leaf(v).requires_grad_(true), opts);
    }
    EXPECT_FALSE(o_nograd.requires_grad());
    vqad::test::poison_cuda_allocator();
    const torch::Tensor o_leaves = vqad::ops::attention_qat(leaf(q), leaf(k), leaf(v), opts);
    EXPECT_FALSE(o_leaves.requires_grad());
    torch::cuda::synchronize();
    EXPECT_EQ(o_nograd.scalar_type(), c.dtype);
    EXPECT_TRUE(all_finite(o_nograd));
    EXPECT_TRUE(torch::equal(o_nograd, with_graph.o));
    EXPECT_TRUE(torch::equal(o_leaves, with_graph.o));
  }
}

TEST(AttentionQatOpCuda, HeadDim96IsAClearError) {
  require_gpu();
  const auto bf = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor q = torch::randn({1, 64, 2, 96}, bf);
  const std::string msg = error_of([&] { (void)vqad::ops::attention_qat(q, q, q); });
  EXPECT_NE(msg.find("head_dim 64 or 128"), std::string::npos) << msg;
  EXPECT_NE(msg.find("found head_dim 96"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[1, 64, 2, 96]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cuda"), std::string::npos) << msg;
}

TEST(AttentionQatOpCuda, BlockNOtherThanTheKernelsIsAClearError) {
  require_gpu();
  const auto bf = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor q = torch::randn({1, 100, 2, 128}, bf);
  AttnQatOptions opts;
  opts.block_n = 64;
  const std::string msg = error_of([&] { (void)vqad::ops::attention_qat(q, q, q, opts); });
  EXPECT_NE(msg.find("block_n 64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("128"), std::string::npos) << msg;
}

// The model's ATTN_QAT_TRAIN backend reaches the kernels: a one-block Wan model with
// head_dim 128 trains a step on CUDA and agrees with the same model on CPU.
TEST(AttentionQatOpCuda, WanBlockWithAttnQatBackendRunsOnCuda) {
  require_gpu();
  vqad::model::WanConfig cfg = vqad::model::WanConfig::tiny();
  cfg.num_attention_heads = 2;
  cfg.attention_head_dim = 128;
  cfg.num_layers = 1;
  cfg.ffn_dim = 256;
  torch::manual_seed(41);
  std::shared_ptr<vqad::model::WanModel> cpu_model, gpu_model;
  {
    vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kAttnQatTrain);
    cpu_model = std::make_shared<vqad::model::WanModel>(
        cfg, vqad::model::WanModelOptions{.device = torch::kCPU, .compute_dtype = torch::kBFloat16});
    gpu_model = std::make_shared<vqad::model::WanModel>(
        cfg, vqad::model::WanModelOptions{.device = torch::kCUDA, .compute_dtype = torch::kBFloat16,
                                          .gradient_checkpointing = true});
  }
  {
    torch::NoGradGuard ng;
    auto src = cpu_model->named_parameters();
    for (auto& p : gpu_model->named_parameters()) p.value().copy_(src[p.key()]);
  }
  torch::manual_seed(42);
  const torch::Tensor x = torch::randn({1, cfg.in_channels, 3, 10, 12});  // 3 x 5 x 6 = 90 tokens
  const torch::Tensor t = torch::tensor({500.0f});
  const torch::Tensor text = torch::randn({1, 7, cfg.text_dim});
  const torch::Tensor y_cpu = cpu_model->forward(x, t, text);
  y_cpu.to(torch::kFloat32).pow(2).mean().backward();
  vqad::test::poison_cuda_allocator();
  const torch::Tensor y_gpu = gpu_model->forward(x.cuda(), t.cuda(), text.cuda());
  y_gpu.to(torch::kFloat32).pow(2).mean().backward();
  torch::cuda::synchronize();
  EXPECT_TRUE(all_finite(y_gpu));
  const double e_y = rel_l2(y_gpu, y_cpu);
  std::printf("  Wan block: rel L2 of the output CUDA vs CPU %.2e\n", e_y);
  // Linears accumulate in another order on the GPU; bf16 activations then feed the
  // NVFP4 quantizers, so a few blocks round differently. Loose, but a wrong
  // attention output (layout, scale, missing rows) is O(1).
  EXPECT_LE(e_y, 5e-2);
  auto cpu_params = cpu_model->named_parameters();
  for (const auto& p : gpu_model->named_parameters()) {
    if (p.key().find("attn1.to_q.weight") == std::string::npos) continue;
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(all_finite(p.value().grad())) << p.key();
    const double e_g = rel_l2(p.value().grad(), cpu_params[p.key()].grad());
    std::printf("  %s grad rel L2 CUDA vs CPU %.2e\n", p.key().c_str(), e_g);
    EXPECT_LE(e_g, 1e-1) << p.key();
  }
}

}  // namespace

#endif  // VQAD_WITH_TORCH_CUDA
