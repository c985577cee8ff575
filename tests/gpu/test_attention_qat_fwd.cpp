// ATTN_QAT_TRAIN forward kernels (kernels/attention/attention_qat.h) against the CPU
// reference (numerics/attention_qat_ref.h) run at the kernel's BLOCK_N, on fresh
// random inputs with NaN-poisoned outputs and lengths that are not tile multiples.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

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
constexpr int kD = ka::kAttnQatHeadDim;

uint16_t bf16_bits(float x) {
  const float r = ref::bf16_round(x);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Device buffer freed on scope exit; filled with `fill` bytes (0xFF = NaN poison).
template <typename T>
struct DevBuf {
  T* ptr = nullptr;
  size_t n = 0;
  DevBuf(size_t count, uint8_t fill) : n(count) {
    VQAD_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
    VQAD_CUDA_CHECK(cudaMemset(ptr, fill, std::max<size_t>(n, 1) * sizeof(T)));
  }
  DevBuf(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(ptr); }
  void upload(const std::vector<T>& h) {
    VQAD_CUDA_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    VQAD_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

bool have_gpu() { return vqad::kernels::device_count() > 0; }

struct Inputs {
  int B, H, Lq, Lkv;
  std::vector<float> q, k, v;  // bf16-valued, contiguous [B, L, H, D]
};

Inputs make_inputs(int B, int H, int Lq, int Lkv, float scale, uint32_t seed) {
  Inputs in{B, H, Lq, Lkv, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  const size_t row = static_cast<size_t>(H) * kD;
  in.q.resize(static_cast<size_t>(B) * Lq * row);
  in.k.resize(static_cast<size_t>(B) * Lkv * row);
  in.v.resize(static_cast<size_t>(B) * Lkv * row);
  for (auto* t : {&in.q, &in.k, &in.v})
    for (float& x : *t) x = ref::bf16_round(nd(rng));
  return in;
}

std::vector<uint16_t> to_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_bits(x[i]);
  return b;
}

struct FwdOut {
  std::vector<float> o, o_hp, m, l;
  std::vector<uint16_t> o_bits, o_hp_bits;
};

// Pre-pass + forward on the GPU. `packed` puts Q, K, V in one [B, L, 3, H, D]
// buffer (fused projection layout; needs Lq == Lkv) so the strided path is used.
FwdOut run_gpu(const Inputs& in, bool quant_qkv, bool quant_p, bool packed) {
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
  DevBuf<uint16_t> dpacked(hpacked.size(), 0);
  DevBuf<uint16_t> dq(packed ? 0 : in.q.size(), 0), dk(packed ? 0 : in.k.size(), 0),
      dv(packed ? 0 : in.v.size(), 0);
  if (packed) {
    dpacked.upload(hpacked);
    const kk::BlhdStrides s{static_cast<int64_t>(in.Lq) * 3 * static_cast<int64_t>(row),
                            3 * static_cast<int64_t>(row), kD, 1};
    fq.q = {dpacked.ptr, s}, fq.k = {dpacked.ptr + row, s}, fq.v = {dpacked.ptr + 2 * row, s};
  } else {
    dq.upload(to_bits(in.q));
    dk.upload(to_bits(in.k));
    dv.upload(to_bits(in.v));
    fq.q = {dq.ptr, kk::contiguous_blhd(in.Lq, in.H, kD)};
    fq.k = {dk.ptr, kk::contiguous_blhd(in.Lkv, in.H, kD)};
    fq.v = {dv.ptr, kk::contiguous_blhd(in.Lkv, in.H, kD)};
  }
  DevBuf<uint16_t> qh(in.q.size(), 0xFF), kh(in.k.size(), 0xFF), vh(in.v.size(), 0xFF);
  fq.q_out = qh.ptr, fq.k_out = kh.ptr, fq.v_out = vh.ptr;
  ka::launch_fake_quant_qkv(fq, nullptr);

  const size_t nstat = static_cast<size_t>(in.B) * in.H * in.Lq;
  DevBuf<uint16_t> o(in.q.size(), 0xFF), ohp(in.q.size(), 0xFF);
  DevBuf<float> m(nstat, 0xFF), l(nstat, 0xFF);
  ka::AttnQatFwdParams fp;
  const kk::BlhdStrides sq = kk::contiguous_blhd(in.Lq, in.H, kD), skv = kk::contiguous_blhd(in.Lkv, in.H, kD);
  fp.q = {qh.ptr, sq}, fp.k = {kh.ptr, skv}, fp.v = {vh.ptr, skv};
  fp.o = {o.ptr, sq}, fp.o_hp = {ohp.ptr, sq}, fp.m = m.ptr, fp.l = l.ptr;
  fp.batch = in.B, fp.heads = in.H, fp.len_q = in.Lq, fp.len_kv = in.Lkv, fp.head_dim = kD;
  fp.quant_p = quant_p;
  ka::launch_attn_qat_fwd(fp, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());

  FwdOut r;
  r.o_bits = o.download();
  r.o_hp_bits = ohp.download();
  r.o.resize(r.o_bits.size());
  r.o_hp.resize(r.o_bits.size());
  for (size_t i = 0; i < r.o.size(); ++i) {
    r.o[i] = bf16_value(r.o_bits[i]);
    r.o_hp[i] = bf16_value(r.o_hp_bits[i]);
  }
  r.m = m.download();
  r.l = l.download();
  return r;
}

FwdOut run_ref(const Inputs& in, bool quant_qkv, bool quant_p) {
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

void expect_close(const FwdOut& got, const FwdOut& want, const char* what) {
  for (const auto* v : {&got.o, &got.o_hp, &got.m, &got.l})
    for (float x : *v) ASSERT_TRUE(std::isfinite(x)) << what << ": non-finite output (poison not overwritten?)";
  const double eo = rel_l2(got.o, want.o), ehp = rel_l2(got.o_hp, want.o_hp);
  double m_abs = 0, l_rel = 0;
  for (size_t i = 0; i < got.m.size(); ++i) {
    m_abs = std::max(m_abs, static_cast<double>(std::fabs(got.m[i] - want.m[i])));
    l_rel = std::max(l_rel, static_cast<double>(std::fabs(got.l[i] - want.l[i]) / want.l[i]));
  }
  ::testing::Test::RecordProperty(std::string(what) + "_o_rel_l2", std::to_string(eo));
  std::printf("  %s: O rel L2 %.3e, O_hp rel L2 %.3e, m max abs %.2e, l max rel %.2e\n", what, eo, ehp, m_abs,
              l_rel);
  EXPECT_LE(eo, 1e-2) << what;
  EXPECT_LE(ehp, 1e-2) << what;
  EXPECT_LE(m_abs, 1e-3) << what;
  EXPECT_LE(l_rel, 1e-3) << what;
}

uint32_t fresh_seed() { return std::random_device{}(); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

TEST(AttnQatFwdGpu, PrepassIsBitExactWithScalarReference) {
  REQUIRE_GPU();
  const int B = 2, H = 3, L = 37;
  Inputs in = make_inputs(B, H, L, L, 1.0f, fresh_seed());
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
    DevBuf<uint16_t> dp(hp.size(), 0), dq(in.q.size(), 0), dk(in.k.size(), 0), dv(in.v.size(), 0);
    if (packed) {
      dp.upload(hp);
      const kk::BlhdStrides s{static_cast<int64_t>(L) * 3 * static_cast<int64_t>(row), 3 * static_cast<int64_t>(row),
                              kD, 1};
      fq.q = {dp.ptr, s}, fq.k = {dp.ptr + row, s}, fq.v = {dp.ptr + 2 * row, s};
    } else {
      dq.upload(to_bits(in.q));
      dk.upload(to_bits(in.k));
      dv.upload(to_bits(in.v));
      const kk::BlhdStrides s = kk::contiguous_blhd(L, H, kD);
      fq.q = {dq.ptr, s}, fq.k = {dk.ptr, s}, fq.v = {dv.ptr, s};
    }
    for (bool quant : {true, false}) {
      fq.quant_qk = fq.quant_v = quant;
      DevBuf<uint16_t> oq(in.q.size(), 0xFF), ok(in.k.size(), 0xFF), ov(in.v.size(), 0xFF);
      fq.q_out = oq.ptr, fq.k_out = ok.ptr, fq.v_out = ov.ptr;
      ka::launch_fake_quant_qkv(fq, nullptr);
      VQAD_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float>* src[3] = {&in.q, &in.k, &in.v};
      const DevBuf<uint16_t>* out[3] = {&oq, &ok, &ov};
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
      }
    }
  }
}

TEST(AttnQatFwdGpu, SelfAttentionMatchesReference) {
  REQUIRE_GPU();
  const Inputs in = make_inputs(1, 2, 640, 640, 1.0f, fresh_seed());
  expect_close(run_gpu(in, true, true, /*packed=*/true), run_ref(in, true, true), "self 640");
}

TEST(AttnQatFwdGpu, RaggedCrossLengthsMatchReference) {
  REQUIRE_GPU();
  {
    const Inputs in = make_inputs(1, 2, 1000, 777, 1.0f, fresh_seed());
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "1000x777");
  }
  {
    const Inputs in = make_inputs(2, 3, 333, 1100, 1.0f, fresh_seed());
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "B2 333x1100");
  }
  {
    const Inputs in = make_inputs(1, 1, 5, 17, 1.0f, fresh_seed());
    expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "5x17");
  }
}

TEST(AttnQatFwdGpu, PeakyAttentionMatchesReference) {
  REQUIRE_GPU();
  const Inputs in = make_inputs(1, 2, 513, 700, 3.0f, fresh_seed());
  expect_close(run_gpu(in, true, true, false), run_ref(in, true, true), "peaky x3");
}

TEST(AttnQatFwdGpu, QuantPOffIsPlainFlashAttention) {
  REQUIRE_GPU();
  const Inputs in = make_inputs(1, 2, 1000, 777, 1.0f, fresh_seed());
  // Everything off: dense BF16 attention; O and O_hp are the same bits.
  const FwdOut dense = run_gpu(in, false, false, false);
  expect_close(dense, run_ref(in, false, false), "dense");
  EXPECT_EQ(dense.o_bits, dense.o_hp_bits);
  // Quantized Q/K/V with BF16 P.
  expect_close(run_gpu(in, true, false, false), run_ref(in, true, false), "quant_p off");
}

TEST(AttnQatFwdGpu, UnsupportedShapesAndLayoutsThrow) {
  REQUIRE_GPU();
  DevBuf<uint16_t> buf(4 * 64 * 128, 0);
  DevBuf<float> stat(64, 0);
  ka::AttnQatFwdParams fp;
  fp.q = fp.k = fp.v = {buf.ptr, kk::contiguous_blhd(8, 1, 64)};
  fp.o = fp.o_hp = {buf.ptr, kk::contiguous_blhd(8, 1, 64)};
  fp.m = fp.l = stat.ptr;
  fp.batch = 1, fp.heads = 1, fp.len_q = 8, fp.len_kv = 8, fp.head_dim = 64;
  try {
    ka::launch_attn_qat_fwd(fp, nullptr);
    FAIL() << "head dim 64 accepted";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("D=64"), std::string::npos) << e.what();
  }
  fp.head_dim = 128;
  fp.q.stride = fp.k.stride = fp.v.stride = fp.o.stride = fp.o_hp.stride = kk::contiguous_blhd(8, 1, 128);
  fp.k.stride.d = 2;
  EXPECT_THROW(ka::launch_attn_qat_fwd(fp, nullptr), vqad::Error);
  fp.k.stride.d = 1;
  fp.o_hp.data = nullptr;  // quant_p needs O_hp for the backward
  EXPECT_THROW(ka::launch_attn_qat_fwd(fp, nullptr), vqad::Error);
  ka::FakeQuantQkvParams fq;
  fq.q = fq.k = fq.v = {buf.ptr, kk::contiguous_blhd(8, 1, 120)};
  fq.q_out = fq.k_out = fq.v_out = buf.ptr;
  fq.batch = 1, fq.heads = 1, fq.len_q = fq.len_kv = 8, fq.head_dim = 120;
  EXPECT_THROW(ka::launch_fake_quant_qkv(fq, nullptr), vqad::Error);
}

}  // namespace
