// Standalone playground for the ATTN_QAT_TRAIN backward kernels: checks
// launch_attn_qat_bwd against the CPU reference at small shapes (dQ, dK, dV within the
// kernel tests' multiple of the BF16 noise floor, tests/support/metrics.h), then times it
// at the benchmark shapes. CMake target vqad_pg_attn_bwd (-DVQAD_PLAYGROUND=ON), or one
// nvcc command on a GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -I. \
//     bench/playground/attn_bwd_playground.cu src/vqad/kernels/attention/sm90/attn_qat_bwd.cu \
//     src/vqad/kernels/attention/sm90/attn_qat_bwd_wgmma.cu src/vqad/kernels/common/tma.cu \
//     src/vqad/kernels/common/device.cu src/vqad/numerics/attention_qat_ref.cpp \
//     src/vqad/numerics/nvfp4.cpp -o /tmp/attn_bwd_pg
//   /tmp/attn_bwd_pg [check] [time] [quick] [digest] [impl=mma|wgmma] [shape=B,H,L] [json=<path>]
// shape= times that shape alone (any B, H, L; D = 128); quick: consistent mode only, at
// (1,3,31200) unless shape= names another (for profilers).
// impl= runs one of the two implementations of launch_attn_qat_bwd (default: both);
// digest: time also prints an FNV-1a hash of each timed run's dQ, dK, dV (fixed inputs), so
// two builds of a kernel can be shown to give the same bits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "tests/support/metrics.h"
#include "vqad/core/fnv1a.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/numerics/attention_qat_ref.h"
#include "vqad/numerics/nvfp4.h"

namespace ref = vqad::attn_qat_ref;
using vqad::kernels::AttnQatBwdParams;
using vqad::kernels::AttnQatBwdPMode;

namespace {

constexpr int kD = 128;

// Poisoned device tensors with padded rows (tests/support/device_buffers.h: the pads
// must stay poisoned), rel-L2 and the noise-floor tolerance of the kernel tests.
using vqad::test::DeviceBlhd;
using vqad::test::DeviceBuffer;
using vqad::test::rel_l2;

double norm(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

ref::BwdMode ref_mode(AttnQatBwdPMode m) {
  return m == AttnQatBwdPMode::kFastVideo ? ref::BwdMode::kFastVideo : ref::BwdMode::kConsistent;
}

struct CheckResult {
  double dq, dk, dv;
  double dq_tol, dk_tol, dv_tol;  // kBf16FloorMultiple x the reference's BF16 noise floor
  bool deterministic, pads_ok;
  double dv_norm_ratio;  // ||dV_kernel|| / ||dV_STE||
};

// One correctness case: random inputs, CPU reference forward (for O_hp, m, l)
// and backward, kernel with NaN-poisoned outputs.
std::vector<CheckResult> check_case(int B, int H, int Lq, int Lkv, AttnQatBwdPMode mode,
                                    int pad, uint64_t seed, bool verbose,
                                    const std::vector<vqad::kernels::AttnQatBwdImpl>& impls) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto gen = [&](int L) {
    std::vector<float> x(static_cast<size_t>(B) * L * H * kD);
    for (auto& v : x) v = ref::bf16_round(nd(rng));
    return x;
  };
  std::vector<float> q = gen(Lq), k = gen(Lkv), v = gen(Lkv), dout = gen(Lq);
  // Q^, K^, V^: the forward's fake-quantized operands (unit scale, 16 along D).
  for (auto* t : {&q, &k, &v}) vqad::nvfp4::fake_quantize(t->data(), t->data(), t->size(), 1.0f);

  ref::Dims dims{B, Lq, Lkv, H, kD};
  ref::Options opts;
  opts.block_n = 128;
  opts.quant_qk = false;  // already quantized above
  opts.quant_v = false;
  opts.quant_p = mode != AttnQatBwdPMode::kNone;
  opts.bwd_mode = ref_mode(mode);
  std::vector<float> o(q.size()), ohp(q.size()), m(static_cast<size_t>(B) * H * Lq),
      l(m.size());
  ref::forward(dims, ref::contiguous_view(q.data(), Lq, H, kD),
               ref::contiguous_view(k.data(), Lkv, H, kD), ref::contiguous_view(v.data(), Lkv, H, kD),
               opts, ref::contiguous_view(o.data(), Lq, H, kD),
               ref::contiguous_view(ohp.data(), Lq, H, kD), m.data(), l.data());
  for (auto& x : ohp) x = ref::bf16_round(x);  // the kernel sees a BF16 O_hp
  std::vector<float> rdq(q.size()), rdk(k.size()), rdv(v.size());
  ref::backward(dims, ref::contiguous_view(q.data(), Lq, H, kD),
                ref::contiguous_view(k.data(), Lkv, H, kD),
                ref::contiguous_view(v.data(), Lkv, H, kD),
                ref::contiguous_view(ohp.data(), Lq, H, kD),
                ref::contiguous_view(dout.data(), Lq, H, kD), m.data(), l.data(), opts,
                ref::contiguous_view(rdq.data(), Lq, H, kD), ref::contiguous_view(rdk.data(), Lkv, H, kD),
                ref::contiguous_view(rdv.data(), Lkv, H, kD));
  std::vector<float> ste_dv;
  if (mode != AttnQatBwdPMode::kNone) {
    // dV_STE = softmax(scale Q^ K^T)^T dO: the same backward with P unquantized.
    ref::Options ste = opts;
    ste.quant_p = false;
    std::vector<float> sdq(q.size()), sdk(k.size());
    ste_dv.resize(v.size());
    ref::backward(dims, ref::contiguous_view(q.data(), Lq, H, kD),
                  ref::contiguous_view(k.data(), Lkv, H, kD),
                  ref::contiguous_view(v.data(), Lkv, H, kD),
                  ref::contiguous_view(ohp.data(), Lq, H, kD),
                  ref::contiguous_view(dout.data(), Lq, H, kD), m.data(), l.data(), ste,
                  ref::contiguous_view(sdq.data(), Lq, H, kD),
                  ref::contiguous_view(sdk.data(), Lkv, H, kD),
                  ref::contiguous_view(ste_dv.data(), Lkv, H, kD));
  }

  DeviceBlhd gq(B, Lq, H, kD, 0, pad), gk(B, Lkv, H, kD, 0, pad), gv(B, Lkv, H, kD, 0, pad),
      gdo(B, Lq, H, kD, 0, pad), gohp(B, Lq, H, kD, 0, pad);
  gq.upload(q);
  gk.upload(k);
  gv.upload(v);
  gdo.upload(dout);
  gohp.upload(ohp);
  // 0xFFFF = bf16 NaN: poisoned outputs
  DeviceBlhd dq_(B, Lq, H, kD, 0, pad), dk_(B, Lkv, H, kD, 0, pad), dv_(B, Lkv, H, kD, 0, pad);
  DeviceBuffer<float> dm_buf(m), dl_buf(l);
  float* dm = dm_buf.get();
  float* dl = dl_buf.get();

  AttnQatBwdParams p;
  p.batch = B, p.heads = H, p.len_q = Lq, p.len_kv = Lkv, p.head_dim = kD;
  p.p_mode = mode;
  p.q_hat = gq.in(), p.k_hat = gk.in(), p.v_hat = gv.in(), p.d_out = gdo.in(), p.o_hp = gohp.in();
  p.m = dm, p.l = dl;
  p.d_q = dq_.out(), p.d_k = dk_.out(), p.d_v = dv_.out();
  DeviceBuffer<uint8_t> ws(vqad::kernels::attn_qat_bwd_workspace_bytes(p));  // 0xFF garbage
  p.workspace = ws.get();
  std::vector<CheckResult> results;
  for (const auto impl : impls) {
    p.impl = impl;
    for (DeviceBlhd* t : {&dq_, &dk_, &dv_}) t->poison();
    vqad::kernels::launch_attn_qat_bwd(p, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    const auto rq = dq_.raw(), rk = dk_.raw(), rv = dv_.raw();
    // A second run must give identical bits (no atomics).
    vqad::kernels::launch_attn_qat_bwd(p, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    CheckResult r{};
    r.deterministic = rq == dq_.raw() && rk == dk_.raw() && rv == dv_.raw();
    r.pads_ok = dq_.poison_damage(rq) == 0 && dk_.poison_damage(rk) == 0 && dv_.poison_damage(rv) == 0;
    const auto kq = dq_.values(rq), kk = dk_.values(rk), kv = dv_.values(rv);
    r.dq = rel_l2(kq, rdq);
    r.dk = rel_l2(kk, rdk);
    r.dv = rel_l2(kv, rdv);
    r.dq_tol = vqad::test::floor_tolerance(vqad::test::closeness(kq, rdq));
    r.dk_tol = vqad::test::floor_tolerance(vqad::test::closeness(kk, rdk));
    r.dv_tol = vqad::test::floor_tolerance(vqad::test::closeness(kv, rdv));
    r.dv_norm_ratio = ste_dv.empty() ? 1.0 : norm(kv) / norm(ste_dv);
    results.push_back(r);
  }
  if (verbose && !ste_dv.empty())
    std::printf("    ref ||dV||/||dV_STE|| = %.4f\n", norm(rdv) / norm(ste_dv));
  return results;
}

__global__ void fill_random_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float u = (h & 0xFFFFFF) / 16777216.0f;  // [0,1)
    x[i] = __float2bfloat16((u - 0.5f) * 3.4f);   // variance ~1
  }
}
__global__ void fill_const(float* x, size_t n, float v) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] = v;
}

struct TimeResult {
  double median_ms, min_ms, tflops;
  uint64_t digest = 0;  // FNV-1a of dQ, dK, dV after the timed calls (g_digest)
};

bool g_digest = false;

TimeResult time_shape(int B, int H, int L, AttnQatBwdPMode mode,
                      vqad::kernels::AttnQatBwdImpl impl, int iters) {
  const size_t n = static_cast<size_t>(B) * L * H * kD;
  __nv_bfloat16* buf[8];
  for (int i = 0; i < 8; ++i) {
    VQAD_CUDA_CHECK(cudaMalloc(&buf[i], n * 2));
    fill_random_bf16<<<1024, 256>>>(buf[i], n, 1234u + 77u * i);
  }
  float *dm, *dl;
  const size_t rows = static_cast<size_t>(B) * H * L;
  VQAD_CUDA_CHECK(cudaMalloc(&dm, rows * 4));
  VQAD_CUDA_CHECK(cudaMalloc(&dl, rows * 4));
  // Plausible row statistics for unit-variance inputs (the cost does not
  // depend on their values).
  fill_const<<<256, 256>>>(dm, rows, 6.0f);
  fill_const<<<256, 256>>>(dl, rows, 800.0f);
  const int64_t sl = static_cast<int64_t>(H) * kD, sb = sl * L;
  AttnQatBwdParams p;
  p.batch = B, p.heads = H, p.len_q = L, p.len_kv = L, p.head_dim = kD, p.p_mode = mode;
  p.impl = impl;
  const vqad::kernels::BlhdStrides st{sb, sl, kD, 1};
  p.q_hat = {buf[0], st};
  p.k_hat = {buf[1], st};
  p.v_hat = {buf[2], st};
  p.d_out = {buf[3], st};
  p.o_hp = {buf[4], st};
  p.m = dm, p.l = dl;
  p.d_q = {buf[5], st};
  p.d_k = {buf[6], st};
  p.d_v = {buf[7], st};
  void* ws;
  VQAD_CUDA_CHECK(cudaMalloc(&ws, vqad::kernels::attn_qat_bwd_workspace_bytes(p)));
  p.workspace = ws;
  for (int i = 0; i < 3; ++i) vqad::kernels::launch_attn_qat_bwd(p, nullptr);
  VQAD_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(e0);
    vqad::kernels::launch_attn_qat_bwd(p, nullptr);
    cudaEventRecord(e1);
    VQAD_CUDA_CHECK(cudaEventSynchronize(e1));
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  TimeResult r;
  r.median_ms = ms[ms.size() / 2];
  r.min_ms = ms.front();
  const double flops = 10.0 * B * H * static_cast<double>(L) * L * kD;  // 2.5 x forward
  r.tflops = flops / (r.median_ms * 1e-3) / 1e12;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (g_digest) {
    std::vector<uint16_t> host(n);
    uint64_t h = vqad::kFnv1aOffset;
    for (int i = 5; i < 8; ++i) {
      VQAD_CUDA_CHECK(cudaMemcpy(host.data(), buf[i], n * 2, cudaMemcpyDeviceToHost));
      h = vqad::fnv1a(host.data(), n * 2, h);
    }
    r.digest = h;
  }
  for (auto* b : buf) cudaFree(b);
  cudaFree(dm);
  cudaFree(dl);
  cudaFree(ws);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool do_check = false, do_time = false;
  std::string json_path;
  std::vector<vqad::kernels::AttnQatBwdImpl> impls = {vqad::kernels::AttnQatBwdImpl::kMmaSync,
                                                      vqad::kernels::AttnQatBwdImpl::kWgmma};
  bool quick = false;  // time only consistent mode, at (1,3,31200) without shape= (for profilers)
  int only[3] = {0, 0, 0};  // shape=B,H,L: time that shape alone
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "check") do_check = true;
    else if (a == "time") do_time = true;
    else if (a.rfind("json=", 0) == 0) json_path = a.substr(5);
    else if (a == "quick") quick = true;
    else if (a.rfind("shape=", 0) == 0) {
      if (std::sscanf(a.c_str() + 6, "%d,%d,%d", &only[0], &only[1], &only[2]) != 3 || only[0] < 1 || only[1] < 1 ||
          only[2] < 1) {
        std::fprintf(stderr, "shape= expects B,H,L (each >= 1), found %s\n", a.c_str() + 6);
        return 2;
      }
    }
    else if (a == "digest") g_digest = true;
    else if (a == "impl=mma") impls = {vqad::kernels::AttnQatBwdImpl::kMmaSync};
    else if (a == "impl=wgmma") impls = {vqad::kernels::AttnQatBwdImpl::kWgmma};
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!do_check && !do_time) do_check = do_time = true;
  cudaDeviceProp prop;
  VQAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  bool ok = true;
  std::string json = "{\"check\": [";
  if (do_check) {
    const uint64_t seed0 =
        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("correctness vs CPU reference (seed %llu), rel L2 limit %.0fx the BF16 noise floor\n",
                static_cast<unsigned long long>(seed0), vqad::test::kBf16FloorMultiple);
    std::printf("%-24s %-11s %-8s %9s %9s %9s %5s %5s %8s\n", "shape (B,H,Lq,Lkv) pad", "mode",
                "impl", "dQ", "dK", "dV", "det", "pads", "dV/STE");
    struct C {
      int B, H, Lq, Lkv, pad;
      AttnQatBwdPMode mode;
    };
    const C cases[] = {
        {1, 2, 200, 200, 0, AttnQatBwdPMode::kConsistent},
        {2, 3, 333, 157, 8, AttnQatBwdPMode::kConsistent},
        {1, 2, 77, 610, 0, AttnQatBwdPMode::kConsistent},
        {1, 1, 1, 129, 16, AttnQatBwdPMode::kConsistent},
        {1, 2, 300, 250, 0, AttnQatBwdPMode::kFastVideo},
        {2, 2, 190, 333, 8, AttnQatBwdPMode::kNone},
        {1, 2, 4096, 4096, 0, AttnQatBwdPMode::kConsistent},
        {1, 1, 4096, 4096, 0, AttnQatBwdPMode::kFastVideo},
    };
    int idx = 0;
    for (const C& c : cases) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto rs = check_case(c.B, c.H, c.Lq, c.Lkv, c.mode, c.pad, seed0 + idx, true, impls);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (size_t k = 0; k < impls.size(); ++k) {
        const CheckResult& r = rs[k];
        const bool pass = r.dq <= r.dq_tol && r.dk <= r.dk_tol && r.dv <= r.dv_tol && r.deterministic &&
                          r.pads_ok &&
                          (c.mode != AttnQatBwdPMode::kConsistent || c.Lkv < 4096 ||
                           (r.dv_norm_ratio >= 0.9 && r.dv_norm_ratio <= 1.1));
        ok = ok && pass;
        char shape[64];
        std::snprintf(shape, sizeof(shape), "(%d,%d,%d,%d) %d", c.B, c.H, c.Lq, c.Lkv, c.pad);
        std::printf("%-24s %-11s %-8s %9.2e %9.2e %9.2e %5s %5s %8.4f %s (%.1fs)\n", shape,
                    vqad::kernels::attn_qat_bwd_p_mode_name(c.mode),
                    vqad::kernels::attn_qat_bwd_impl_name(impls[k]), r.dq, r.dk, r.dv,
                    r.deterministic ? "yes" : "NO", r.pads_ok ? "ok" : "BAD", r.dv_norm_ratio,
                    pass ? "PASS" : "FAIL", secs);
        char buf[512];
        std::snprintf(buf, sizeof(buf),
                      "%s{\"shape\": [%d,%d,%d,%d], \"mode\": \"%s\", \"impl\": \"%s\", "
                      "\"dq_rel_l2\": %.4e, \"dk_rel_l2\": %.4e, \"dv_rel_l2\": %.4e, "
                      "\"dv_norm_ratio\": %.4f, \"pass\": %s}",
                      idx ? ", " : "", c.B, c.H, c.Lq, c.Lkv,
                      vqad::kernels::attn_qat_bwd_p_mode_name(c.mode),
                      vqad::kernels::attn_qat_bwd_impl_name(impls[k]), r.dq, r.dk, r.dv,
                      r.dv_norm_ratio, pass ? "true" : "false");
        json += buf;
        ++idx;
      }
    }
  }
  json += "], \"time\": [";
  if (do_time) {
    std::printf("\ntiming launch_attn_qat_bwd (stats + dK/dV + dQ), median of 20 after warm-up\n");
    std::printf("%-22s %-11s %-8s %10s %10s %10s\n", "shape (B,H,L,D)", "mode", "impl",
                "median ms", "min ms", "TFLOP/s");
    struct S {
      int B, H, L;
    };
    std::vector<S> shapes = {{1, 3, 31200}, {1, 12, 31200}, {1, 12, 8192}};
    if (only[0] > 0) shapes = {{only[0], only[1], only[2]}};
    else if (quick) shapes = {{1, 3, 31200}};
    int idx = 0;
    for (const S& s : shapes) {
      for (AttnQatBwdPMode mode :
           {AttnQatBwdPMode::kConsistent, AttnQatBwdPMode::kNone, AttnQatBwdPMode::kFastVideo}) {
        for (auto impl : impls) {
          if (s.H == 12 && s.L == 31200 && mode == AttnQatBwdPMode::kNone) continue;
          // fastvideo mode only for the digests, at the short shape and (1,3,31200)
          if (mode == AttnQatBwdPMode::kFastVideo && (!g_digest || (s.H == 12 && s.L == 31200))) continue;
          if (quick && mode != AttnQatBwdPMode::kConsistent) continue;
          const TimeResult r = time_shape(s.B, s.H, s.L, mode, impl, 20);
          char shape[64];
          std::snprintf(shape, sizeof(shape), "(%d,%d,%d,128)", s.B, s.H, s.L);
          std::printf("%-22s %-11s %-8s %10.3f %10.3f %10.1f", shape,
                      vqad::kernels::attn_qat_bwd_p_mode_name(mode),
                      vqad::kernels::attn_qat_bwd_impl_name(impl), r.median_ms, r.min_ms, r.tflops);
          if (g_digest) std::printf("  digest %016llx", static_cast<unsigned long long>(r.digest));
          std::printf("\n");
          char buf[256];
          std::snprintf(buf, sizeof(buf),
                        "%s{\"shape\": [%d,%d,%d,128], \"mode\": \"%s\", \"impl\": \"%s\", "
                        "\"median_ms\": %.4f, \"min_ms\": %.4f, \"tflops\": %.1f}",
                        idx ? ", " : "", s.B, s.H, s.L, vqad::kernels::attn_qat_bwd_p_mode_name(mode),
                        vqad::kernels::attn_qat_bwd_impl_name(impl), r.median_ms, r.min_ms, r.tflops);
          json += buf;
          ++idx;
        }
      }
    }
  }
  json += "]}\n";
  if (!json_path.empty()) {
    if (FILE* f = std::fopen(json_path.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
