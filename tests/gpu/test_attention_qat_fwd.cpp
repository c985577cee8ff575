// ATTN_QAT_TRAIN forward kernels (kernels/attention/attention_qat.h) against the CPU
// reference (numerics/attention_qat_ref.h) run at the kernel's BLOCK_N, on fresh random
// inputs (seeds printed; VQAD_TEST_SEED replays one) with NaN-poisoned outputs in padded
// strided storage (the pads and a tail past the end must stay poisoned), lengths that
// are not tile multiples, and peaky rows (a few logits far above the others: P quantized
// against another row max than the running max of whole KV tiles would fail). O and
// O_hp are held to a multiple of the measured BF16 noise floor of the reference
// (tests/support/metrics.h), as the VSA kernels are.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/attention_inputs.h"
#include "tests/support/device_buffers.h"
#include "tests/support/errors.h"
#include "tests/support/metrics.h"
#include "vqad/core/error.h"
#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/nvfp4.h"

namespace {

namespace kk = vqad::kernels;
namespace ka = vqad::kernels::attention;
namespace ref = vqad::attn_qat_ref;
using vqad::test::AttentionInputs;
using vqad::test::bf16_bits;
using vqad::test::bf16_value;
using vqad::test::DeviceBlhd;
using vqad::test::DeviceBuffer;
// The head dim of most cases (the Wan models'); the kernels also take 64.
constexpr int kD = 128;
// Poisoned storage around the outputs: O rows padded by 8 elements, O_hp rows by 16 (so
// that a kernel mixing up the two views' strides writes into a pad), 64 past the end;
// 256 bytes past the row statistics.
constexpr int kOPad = 8, kOHpPad = 16, kTail = 64;
constexpr size_t kStatSentinel = 256;

bool have_gpu() { return kk::device_count() > 0; }

struct FwdOut {
  std::vector<float> o, o_hp, m, l;
  std::vector<uint16_t> o_bits, o_hp_bits;  // the tensors' elements, contiguous
  size_t poison_damage = 0;                 // storage around the outputs that was written
  size_t o_hp_written = 0;                  // O_hp storage elements that lost the poison
  size_t stats_written = 0;                 // m and l bytes that lost the poison
};
// Which outputs the call asks for: all of them, all but O_hp (the kernel without the
// high-precision product; m and l stay), or O alone (what a call without gradient uses).
enum class Outputs { kAll, kNoOHp, kOOnly };

AttentionInputs normal_inputs(int B, int H, int Lq, int Lkv, float scale, const char* what, int D = kD) {
  return vqad::test::normal_attention_inputs(B, H, Lq, Lkv, D, scale, vqad::test::test_seed(what));
}

// Pre-pass + forward on the GPU. `packed` puts Q, K, V in one [B, L, 3, H, D] buffer
// (fused projection layout; needs Lq == Lkv) so the strided input path is used.
// split_tiles > 0: the last split_tiles query tiles run split at KV tile split_key_tile
// (with the workspace the launcher asks for, NaN-poisoned); 0: no split.
FwdOut run_gpu(const AttentionInputs& in, bool quant_qkv, bool quant_p, bool packed, int split_tiles = 0,
               int split_key_tile = -1, Outputs outputs = Outputs::kAll) {
  const int kD = static_cast<int>(in.D);
  const size_t row = static_cast<size_t>(in.H) * kD;
  ka::FakeQuantQkvParams fq;
  fq.batch = in.B, fq.heads = in.H, fq.len_q = in.Lq, fq.len_kv = in.Lkv, fq.head_dim = kD;
  fq.quant_qk = fq.quant_v = quant_qkv;
  std::vector<uint16_t> hpacked;
  if (packed) {
    hpacked.resize(static_cast<size_t>(in.B) * in.Lq * 3 * row);
    for (size_t bl = 0; bl < static_cast<size_t>(in.B) * in.Lq; ++bl)
      for (size_t i = 0; i < row; ++i) {
        hpacked[(bl * 3 + 0) * row + i] = bf16_bits(in.q[bl * row + i]);
        hpacked[(bl * 3 + 1) * row + i] = bf16_bits(in.k[bl * row + i]);
        hpacked[(bl * 3 + 2) * row + i] = bf16_bits(in.v[bl * row + i]);
      }
  }
  DeviceBuffer<uint16_t> dpacked(hpacked);
  DeviceBuffer<uint16_t> dq(packed ? std::vector<uint16_t>() : bf16_bits(in.q)),
      dk(packed ? std::vector<uint16_t>() : bf16_bits(in.k)), dv(packed ? std::vector<uint16_t>() : bf16_bits(in.v));
  if (packed) {
    const kk::BlhdStrides s{static_cast<int64_t>(in.Lq) * 3 * static_cast<int64_t>(row),
                            3 * static_cast<int64_t>(row), kD, 1};
    fq.q = {dpacked.get(), s}, fq.k = {dpacked.get() + row, s}, fq.v = {dpacked.get() + 2 * row, s};
  } else {
    fq.q = {dq.get(), kk::contiguous_blhd(in.Lq, in.H, kD)};
    fq.k = {dk.get(), kk::contiguous_blhd(in.Lkv, in.H, kD)};
    fq.v = {dv.get(), kk::contiguous_blhd(in.Lkv, in.H, kD)};
  }
  DeviceBuffer<uint16_t> qh(in.q.size()), kh(in.k.size()), vh(in.v.size());  // NaN-poisoned
  fq.q_out = qh.get(), fq.k_out = kh.get(), fq.v_out = vh.get();
  ka::launch_fake_quant_qkv(fq, nullptr);

  const size_t nstat = static_cast<size_t>(in.B) * in.H * in.Lq;
  DeviceBlhd o(in.B, in.Lq, in.H, kD, 0, kOPad, kTail), ohp(in.B, in.Lq, in.H, kD, 0, kOHpPad, kTail);
  DeviceBuffer<float> m(nstat, vqad::test::kPoisonByte, kStatSentinel), l(nstat, vqad::test::kPoisonByte, kStatSentinel);
  ka::AttnQatFwdParams fp;
  const kk::BlhdStrides skv = kk::contiguous_blhd(in.Lkv, in.H, kD);
  fp.q = {qh.get(), kk::contiguous_blhd(in.Lq, in.H, kD)}, fp.k = {kh.get(), skv}, fp.v = {vh.get(), skv};
  fp.o = o.out(), fp.o_hp = ohp.out(), fp.m = m.get(), fp.l = l.get();
  fp.batch = in.B, fp.heads = in.H, fp.len_q = in.Lq, fp.len_kv = in.Lkv, fp.head_dim = kD;
  fp.quant_p = quant_p;
  fp.split_tiles = split_tiles;
  fp.split_key_tile = split_key_tile;
  if (outputs != Outputs::kAll) fp.o_hp.data = nullptr;
  if (outputs == Outputs::kOOnly) fp.m = fp.l = nullptr;
  DeviceBuffer<uint8_t> ws(split_tiles > 0 ? ka::attn_qat_fwd_workspace_bytes(fp) : 0);
  if (split_tiles > 0) {
    EXPECT_GT(ws.size(), 0u);
    fp.workspace = ws.get(), fp.workspace_bytes = ws.size();
  }
  ka::launch_attn_qat_fwd(fp, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());

  FwdOut r;
  const std::vector<uint16_t> o_raw = o.raw(), ohp_raw = ohp.raw();
  r.o = o.values(o_raw);
  r.o_hp = ohp.values(ohp_raw);
  r.o_bits = bf16_bits(r.o);
  r.o_hp_bits = bf16_bits(r.o_hp);
  r.poison_damage = o.poison_damage(o_raw) + ohp.poison_damage(ohp_raw) + m.sentinel_damage() + l.sentinel_damage();
  r.m = m.download();
  r.l = l.download();
  for (const uint16_t x : ohp_raw) r.o_hp_written += x != vqad::test::kBf16Poison;
  for (const auto* v : {&r.m, &r.l})
    for (const float x : *v) {
      uint32_t u;
      std::memcpy(&u, &x, sizeof(u));
      r.stats_written += u != 0xFFFFFFFFu;
    }
  return r;
}

FwdOut run_ref(const AttentionInputs& in, bool quant_qkv, bool quant_p) {
  const int kD = static_cast<int>(in.D);
  ref::Dims dims{in.B, in.Lq, in.Lkv, in.H, kD};
  ref::Options opts;
  opts.block_n = ka::kAttnQatBlockN;
  opts.quant_p = quant_p;
  opts.quant_qk = opts.quant_v = quant_qkv;
  FwdOut r;
  r.o.resize(in.q.size());
  r.o_hp.resize(in.q.size());
  r.m.resize(static_cast<size_t>(in.B) * in.H * in.Lq);
  r.l.resize(r.m.size());
  ref::forward(dims, ref::contiguous_view(in.q.data(), in.Lq, in.H, kD),
               ref::contiguous_view(in.k.data(), in.Lkv, in.H, kD),
               ref::contiguous_view(in.v.data(), in.Lkv, in.H, kD), opts,
               ref::contiguous_view(r.o.data(), in.Lq, in.H, kD),
               ref::contiguous_view(r.o_hp.data(), in.Lq, in.H, kD), r.m.data(), r.l.data());
  return r;
}

// O and O_hp within kBf16FloorMultiple x the reference's BF16 noise floor, every element
// written (finite), nothing written around the outputs; m to 1e-3 and l (fp32) to 1e-3 of
// itself or two bf16 steps of a P <= 1 (below).
void expect_close(const FwdOut& got, const FwdOut& want, const char* what) {
  EXPECT_EQ(got.poison_damage, 0u) << what << ": the kernel wrote outside O, O_hp, m or l";
  for (const auto* v : {&got.m, &got.l})
    for (float x : *v) ASSERT_TRUE(std::isfinite(x)) << what << ": non-finite m or l (poison not overwritten?)";
  const vqad::test::Closeness co = vqad::test::closeness(got.o, want.o);
  const vqad::test::Closeness chp = vqad::test::closeness(got.o_hp, want.o_hp);
  // l is a sum of bf16(P) with every term at most 1 (P in the units of the final row max).
  // The kernel's exp2 (ex2.approx) and the reference's differ in the last fp32 bits, so
  // now and then a P rounds to the neighbouring bf16 value: at most 2^-8 for P <= 1. On a
  // peaky row (l of a few units) one such step is above 1e-3 of l, so the bound is 1e-3
  // of l or two such steps, whichever is larger (l_err: the largest |error| / bound * 1e-3).
  double m_abs = 0, l_err = 0;
  for (size_t i = 0; i < got.m.size(); ++i) {
    m_abs = std::max(m_abs, static_cast<double>(std::fabs(got.m[i] - want.m[i])));
    const double bound = std::max(1e-3 * want.l[i], 2.0 * std::ldexp(1.0, -8));
    l_err = std::max(l_err, 1e-3 * std::fabs(got.l[i] - want.l[i]) / bound);
  }
  ::testing::Test::RecordProperty(std::string(what) + "_o_rel_l2", std::to_string(co.rel));
  std::printf("  %s: O rel L2 %.3e (floor %.3e, tol %.3e), O_hp %.3e (floor %.3e), m max abs %.2e, l max error %.2e "
              "(of bound 1e-3)\n",
              what, co.rel, co.floor, vqad::test::floor_tolerance(co), chp.rel, chp.floor, m_abs, l_err);
  EXPECT_LT(co.first_nonfinite, 0) << what << ": O element " << co.first_nonfinite << " is not finite (unwritten?)";
  EXPECT_LT(chp.first_nonfinite, 0) << what << ": O_hp element " << chp.first_nonfinite << " is not finite";
  EXPECT_LE(co.rel, vqad::test::floor_tolerance(co)) << what << ": O, worst element " << co.worst;
  EXPECT_LE(chp.rel, vqad::test::floor_tolerance(chp)) << what << ": O_hp, worst element " << chp.worst;
  EXPECT_LE(m_abs, 1e-3) << what;
  EXPECT_LE(l_err, 1e-3) << what;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

TEST(AttnQatFwdGpu, PrepassIsBitExactWithScalarReference) {
  REQUIRE_GPU();
  const int B = 2, H = 3, L = 37;
  AttentionInputs in = normal_inputs(B, H, L, L, 1.0f, "prepass");
  // Special blocks: all zero, one huge value, +-inf, NaN, values at E2M1 ties.
  const float special[] = {0.0f, -0.0f, 1e6f, std::numeric_limits<float>::infinity(), -3000.0f, 0.75f, 2.5f,
                           5.0f, 1.75f};
  for (int i = 0; i < 16; ++i) in.k[i] = 0.0f;                             // zero block
  for (int i = 0; i < 16; ++i) in.k[16 + i] = ref::bf16_round(special[i % 9] * (i % 2 ? -1.0f : 1.0f));
  in.v[40] = std::numeric_limits<float>::quiet_NaN();                       // NaN block 2
  for (int i = 0; i < 16; ++i) in.q[64 + i] = ref::bf16_round(0.25f * (i + 1));  // exact ties after scaling
  for (bool packed : {true, false}) {
    const size_t row = static_cast<size_t>(H) * kD;
    ka::FakeQuantQkvParams fq;
    fq.batch = B, fq.heads = H, fq.len_q = fq.len_kv = L, fq.head_dim = kD;
    std::vector<uint16_t> hp(static_cast<size_t>(B) * L * 3 * row);
    for (size_t bl = 0; bl < static_cast<size_t>(B) * L; ++bl)
      for (size_t i = 0; i < row; ++i) {
        hp[(bl * 3 + 0) * row + i] = bf16_bits(in.q[bl * row + i]);
        hp[(bl * 3 + 1) * row + i] = bf16_bits(in.k[bl * row + i]);
        hp[(bl * 3 + 2) * row + i] = bf16_bits(in.v[bl * row + i]);
      }
    DeviceBuffer<uint16_t> dp(hp), dq(bf16_bits(in.q)), dk(bf16_bits(in.k)), dv(bf16_bits(in.v));
    if (packed) {
      const kk::BlhdStrides s{static_cast<int64_t>(L) * 3 * static_cast<int64_t>(row), 3 * static_cast<int64_t>(row),
                              kD, 1};
      fq.q = {dp.get(), s}, fq.k = {dp.get() + row, s}, fq.v = {dp.get() + 2 * row, s};
    } else {
      const kk::BlhdStrides s = kk::contiguous_blhd(L, H, kD);
      fq.q = {dq.get(), s}, fq.k = {dk.get(), s}, fq.v = {dv.get(), s};
    }
    for (bool quant : {true, false}) {
      fq.quant_qk = fq.quant_v = quant;
      constexpr size_t kSentinel = 256;  // bytes past each contiguous output
      DeviceBuffer<uint16_t> oq(in.q.size(), vqad::test::kPoisonByte, kSentinel),
          ok(in.k.size(), vqad::test::kPoisonByte, kSentinel), ov(in.v.size(), vqad::test::kPoisonByte, kSentinel);
      fq.q_out = oq.get(), fq.k_out = ok.get(), fq.v_out = ov.get();
      ka::launch_fake_quant_qkv(fq, nullptr);
      VQAD_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float>* src[3] = {&in.q, &in.k, &in.v};
      const DeviceBuffer<uint16_t>* out[3] = {&oq, &ok, &ov};
      for (int w = 0; w < 3; ++w) {
        std::vector<float> want(*src[w]);
        if (quant) vqad::nvfp4::fake_quantize(want.data(), want.data(), want.size(), 1.0f);
        const std::vector<uint16_t> got = out[w]->download();
        size_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          const bool both_nan = std::isnan(want[i]) && std::isnan(bf16_value(got[i]));
          if (!both_nan && got[i] != bf16_bits(want[i])) {
            if (bad++ < 3)
              ADD_FAILURE() << "tensor " << w << " elem " << i << " packed=" << packed << " quant=" << quant
                            << ": got " << bf16_value(got[i]) << " want " << want[i];
          }
        }
        EXPECT_EQ(bad, 0u) << "tensor " << w;
        EXPECT_EQ(out[w]->sentinel_damage(), 0u) << "tensor " << w << ": written past the end";
      }
    }
  }
}

TEST(AttnQatFwdGpu, SelfAttentionMatchesReference) {
  REQUIRE_GPU();
  const AttentionInputs in = normal_inputs(1, 2, 640, 640, 1.0f, "self 640");
  expect_close(run_gpu(in, true, true, /*packed=*/true), run_ref(in, true, true), "self 640");
}

TEST(AttnQatFwdGpu, RaggedCrossLengthsMatchReference) {
  REQUIRE_GPU();
  {
    const AttentionInputs in = normal_inputs(1, 2, 1000, 777, 1.0f, "1000x777");
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "1000x777");
  }
  {
    const AttentionInputs in = normal_inputs(2, 3, 333, 1100, 1.0f, "B2 333x1100");
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "B2 333x1100");
  }
  {
    const AttentionInputs in = normal_inputs(1, 1, 5, 17, 1.0f, "5x17");
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "5x17");
  }
}

// Head dim 64: self and ragged cross lengths, packed (strided) Q/K/V, QAT with P
// quantization (which queues the next tile's Q^K^T early at this D) and BF16 P.
TEST(AttnQatFwdGpu, HeadDim64MatchesReference) {
  REQUIRE_GPU();
  {
    const AttentionInputs in = normal_inputs(1, 3, 640, 640, 1.0f, "D64 self 640", 64);
    expect_close(run_gpu(in, true, true, /*packed=*/true), run_ref(in, true, true), "D64 self 640");
  }
  {
    const AttentionInputs in = normal_inputs(2, 2, 1000, 777, 1.0f, "D64 B2 1000x777", 64);
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "D64 B2 1000x777");
    expect_close(run_gpu(in, true, false, false), run_ref(in, true, false), "D64 quant_p off");
    const FwdOut dense = run_gpu(in, false, false, false);
    expect_close(dense, run_ref(in, false, false), "D64 dense");
    EXPECT_EQ(dense.o_bits, dense.o_hp_bits);
  }
  {
    const AttentionInputs in = normal_inputs(1, 1, 5, 17, 1.0f, "D64 5x17", 64);
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "D64 5x17");
  }
}

TEST(AttnQatFwdGpu, LargeInputsMatchReference) {
  REQUIRE_GPU();
  const AttentionInputs in = normal_inputs(1, 2, 513, 700, 3.0f, "inputs x3");
  expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "inputs x3");
}

// A few logits per row about 2^6 above the others, in the fifth KV tile of eight (keys
// 611-613 of 1000); V of those keys points against the others', so the mass of the other
// tiles shows in O. On the CPU reference, quantizing P against the final row max instead
// of the running max of whole tiles moves O by ~19x this tolerance, against the running
// max of 16-key tiles by ~5x (tests/support/attention_inputs.h).
AttentionInputs peaky_inputs(int B, int H, int Lq, int Lkv, const char* what) {
  vqad::test::PeakySpec spec;
  spec.spike_key = 611;
  spec.spikes = 3;
  spec.margin = 6.0f;
  const uint64_t seed = vqad::test::test_seed(what);
  AttentionInputs in = vqad::test::peaky_attention_inputs(B, H, Lq, Lkv, kD, spec, seed);
  std::mt19937_64 rng(seed + 1);
  const std::vector<float> w = vqad::test::normal_bf16(static_cast<size_t>(H) * kD, 1.0f, rng);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < Lkv; ++j)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kD; ++d) {
          const bool spike = j >= spec.spike_key && j < spec.spike_key + spec.spikes;
          float& e = in.v[((static_cast<size_t>(b) * Lkv + j) * H + h) * kD + d];
          e = ref::bf16_round(0.5f * e + (spike ? -1.0f : 1.0f) * w[static_cast<size_t>(h) * kD + d]);
        }
  return in;
}

TEST(AttnQatFwdGpu, PeakyRowsMatchReference) {
  REQUIRE_GPU();
  const AttentionInputs in = peaky_inputs(1, 2, 300, 1000, "peaky 300x1000");
  expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "peaky 300x1000");
  // BF16 Q/K/V: the same rows without the Q/K quantization's coarser logits.
  expect_close(run_gpu(in, false, true, false), run_ref(in, false, true), "peaky bf16 qkv");
}

TEST(AttnQatFwdGpu, QuantPOffIsPlainFlashAttention) {
  REQUIRE_GPU();
  const AttentionInputs in = normal_inputs(1, 2, 1000, 777, 1.0f, "quant_p off");
  // Everything off: dense BF16 attention; O and O_hp are the same bits.
  const FwdOut dense = run_gpu(in, false, false, false);
  expect_close(dense, run_ref(in, false, false), "dense");
  EXPECT_EQ(dense.o_bits, dense.o_hp_bits);
  // Quantized Q/K/V with BF16 P.
  expect_close(run_gpu(in, true, false, false), run_ref(in, true, false), "quant_p off");
}

// Key split (attention_qat.h): the later part takes the running max over the earlier KV
// tiles first, so m is the unsplit kernel's bit for bit; O, O_hp and l differ only by fp32
// rounding (the earlier tiles' sum rescaled once instead of once per max update, and added
// in another order). That rounding is relative to the summands, which are at most max |V|
// in magnitude, not to their sum: where O cancels towards zero the two can differ by
// several BF16 steps of the element. So an element may differ by one BF16 step of itself
// plus 2^-16 max |V| (the fp32 noise is about 2^-20 max |V|; a wrong rescale moves O by
// percent). Both match the reference. Splits of every tile and of the last few, early and
// late split points, the peaky rows' spike (KV tile 4) before and after the split, D = 64,
// BF16 P.
void expect_split_same(const FwdOut& split, const FwdOut& whole, float v_max, const char* what) {
  ASSERT_EQ(split.m.size(), whole.m.size());
  size_t m_diff = 0, far = 0;
  for (size_t i = 0; i < split.m.size(); ++i) m_diff += std::memcmp(&split.m[i], &whole.m[i], sizeof(float)) != 0;
  double l_rel = 0;
  for (size_t i = 0; i < split.l.size(); ++i)
    l_rel = std::max(l_rel, static_cast<double>(std::fabs(split.l[i] - whole.l[i]) / whole.l[i]));
  const float noise = std::ldexp(v_max, -16);
  float worst = 0, worst_x = 0, worst_y = 0;  // the largest difference beyond one BF16 step
  for (const auto& [a, b] : {std::pair(&split.o, &whole.o), std::pair(&split.o_hp, &whole.o_hp)})
    for (size_t i = 0; i < a->size(); ++i) {
      const float x = (*a)[i], y = (*b)[i];
      const float excess = std::fabs(x - y) - std::ldexp(std::max(std::fabs(x), std::fabs(y)), -7);
      if (!(excess <= noise)) ++far;
      if (!(excess <= worst)) worst = excess, worst_x = x, worst_y = y;
    }
  std::printf("  %s: split vs unsplit: m differs in %zu rows, l max rel %.2e, %zu O / O_hp elements apart by more "
              "than one BF16 step + %.2e (largest excess %.2e: %.6e vs %.6e)\n",
              what, m_diff, l_rel, far, noise, worst, worst_x, worst_y);
  EXPECT_EQ(m_diff, 0u) << what;
  EXPECT_LE(l_rel, 1e-5) << what;
  EXPECT_EQ(far, 0u) << what;
}

// A forward case of the split and the without-O_hp tests: shape, forced key split
// (split_tiles 0: none), peaky or normal inputs, P quantization.
struct Case {
  const char* what;
  int B, H, Lq, Lkv, D, split_tiles, key_tile;
  bool peaky, quant_p;
};
AttentionInputs inputs_of(const Case& c) {
  return c.peaky ? peaky_inputs(c.B, c.H, c.Lq, c.Lkv, c.what) : normal_inputs(c.B, c.H, c.Lq, c.Lkv, 1.0f, c.what, c.D);
}

TEST(AttnQatFwdGpu, KeySplitKeepsTheNumerics) {
  REQUIRE_GPU();
  const Case cases[] = {
      {"split all 1000x777 at 3", 1, 2, 1000, 777, kD, 16, 3, false, true},      // 16 tiles, 7 KV tiles
      {"split all 1000x777 at 6", 1, 2, 1000, 777, kD, 16, 6, false, true},      // the ragged last KV tile later
      {"split last 5 B2 333x1100 at 1", 2, 3, 333, 1100, kD, 5, 1, false, true},  // 18 tiles, 9 KV tiles
      {"peaky split at 4", 1, 2, 300, 1000, kD, 6, 4, true, true},              // spike in the later part
      {"peaky split at 5", 1, 2, 300, 1000, kD, 6, 5, true, true},              // spike in the running max pass
      {"D64 split all B2 1000x777 at 2", 2, 2, 1000, 777, 64, 32, 2, false, true},
      {"BF16 P split all 1000x777 at 4", 1, 2, 1000, 777, kD, 16, 4, false, false},
  };
  for (const Case& c : cases) {
    const AttentionInputs in = inputs_of(c);
    const FwdOut split = run_gpu(in, true, c.quant_p, false, c.split_tiles, c.key_tile);
    expect_close(split, run_ref(in, true, c.quant_p), c.what);
    float v_max = 0;
    for (const float x : in.v) v_max = std::max(v_max, std::fabs(x));
    expect_split_same(split, run_gpu(in, true, c.quant_p, false), v_max, c.what);
    // Deterministic: the combine's order does not depend on which part finishes first.
    const FwdOut again = run_gpu(in, true, c.quant_p, false, c.split_tiles, c.key_tile);
    EXPECT_EQ(again.o_bits, split.o_bits) << c.what;
    EXPECT_EQ(again.o_hp_bits, split.o_hp_bits) << c.what;
    EXPECT_EQ(0, std::memcmp(again.m.data(), split.m.data(), split.m.size() * sizeof(float))) << c.what;
    EXPECT_EQ(0, std::memcmp(again.l.data(), split.l.data(), split.l.size() * sizeof(float))) << c.what;
  }
}

// Without O_hp (a call that needs no gradient) the QAT kernel skips the high-precision
// P.V product; O (and m, l where asked for) must be the full kernel's bit for bit, and
// nothing is written to the O_hp storage (nor m, l when they are null).
TEST(AttnQatFwdGpu, WithoutOHpTheOutputIsTheSameBits) {
  REQUIRE_GPU();
  const Case cases[] = {
      {"self 1000", 1, 2, 1000, 1000, kD, 0, -1, false, true},
      {"ragged B2 333x1100", 2, 3, 333, 1100, kD, 0, -1, false, true},
      {"cross 700x200", 1, 2, 700, 200, kD, 0, -1, false, true},
      {"peaky 300x1000", 1, 2, 300, 1000, kD, 0, -1, true, true},
      {"D64 B2 1000x777", 2, 2, 1000, 777, 64, 0, -1, false, true},
      {"split last 5 B2 333x1100 at 1", 2, 3, 333, 1100, kD, 5, 1, false, true},
      {"D64 split all 1000x777 at 2", 1, 2, 1000, 777, 64, 16, 2, false, true},
      {"BF16 P 1000x777", 1, 2, 1000, 777, kD, 0, -1, false, false},
  };
  for (const Case& c : cases) {
    const AttentionInputs in = inputs_of(c);
    const FwdOut all = run_gpu(in, true, c.quant_p, false, c.split_tiles, c.key_tile);
    expect_close(all, run_ref(in, true, c.quant_p), c.what);
    for (const Outputs outputs : {Outputs::kNoOHp, Outputs::kOOnly}) {
      const bool stats = outputs == Outputs::kNoOHp;
      const FwdOut got = run_gpu(in, true, c.quant_p, false, c.split_tiles, c.key_tile, outputs);
      const std::string what = std::string(c.what) + (stats ? " (no O_hp)" : " (O alone)");
      EXPECT_EQ(got.poison_damage, 0u) << what;
      EXPECT_EQ(got.o_hp_written, 0u) << what << ": O_hp storage written without O_hp";
      EXPECT_EQ(got.o_bits, all.o_bits) << what;
      if (stats) {
        EXPECT_EQ(0, std::memcmp(got.m.data(), all.m.data(), all.m.size() * sizeof(float))) << what;
        EXPECT_EQ(0, std::memcmp(got.l.data(), all.l.data(), all.l.size() * sizeof(float))) << what;
      } else {
        EXPECT_EQ(got.stats_written, 0u) << what << ": m or l written while null";
      }
    }
  }
}

TEST(AttnQatFwdGpu, KeySplitNeedsItsWorkspaceAndARange) {
  REQUIRE_GPU();
  const int L = 300;
  DeviceBuffer<uint16_t> buf(static_cast<size_t>(L) * kD, 0);
  DeviceBuffer<float> stat(L, 0);
  ka::AttnQatFwdParams fp;
  fp.q = fp.k = fp.v = {buf.get(), kk::contiguous_blhd(L, 1, kD)};
  fp.o = fp.o_hp = {buf.get(), kk::contiguous_blhd(L, 1, kD)};
  fp.m = fp.l = stat.get();
  fp.batch = 1, fp.heads = 1, fp.len_q = L, fp.len_kv = L, fp.head_dim = kD;
  fp.split_tiles = 3, fp.split_key_tile = 1;  // 3 query tiles, 3 KV tiles
  using vqad::test::error_of;
  std::string msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("split_tiles 3: expected a workspace of "), std::string::npos) << msg;
  fp.split_key_tile = 3;
  msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("expected split_key_tile in [1, 2]"), std::string::npos) << msg;
  fp.split_key_tile = 1, fp.split_tiles = 4;
  msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("expected split_tiles <= the 3 query tiles, found 4"), std::string::npos) << msg;
}

TEST(AttnQatFwdGpu, UnsupportedShapesAndLayoutsAreClearErrors) {
  REQUIRE_GPU();
  DeviceBuffer<uint16_t> buf(4 * 64 * 128, 0);
  DeviceBuffer<float> stat(64, 0);
  ka::AttnQatFwdParams fp;
  fp.q = fp.k = fp.v = {buf.get(), kk::contiguous_blhd(8, 1, 96)};
  fp.o = fp.o_hp = {buf.get(), kk::contiguous_blhd(8, 1, 96)};
  fp.m = fp.l = stat.get();
  fp.batch = 1, fp.heads = 1, fp.len_q = 8, fp.len_kv = 8, fp.head_dim = 96;
  using vqad::test::error_of;
  std::string msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("attn_qat_fwd: expected head dim 64 or 128, found 96"), std::string::npos) << msg;
  EXPECT_NE(msg.find("D=96"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(sm_"), std::string::npos) << msg;  // the device and its arch
  fp.head_dim = 128;
  fp.q.stride = fp.k.stride = fp.v.stride = fp.o.stride = fp.o_hp.stride = kk::contiguous_blhd(8, 1, 128);
  fp.k.stride.d = 2;
  msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("tensor k: expected head-dim stride 1, found 2"), std::string::npos) << msg;
  fp.k.stride.d = 1;
  fp.v.stride.l = 132;  // rows no longer 16-byte aligned
  msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("tensor v: expected strides (b, l, h) that are non-negative multiples of 8"), std::string::npos)
      << msg;
  fp.v.stride.l = 128;
  fp.o_hp.stride.h = 100;  // O_hp is checked like O when given
  msg = error_of([&] { ka::launch_attn_qat_fwd(fp, nullptr); });
  EXPECT_NE(msg.find("tensor o_hp"), std::string::npos) << msg;
  ka::FakeQuantQkvParams fq;
  fq.q = fq.k = fq.v = {buf.get(), kk::contiguous_blhd(8, 1, 120)};
  fq.q_out = fq.k_out = fq.v_out = buf.get();
  fq.batch = 1, fq.heads = 1, fq.len_q = fq.len_kv = 8, fq.head_dim = 120;
  msg = error_of([&] { ka::launch_fake_quant_qkv(fq, nullptr); });
  EXPECT_NE(msg.find("fake_quant_qkv: unsupported shape"), std::string::npos) << msg;
  EXPECT_NE(msg.find("D=120"), std::string::npos) << msg;
}

}  // namespace
