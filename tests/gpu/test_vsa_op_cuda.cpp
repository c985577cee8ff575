// The VSA autograd op (ops/vsa_attention.h) on CUDA tensors in calls that record no graph:
// grad mode off (the first pass of an activation-checkpointed block, sampling, no-grad
// teacher passes) or no input that needs a gradient. The op then runs the forward without
// the fine stage's O_hp product and keeps nothing for a backward; its output and its
// selection must be the graph-recording call's bit for bit, for every cube shape and
// mode, and the full forward stays available (full_forward_without_grad). The caching
// allocator is filled with NaN before each call so an element a kernel skips shows up.
#ifdef VQAD_WITH_TORCH_CUDA

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <string>

#include "tests/support/metrics.h"
#include "tests/support/torch_checks.h"
#include "vqad/core/attention_backend.h"
#include "vqad/ops/vsa_attention.h"

namespace {

using vqad::AttentionBackend;
using vqad::ops::VsaOptions;
using vqad::test::all_finite;

struct OpRun {
  torch::Tensor o;
  vqad::vsa_ref::SelectionLists selection;
};

OpRun run_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& gate,
        std::array<int64_t, 3> grid, AttentionBackend backend, const VsaOptions& opts) {
  vqad::test::poison_cuda_allocator();
  OpRun r;
  r.o = vqad::ops::vsa_attention(q, k, v, gate, grid, backend, opts, &r.selection);
  torch::cuda::synchronize();
  return r;
}

TEST(VsaOpCuda, NoGradForwardIsTheSameBits) {
  ASSERT_TRUE(torch::cuda::is_available()) << "the GPU tests need a CUDA device";
  struct C {
    AttentionBackend backend;
    std::array<int64_t, 3> grid;  // partial cubes in every direction
    double sparsity;
    bool quant_p, gate;
    torch::ScalarType dtype;
  };
  const C cases[] = {{AttentionBackend::kVsaQatTrainC128, {5, 6, 10}, 0.5, true, true, torch::kBFloat16},
                     {AttentionBackend::kVsaQatTrainC128, {4, 6, 12}, 0.3, true, false, torch::kFloat32},
                     {AttentionBackend::kVsaQatTrainC64, {6, 5, 7}, 0.4, true, true, torch::kBFloat16},
                     {AttentionBackend::kVsaQatTrainC128, {4, 8, 12}, 0.5, false, true, torch::kBFloat16},
                     {AttentionBackend::kVsaTrainC128, {5, 6, 10}, 0.6, true, true, torch::kBFloat16},
                     {AttentionBackend::kVsaTrain, {5, 7, 9}, 0.6, true, true, torch::kBFloat16}};
  int i = 0;
  for (const C& c : cases) {
    const std::string what = std::string(vqad::attention_backend_name(c.backend)) + " grid " +
                             std::to_string(c.grid[0]) + "x" + std::to_string(c.grid[1]) + "x" +
                             std::to_string(c.grid[2]) + (c.quant_p ? "" : " quant_p off") +
                             (c.gate ? " gate" : " no gate");
    SCOPED_TRACE(what);
    torch::manual_seed(vqad::test::test_seed("VsaNoGradForwardIsTheSameBits") + i++);
    const int64_t B = 2, H = 2, D = 128, L = c.grid[0] * c.grid[1] * c.grid[2];
    const auto opt = torch::TensorOptions().device(torch::kCUDA).dtype(c.dtype);
    // q, k, v as views of one packed projection (the model's layout)
    const torch::Tensor qkv = torch::randn({B, L, 3, H, D}, opt);
    const torch::Tensor q = qkv.select(2, 0), k = qkv.select(2, 1), v = qkv.select(2, 2);
    const torch::Tensor gate = c.gate ? 0.5 * torch::randn({B, L, H, D}, opt) : torch::Tensor();
    VsaOptions opts;
    opts.sparsity = c.sparsity;
    opts.quant_p = c.quant_p;
    auto leaf = [](const torch::Tensor& t, bool grad) {
      return t.defined() ? t.detach().requires_grad_(grad) : torch::Tensor();
    };

    // With a graph: the full forward, saved for a backward.
    const OpRun with_graph = run_op(leaf(q, true), leaf(k, true), leaf(v, true), leaf(gate, c.gate), c.grid, c.backend, opts);
    ASSERT_TRUE(with_graph.o.requires_grad());
    OpRun nograd, leaves, full;
    {
      torch::NoGradGuard no_grad;
      nograd = run_op(leaf(q, true), leaf(k, true), leaf(v, true), leaf(gate, c.gate), c.grid, c.backend, opts);
      VsaOptions full_opts = opts;
      full_opts.full_forward_without_grad = true;
      full = run_op(leaf(q, true), leaf(k, true), leaf(v, true), leaf(gate, c.gate), c.grid, c.backend, full_opts);
    }
    leaves = run_op(leaf(q, false), leaf(k, false), leaf(v, false), leaf(gate, false), c.grid, c.backend, opts);
    for (const OpRun* r : {&nograd, &leaves, &full}) {
      EXPECT_FALSE(r->o.requires_grad());
      EXPECT_EQ(r->o.scalar_type(), c.dtype);
      EXPECT_TRUE(all_finite(r->o));
      EXPECT_TRUE(torch::equal(r->o, with_graph.o.detach())) << "output bits differ from the graph-recording call";
      EXPECT_EQ(r->selection.count, with_graph.selection.count);
      EXPECT_EQ(r->selection.index, with_graph.selection.index);
    }
  }
}

}  // namespace

#endif  // VQAD_WITH_TORCH_CUDA
