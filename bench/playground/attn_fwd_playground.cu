// Standalone playground for the ATTN_QAT_TRAIN forward: checks the Q/K/V pre-pass
// bit for bit against nvfp4::fake_quantize and the forward kernel against the CPU
// reference (at the kernel's BLOCK_N; O and O_hp within the kernel tests' multiple of
// the BF16 noise floor, tests/support/metrics.h) at small shapes, then times both at
// the benchmark shapes: the kernel with and without the key split of the last wave in
// alternating rounds, and the cost of a max-only KV tile (max_only row; the plan's
// kAttnQatFwdMaxOnlyCost). CMake target vqad_pg_attn_fwd (-DVQAD_PLAYGROUND=ON), or one
// nvcc command on a GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -I. \
//     bench/playground/attn_fwd_playground.cu src/vqad/kernels/attention/sm90/attn_qat_fwd_sm90.cu src/vqad/kernels/common/tma.cu \
//     src/vqad/kernels/attention/fake_quant_qkv.cu src/vqad/kernels/common/device.cu \
//     src/vqad/numerics/attention_qat_ref.cpp src/vqad/numerics/nvfp4.cpp -o /tmp/attn_fwd_pg
//   /tmp/attn_fwd_pg [check] [time] [d64] [sweep] [digest] [shape=B,H,L]   (d64: head dim 64 instead of 128;
//   shape=: time that shape alone;
//   sweep: time also times the planned split at neighbouring key tiles; digest: time also
//   prints a hash of each QAT run's outputs, to compare two kernel builds bit for bit;
//   neither check nor time: both; any other argument is refused)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tests/support/metrics.h"
#include "vqad/core/fnv1a.h"
#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/nvfp4.h"

namespace ref = vqad::attn_qat_ref;
namespace kk = vqad::kernels;
namespace ka = vqad::kernels::attention;

namespace {

// Head dim of every case: 128, or 64 with the argument d64.
int kD = 128;
// With the argument sweep, `time` also times the planned split at neighbouring key tiles.
bool g_sweep = false;
bool g_digest = false;  // digest: print an FNV-1a hash of each QAT run's O, O_hp, m, l

// BF16 conversions, rel-L2 and the noise-floor tolerance of the kernel tests (tests/support).
uint16_t to_bf16_bits(float x) { return vqad::test::bf16_bits(x); }
float from_bf16_bits(uint16_t b) { return vqad::test::bf16_value(b); }
using vqad::test::rel_l2;

template <typename T>
T* dev_alloc(size_t n, uint8_t fill) {
  T* p = nullptr;
  VQAD_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  VQAD_CUDA_CHECK(cudaMemset(p, fill, n * sizeof(T)));
  return p;
}

struct CaseResult {
  double o = 0, o_hp = 0, m_abs = 0, l_rel = 0;
  double o_tol = 0, o_hp_tol = 0;  // kBf16FloorMultiple x the reference's BF16 noise floor
  long nonfinite = 0;
  bool prepass_exact = true;
};

// Self-attention cases read Q, K, V out of one packed [B, L, 3, H, D] buffer (the
// layout of a fused QKV projection), cross cases use separate tensors; both go
// through the pre-pass and the forward exactly as the op will call them.
CaseResult run_case(int B, int H, int Lq, int Lkv, bool quant_p, bool quant_qkv, float input_scale,
                    uint32_t seed, int split_tiles = 0, int split_key_tile = -1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, input_scale);
  const bool packed = Lq == Lkv;
  const int64_t row = static_cast<int64_t>(H) * kD;
  std::vector<float> q(static_cast<size_t>(B) * Lq * row), k(static_cast<size_t>(B) * Lkv * row),
      v(static_cast<size_t>(B) * Lkv * row);
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = ref::bf16_round(nd(rng));

  // device inputs
  ka::FakeQuantQkvParams fq;
  fq.batch = B, fq.heads = H, fq.len_q = Lq, fq.len_kv = Lkv, fq.head_dim = kD;
  fq.quant_qk = quant_qkv, fq.quant_v = quant_qkv;
  std::vector<uint16_t*> to_free;
  if (packed) {
    std::vector<uint16_t> h(static_cast<size_t>(B) * Lq * 3 * row);
    for (int b = 0; b < B; ++b)
      for (int l = 0; l < Lq; ++l)
        for (int w = 0; w < 3; ++w)
          for (int i = 0; i < row; ++i) {
            const std::vector<float>& src = w == 0 ? q : (w == 1 ? k : v);
            h[((static_cast<size_t>(b) * Lq + l) * 3 + w) * row + i] = to_bf16_bits(src[(static_cast<size_t>(b) * Lq + l) * row + i]);
          }
    uint16_t* d = dev_alloc<uint16_t>(h.size(), 0);
    VQAD_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    to_free.push_back(d);
    const kk::BlhdStrides s{static_cast<int64_t>(Lq) * 3 * row, 3 * row, kD, 1};
    fq.q = {d, s}, fq.k = {d + row, s}, fq.v = {d + 2 * row, s};
  } else {
    const std::vector<float>* srcs[3] = {&q, &k, &v};
    kk::BlhdIn* dsts[3] = {&fq.q, &fq.k, &fq.v};
    for (int w = 0; w < 3; ++w) {
      std::vector<uint16_t> h(srcs[w]->size());
      for (size_t i = 0; i < h.size(); ++i) h[i] = to_bf16_bits((*srcs[w])[i]);
      uint16_t* d = dev_alloc<uint16_t>(h.size(), 0);
      VQAD_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
      to_free.push_back(d);
      *dsts[w] = {d, kk::contiguous_blhd(w == 0 ? Lq : Lkv, H, kD)};
    }
  }
  uint16_t* qh = dev_alloc<uint16_t>(q.size(), 0xFF);  // NaN-poisoned
  uint16_t* kh = dev_alloc<uint16_t>(k.size(), 0xFF);
  uint16_t* vh = dev_alloc<uint16_t>(v.size(), 0xFF);
  fq.q_out = qh, fq.k_out = kh, fq.v_out = vh;
  ka::launch_fake_quant_qkv(fq, nullptr);

  CaseResult r;
  // pre-pass vs nvfp4::fake_quantize, bit for bit
  {
    const std::vector<float>* srcs[3] = {&q, &k, &v};
    uint16_t* outs[3] = {qh, kh, vh};
    for (int w = 0; w < 3; ++w) {
      std::vector<uint16_t> got(srcs[w]->size());
      VQAD_CUDA_CHECK(cudaMemcpy(got.data(), outs[w], got.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<float> want(*srcs[w]);
      if (quant_qkv) vqad::nvfp4::fake_quantize(want.data(), want.data(), want.size(), 1.0f);
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != to_bf16_bits(want[i])) {
          if (r.prepass_exact)
            std::printf("  pre-pass mismatch tensor %d elem %zu: got %g want %g\n", w, i, from_bf16_bits(got[i]),
                        want[i]);
          r.prepass_exact = false;
        }
    }
  }

  uint16_t* o = dev_alloc<uint16_t>(q.size(), 0xFF);
  uint16_t* ohp = dev_alloc<uint16_t>(q.size(), 0xFF);
  const size_t nstat = static_cast<size_t>(B) * H * Lq;
  float* m = dev_alloc<float>(nstat, 0xFF);
  float* l = dev_alloc<float>(nstat, 0xFF);
  ka::AttnQatFwdParams fp;
  const kk::BlhdStrides sq = kk::contiguous_blhd(Lq, H, kD), skv = kk::contiguous_blhd(Lkv, H, kD);
  fp.q = {qh, sq}, fp.k = {kh, skv}, fp.v = {vh, skv};
  fp.o = {o, sq}, fp.o_hp = {ohp, sq};
  fp.m = m, fp.l = l;
  fp.batch = B, fp.heads = H, fp.len_q = Lq, fp.len_kv = Lkv, fp.head_dim = kD;
  fp.quant_p = quant_p;
  fp.split_tiles = split_tiles, fp.split_key_tile = split_key_tile;  // 0: no key split
  uint8_t* ws = nullptr;
  if (split_tiles > 0) {
    fp.workspace_bytes = ka::attn_qat_fwd_workspace_bytes(fp);
    ws = dev_alloc<uint8_t>(fp.workspace_bytes, 0xFF);
    fp.workspace = ws;
  }
  ka::launch_attn_qat_fwd(fp, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  if (ws != nullptr) VQAD_CUDA_CHECK(cudaFree(ws));

  std::vector<uint16_t> ho(q.size()), hohp(q.size());
  std::vector<float> hm(nstat), hl(nstat);
  VQAD_CUDA_CHECK(cudaMemcpy(ho.data(), o, ho.size() * 2, cudaMemcpyDeviceToHost));
  VQAD_CUDA_CHECK(cudaMemcpy(hohp.data(), ohp, hohp.size() * 2, cudaMemcpyDeviceToHost));
  VQAD_CUDA_CHECK(cudaMemcpy(hm.data(), m, nstat * 4, cudaMemcpyDeviceToHost));
  VQAD_CUDA_CHECK(cudaMemcpy(hl.data(), l, nstat * 4, cudaMemcpyDeviceToHost));

  ref::Dims dims{B, Lq, Lkv, H, kD};
  ref::Options opts;
  opts.block_n = ka::kAttnQatBlockN;
  opts.quant_p = quant_p;
  opts.quant_qk = opts.quant_v = quant_qkv;
  std::vector<float> ro(q.size()), rohp(q.size()), rm(nstat), rl(nstat);
  ref::forward(dims, ref::contiguous_view(q.data(), Lq, H, kD), ref::contiguous_view(k.data(), Lkv, H, kD),
               ref::contiguous_view(v.data(), Lkv, H, kD), opts, ref::contiguous_view(ro.data(), Lq, H, kD),
               ref::contiguous_view(rohp.data(), Lq, H, kD), rm.data(), rl.data());

  std::vector<float> fo(q.size()), fohp(q.size());
  for (size_t i = 0; i < fo.size(); ++i) {
    fo[i] = from_bf16_bits(ho[i]);
    fohp[i] = from_bf16_bits(hohp[i]);
    if (!std::isfinite(fo[i]) || !std::isfinite(fohp[i])) ++r.nonfinite;
  }
  for (size_t i = 0; i < nstat; ++i) {
    if (!std::isfinite(hm[i]) || !std::isfinite(hl[i])) ++r.nonfinite;
    r.m_abs = std::max(r.m_abs, static_cast<double>(std::fabs(hm[i] - rm[i])));
    r.l_rel = std::max(r.l_rel, static_cast<double>(std::fabs(hl[i] - rl[i]) / rl[i]));
  }
  r.o = rel_l2(fo, ro);
  r.o_hp = rel_l2(fohp, rohp);
  r.o_tol = vqad::test::floor_tolerance(vqad::test::closeness(fo, ro));
  r.o_hp_tol = vqad::test::floor_tolerance(vqad::test::closeness(fohp, rohp));
  for (void* ptr : std::vector<void*>{qh, kh, vh, o, ohp, m, l}) VQAD_CUDA_CHECK(cudaFree(ptr));
  for (uint16_t* ptr : to_free) VQAD_CUDA_CHECK(cudaFree(ptr));
  return r;
}

int check() {
  struct C {
    int B, H, Lq, Lkv;
    bool quant_p, quant_qkv;
    float scale;
    int split_tiles = 0, split_key_tile = -1;  // key split of the last query tiles
  };
  const C cases[] = {
      {1, 2, 256, 256, true, true, 1.0f},   {1, 2, 1000, 777, true, true, 1.0f},
      {2, 3, 333, 1100, true, true, 1.0f},  {1, 2, 777, 1000, true, true, 3.0f},
      {1, 1, 1, 17, true, true, 1.0f},      {1, 2, 1000, 777, false, true, 1.0f},
      {1, 2, 1000, 777, false, false, 1.0f}, {1, 2, 4096, 4096, true, true, 1.0f},
      {1, 2, 1000, 777, true, true, 1.0f, 16, 3},  {2, 3, 333, 1100, true, true, 1.0f, 5, 1},
      {1, 2, 1000, 777, false, true, 1.0f, 16, 6}, {1, 2, 4096, 4096, true, true, 1.0f, 64, 12},
  };
  int failures = 0;
  uint32_t seed = 1234;
  std::printf("%-24s %-8s %-6s %10s %10s %10s %10s %5s %s\n", "shape B,H,Lq,Lkv", "quant_p", "qkv", "O relL2",
              "Ohp relL2", "m maxabs", "l maxrel", "nan", "pre-pass");
  for (const C& c : cases) {
    const CaseResult r =
        run_case(c.B, c.H, c.Lq, c.Lkv, c.quant_p, c.quant_qkv, c.scale, seed++, c.split_tiles, c.split_key_tile);
    const bool ok = r.o <= r.o_tol && r.o_hp <= r.o_hp_tol && r.m_abs <= 1e-3 && r.l_rel <= 1e-3 &&
                    r.nonfinite == 0 && r.prepass_exact;
    failures += ok ? 0 : 1;
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%d,%d,%d,%d x%.0f%s", c.B, c.H, c.Lq, c.Lkv, c.scale,
                  c.split_tiles > 0 ? " split" : "");
    std::printf("%-24s %-8s %-6s %10.3e %10.3e %10.3e %10.3e %5ld %s %s\n", shape, c.quant_p ? "on" : "off",
                c.quant_qkv ? "on" : "off", r.o, r.o_hp, r.m_abs, r.l_rel, r.nonfinite,
                r.prepass_exact ? "exact" : "MISMATCH", ok ? "ok" : "FAIL");
  }
  std::printf("check: %d failure(s)\n", failures);
  return failures;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int g_only[3] = {0, 0, 0};  // shape=B,H,L: time that shape alone

void time_shapes() {
  struct S {
    int B, H, L;
  };
  std::vector<S> shapes = {{1, 3, 31200}, {1, 12, 31200}, {1, 12, 8192}};
  if (g_only[0] > 0) shapes = {{g_only[0], g_only[1], g_only[2]}};
  std::printf("\n%-18s %-10s %10s %10s %12s\n", "shape B,H,L", "kernel", "ms", "TFLOP/s", "GB/s");
  for (const S& s : shapes) {
    const size_t n = static_cast<size_t>(s.B) * s.L * s.H * kD;
    std::vector<uint16_t> h(n);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    uint16_t* in[3];
    for (int w = 0; w < 3; ++w) {
      for (auto& x : h) x = to_bf16_bits(nd(rng));
      in[w] = dev_alloc<uint16_t>(n, 0);
      VQAD_CUDA_CHECK(cudaMemcpy(in[w], h.data(), n * 2, cudaMemcpyHostToDevice));
    }
    uint16_t* hat[3];
    for (auto& p : hat) p = dev_alloc<uint16_t>(n, 0);
    uint16_t* o = dev_alloc<uint16_t>(n, 0);
    uint16_t* ohp = dev_alloc<uint16_t>(n, 0);
    float* m = dev_alloc<float>(static_cast<size_t>(s.B) * s.H * s.L, 0);
    float* l = dev_alloc<float>(static_cast<size_t>(s.B) * s.H * s.L, 0);
    const kk::BlhdStrides cs = kk::contiguous_blhd(s.L, s.H, kD);
    ka::FakeQuantQkvParams fq;
    fq.q = {in[0], cs}, fq.k = {in[1], cs}, fq.v = {in[2], cs};
    fq.q_out = hat[0], fq.k_out = hat[1], fq.v_out = hat[2];
    fq.batch = s.B, fq.heads = s.H, fq.len_q = fq.len_kv = s.L, fq.head_dim = kD;
    ka::AttnQatFwdParams fp;
    fp.q = {hat[0], cs}, fp.k = {hat[1], cs}, fp.v = {hat[2], cs};
    fp.o = {o, cs}, fp.o_hp = {ohp, cs}, fp.m = m, fp.l = l;
    fp.batch = s.B, fp.heads = s.H, fp.len_q = fp.len_kv = s.L, fp.head_dim = kD;

    cudaEvent_t e0, e1;
    VQAD_CUDA_CHECK(cudaEventCreate(&e0));
    VQAD_CUDA_CHECK(cudaEventCreate(&e1));
    auto time_once = [&](auto&& fn, int calls) {
      std::vector<float> ms;
      for (int i = 0; i < calls; ++i) {
        VQAD_CUDA_CHECK(cudaEventRecord(e0));
        fn();
        VQAD_CUDA_CHECK(cudaEventRecord(e1));
        VQAD_CUDA_CHECK(cudaEventSynchronize(e1));
        float t = 0;
        VQAD_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      return ms;
    };
    auto time = [&](auto&& fn) {
      for (int i = 0; i < 3; ++i) fn();
      return median(time_once(fn, 10));
    };
    // Variants timed in alternating rounds (in order, then in reverse, ...), 3 calls each a
    // round, after two warm-up calls each; the median of each variant's calls. The clock
    // drifts over a run by more than the difference a split makes.
    auto time_rounds = [&](const std::vector<std::function<void()>>& fns, int rounds) {
      for (int i = 0; i < 2; ++i)
        for (const auto& f : fns) f();
      std::vector<std::vector<float>> t(fns.size());
      for (int r = 0; r < rounds; ++r)
        for (size_t i0 = 0; i0 < fns.size(); ++i0) {
          const size_t i = r % 2 == 0 ? i0 : fns.size() - 1 - i0;
          const std::vector<float> ms = time_once(fns[i], 3);
          t[i].insert(t[i].end(), ms.begin(), ms.end());
        }
      std::vector<float> med;
      for (const auto& v : t) med.push_back(median(v));
      return med;
    };
    const double flops = 4.0 * s.B * s.H * static_cast<double>(s.L) * s.L * kD;
    char shape[48];
    std::snprintf(shape, sizeof(shape), "%d,%d,%d", s.B, s.H, s.L);
    const float t_pre = time([&] { ka::launch_fake_quant_qkv(fq, nullptr); });
    std::printf("%-18s %-10s %10.3f %10s %12.0f\n", shape, "prepass", t_pre, "-", 6.0 * n * 2 / (t_pre * 1e6));
    const int m_tiles = (s.L + ka::kAttnQatBlockM - 1) / ka::kAttnQatBlockM;
    const int64_t tiles = static_cast<int64_t>(s.B) * s.H * m_tiles;
    const int kv_tiles = (s.L + ka::kAttnQatBlockN - 1) / ka::kAttnQatBlockN;
    ka::AttnQatFwdParams whole = fp, split = fp;
    whole.split_tiles = 0;
    split.split_tiles = -1;
    const size_t ws_bytes = ka::attn_qat_fwd_workspace_bytes(split);
    // The workspace of a split of every tile (the max-only measurement below) covers any plan.
    ka::AttnQatFwdParams all = fp;
    all.split_tiles = static_cast<int>(tiles), all.split_key_tile = 1;
    const size_t ws_all = ka::attn_qat_fwd_workspace_bytes(all);
    uint8_t* ws = dev_alloc<uint8_t>(std::max(ws_all, ws_bytes), 0);
    split.workspace = all.workspace = ws;
    split.workspace_bytes = ws_bytes, all.workspace_bytes = ws_all;
    int dev = 0, sms = 0;
    VQAD_CUDA_CHECK(cudaGetDevice(&dev));
    VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const ka::AttnQatFwdSplit plan = ka::attn_qat_fwd_split_plan(tiles, kv_tiles, sms);
    if (g_digest) {
      // Bit-for-bit comparison of kernel builds: the same inputs (fixed seed) give the same
      // hash only if every output bit is the same.
      ka::launch_fake_quant_qkv(fq, nullptr);
      const size_t rows = static_cast<size_t>(s.B) * s.H * s.L;
      std::vector<uint8_t> buf(n * 2);
      for (const ka::AttnQatFwdParams* v : {&whole, &split}) {
        if (v == &split && ws_bytes == 0) continue;
        ka::AttnQatFwdParams q = *v;
        q.quant_p = true;
        ka::launch_attn_qat_fwd(q, nullptr);
        VQAD_CUDA_CHECK(cudaDeviceSynchronize());
        uint64_t hsh = vqad::kFnv1aOffset;
        for (const auto& [ptr, bytes] : std::vector<std::pair<const void*, size_t>>{
                 {o, n * 2}, {ohp, n * 2}, {m, rows * 4}, {l, rows * 4}}) {
          VQAD_CUDA_CHECK(cudaMemcpy(buf.data(), ptr, bytes, cudaMemcpyDeviceToHost));
          hsh = vqad::fnv1a(buf.data(), bytes, hsh);
        }
        std::printf("%-18s %-10s %016llx\n", shape, v == &whole ? "digest" : "digest_spl",
                    static_cast<unsigned long long>(hsh));
        // The same call without O_hp (the kernel that skips the high-precision product)
        // must give the same O, m and l bits.
        std::vector<uint8_t> ref_o(n * 2), ref_ml(rows * 8);
        VQAD_CUDA_CHECK(cudaMemcpy(ref_o.data(), o, n * 2, cudaMemcpyDeviceToHost));
        VQAD_CUDA_CHECK(cudaMemcpy(ref_ml.data(), m, rows * 4, cudaMemcpyDeviceToHost));
        VQAD_CUDA_CHECK(cudaMemcpy(ref_ml.data() + rows * 4, l, rows * 4, cudaMemcpyDeviceToHost));
        VQAD_CUDA_CHECK(cudaMemset(o, 0xff, n * 2));
        VQAD_CUDA_CHECK(cudaMemset(m, 0xff, rows * 4));
        VQAD_CUDA_CHECK(cudaMemset(l, 0xff, rows * 4));
        q.o_hp.data = nullptr;
        ka::launch_attn_qat_fwd(q, nullptr);
        VQAD_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<uint8_t> got_o(n * 2), got_ml(rows * 8);
        VQAD_CUDA_CHECK(cudaMemcpy(got_o.data(), o, n * 2, cudaMemcpyDeviceToHost));
        VQAD_CUDA_CHECK(cudaMemcpy(got_ml.data(), m, rows * 4, cudaMemcpyDeviceToHost));
        VQAD_CUDA_CHECK(cudaMemcpy(got_ml.data() + rows * 4, l, rows * 4, cudaMemcpyDeviceToHost));
        std::printf("%-18s %-10s %s\n", shape, v == &whole ? "o_only" : "o_only_spl",
                    got_o == ref_o && got_ml == ref_ml ? "O, m, l identical" : "DIFFERENT");
      }
    }
    // The kernel unsplit and (where this device plans one) split; with P quantization also
    // the pre-pass and the planned kernel in one timing, as bench attention's "qat fwd", and
    // the same with the host waiting for the pre-pass in between.
    const ka::AttnQatFwdParams& planned = ws_bytes > 0 ? split : whole;
    for (const bool quant_p : {true, false}) {
      whole.quant_p = split.quant_p = quant_p;
      ka::AttnQatFwdParams planned_o = planned;  // without O_hp: skips the high-precision product
      planned_o.o_hp.data = nullptr;
      std::vector<std::function<void()>> fns = {[&] { ka::launch_attn_qat_fwd(whole, nullptr); }};
      if (ws_bytes > 0) fns.push_back([&] { ka::launch_attn_qat_fwd(split, nullptr); });
      const size_t i_pre = fns.size();
      if (quant_p) {
        fns.push_back([&] {
          ka::launch_fake_quant_qkv(fq, nullptr);
          ka::launch_attn_qat_fwd(planned, nullptr);
        });
        fns.push_back([&] {
          ka::launch_fake_quant_qkv(fq, nullptr);
          VQAD_CUDA_CHECK(cudaDeviceSynchronize());
          ka::launch_attn_qat_fwd(planned, nullptr);
        });
        fns.push_back([&] { ka::launch_attn_qat_fwd(planned_o, nullptr); });
      }
      const std::vector<float> t = time_rounds(fns, 8);
      const float t_w = t[0], t_planned = t[i_pre - 1];
      std::printf("%-18s %-10s %10.3f %10.1f%s\n", shape, quant_p ? "fwd_qat" : "fwd_bf16", t_w, flops / (t_w * 1e9),
                  ws_bytes > 0 ? "" : "   (no split planned on this device)");
      if (ws_bytes > 0)
        std::printf("%-18s %-10s %10.3f %10.1f   (%d tiles split at KV tile %d, modelled last wave %.2f; "
                    "split / unsplit %.3f)\n",
                    shape, quant_p ? "qat_split" : "bf16_split", t_planned, flops / (t_planned * 1e9), plan.tiles,
                    plan.key_tile, plan.makespan, t_planned / t_w);
      if (quant_p) {
        std::printf("%-18s %-10s %10.3f %10.1f   (timed together; the parts timed apart add to %.3f)\n", shape,
                    "pre+qat", t[i_pre], flops / (t[i_pre] * 1e9), t_pre + t_planned);
        std::printf("%-18s %-10s %10.3f %10.1f   (host waits for the pre-pass before the kernel)\n", shape,
                    "pre|qat", t[i_pre + 1], flops / (t[i_pre + 1] * 1e9));
        std::printf("%-18s %-10s %10.3f %10.1f   (the planned kernel without O_hp; / with O_hp %.3f)\n", shape,
                    "qat_no_hp", t[i_pre + 2], flops / (t[i_pre + 2] * 1e9), t[i_pre + 2] / t_planned);
      }
    }
    // The max-only KV tile's cost (kAttnQatFwdMaxOnlyCost): every tile split, at KV tile 1
    // and at the last one. Both runs do the same full tiles and combines; the second also
    // runs kv_tiles - 2 more max-only tiles per query tile. With many waves the time is
    // proportional to the work, so cost = (t_late - t_early) / (kv_tiles - 2) per query
    // tile over the unsplit time per KV tile (t_whole / kv_tiles).
    if (tiles >= 8 * sms && kv_tiles >= 4) {
      all.quant_p = whole.quant_p = true;
      ka::AttnQatFwdParams late = all;
      late.split_key_tile = kv_tiles - 1;
      const std::vector<float> t = time_rounds({[&] { ka::launch_attn_qat_fwd(all, nullptr); },
                                                [&] { ka::launch_attn_qat_fwd(late, nullptr); }},
                                               8);
      const float t_early = t[0], t_late = t[1];
      const float t_w = time([&] { ka::launch_attn_qat_fwd(whole, nullptr); });
      const double cost = (t_late - t_early) / (kv_tiles - 2) / (t_w / kv_tiles);
      std::printf("%-18s %-10s %10.3f ms split all at 1, %.3f ms at %d, unsplit %.3f ms: max-only KV tile "
                  "%.3f of a full one (model: %.2f)\n",
                  shape, "max_only", t_early, t_late, kv_tiles - 1, t_w, cost, ka::kAttnQatFwdMaxOnlyCost);
    }
    // The planned split at key tiles around the plan's, in alternating rounds (how far the
    // makespan model's choice is from the measured best).
    if (g_sweep && ws_bytes > 0) {
      whole.quant_p = split.quant_p = true;
      std::vector<int> ks;
      for (int d = -24; d <= 24; d += 6)
        if (plan.key_tile + d >= 1 && plan.key_tile + d < kv_tiles) ks.push_back(plan.key_tile + d);
      std::vector<ka::AttnQatFwdParams> variants;
      for (const int k : ks) {
        ka::AttnQatFwdParams v = split;
        v.split_key_tile = k;
        variants.push_back(v);
      }
      variants.push_back(whole);
      std::vector<std::function<void()>> fns;
      for (const auto& v : variants) fns.push_back([&v] { ka::launch_attn_qat_fwd(v, nullptr); });
      const std::vector<float> t = time_rounds(fns, 6);
      const float t_whole = t.back();
      for (size_t i = 0; i < ks.size(); ++i) {
        const float ms = t[i];
        std::printf("%-18s %-10s %10.3f %10.1f   (%d tiles at KV tile %d%s, modelled last wave %.2f; / unsplit %.3f)\n",
                    shape, "sweep", ms, flops / (ms * 1e9), plan.tiles, ks[i], ks[i] == plan.key_tile ? ", planned" : "",
                    ka::attn_qat_fwd_split_makespan(plan.tiles, sms, ks[i], kv_tiles), ms / t_whole);
      }
      std::printf("%-18s %-10s %10.3f %10.1f\n", shape, "sweep_none", t_whole, flops / (t_whole * 1e9));
    }
    VQAD_CUDA_CHECK(cudaFree(ws));
    fp.split_tiles = 0;
    VQAD_CUDA_CHECK(cudaEventDestroy(e0));
    VQAD_CUDA_CHECK(cudaEventDestroy(e1));
    for (void* ptr : std::vector<void*>{in[0], in[1], in[2], hat[0], hat[1], hat[2], o, ohp, m, l})
      VQAD_CUDA_CHECK(cudaFree(ptr));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool do_check = false, do_time = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "check") do_check = true;
    else if (a == "time") do_time = true;
    else if (a == "d64") kD = 64;
    else if (a == "sweep") g_sweep = true;
    else if (a == "digest") g_digest = true;
    else if (a.rfind("shape=", 0) == 0) {
      if (std::sscanf(a.c_str() + 6, "%d,%d,%d", &g_only[0], &g_only[1], &g_only[2]) != 3 || g_only[0] < 1 ||
          g_only[1] < 1 || g_only[2] < 1) {
        std::fprintf(stderr, "attn_fwd_pg: shape= expects B,H,L (each >= 1), found %s\n", a.c_str() + 6);
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "attn_fwd_pg: unknown argument %s (expected check, time, d64, sweep, digest, shape=B,H,L)\n", a.c_str());
      return 2;
    }
  }
  if (!do_check && !do_time) do_check = do_time = true;  // neither named: both
  int failures = 0;
  try {
    if (do_check) failures = check();
    if (do_time) time_shapes();
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 2;
  }
  return failures == 0 ? 0 : 1;
}
