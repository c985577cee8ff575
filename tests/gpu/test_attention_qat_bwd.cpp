// ATTN_QAT_TRAIN backward kernels (kernels/attention/attention_qat_bwd.h) against
// the CPU reference backward (numerics/attention_qat_ref.h) on fresh random inputs
// (seeds printed; VQAD_TEST_SEED replays one): self and cross lengths, ragged tails,
// padded row strides, NaN-poisoned outputs whose pads and tail must stay poisoned, peaky
// rows; dQ, dK, dV held to a multiple of the reference's measured BF16 noise floor
// (tests/support/metrics.h); plus the dV norm metric of the consistent mode and bitwise
// determinism. Plain CUDA runtime + host code, no torch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/attention_inputs.h"
#include "tests/support/device_buffers.h"
#include "tests/support/errors.h"
#include "tests/support/metrics.h"
#include "vqad/core/error.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/nvfp4.h"

namespace {

namespace ref = vqad::attn_qat_ref;
using vqad::kernels::AttnQatBwdParams;
using vqad::kernels::AttnQatBwdPMode;
using vqad::test::DeviceBlhd;
using vqad::test::DeviceBuffer;
// The head dim of most cases (the Wan models'); Case::D = 64 runs the other kernels.
constexpr int kD = 128;

double l2(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

struct Case {
  int B, H, Lq, Lkv, pad;  // pad: poisoned elements after each L row of every tensor (strided views)
  AttnQatBwdPMode mode;
  bool peaky = false;  // a few logits per row far above the others (tests/support/attention_inputs.h)
  int D = kD;          // head dim
};

struct Outcome {
  vqad::kernels::AttnQatBwdImpl impl = vqad::kernels::AttnQatBwdImpl::kAuto;
  std::string what;                  // the case, its seed and the implementation, for failures
  vqad::test::Closeness dq, dk, dv;  // against the reference, with its BF16 noise floor
  double dv_norm_ratio = 0;          // ||dV_kernel|| / ||dV_STE||
  bool deterministic = false;
  size_t poison_damage = 0;  // elements around dQ, dK, dV (pads, tail) that were written
};

// Every implementation available on this device: mma.sync everywhere, wgmma on sm_90.
std::vector<vqad::kernels::AttnQatBwdImpl> impls_for_device() {
  std::vector<vqad::kernels::AttnQatBwdImpl> impls = {vqad::kernels::AttnQatBwdImpl::kMmaSync};
  if (vqad::kernels::device_info(-1).arch() == 90) impls.push_back(vqad::kernels::AttnQatBwdImpl::kWgmma);
  return impls;
}

// Runs the case once through the reference and once per implementation.
std::vector<Outcome> run_case(const Case& c) {
  const int kD = c.D;
  char what[160];
  // (the D = 128 cases keep their names, and so their seeds)
  std::snprintf(what, sizeof(what), "B=%d H=%d Lq=%d Lkv=%d pad=%d %s%s%s", c.B, c.H, c.Lq, c.Lkv, c.pad,
                vqad::kernels::attn_qat_bwd_p_mode_name(c.mode), c.peaky ? " peaky" : "", c.D == 128 ? "" : " D=64");
  const uint64_t seed = vqad::test::test_seed(what);
  SCOPED_TRACE(std::string(what) + ", seed " + std::to_string(seed));
  vqad::test::AttentionInputs in;
  if (c.peaky) {
    // As the forward test's peaky rows: spikes in a middle KV tile, V of the spike keys
    // against the others'.
    vqad::test::PeakySpec spec;
    spec.spike_key = c.Lkv * 3 / 5;
    spec.margin = 6.0f;
    in = vqad::test::peaky_attention_inputs(c.B, c.H, c.Lq, c.Lkv, kD, spec, seed);
    std::mt19937_64 wrng(seed + 1);
    const std::vector<float> w = vqad::test::normal_bf16(static_cast<size_t>(c.H) * kD, 1.0f, wrng);
    for (int b = 0; b < c.B; ++b)
      for (int j = 0; j < c.Lkv; ++j)
        for (int h = 0; h < c.H; ++h)
          for (int d = 0; d < kD; ++d) {
            const bool spike = j >= spec.spike_key && j < spec.spike_key + spec.spikes;
            float& e = in.v[((static_cast<size_t>(b) * c.Lkv + j) * c.H + h) * kD + d];
            e = ref::bf16_round(0.5f * e + (spike ? -1.0f : 1.0f) * w[static_cast<size_t>(h) * kD + d]);
          }
  } else {
    in = vqad::test::normal_attention_inputs(c.B, c.H, c.Lq, c.Lkv, kD, 1.0f, seed);
  }
  std::mt19937_64 rng(seed + 2);
  std::vector<float> q = in.q, k = in.k, v = in.v;
  std::vector<float> dout = vqad::test::normal_bf16(q.size(), 1.0f, rng);
  // The kernel takes the forward's fake-quantized Q^, K^, V^ (unit scale along D);
  // the reference gets the same values with its own Q/K/V quantization off.
  for (auto* t : {&q, &k, &v}) vqad::nvfp4::fake_quantize(t->data(), t->data(), t->size(), 1.0f);

  const ref::Dims dims{c.B, c.Lq, c.Lkv, c.H, kD};
  ref::Options opts;
  opts.block_n = 128;
  opts.quant_qk = false;
  opts.quant_v = false;
  opts.quant_p = c.mode != AttnQatBwdPMode::kNone;
  opts.bwd_mode =
      c.mode == AttnQatBwdPMode::kFastVideo ? ref::BwdMode::kFastVideo : ref::BwdMode::kConsistent;
  auto vq = [&](std::vector<float>& x, int L) { return ref::contiguous_view(x.data(), L, c.H, kD); };
  std::vector<float> o(q.size()), ohp(q.size()), m(static_cast<size_t>(c.B) * c.H * c.Lq), l(m.size());
  ref::forward(dims, vq(q, c.Lq), vq(k, c.Lkv), vq(v, c.Lkv), opts, vq(o, c.Lq), vq(ohp, c.Lq),
               m.data(), l.data());
  for (auto& x : ohp) x = ref::bf16_round(x);  // the kernel sees O_hp in BF16
  std::vector<float> rdq(q.size()), rdk(k.size()), rdv(v.size());
  ref::backward(dims, vq(q, c.Lq), vq(k, c.Lkv), vq(v, c.Lkv), vq(ohp, c.Lq), vq(dout, c.Lq),
                m.data(), l.data(), opts, vq(rdq, c.Lq), vq(rdk, c.Lkv), vq(rdv, c.Lkv));
  // dV_STE: P not quantized.
  ref::Options ste = opts;
  ste.quant_p = false;
  std::vector<float> sdq(q.size()), sdk(k.size()), sdv(v.size());
  ref::backward(dims, vq(q, c.Lq), vq(k, c.Lkv), vq(v, c.Lkv), vq(ohp, c.Lq), vq(dout, c.Lq),
                m.data(), l.data(), ste, vq(sdq, c.Lq), vq(sdk, c.Lkv), vq(sdv, c.Lkv));

  // Inputs and outputs with `pad` poisoned elements after each L row; the outputs also
  // with a poisoned tail past the end.
  constexpr int kTail = 64;
  DeviceBlhd gq(c.B, c.Lq, c.H, kD, 0, c.pad), gk(c.B, c.Lkv, c.H, kD, 0, c.pad), gv(c.B, c.Lkv, c.H, kD, 0, c.pad),
      gdo(c.B, c.Lq, c.H, kD, 0, c.pad), gohp(c.B, c.Lq, c.H, kD, 0, c.pad);
  gq.upload(q);
  gk.upload(k);
  gv.upload(v);
  gdo.upload(dout);
  gohp.upload(ohp);
  DeviceBlhd dq(c.B, c.Lq, c.H, kD, 0, c.pad, kTail), dk(c.B, c.Lkv, c.H, kD, 0, c.pad, kTail),
      dv(c.B, c.Lkv, c.H, kD, 0, c.pad, kTail);
  DeviceBuffer<float> dm(m), dl(l);

  AttnQatBwdParams p;
  p.batch = c.B, p.heads = c.H, p.len_q = c.Lq, p.len_kv = c.Lkv, p.head_dim = kD;
  p.p_mode = c.mode;
  p.q_hat = gq.in(), p.k_hat = gk.in(), p.v_hat = gv.in(), p.d_out = gdo.in(), p.o_hp = gohp.in();
  p.m = dm.get(), p.l = dl.get();
  p.d_q = dq.out(), p.d_k = dk.out(), p.d_v = dv.out();
  DeviceBuffer<uint8_t> ws(vqad::kernels::attn_qat_bwd_workspace_bytes(p));  // 0xFF: garbage a kernel must not trust
  p.workspace = ws.get();

  std::vector<Outcome> outcomes;
  for (const auto impl : impls_for_device()) {
    p.impl = impl;
    for (DeviceBlhd* t : {&dq, &dk, &dv}) t->poison();
    vqad::kernels::launch_attn_qat_bwd(p, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    const auto rq = dq.raw(), rk = dk.raw(), rv = dv.raw();
    vqad::kernels::launch_attn_qat_bwd(p, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());

    Outcome r;
    r.impl = impl;
    r.what = std::string(what) + ", seed " + std::to_string(seed) + ", " + vqad::kernels::attn_qat_bwd_impl_name(impl);
    r.deterministic = rq == dq.raw() && rk == dk.raw() && rv == dv.raw();
    r.poison_damage = dq.poison_damage(rq) + dk.poison_damage(rk) + dv.poison_damage(rv);
    const auto kdv = dv.values(rv);
    r.dq = vqad::test::closeness(dq.values(rq), rdq);
    r.dk = vqad::test::closeness(dk.values(rk), rdk);
    r.dv = vqad::test::closeness(kdv, rdv);
    r.dv_norm_ratio = l2(kdv) / l2(sdv);
    std::printf("  %s %-8s rel L2 (floor): dQ %.3e (%.3e) dK %.3e (%.3e) dV %.3e (%.3e)  "
                "||dV||/||dV_STE|| kernel %.4f ref %.4f\n",
                what, vqad::kernels::attn_qat_bwd_impl_name(impl), r.dq.rel, r.dq.floor, r.dk.rel, r.dk.floor,
                r.dv.rel, r.dv.floor, r.dv_norm_ratio, l2(rdv) / l2(sdv));
    outcomes.push_back(r);
  }
  return outcomes;
}

// dQ, dK, dV within kBf16FloorMultiple x the reference's BF16 noise floor, every element
// written.
void expect_close(const Outcome& r) {
  const std::pair<const char*, const vqad::test::Closeness*> grads[] = {{"dQ", &r.dq}, {"dK", &r.dk}, {"dV", &r.dv}};
  for (const auto& [name, c] : grads) {
    EXPECT_LT(c->first_nonfinite, 0) << name << ": element " << c->first_nonfinite << " is not finite (unwritten?)";
    EXPECT_LE(c->rel, vqad::test::floor_tolerance(*c))
        << name << ": rel L2 " << c->rel << ", floor " << c->floor << ", worst element " << c->worst;
  }
}

void expect_matches(const Case& c) {
  for (const Outcome& r : run_case(c)) {
    SCOPED_TRACE(r.what);
    expect_close(r);
    EXPECT_TRUE(r.deterministic) << "two launches gave different bits";
    EXPECT_EQ(r.poison_damage, 0u) << "a kernel wrote outside the gradient rows";
  }
}

class AttnQatBwdGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(vqad::kernels::device_count(), 0) << "GPU tests need a CUDA device";
  }
};

TEST_F(AttnQatBwdGpu, SelfRaggedConsistent) { expect_matches({1, 2, 200, 200, 0, AttnQatBwdPMode::kConsistent}); }
TEST_F(AttnQatBwdGpu, CrossShorterKvPaddedStrides) {
  expect_matches({2, 3, 333, 157, 8, AttnQatBwdPMode::kConsistent});
}
TEST_F(AttnQatBwdGpu, CrossLongerKv) { expect_matches({1, 2, 77, 610, 0, AttnQatBwdPMode::kConsistent}); }
// 6 heads x 24 key blocks: several dQ partial sums per head, each a chain of 12
// ordered bulk reductions (sm_90 path), ragged query and key tails.
TEST_F(AttnQatBwdGpu, OrderedDqLongChains) {
  expect_matches({2, 3, 700, 3000, 0, AttnQatBwdPMode::kConsistent});
}
TEST_F(AttnQatBwdGpu, SingleQueryRow) { expect_matches({1, 1, 1, 129, 16, AttnQatBwdPMode::kConsistent}); }
TEST_F(AttnQatBwdGpu, FastVideoMode) { expect_matches({1, 2, 300, 250, 0, AttnQatBwdPMode::kFastVideo}); }
TEST_F(AttnQatBwdGpu, NoPQuantization) { expect_matches({2, 2, 190, 333, 8, AttnQatBwdPMode::kNone}); }
// A few logits per row about 2^6 above the others: the dV path's P is quantized against
// the saved final row max m; against a max 2^6 lower (as a per-tile running max would
// be) dV moves by ~2x this tolerance on the CPU reference.
TEST_F(AttnQatBwdGpu, PeakyRowsConsistent) {
  expect_matches({1, 2, 300, 1000, 8, AttnQatBwdPMode::kConsistent, /*peaky=*/true});
}
TEST_F(AttnQatBwdGpu, PeakyRowsFastVideo) { expect_matches({1, 2, 300, 1000, 0, AttnQatBwdPMode::kFastVideo, true}); }

// Head dim 64 (both implementations): ragged self / cross lengths with padded strides,
// long ordered dQ chains with the tail split, each P mode.
TEST_F(AttnQatBwdGpu, HeadDim64SelfRagged) { expect_matches({1, 2, 200, 200, 0, AttnQatBwdPMode::kConsistent, false, 64}); }
TEST_F(AttnQatBwdGpu, HeadDim64CrossPaddedStrides) {
  expect_matches({2, 3, 333, 157, 8, AttnQatBwdPMode::kConsistent, false, 64});
}
TEST_F(AttnQatBwdGpu, HeadDim64OrderedDqLongChains) {
  expect_matches({2, 3, 700, 3000, 0, AttnQatBwdPMode::kConsistent, false, 64});
}
TEST_F(AttnQatBwdGpu, HeadDim64FastVideoPeaky) {
  expect_matches({1, 2, 300, 1000, 8, AttnQatBwdPMode::kFastVideo, true, 64});
}
TEST_F(AttnQatBwdGpu, HeadDim64NoPQuantization) {
  expect_matches({2, 2, 190, 333, 8, AttnQatBwdPMode::kNone, false, 64});
}

TEST_F(AttnQatBwdGpu, ConsistentDvNormAtN4096) {
  for (const Outcome& r : run_case({1, 1, 4096, 4096, 0, AttnQatBwdPMode::kConsistent})) {
    SCOPED_TRACE(r.what);
    expect_close(r);
    EXPECT_GE(r.dv_norm_ratio, 0.9);
    EXPECT_LE(r.dv_norm_ratio, 1.1);
    EXPECT_TRUE(r.deterministic);
  }
}

TEST_F(AttnQatBwdGpu, FastVideoFlushesDvAtN4096) {
  // Parity mode: most 16-key groups of the normalised P flush to zero, so dV
  // loses most of its norm (spec: about 0.22 at N = 4096), and the kernel still
  // matches the reference.
  for (const Outcome& r : run_case({1, 1, 4096, 4096, 0, AttnQatBwdPMode::kFastVideo})) {
    SCOPED_TRACE(r.what);
    expect_close(r);
    EXPECT_LT(r.dv_norm_ratio, 0.5);
  }
}

TEST_F(AttnQatBwdGpu, RejectsBadInput) {
  DeviceBlhd t(1, 32, 1, kD);
  DeviceBuffer<float> stats(32);
  DeviceBuffer<uint8_t> ws(32 * 16);
  AttnQatBwdParams p;
  p.batch = 1, p.heads = 1, p.len_q = 32, p.len_kv = 32;
  p.q_hat = p.k_hat = p.v_hat = p.d_out = p.o_hp = t.in();
  p.d_q = p.d_k = p.d_v = t.out();
  p.m = p.l = stats.get();
  p.workspace = ws.get();
  using vqad::test::error_of;
  AttnQatBwdParams bad = p;
  bad.head_dim = 96;
  std::string msg = error_of([&] { vqad::kernels::launch_attn_qat_bwd(bad, nullptr); });
  EXPECT_NE(msg.find("attn_qat_bwd: expected head dim 64 or 128, found 96"), std::string::npos) << msg;
  EXPECT_NE(msg.find("B=1 H=1 Lq=32 Lkv=32 D=96"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(sm_"), std::string::npos) << msg;  // the device and its arch
  bad = p;
  bad.k_hat.stride.l = 132;  // rows no longer 16-byte aligned
  msg = error_of([&] { vqad::kernels::launch_attn_qat_bwd(bad, nullptr); });
  EXPECT_NE(msg.find("tensor k_hat: expected strides (b, l, h) that are non-negative multiples of 8"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("found (4096, 132, 128)"), std::string::npos) << msg;
  bad = p;
  bad.d_v.stride.d = 2;
  msg = error_of([&] { vqad::kernels::launch_attn_qat_bwd(bad, nullptr); });
  EXPECT_NE(msg.find("tensor d_v: expected head-dim stride 1, found 2"), std::string::npos) << msg;
  bad = p;
  bad.workspace = nullptr;
  msg = error_of([&] { vqad::kernels::launch_attn_qat_bwd(bad, nullptr); });
  EXPECT_NE(msg.find("expected a workspace of"), std::string::npos) << msg;
  bad = p;
  bad.len_kv = 0;
  msg = error_of([&] { vqad::kernels::launch_attn_qat_bwd(bad, nullptr); });
  EXPECT_NE(msg.find("unsupported shape"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Lkv=0"), std::string::npos) << msg;
}

}  // namespace
