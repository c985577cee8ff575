// The fused block ops on CUDA (kernels/fused/fused_block_kernels.cu behind
// ops/fused_block.h) against their composite torch expressions, on the same GPU and on
// the CPU, on fresh random inputs: ragged L (1, 77, 1000, 4099), C = 1536, small C,
// C not a multiple of 8 (the scalar-vector path) and C > 8192 (several vectors per
// thread), bf16 and fp32, per-batch and broadcast modulation vectors. Forward: at most
// one bf16 ulp off, bitwise equal on almost every element; gradients: relative L2
// <= 1e-3 and bitwise reproducible. The caching allocator is filled with NaN before the
// CUDA calls, and the launchers are run directly on NaN-poisoned outputs with a
// sentinel tail, so a skipped element or a write past the end shows up.
#ifdef VQAD_WITH_TORCH_CUDA

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/cuda/CUDAContext.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tests/support/errors.h"
#include "tests/support/torch_checks.h"
#include "vqad/kernels/fused/fused_block_kernels.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/fused_block.h"

namespace {

using vqad::test::all_finite;
using vqad::test::error_of;
using vqad::test::rel_l2;

using torch::Tensor;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
namespace kf = vqad::kernels::fused;

constexpr double kEps = 1e-6;

void require_gpu() { ASSERT_TRUE(torch::cuda::is_available()) << "the GPU tests need a CUDA device"; }

struct OpRun {
  Tensor out;
  std::vector<Tensor> grads;
};

// fn on fresh leaves of `inputs` moved to `device`; backpropagates `upstream`.
OpRun run_op(const Fn& fn, const std::vector<Tensor>& inputs, const Tensor& upstream, torch::Device device) {
  std::vector<Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().to(device).clone().requires_grad_(true));
  Tensor out = fn(leaves);
  out.backward(upstream.to(device));
  OpRun r;
  r.out = out.detach();
  for (auto& t : leaves) r.grads.push_back(t.grad());
  return r;
}

struct UlpStats {
  int64_t max = 0;             // largest distance in bf16 ulps
  int64_t max_above_floor = 0;  // the same over elements differing by more than the floor
  double differ = 0, over_one = 0;  // fractions of elements
};

// Distance in bf16 ulps (ordered bit patterns) of the two tensors rounded to bf16.
// floor: 2^-16 * max |want|, the size of a last-bit fp32 difference of the terms of an
// output that nearly cancels (LN(x) * (1 + scale) ~ -shift): there one bf16 ulp of the
// small result is smaller than that, so it may be a few ulps off.
UlpStats bf16_ulps(const Tensor& got, const Tensor& want) {
  auto ordered = [](const Tensor& t) {
    const Tensor bits =
        t.detach().to(torch::kCPU).to(torch::kBFloat16).contiguous().view(torch::kInt16).to(torch::kInt64);
    return torch::where(bits < 0, -(bits.bitwise_and(0x7fff)), bits);
  };
  const Tensor d = (ordered(got) - ordered(want)).abs();
  const Tensor g = got.detach().to(torch::kCPU).to(torch::kBFloat16).to(torch::kFloat64);
  const Tensor w = want.detach().to(torch::kCPU).to(torch::kBFloat16).to(torch::kFloat64);
  const double floor = std::ldexp(w.abs().max().item<double>(), -16);
  const Tensor above = (g - w).abs().gt(floor);
  return {d.max().item<int64_t>(), (d * above).max().item<int64_t>(), d.ne(0).to(torch::kFloat64).mean().item<double>(),
          d.gt(1).to(torch::kFloat64).mean().item<double>()};
}

void expect_forward_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(all_finite(got)) << what;
  const UlpStats u = bf16_ulps(got, want);
  EXPECT_LE(u.max_above_floor, 1) << what << " (max " << u.max << " ulps)";
  EXPECT_LE(u.differ, 0.01) << what;
  EXPECT_LE(u.over_one, 1e-4) << what;
  if (got.scalar_type() == torch::kFloat32) EXPECT_LE(rel_l2(got, want), 1e-6) << what;
}

void expect_grads_close(const OpRun& got, const OpRun& want, double tol, const std::string& what) {
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    ASSERT_TRUE(got.grads[i].defined()) << what << " grad " << i;
    EXPECT_EQ(got.grads[i].scalar_type(), want.grads[i].scalar_type()) << what << " grad " << i;
    EXPECT_TRUE(all_finite(got.grads[i])) << what << " grad " << i;
    const double e = rel_l2(got.grads[i], want.grads[i]);
    EXPECT_LE(e, tol) << what << " grad " << i;
  }
}

void expect_bitwise_repeat(const OpRun& a, const OpRun& b, const std::string& what) {
  EXPECT_TRUE(torch::equal(a.out, b.out)) << what << ": output not reproducible";
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << what << ": grad " << i << " not reproducible";
}

struct Case {
  int64_t B, L, C;
  torch::ScalarType dt;
  bool broadcast;  // modulation vectors [1, 1, C] instead of [B, 1, C]
};

std::string name_of(const char* op, const Case& c) {
  return std::string(op) + " B=" + std::to_string(c.B) + " L=" + std::to_string(c.L) + " C=" + std::to_string(c.C) +
         " " + c10::toString(c.dt) + (c.broadcast ? " broadcast" : "");
}

std::vector<Case> cases() {
  const auto bf = torch::kBFloat16, f32 = torch::kFloat32;
  return {{2, 1, 1536, bf, false},   {2, 77, 1536, bf, true},  {2, 1000, 1536, bf, false}, {1, 4099, 64, bf, false},
          {2, 77, 64, bf, false},    {2, 1000, 128, bf, true}, {2, 77, 100, bf, false},    {2, 1, 100, bf, true},
          {1, 3, 8200, bf, false},   {2, 77, 1536, f32, false}, {2, 77, 100, f32, true},   {1, 5, 8200, f32, true}};
}

const torch::Device kCuda(torch::kCUDA), kCpu(torch::kCPU);

// ---- modulated layer norm ------------------------------------------------------------------
TEST(FusedBlockCuda, ModulatedLayerNormMatchesComposite) {
  require_gpu();
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const std::string what = name_of("modulated_layer_norm", c);
    vqad::test::SeededCase seeded(seed++);
    const int64_t vb = c.broadcast ? 1 : c.B;
    const Tensor x = (torch::randn({c.B, c.L, c.C}) * 2 + 0.5).to(c.dt);
    const Tensor scale = 0.5 * torch::randn({vb, 1, c.C}), shift = torch::randn({vb, 1, c.C});
    const Tensor up = torch::randn({c.B, c.L, c.C}).to(c.dt);
    const Fn op = [](const std::vector<Tensor>& t) { return vqad::ops::modulated_layer_norm(t[0], t[1], t[2], kEps); };
    const Fn ref = [](const std::vector<Tensor>& t) {
      return vqad::ops::modulated_layer_norm_composite(t[0], t[1], t[2], kEps);
    };
    vqad::test::poison_cuda_allocator();
    const OpRun got = run_op(op, {x, scale, shift}, up, kCuda);
    const OpRun gpu_ref = run_op(ref, {x, scale, shift}, up, kCuda);
    const OpRun cpu_ref = run_op(ref, {x, scale, shift}, up, kCpu);
    expect_forward_close(got.out, gpu_ref.out, what + " vs GPU composite");
    expect_forward_close(got.out, cpu_ref.out, what + " vs CPU composite");
    expect_grads_close(got, gpu_ref, 1e-3, what + " vs GPU composite");
    expect_grads_close(got, cpu_ref, 1e-3, what + " vs CPU composite");
    vqad::test::poison_cuda_allocator();
    expect_bitwise_repeat(got, run_op(op, {x, scale, shift}, up, kCuda), what);
  }
}

// ---- gated residual -------------------------------------------------------------------------
TEST(FusedBlockCuda, GatedResidualMatchesComposite) {
  require_gpu();
  uint64_t seed = 200;
  for (const Case& c : cases()) {
    const std::string what = name_of("gated_residual", c);
    vqad::test::SeededCase seeded(seed++);
    const int64_t vb = c.broadcast ? 1 : c.B;
    const Tensor x = torch::randn({c.B, c.L, c.C}).to(c.dt), a = (3 * torch::randn({c.B, c.L, c.C})).to(c.dt);
    const Tensor gate = torch::randn({vb, 1, c.C});
    const Tensor up = torch::randn({c.B, c.L, c.C}).to(c.dt);
    const Fn op = [](const std::vector<Tensor>& t) { return vqad::ops::gated_residual(t[0], t[1], t[2]); };
    const Fn ref = [](const std::vector<Tensor>& t) { return vqad::ops::gated_residual_composite(t[0], t[1], t[2]); };
    vqad::test::poison_cuda_allocator();
    const OpRun got = run_op(op, {x, a, gate}, up, kCuda);
    const OpRun gpu_ref = run_op(ref, {x, a, gate}, up, kCuda);
    const OpRun cpu_ref = run_op(ref, {x, a, gate}, up, kCpu);
    // One fp32 product, one fp32 sum, one rounding: the same bits as the composite.
    EXPECT_TRUE(torch::equal(got.out, gpu_ref.out)) << what;
    EXPECT_TRUE(torch::equal(got.out.cpu(), cpu_ref.out)) << what;
    EXPECT_TRUE(torch::equal(got.grads[0], gpu_ref.grads[0])) << what << ": dx";
    EXPECT_TRUE(torch::equal(got.grads[1], gpu_ref.grads[1])) << what << ": da";
    EXPECT_TRUE(torch::equal(got.grads[1].cpu(), cpu_ref.grads[1])) << what << ": da";
    expect_grads_close(got, gpu_ref, 1e-5, what + " vs GPU composite");
    expect_grads_close(got, cpu_ref, 1e-5, what + " vs CPU composite");
    vqad::test::poison_cuda_allocator();
    expect_bitwise_repeat(got, run_op(op, {x, a, gate}, up, kCuda), what);
  }
}

// ---- RMSNorm (+ RoPE) -------------------------------------------------------------------------
struct RmsCase {
  int64_t B, L, C, D;
  torch::ScalarType dt;
};

TEST(FusedBlockCuda, RmsNormRopeMatchesComposite) {
  require_gpu();
  const auto bf = torch::kBFloat16, f32 = torch::kFloat32;
  const std::vector<RmsCase> rcases{{2, 1, 1536, 128, bf},   {2, 77, 1536, 128, bf}, {1, 1000, 1536, 128, bf},
                                    {1, 4099, 64, 32, bf},   {2, 77, 64, 32, bf},    {2, 77, 100, 10, bf},
                                    {1, 3, 8200, 100, bf},   {2, 77, 1536, 128, f32}, {2, 33, 100, 10, f32}};
  uint64_t seed = 300;
  for (const RmsCase& c : rcases) {
    for (bool rope : {true, false}) {
      const std::string what = std::string(rope ? "rms_norm_rope" : "rms_norm") + " B=" + std::to_string(c.B) +
                               " L=" + std::to_string(c.L) + " C=" + std::to_string(c.C) + " D=" +
                               std::to_string(c.D) + " " + c10::toString(c.dt);
      vqad::test::SeededCase seeded(seed++);
      const Tensor x = (torch::randn({c.B, c.L, c.C}) * 2).to(c.dt);
      const Tensor w = 1 + 0.3 * torch::randn({c.C});
      const Tensor up = torch::randn({c.B, c.L, c.C}).to(c.dt);
      const Tensor angle = 6.3f * torch::rand({c.L, c.D / 2});
      const Tensor cos_cpu = rope ? torch::cos(angle) : Tensor(), sin_cpu = rope ? torch::sin(angle) : Tensor();
      const Tensor cos_gpu = rope ? cos_cpu.cuda() : Tensor(), sin_gpu = rope ? sin_cpu.cuda() : Tensor();
      const Fn op = [&](const std::vector<Tensor>& t) {
        return vqad::ops::rms_norm_rope(t[0], t[1], kEps, cos_gpu, sin_gpu);
      };
      const Fn gpu_fn = [&](const std::vector<Tensor>& t) {
        return vqad::ops::rms_norm_rope_composite(t[0], t[1], kEps, cos_gpu, sin_gpu);
      };
      const Fn cpu_fn = [&](const std::vector<Tensor>& t) {
        return vqad::ops::rms_norm_rope_composite(t[0], t[1], kEps, cos_cpu, sin_cpu);
      };
      vqad::test::poison_cuda_allocator();
      const OpRun got = run_op(op, {x, w}, up, kCuda);
      const OpRun gpu_ref = run_op(gpu_fn, {x, w}, up, kCuda);
      const OpRun cpu_ref = run_op(cpu_fn, {x, w}, up, kCpu);
      for (const OpRun* ref : {&gpu_ref, &cpu_ref}) {
        const std::string where = what + (ref == &gpu_ref ? " vs GPU composite" : " vs CPU composite");
        ASSERT_EQ(got.out.sizes(), ref->out.sizes()) << where;
        EXPECT_EQ(got.out.scalar_type(), ref->out.scalar_type()) << where;
        EXPECT_TRUE(all_finite(got.out)) << where;
        // The composite rounds to bf16 before the weight and before the rotation: where
        // the reference's rsqrt differs in the last fp32 bit, a value can round the other
        // way there (rare), and the rotation of that 1-ulp step can be more than one ulp
        // of an output that cancels. Everything else is bitwise equal.
        const UlpStats u = bf16_ulps(got.out, ref->out);
        EXPECT_LE(u.differ, 0.01) << where;
        EXPECT_LE(u.over_one, 1e-4) << where;
        EXPECT_LE(rel_l2(got.out, ref->out), c.dt == f32 ? 1e-6 : 1e-3) << where;
        expect_grads_close(got, *ref, 1e-3, where);
      }
      vqad::test::poison_cuda_allocator();
      expect_bitwise_repeat(got, run_op(op, {x, w}, up, kCuda), what);
    }
  }
}

// ---- launchers on poisoned buffers ------------------------------------------------------------
constexpr int64_t kPad = 64;
constexpr float kSentinel = 7.25f;

// [n + kPad]: NaN where the kernel must write, the sentinel after.
Tensor poisoned(int64_t n, torch::ScalarType dt) {
  Tensor t = torch::full({n + kPad}, NAN, torch::TensorOptions().device(torch::kCUDA).dtype(dt));
  t.narrow(0, n, kPad).fill_(kSentinel);
  return t;
}

void expect_written(const Tensor& buf, const Tensor& want, const std::string& what) {
  const int64_t n = want.numel();
  const Tensor body = buf.narrow(0, 0, n).view(want.sizes());
  EXPECT_TRUE(all_finite(body)) << what << ": an element was not written";
  EXPECT_TRUE(torch::equal(body, want)) << what;
  EXPECT_TRUE(buf.narrow(0, n, kPad).eq(kSentinel).all().item<bool>()) << what << ": written past the end";
}

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

TEST(FusedBlockCuda, LaunchersWriteEveryElementAndNothingPastTheEnd) {
  require_gpu();
  for (const auto& [L, C] : std::vector<std::pair<int64_t, int64_t>>{{77, 1536}, {1000, 64}, {5, 100}}) {
    const int64_t B = 2, n = B * L * C;
    const std::string what = "L=" + std::to_string(L) + " C=" + std::to_string(C);
    torch::manual_seed(400 + C);
    const auto cuda = torch::TensorOptions().device(torch::kCUDA);
    const Tensor x = torch::randn({B, L, C}, cuda).to(torch::kBFloat16);
    const Tensor a = torch::randn({B, L, C}, cuda).to(torch::kBFloat16);
    const Tensor g = torch::randn({B, L, C}, cuda).to(torch::kBFloat16);
    const Tensor scale = 0.5 * torch::randn({B, 1, C}, cuda), shift = torch::randn({B, 1, C}, cuda);
    const Tensor w = 1 + 0.3 * torch::randn({C}, cuda);
    const kf::RowShape s{B, L, C};
    const kf::BatchVector sv{scale.data_ptr<float>(), C}, hv{shift.data_ptr<float>(), C};
    const int64_t D = C == 100 ? 10 : 32;
    const Tensor angle = 6.3f * torch::rand({L, D / 2}, cuda);
    const Tensor cs = torch::cos(angle), sn = torch::sin(angle);
    const kf::RopeTables rope{cs.data_ptr<float>(), sn.data_ptr<float>(), D};
    const int64_t ws_floats = int64_t(kf::partials_floats(s));
    ASSERT_GT(ws_floats, 0);

    // Expected values from the ops (the same kernels, fresh buffers).
    Tensor xl = x.clone().requires_grad_(true), sl = scale.clone().requires_grad_(true);
    Tensor hl = shift.clone().requires_grad_(true);
    const Tensor ln_out = vqad::ops::modulated_layer_norm(xl, sl, hl, kEps);
    ln_out.backward(g);
    Tensor xg = x.clone().requires_grad_(true), ag = a.clone().requires_grad_(true);
    Tensor gl = scale.clone().requires_grad_(true);
    const Tensor gr_out = vqad::ops::gated_residual(xg, ag, gl);
    gr_out.backward(g);
    Tensor xr = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true);
    const Tensor rms_out = vqad::ops::rms_norm_rope(xr, wr, kEps, cs, sn);
    rms_out.backward(g);

    // modulated layer norm
    Tensor out = poisoned(n, torch::kBFloat16), mean = poisoned(B * L, torch::kFloat32);
    Tensor rstd = poisoned(B * L, torch::kFloat32);
    kf::launch_modulated_layer_norm_fwd(x.data_ptr(), kf::ElemType::kBF16, s, sv, hv, float(kEps), out.data_ptr(),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), stream());
    expect_written(out, ln_out.detach(), what + " ln out");
    EXPECT_TRUE(all_finite(mean.narrow(0, 0, B * L)) && all_finite(rstd.narrow(0, 0, B * L))) << what;
    Tensor dx = poisoned(n, torch::kBFloat16), dscale = poisoned(B * C, torch::kFloat32);
    Tensor dshift = poisoned(B * C, torch::kFloat32), ws = poisoned(2 * ws_floats, torch::kFloat32);
    kf::launch_modulated_layer_norm_bwd(g.data_ptr(), x.data_ptr(), kf::ElemType::kBF16, s, sv,
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                                        dscale.data_ptr<float>(), dshift.data_ptr<float>(), ws.data_ptr<float>(),
                                        stream());
    expect_written(dx, xl.grad(), what + " ln dx");
    expect_written(dscale, sl.grad(), what + " ln dscale");
    expect_written(dshift, hl.grad(), what + " ln dshift");
    EXPECT_TRUE(ws.narrow(0, 2 * ws_floats, kPad).eq(kSentinel).all().item<bool>()) << what << " ln workspace";

    // gated residual (gate = scale)
    out = poisoned(n, torch::kBFloat16);
    kf::launch_gated_residual_fwd(x.data_ptr(), a.data_ptr(), kf::ElemType::kBF16, s, sv, out.data_ptr(), stream());
    expect_written(out, gr_out.detach(), what + " gated out");
    Tensor da = poisoned(n, torch::kBFloat16), dgate = poisoned(B * C, torch::kFloat32);
    ws = poisoned(ws_floats, torch::kFloat32);
    kf::launch_gated_residual_bwd(g.data_ptr(), a.data_ptr(), kf::ElemType::kBF16, s, sv, da.data_ptr(),
                                  dgate.data_ptr<float>(), ws.data_ptr<float>(), stream());
    expect_written(da, ag.grad(), what + " gated da");
    expect_written(dgate, gl.grad(), what + " gated dgate");
    EXPECT_TRUE(ws.narrow(0, ws_floats, kPad).eq(kSentinel).all().item<bool>()) << what << " gated workspace";

    // RMSNorm + RoPE
    out = poisoned(n, torch::kBFloat16), rstd = poisoned(B * L, torch::kFloat32);
    kf::launch_rms_norm_fwd(x.data_ptr(), kf::ElemType::kBF16, s, w.data_ptr<float>(), float(kEps), rope,
                            out.data_ptr(), rstd.data_ptr<float>(), stream());
    expect_written(out, rms_out.detach(), what + " rms out");
    dx = poisoned(n, torch::kBFloat16);
    Tensor dw = poisoned(C, torch::kFloat32);
    ws = poisoned(ws_floats, torch::kFloat32);
    kf::launch_rms_norm_bwd(g.data_ptr(), x.data_ptr(), kf::ElemType::kBF16, s, w.data_ptr<float>(), rope,
                            rstd.data_ptr<float>(), dx.data_ptr(), dw.data_ptr<float>(), ws.data_ptr<float>(),
                            stream());
    expect_written(dx, xr.grad(), what + " rms dx");
    expect_written(dw, wr.grad(), what + " rms dweight");
  }
}

// ---- errors -------------------------------------------------------------------------------------
TEST(FusedBlockCuda, BadInputsAreClearErrors) {
  require_gpu();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const Tensor x = torch::randn({2, 5, 64}, cuda).to(torch::kBFloat16);
  const Tensor v = torch::randn({2, 1, 64}, cuda);
  std::string msg = error_of([&] { vqad::ops::modulated_layer_norm(x, v.cpu(), v, kEps); });
  EXPECT_NE(msg.find("modulated_layer_norm: scale [2, 1, 64] is on cpu but x [2, 5, 64] is on cuda"),
            std::string::npos)
      << msg;
  msg = error_of([&] { vqad::ops::gated_residual(x.to(torch::kFloat16), x.to(torch::kFloat16), v); });
  EXPECT_NE(msg.find("gated_residual: x must be float32 or bfloat16, found Half"), std::string::npos) << msg;
  const Tensor odd = torch::randn({1, 3, 63}, cuda);
  msg = error_of([&] { vqad::ops::rms_norm_rope(odd, torch::ones({63}, cuda), kEps); });
  EXPECT_NE(msg.find("rms_norm_rope: x [1, 3, 63]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("even number of columns"), std::string::npos) << msg;
  const Tensor wide = torch::randn({1, 1, 4097}, cuda);
  msg = error_of([&] { vqad::ops::modulated_layer_norm(wide, torch::zeros({1, 1, 4097}, cuda),
                                                       torch::zeros({1, 1, 4097}, cuda), kEps); });
  EXPECT_NE(msg.find("4097 columns exceed"), std::string::npos) << msg;
}

// ---- the model on CUDA runs the fused ops -----------------------------------------------------------
// A tiny Wan model (bf16, gradient checkpointing: the ops run under no-grad, then again
// for the backward) trains a step on CUDA and agrees with the same model on CPU.
TEST(FusedBlockCuda, WanModelWithFusedOpsMatchesCpu) {
  require_gpu();
  vqad::model::WanConfig cfg = vqad::model::WanConfig::tiny();
  torch::manual_seed(51);
  auto cpu_model = std::make_shared<vqad::model::WanModel>(
      cfg, vqad::model::WanModelOptions{.device = torch::kCPU, .compute_dtype = torch::kBFloat16});
  auto gpu_model = std::make_shared<vqad::model::WanModel>(
      cfg, vqad::model::WanModelOptions{.device = torch::kCUDA, .compute_dtype = torch::kBFloat16,
                                        .gradient_checkpointing = true});
  {
    torch::NoGradGuard ng;
    auto src = cpu_model->named_parameters();
    for (auto& p : gpu_model->named_parameters()) {
      p.value().copy_(src[p.key()]);
      // Non-trivial norm weights and modulation tables.
      if (p.key().find("norm") != std::string::npos || p.key().find("scale_shift_table") != std::string::npos) {
        const Tensor r = 1 + 0.3 * torch::randn(p.value().sizes());
        p.value().copy_(r);
        src[p.key()].copy_(r);
      }
    }
  }
  torch::manual_seed(52);
  const Tensor x = torch::randn({1, cfg.in_channels, 3, 10, 12});
  const Tensor t = torch::tensor({500.0f});
  const Tensor text = torch::randn({1, 7, cfg.text_dim});
  const Tensor y_cpu = cpu_model->forward(x, t, text);
  y_cpu.to(torch::kFloat32).pow(2).mean().backward();
  vqad::test::poison_cuda_allocator();
  const Tensor y_gpu = gpu_model->forward(x.cuda(), t.cuda(), text.cuda());
  y_gpu.to(torch::kFloat32).pow(2).mean().backward();
  torch::cuda::synchronize();
  EXPECT_TRUE(all_finite(y_gpu));
  const double e_y = rel_l2(y_gpu, y_cpu);
  std::printf("  tiny Wan, output rel L2 CUDA vs CPU %.2e\n", e_y);
  // Linears and attention accumulate in other orders on the GPU and bf16 activations
  // round differently: loose, but a wrong fused op is O(1).
  EXPECT_LE(e_y, 5e-2);
  auto cpu_params = cpu_model->named_parameters();
  int checked = 0;
  for (const auto& p : gpu_model->named_parameters()) {
    const std::string& k = p.key();
    const bool fused_param = k.find("scale_shift_table") != std::string::npos || k.find("norm_q") != std::string::npos ||
                             k.find("norm_k") != std::string::npos || k.find("to_q.weight") != std::string::npos;
    if (!fused_param) continue;
    ASSERT_TRUE(p.value().grad().defined()) << k;
    EXPECT_TRUE(all_finite(p.value().grad())) << k;
    const double e_g = rel_l2(p.value().grad(), cpu_params[k].grad());
    std::printf("  %s grad rel L2 CUDA vs CPU %.2e\n", k.c_str(), e_g);
    EXPECT_LE(e_g, 1e-1) << k;
    ++checked;
  }
  EXPECT_GT(checked, 4);
}

}  // namespace

#endif  // VQAD_WITH_TORCH_CUDA
