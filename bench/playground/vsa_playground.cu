// Standalone playground for the VSA pipeline (vsa_forward / vsa_backward of
// kernels/vsa): runs the forward and backward twice on fresh random inputs and checks
// that every output is finite and bitwise equal across the runs, then times them at a
// grid (B = 1, D = 128, gate on) for VSA_TRAIN and VSA_QAT_TRAIN with C128 cubes. The
// numerics against the CPU reference are the kernel tests' (tests/gpu/test_vsa_cuda.cpp);
// `vqad bench vsa` times the same calls next to the dense kernels and cuDNN. CMake
// target vqad_pg_vsa (-DVQAD_PLAYGROUND=ON), or after building vqad_kernels and vqad_base:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Isrc -I. -Ibuild/generated bench/playground/vsa_playground.cu build/libvqad_kernels.a \
//     build/libvqad_base.a -lyaml-cpp -lcuda -o /tmp/vsa_pg
//   /tmp/vsa_pg [grid=T,H,W] [heads=12] [sparsity=0.9] [iters=20] [profile]
// Reported per variant: median ms of the forward, the backward, one forward + backward
// timed alone (the GPU idle until the first launch counts), and forward + backward queued
// back to back (iters pairs between two events / iters: the kernels' time with the launch
// gaps a training step sees), and an FNV-1a digest of the outputs (the inputs have a fixed
// seed); `profile` adds the time of every kernel of one forward + backward (each launched
// alone from a captured graph).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "vqad/core/fnv1a.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/vsa/vsa_kernels.h"
#include "vqad/numerics/vsa_ref.h"

namespace kv = vqad::kernels::vsa;
namespace vr = vqad::vsa_ref;
using vqad::test::DeviceBuffer;

namespace {

constexpr int kD = kv::kVsaHeadDim;

struct Args {
  int T = 20, Hg = 30, W = 52, heads = 12, iters = 20;
  double sparsity = 0.9;
};

std::vector<uint16_t> random_bf16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<uint16_t> r(n);
  for (auto& e : r) {
    const __nv_bfloat16 b = __float2bfloat16(nd(rng));
    std::memcpy(&e, &b, 2);
  }
  return r;
}

bool all_finite_bf16(const std::vector<uint16_t>& x) {
  for (uint16_t e : x)
    if ((e & 0x7f80u) == 0x7f80u) return false;
  return true;
}

// The launch configuration of a grid (device tables filled in by Pipeline).
kv::VsaConfig config_of(const Args& a, const vr::Tiling& t, bool quantize) {
  kv::VsaConfig c;
  c.batch = 1;
  c.heads = a.heads;
  c.grid_t = a.T, c.grid_h = a.Hg, c.grid_w = a.W;
  c.tiling.len = static_cast<int>(t.num_tokens());
  c.tiling.num_cubes = static_cast<int>(t.num_cubes);
  c.tiling.blocks_per_cube = static_cast<int>(t.blocks_per_cube);
  c.tiling.padded_len = static_cast<int>(t.padded_len);
  c.tiling.max_cube_tokens = *std::max_element(t.cube_tokens.begin(), t.cube_tokens.end());
  c.topk = static_cast<int>(vr::effective_topk(a.sparsity, t.num_cubes));
  c.quantize = quantize;
  return c;
}

std::vector<int32_t> i32(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

struct Pipeline {
  vr::Tiling t;
  kv::VsaConfig c;
  size_t n, tiled, rows, coarse;
  DeviceBuffer<int32_t> s2t, t2s, ct, bt;
  DeviceBuffer<uint16_t> q, k, v, gate, d_o, o, dq, dk, dv, dgate, tq, tk, tv, ohp;
  DeviceBuffer<float> m, l, q_c, k_c, v_c, out_c, probs;
  DeviceBuffer<int32_t> sel_index, sel_count;
  DeviceBuffer<uint8_t> wsf, wsb;
  kv::VsaForwardArgs fa;
  kv::VsaBackwardArgs ba;

  Pipeline(const Args& a, bool quantize)
      : t(vr::make_tiling(a.T, a.Hg, a.W, vr::kCubeC128)),
        c(config_of(a, t, quantize)),
        n(static_cast<size_t>(t.num_tokens() * a.heads * kD)),
        tiled(static_cast<size_t>(t.padded_len * a.heads * kD)),
        rows(static_cast<size_t>(t.padded_len * a.heads)),
        coarse(static_cast<size_t>(t.num_cubes * a.heads * kD)),
        s2t(i32(t.slot_to_token)),
        t2s(i32(t.token_to_slot)),
        ct(t.cube_tokens),
        bt(t.block_tokens),
        q(n), k(n), v(n), gate(n), d_o(n), o(n), dq(n), dk(n), dv(n), dgate(n),
        tq(tiled), tk(tiled), tv(tiled), ohp(tiled),
        m(rows), l(rows), q_c(coarse), k_c(coarse), v_c(coarse), out_c(coarse),
        probs(static_cast<size_t>(a.heads * t.num_cubes * t.num_cubes)),
        sel_index(static_cast<size_t>(a.heads * t.num_cubes) * c.topk),
        sel_count(static_cast<size_t>(a.heads * t.num_cubes)),
        wsf(kv::vsa_forward_workspace_bytes(c)),
        wsb(kv::vsa_backward_workspace_bytes(c)) {
    c.tiling.slot_to_token = s2t.get();
    c.tiling.token_to_slot = t2s.get();
    c.tiling.cube_tokens = ct.get();
    c.tiling.block_tokens = bt.get();
    std::mt19937 rng(2026);
    q.upload(random_bf16(n, 1.0f, rng));
    k.upload(random_bf16(n, 1.0f, rng));
    v.upload(random_bf16(n, 1.0f, rng));
    gate.upload(random_bf16(n, 0.5f, rng));
    d_o.upload(random_bf16(n, 1.0f, rng));
    const int64_t L = t.num_tokens();
    const vqad::kernels::BlhdStrides st{L * c.heads * kD, c.heads * kD, kD, 1};
    auto in = [&](const DeviceBuffer<uint16_t>& d) { return vqad::kernels::BlhdIn{d.get(), st}; };
    auto out = [&](DeviceBuffer<uint16_t>& d) { return vqad::kernels::BlhdOut{d.get(), st}; };
    fa.q = in(q), fa.k = in(k), fa.v = in(v), fa.gate = in(gate), fa.o = out(o);
    fa.tiled_q = tq.get(), fa.tiled_k = tk.get(), fa.tiled_v = tv.get(), fa.o_fine_hp = ohp.get();
    fa.m = m.get(), fa.l = l.get(), fa.sel_index = sel_index.get(), fa.sel_count = sel_count.get();
    fa.q_c = q_c.get(), fa.k_c = k_c.get(), fa.v_c = v_c.get(), fa.probs = probs.get(), fa.out_c = out_c.get();
    fa.workspace = wsf.get();
    ba.gate = in(gate), ba.d_o = in(d_o);
    ba.tiled_q = tq.get(), ba.tiled_k = tk.get(), ba.tiled_v = tv.get(), ba.o_fine_hp = ohp.get();
    ba.m = m.get(), ba.l = l.get(), ba.sel_index = sel_index.get(), ba.sel_count = sel_count.get();
    ba.q_c = q_c.get(), ba.k_c = k_c.get(), ba.v_c = v_c.get(), ba.probs = probs.get(), ba.out_c = out_c.get();
    ba.dq = out(dq), ba.dk = out(dk), ba.dv = out(dv), ba.dgate = out(dgate);
    ba.workspace = wsb.get();
  }

  void forward() { kv::vsa_forward(c, fa, nullptr); }
  void backward() { kv::vsa_backward(c, ba, nullptr); }
  // The BF16 outputs (o, dq, dk, dv, dgate) and the selection lists.
  struct Outputs {
    std::vector<std::vector<uint16_t>> bf16;
    std::vector<int32_t> sel;
    bool operator==(const Outputs& x) const { return bf16 == x.bf16 && sel == x.sel; }
  };
  Outputs outputs() const {
    return {{o.download(), dq.download(), dk.download(), dv.download(), dgate.download()}, sel_index.download()};
  }
};

template <class Fn>
double median_ms(Fn&& fn, int iters, int per_event = 1) {
  cudaEvent_t a, b;
  VQAD_CUDA_CHECK(cudaEventCreate(&a));
  VQAD_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < 3; ++i) fn();
  for (int i = 0; i < iters; ++i) {
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    VQAD_CUDA_CHECK(cudaEventRecord(a));
    for (int r = 0; r < per_event; ++r) fn();
    VQAD_CUDA_CHECK(cudaEventRecord(b));
    VQAD_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    VQAD_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / per_event);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A kernel's name without its namespaces, template arguments and parameters
// ("coarse_forward_kernel"), or its symbol when it cannot be demangled.
std::string kernel_name(const void* func) {
  const char* symbol = nullptr;
  if (cudaFuncGetName(&symbol, func) != cudaSuccess || symbol == nullptr) return "?";
  int status = 0;
  char* demangled = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) return symbol;
  std::string name = demangled;
  std::free(demangled);
  name = name.substr(0, name.find_first_of("<("));  // the template arguments or parameters
  const size_t ns = name.rfind("::");
  return ns == std::string::npos ? name : name.substr(ns + 2);
}

// Per-kernel times of one forward + backward: the calls are captured into a CUDA graph
// and every kernel node is then launched alone with its captured arguments (median_ms;
// its inputs are the previous run's, so the times are the kernels', not the launch
// gaps'). Memset nodes are listed without a time.
void profile(Pipeline& p, int iters) {
  cudaStream_t s;
  VQAD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  VQAD_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  kv::vsa_forward(p.c, p.fa, s);
  kv::vsa_backward(p.c, p.ba, s);
  VQAD_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  size_t count = 0;
  VQAD_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  VQAD_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &count));
  double total = 0;
  for (cudaGraphNode_t n : nodes) {  // capture order of a single stream
    cudaGraphNodeType type;
    VQAD_CUDA_CHECK(cudaGraphNodeGetType(n, &type));
    if (type != cudaGraphNodeTypeKernel) {
      std::printf("  %-60s %9s\n", type == cudaGraphNodeTypeMemset ? "(memset)" : "(other node)", "-");
      continue;
    }
    cudaKernelNodeParams kp{};
    VQAD_CUDA_CHECK(cudaGraphKernelNodeGetParams(n, &kp));
    const double med = median_ms(
        [&] {
          VQAD_CUDA_CHECK(cudaLaunchKernel(kp.func, kp.gridDim, kp.blockDim, kp.kernelParams, kp.sharedMemBytes, 0));
        },
        iters);
    total += med;
    const std::string shown = kernel_name(kp.func);
    std::printf("  %-60s %9.3f  grid %ux%ux%u block %u smem %zu\n", shown.c_str(), med, kp.gridDim.x, kp.gridDim.y,
                kp.gridDim.z, kp.blockDim.x * kp.blockDim.y * kp.blockDim.z, static_cast<size_t>(kp.sharedMemBytes));
  }
  std::printf("  %-60s %9.3f\n", "sum of kernels", total);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

}  // namespace

int run(const Args& a, bool prof);

int main(int argc, char** argv) {
  Args a;
  bool prof = false;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "profile") {
      prof = true;
      continue;
    }
    if (s.rfind("grid=", 0) == 0) {
      if (std::sscanf(s.c_str() + 5, "%d,%d,%d", &a.T, &a.Hg, &a.W) != 3) {
        std::fprintf(stderr, "vsa_playground: grid= expects T,H,W, found %s\n", s.c_str());
        return 2;
      }
    } else if (s.rfind("heads=", 0) == 0) {
      a.heads = std::atoi(s.c_str() + 6);
    } else if (s.rfind("sparsity=", 0) == 0) {
      a.sparsity = std::atof(s.c_str() + 9);
    } else if (s.rfind("iters=", 0) == 0) {
      a.iters = std::atoi(s.c_str() + 6);
    } else {
      std::fprintf(stderr, "vsa_playground: unknown argument %s (grid=T,H,W heads= sparsity= iters= profile)\n", s.c_str());
      return 2;
    }
  }
  if (a.T < 1 || a.Hg < 1 || a.W < 1 || a.heads < 1 || a.iters < 1 || !(a.sparsity >= 0.0 && a.sparsity < 1.0)) {
    std::fprintf(stderr,
                 "vsa_playground: expected grid dims, heads and iters >= 1 and sparsity in [0, 1), found grid %dx%dx%d "
                 "heads=%d iters=%d sparsity=%g\n",
                 a.T, a.Hg, a.W, a.heads, a.iters, a.sparsity);
    return 2;
  }
  try {
    return run(a, prof);
  } catch (const std::exception& e) {  // launch checks (vqad::Error) and CUDA failures: one line
    std::fprintf(stderr, "vsa_playground: %s\n", e.what());
    return 1;
  }
}

int run(const Args& a, bool prof) {
  int failures = 0;
  std::printf("grid %dx%dx%d, B=1 H=%d D=%d, sparsity %.2f, C128, gate on\n", a.T, a.Hg, a.W, a.heads, kD,
              a.sparsity);
  std::printf("%-20s %9s %9s %12s %12s  %s\n", "variant", "fwd ms", "bwd ms", "fwd+bwd ms", "queued ms", "check");
  for (bool quantize : {false, true}) {
    Pipeline p(a, quantize);
    p.forward();
    p.backward();
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    const auto first = p.outputs();
    p.forward();
    p.backward();
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    const auto second = p.outputs();
    bool finite = true;
    for (const auto& x : first.bf16) finite &= all_finite_bf16(x);
    const bool same = first == second;
    const double f = median_ms([&] { p.forward(); }, a.iters);
    const double b = median_ms([&] { p.backward(); }, a.iters);
    const double fb = median_ms([&] { p.forward(), p.backward(); }, a.iters);
    const double queued = median_ms([&] { p.forward(), p.backward(); }, 5, a.iters);
    const bool ok = finite && same;
    failures += ok ? 0 : 1;
    // FNV-1a of the outputs (fixed-seed inputs): two builds of the kernels give the same
    // hash where their arithmetic is the same.
    uint64_t digest = vqad::kFnv1aOffset;
    const auto hash = [&](const void* data, size_t bytes) { digest = vqad::fnv1a(data, bytes, digest); };
    for (const auto& x : first.bf16) hash(x.data(), x.size() * sizeof(x[0]));
    hash(first.sel.data(), first.sel.size() * sizeof(first.sel[0]));
    std::printf("%-20s %9.3f %9.3f %12.3f %12.3f  %s, digest %016llx\n", quantize ? "VSA_QAT_TRAIN_C128" : "VSA_TRAIN_C128",
                f, b, fb, queued, ok ? "finite, deterministic" : (finite ? "NOT deterministic" : "NOT finite"),
                static_cast<unsigned long long>(digest));
    if (prof) profile(p, a.iters);
  }
  return failures == 0 ? 0 : 1;
}
