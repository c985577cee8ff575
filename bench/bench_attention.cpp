// `vqad bench attention`: the ATTN_QAT_TRAIN CUDA kernels (Q/K/V pre-pass + forward,
// backward) against LibTorch SDPA with the cuDNN and the flash backends, side by side
// in one run at the performance-spec shapes (head dim 128 by default, 64 on request).
// Before timing, the kernels are checked against the CPU reference at a small ragged
// shape, once per head dim. Every variant of a shape, the peers included, is timed in the
// same alternating rounds (time_in_rounds). Prints a table and writes JSON.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/numerics/attention_qat_ref.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>

#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#endif

namespace vqad::cli {
namespace {

struct AttentionBenchOptions {
  std::vector<std::string> shapes = {"1,3,31200", "1,12,31200", "1,12,8192"};  // B,H,L[,D] (D: 128 or 64)
  int warmup = 3;
  int iters = 10;
  int rounds = 4;  // alternating rounds of every variant (time_in_rounds)
  bool backward = true;
  std::string out_dir = "bench_out";
};

struct Shape {
  int64_t b = 0, h = 0, l = 0, d = 128;
};

Shape parse_shape(const std::string& s) {
  Shape r;
  char c1 = 0, c2 = 0, c3 = 0;
  std::istringstream is(s);
  bool ok = static_cast<bool>(is >> r.b >> c1 >> r.h >> c2 >> r.l) && c1 == ',' && c2 == ',';
  if (ok && !is.eof()) ok = static_cast<bool>(is >> c3 >> r.d) && c3 == ',';
  if (!ok || !is.eof() || r.b < 1 || r.h < 1 || r.l < 1)
    fail("bench attention: --shape '", s, "' must be B,H,L or B,H,L,D with positive integers, e.g. 1,3,31200");
  if (r.d != 64 && r.d != 128) fail("bench attention: --shape '", s, "': D must be 64 or 128, found ", r.d);
  return r;
}

#ifdef VQAD_WITH_TORCH_CUDA
namespace ka = vqad::kernels::attention;
namespace ref = vqad::attn_qat_ref;

// Median of the calls' CUDA-event times on the current LibTorch stream, each call
// synchronized before the next (its host work inside its own event pair).
template <class Fn>
double time_ms(Fn&& fn, int warmup, int iters) {
  return vqad::bench::time_cuda([&](cudaStream_t) { fn(); }, at::cuda::getCurrentCUDAStream().stream(), warmup,
                                iters, vqad::bench::TimingSync::kEachCall)
      .median_ms;
}

// BLHD views of the launch convention (kernels/common/launch.h).
vqad::kernels::BlhdStrides strides_of(const torch::Tensor& t) {
  return vqad::kernels::BlhdStrides{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}
vqad::kernels::BlhdIn blhd_in(const torch::Tensor& t) { return {t.data_ptr(), strides_of(t)}; }
vqad::kernels::BlhdOut blhd_out(const torch::Tensor& t) { return {t.data_ptr(), strides_of(t)}; }

// The vqad QAT attention on one set of BLHD bf16 CUDA tensors: pre-pass buffers,
// forward outputs and backward gradients, allocated once and reused by every call.
struct QatRun {
  torch::Tensor q, k, v, d_out;                   // inputs
  torch::Tensor qh, kh, vh, o, o_hp, m, l;        // pre-pass + forward
  torch::Tensor fwd_workspace;                    // forward (key split of the last wave)
  torch::Tensor dq, dk, dv, workspace;            // backward
  ka::FakeQuantQkvParams fq;
  ka::AttnQatFwdParams fwd;
  vqad::kernels::AttnQatBwdParams bwd;

  QatRun(const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_, const torch::Tensor& do_)
      : q(q_), k(k_), v(v_), d_out(do_) {
    const int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), Lkv = k.size(1);
    qh = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    kh = torch::empty_like(k, torch::MemoryFormat::Contiguous);
    vh = torch::empty_like(v, torch::MemoryFormat::Contiguous);
    o = torch::empty_like(qh);
    o_hp = torch::empty_like(qh);
    const auto f32 = q.options().dtype(torch::kFloat32);
    m = torch::empty({B, H, Lq}, f32);
    l = torch::empty({B, H, Lq}, f32);
    fq.q = blhd_in(q), fq.k = blhd_in(k), fq.v = blhd_in(v);
    fq.q_out = qh.data_ptr(), fq.k_out = kh.data_ptr(), fq.v_out = vh.data_ptr();
    fq.batch = static_cast<int>(B), fq.heads = static_cast<int>(H);
    fq.len_q = static_cast<int>(Lq), fq.len_kv = static_cast<int>(Lkv), fq.head_dim = static_cast<int>(q.size(3));
    fwd.q = blhd_in(qh), fwd.k = blhd_in(kh), fwd.v = blhd_in(vh);
    fwd.o = blhd_out(o), fwd.o_hp = blhd_out(o_hp);
    fwd.m = m.data_ptr<float>(), fwd.l = l.data_ptr<float>();
    fwd.batch = fq.batch, fwd.heads = fq.heads, fwd.len_q = fq.len_q, fwd.len_kv = fq.len_kv;
    fwd.head_dim = fq.head_dim;
    fwd.quant_p = true;
    const size_t ws = ka::attn_qat_fwd_workspace_bytes(fwd);
    if (ws > 0) {
      fwd_workspace = torch::empty({static_cast<int64_t>(ws)}, q.options().dtype(torch::kUInt8));
      fwd.workspace = fwd_workspace.data_ptr(), fwd.workspace_bytes = ws;
    }
  }
  cudaStream_t stream() const { return at::cuda::getCurrentCUDAStream().stream(); }
  void prepass() { ka::launch_fake_quant_qkv(fq, stream()); }
  void forward() { ka::launch_attn_qat_fwd(fwd, stream()); }

  void setup_backward() {
    dq = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    dk = torch::empty_like(k, torch::MemoryFormat::Contiguous);
    dv = torch::empty_like(v, torch::MemoryFormat::Contiguous);
    bwd.batch = fwd.batch, bwd.heads = fwd.heads, bwd.len_q = fwd.len_q, bwd.len_kv = fwd.len_kv;
    bwd.head_dim = fwd.head_dim;
    bwd.p_mode = vqad::kernels::AttnQatBwdPMode::kConsistent;
    bwd.q_hat = blhd_in(qh), bwd.k_hat = blhd_in(kh), bwd.v_hat = blhd_in(vh);
    bwd.d_out = blhd_in(d_out), bwd.o_hp = blhd_in(o_hp);
    bwd.m = m.data_ptr<float>(), bwd.l = l.data_ptr<float>();
    bwd.d_q = blhd_out(dq), bwd.d_k = blhd_out(dk), bwd.d_v = blhd_out(dv);
    const size_t ws = vqad::kernels::attn_qat_bwd_workspace_bytes(bwd);
    workspace = torch::empty({static_cast<int64_t>(std::max<size_t>(ws, 16))}, q.options().dtype(torch::kUInt8));
    bwd.workspace = workspace.data_ptr();
  }
  void backward() { vqad::kernels::launch_attn_qat_bwd(bwd, stream()); }
};

double rel_l2(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor g = got.to(torch::kCPU, torch::kFloat64), w = want.to(torch::kFloat64);
  return ((g - w).norm() / w.norm().clamp_min(1e-30)).item<double>();
}

ref::ConstView cview(const torch::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }
ref::View view(torch::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

// Kernels vs the CPU reference at a ragged cross-attention shape (Lq, Lkv not tile
// multiples). Throws when the forward is off; the backward result is reported and
// decides whether the backward is timed.
nlohmann::json check_against_reference(int64_t kD, bool with_backward, bool* backward_ok) {
  const int64_t B = 1, H = 2, Lq = 1000, Lkv = 777;
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q = torch::randn({B, Lq, H, kD}, bf), k = torch::randn({B, Lkv, H, kD}, bf),
                      v = torch::randn({B, Lkv, H, kD}, bf), d_out = torch::randn({B, Lq, H, kD}, bf);
  QatRun run(q, k, v, d_out);
  run.o.fill_(NAN);
  run.o_hp.fill_(NAN);
  run.prepass();
  run.forward();
  auto cpu = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat32).contiguous(); };
  torch::Tensor qc = cpu(q), kc = cpu(k), vc = cpu(v), dc = cpu(d_out);
  ref::Dims dims{B, Lq, Lkv, H, kD};
  ref::Options opts;
  opts.block_n = ka::kAttnQatBlockN;
  torch::Tensor ro = torch::empty_like(qc), rohp = torch::empty_like(qc);
  torch::Tensor rm = torch::empty({B, H, Lq}), rl = torch::empty({B, H, Lq});
  ref::forward(dims, cview(qc), cview(kc), cview(vc), opts, view(ro), view(rohp), rm.data_ptr<float>(),
               rl.data_ptr<float>());
  nlohmann::json j = {{"shape", {B, H, Lq, Lkv, kD}}, {"block_n", ka::kAttnQatBlockN}};
  j["fwd_o_rel_l2"] = rel_l2(run.o, ro);
  j["fwd_o_hp_rel_l2"] = rel_l2(run.o_hp, rohp);
  j["fwd_m_max_abs"] = (run.m.cpu() - rm).abs().max().item<double>();
  j["fwd_l_max_rel"] = ((run.l.cpu() - rl).abs() / rl).max().item<double>();
  VQAD_CHECK(j["fwd_o_rel_l2"].get<double>() <= 1e-2 && j["fwd_o_hp_rel_l2"].get<double>() <= 1e-2 &&
                 j["fwd_m_max_abs"].get<double>() <= 1e-3 && j["fwd_l_max_rel"].get<double>() <= 1e-3,
             "bench attention: forward kernel disagrees with the CPU reference at B=1 H=2 Lq=1000 Lkv=777 D=", kD, ": ",
             j.dump());
  *backward_ok = false;
  if (with_backward) {
    try {
      run.setup_backward();
      run.backward();
      torch::Tensor rdq = torch::empty_like(qc), rdk = torch::empty_like(kc), rdv = torch::empty_like(vc);
      ref::backward(dims, cview(qc), cview(kc), cview(vc), cview(rohp), cview(dc), rm.data_ptr<float>(),
                    rl.data_ptr<float>(), opts, view(rdq), view(rdk), view(rdv));
      j["bwd_dq_rel_l2"] = rel_l2(run.dq, rdq);
      j["bwd_dk_rel_l2"] = rel_l2(run.dk, rdk);
      j["bwd_dv_rel_l2"] = rel_l2(run.dv, rdv);
      *backward_ok = j["bwd_dq_rel_l2"].get<double>() <= 1e-2 && j["bwd_dk_rel_l2"].get<double>() <= 1e-2 &&
                     j["bwd_dv_rel_l2"].get<double>() <= 1e-2;
    } catch (const std::exception& e) {
      j["bwd_error"] = e.what();
    }
  }
  j["bwd_ok"] = *backward_ok;
  return j;
}

// SDPA backend selection through the global SDP toggles, restored on scope exit.
struct SdpBackendScope {
  bool flash, mem, math, cudnn;
  SdpBackendScope(bool use_flash, bool use_cudnn) {
    auto& c = at::globalContext();
    flash = c.userEnabledFlashSDP(), mem = c.userEnabledMemEfficientSDP(), math = c.userEnabledMathSDP();
    cudnn = c.userEnabledCuDNNSDP();
    c.setSDPUseFlash(use_flash);
    c.setSDPUseMemEfficient(false);
    c.setSDPUseMath(false);
    c.setSDPUseCuDNN(use_cudnn);
  }
  ~SdpBackendScope() {
    auto& c = at::globalContext();
    c.setSDPUseFlash(flash);
    c.setSDPUseMemEfficient(mem);
    c.setSDPUseMath(math);
    c.setSDPUseCuDNN(cudnn);
  }
};

// One timed variant: `time` returns the median ms of one batch of calls (time_ms).
struct Variant {
  std::string key;  // JSON key without "_ms"
  std::function<double()> time;
};

// Times the variants in alternating rounds (the order reversed every other round) and
// stores the median of each variant's round medians under "<key>_ms" and the round
// medians under "<key>_rounds_ms". Under load the GPU's clock follows its power cap and
// temperature, and drifts by more than the differences measured (docs/performance.md: on
// an H100 the QAT forward at (1,12,31200) took 14.0 ms in its first round and 16.2 - 16.8
// ms later): timed one after the other, a peer timed later in the run would be measured at
// a lower clock than we are. Alternating rounds expose every variant to the same drift.
void time_in_rounds(const std::vector<Variant>& vs, int rounds, nlohmann::json& r) {
  const int n = static_cast<int>(vs.size());
  std::vector<std::vector<double>> ms(vs.size());
  for (int round = 0; round < rounds; ++round)
    for (int i0 = 0; i0 < n; ++i0) {
      const int i = round % 2 == 0 ? i0 : n - 1 - i0;
      ms[i].push_back(vs[i].time());
    }
  for (int i = 0; i < n; ++i) {
    r[vs[i].key + "_ms"] = vqad::bench::median(ms[i]);
    r[vs[i].key + "_rounds_ms"] = ms[i];
  }
}

// The median over rounds of mine / theirs of the same round ("ratio_<dir>_vs_<peer>_rounds":
// the drift cancels within a round), next to the ratio of the medians.
void round_ratios(nlohmann::json& r, const std::string& dir, const std::string& peer) {
  const std::string mine = "vqad_qat_" + dir + "_rounds_ms", theirs = peer + "_" + dir + "_rounds_ms";
  if (!r.contains(mine) || !r.contains(theirs)) return;
  const std::vector<double> a = r[mine].get<std::vector<double>>(), b = r[theirs].get<std::vector<double>>();
  std::vector<double> q;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) q.push_back(a[i] / b[i]);
  r["ratio_" + dir + "_vs_" + peer + "_rounds"] = q;
  r["ratio_" + dir + "_vs_" + peer + "_round_median"] = vqad::bench::median(q);
}

// SDPA of one backend on BHLD tensors (its native layout): its forward and backward as
// variants, after one untimed call of each (a backend that refuses the shape leaves
// "<name>_error" / "<name>_bwd_error" instead). The graph of the timed backward is built
// here, under the backend's selection.
struct SdpaPeer {
  std::string name;
  bool use_flash, use_cudnn;
  torch::Tensor q, k, v, d_out, qg, kg, vg, out;
  bool fwd_ok = false, bwd_ok = false;

  SdpaPeer(std::string name_, bool flash, bool cudnn, const torch::Tensor& q_, const torch::Tensor& k_,
           const torch::Tensor& v_, const torch::Tensor& do_, bool backward, nlohmann::json& r)
      : name(std::move(name_)), use_flash(flash), use_cudnn(cudnn), q(q_), k(k_), v(v_), d_out(do_) {
    SdpBackendScope scope(use_flash, use_cudnn);
    try {
      torch::NoGradGuard no_grad;
      at::scaled_dot_product_attention(q, k, v);
      fwd_ok = true;
    } catch (const std::exception& e) {
      r[name + "_error"] = std::string(e.what()).substr(0, 200);
      return;
    }
    if (!backward) return;
    try {
      qg = q.detach().requires_grad_(true), kg = k.detach().requires_grad_(true), vg = v.detach().requires_grad_(true);
      out = at::scaled_dot_product_attention(qg, kg, vg);
      backward_call();
      bwd_ok = true;
    } catch (const std::exception& e) {
      r[name + "_bwd_error"] = std::string(e.what()).substr(0, 200);
    }
  }
  void backward_call() {
    qg.mutable_grad() = torch::Tensor();
    kg.mutable_grad() = torch::Tensor();
    vg.mutable_grad() = torch::Tensor();
    torch::autograd::backward({out}, {d_out}, /*retain_graph=*/true);
  }
  Variant forward_variant(const AttentionBenchOptions& o) {
    return {name + "_fwd", [this, &o] {
              SdpBackendScope scope(use_flash, use_cudnn);
              torch::NoGradGuard no_grad;
              return time_ms([&] { at::scaled_dot_product_attention(q, k, v); }, o.warmup, o.iters);
            }};
  }
  Variant backward_variant(const AttentionBenchOptions& o) {
    return {name + "_bwd", [this, &o] {
              SdpBackendScope scope(use_flash, use_cudnn);
              return time_ms([&] { backward_call(); }, o.warmup, o.iters);
            }};
  }
};

nlohmann::json bench_shape(const Shape& s, bool backward_ok, const AttentionBenchOptions& o) {
  const int64_t kD = s.d;
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q = torch::randn({s.b, s.l, s.h, kD}, bf), k = torch::randn({s.b, s.l, s.h, kD}, bf),
                      v = torch::randn({s.b, s.l, s.h, kD}, bf), d_out = torch::randn({s.b, s.l, s.h, kD}, bf);
  const double flops = 4.0 * s.b * s.h * static_cast<double>(s.l) * s.l * kD;
  nlohmann::json r = {{"B", s.b}, {"H", s.h}, {"L", s.l}, {"D", kD}, {"fwd_flops", flops}, {"bwd_flops", 2.5 * flops},
                      {"rounds", o.rounds}};
  QatRun run(q, k, v, d_out);
  const bool timed_backward = o.backward && backward_ok;
  const torch::Tensor qt = q.transpose(1, 2).contiguous(), kt = k.transpose(1, 2).contiguous(),
                      vt = v.transpose(1, 2).contiguous(), dt = d_out.transpose(1, 2).contiguous();
  SdpaPeer cudnn("cudnn", false, true, qt, kt, vt, dt, o.backward, r);
  SdpaPeer flash("flash", true, false, qt, kt, vt, dt, o.backward, r);

  // Forward: the pre-pass alone, the kernel with the key split of the last wave this
  // shape and device plan (attention_qat.h) and with none, pre-pass + kernel ("qat fwd",
  // what the ratios use), the kernel as a plain BF16 flash attention, and the peers.
  ka::AttnQatFwdParams whole = run.fwd;
  whole.split_tiles = 0;
  ka::AttnQatFwdParams o_only = run.fwd;  // what a call without gradient runs: no O_hp, m, l
  o_only.o_hp.data = nullptr;
  o_only.m = o_only.l = nullptr;
  ka::AttnQatFwdParams plain = run.fwd;  // quantization off on the raw inputs
  plain.q = blhd_in(q), plain.k = blhd_in(k), plain.v = blhd_in(v);
  plain.quant_p = false;
  std::vector<Variant> fwd = {
      {"vqad_prepass", [&] { return time_ms([&] { run.prepass(); }, o.warmup, o.iters); }},
      {"vqad_qat_fwd_kernel", [&] { return time_ms([&] { run.forward(); }, o.warmup, o.iters); }},
      {"vqad_qat_fwd_kernel_nosplit",
       [&] { return time_ms([&] { ka::launch_attn_qat_fwd(whole, run.stream()); }, o.warmup, o.iters); }},
      {"vqad_qat_fwd", [&] {
         return time_ms(
             [&] {
               run.prepass();
               run.forward();
             },
             o.warmup, o.iters);
       }},
      {"vqad_qat_fwd_nograd", [&] {
         return time_ms(
             [&] {
               run.prepass();
               ka::launch_attn_qat_fwd(o_only, run.stream());
             },
             o.warmup, o.iters);
       }},
      {"vqad_bf16_fwd", [&] { return time_ms([&] { ka::launch_attn_qat_fwd(plain, run.stream()); }, o.warmup, o.iters); }}};
  if (cudnn.fwd_ok) fwd.push_back(cudnn.forward_variant(o));
  if (flash.fwd_ok) fwd.push_back(flash.forward_variant(o));
  time_in_rounds(fwd, o.rounds, r);
  r["vqad_qat_fwd_split"] = run.fwd_workspace.defined();  // this shape and device split some tiles

  std::vector<Variant> bwd;
  if (timed_backward) {
    run.prepass();
    run.forward();
    run.setup_backward();
    bwd.push_back({"vqad_qat_bwd", [&] { return time_ms([&] { run.backward(); }, o.warmup, o.iters); }});
  }
  if (cudnn.bwd_ok) bwd.push_back(cudnn.backward_variant(o));
  if (flash.bwd_ok) bwd.push_back(flash.backward_variant(o));
  if (!bwd.empty()) time_in_rounds(bwd, o.rounds, r);
  for (const char* key : {"vqad_qat_fwd", "vqad_qat_fwd_nograd", "vqad_bf16_fwd", "cudnn_fwd", "flash_fwd"})
    if (r.contains(std::string(key) + "_ms"))
      r[std::string(key) + "_tflops"] = flops / (r[std::string(key) + "_ms"].get<double>() * 1e9);
  for (const char* key : {"vqad_qat_bwd", "cudnn_bwd", "flash_bwd"})
    if (r.contains(std::string(key) + "_ms"))
      r[std::string(key) + "_tflops"] = 2.5 * flops / (r[std::string(key) + "_ms"].get<double>() * 1e9);
  for (const char* dir : {"fwd", "bwd"})
    for (const char* peer : {"cudnn", "flash"}) {
      const std::string mine = std::string("vqad_qat_") + dir + "_ms", theirs = std::string(peer) + "_" + dir + "_ms";
      if (r.contains(mine) && r.contains(theirs))
        r[std::string("ratio_") + dir + "_vs_" + peer] = r[mine].get<double>() / r[theirs].get<double>();
      round_ratios(r, dir, peer);
    }
  return r;
}

std::string cell(const nlohmann::json& r, const std::string& key) {
  if (!r.contains(key)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", r[key].get<double>());
  return buf;
}

int run_attention_bench(const AttentionBenchOptions& o) {
  VQAD_CHECK(torch::cuda::is_available(), "bench attention: needs a CUDA GPU, none is visible");
  VQAD_CHECK(o.iters >= 1 && o.warmup >= 0 && o.rounds >= 1,
             "bench attention: need --iters >= 1, --warmup >= 0 and --rounds >= 1, found ", o.iters, ", ", o.warmup,
             ", ", o.rounds);
  std::vector<Shape> shapes;
  for (const std::string& s : o.shapes) shapes.push_back(parse_shape(s));
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, at::cuda::current_device());
  std::printf("vqad bench attention on %s (sm_%d%d), BLOCK_N=%d, median of %d after %d warm-up\n", prop.name,
              prop.major, prop.minor, ka::kAttnQatBlockN, o.iters, o.warmup);
  // One reference check per head dim of the shapes.
  std::map<int64_t, bool> backward_ok_by_d;
  nlohmann::json check = nlohmann::json::object();
  for (const Shape& s : shapes) {
    if (backward_ok_by_d.count(s.d)) continue;
    bool ok = false;
    check["D=" + std::to_string(s.d)] = check_against_reference(s.d, o.backward, &ok);
    backward_ok_by_d[s.d] = ok;
    std::printf("check vs CPU reference (1,2,1000x777, D=%lld): %s\n", static_cast<long long>(s.d),
                check["D=" + std::to_string(s.d)].dump().c_str());
    if (o.backward && !ok) std::printf("backward at D=%lld not timed: it failed the reference check\n", (long long)s.d);
  }
  std::printf("%-14s | %9s %9s %9s %9s %7s %7s | %9s %9s %9s %7s %7s\n", "B,H,L,D", "qat fwd", "bf16 fwd",
              "cudnn fwd", "flash fwd", "/cudnn", "/flash", "qat bwd", "cudnn bwd", "flash bwd", "/cudnn", "/flash");
  nlohmann::json results = nlohmann::json::array();
  for (const Shape& s : shapes) {
    nlohmann::json r = bench_shape(s, backward_ok_by_d[s.d], o);
    char name[64];
    std::snprintf(name, sizeof(name), "%lld,%lld,%lld,%lld", (long long)s.b, (long long)s.h, (long long)s.l,
                  (long long)s.d);
    std::printf("%-14s | %9s %9s %9s %9s %7s %7s | %9s %9s %9s %7s %7s\n", name, cell(r, "vqad_qat_fwd_ms").c_str(),
                cell(r, "vqad_bf16_fwd_ms").c_str(), cell(r, "cudnn_fwd_ms").c_str(), cell(r, "flash_fwd_ms").c_str(),
                cell(r, "ratio_fwd_vs_cudnn").c_str(), cell(r, "ratio_fwd_vs_flash").c_str(),
                cell(r, "vqad_qat_bwd_ms").c_str(), cell(r, "cudnn_bwd_ms").c_str(), cell(r, "flash_bwd_ms").c_str(),
                cell(r, "ratio_bwd_vs_cudnn").c_str(), cell(r, "ratio_bwd_vs_flash").c_str());
    std::printf("%-14s | TFLOP/s: qat fwd %s, bf16 fwd %s, cudnn fwd %s, flash fwd %s, qat bwd %s; pre-pass %s ms\n",
                "", cell(r, "vqad_qat_fwd_tflops").c_str(), cell(r, "vqad_bf16_fwd_tflops").c_str(),
                cell(r, "cudnn_fwd_tflops").c_str(), cell(r, "flash_fwd_tflops").c_str(),
                cell(r, "vqad_qat_bwd_tflops").c_str(), cell(r, "vqad_prepass_ms").c_str());
    std::printf("%-14s | qat fwd kernel %s ms, with no key split of the last wave %s ms%s\n", "",
                cell(r, "vqad_qat_fwd_kernel_ms").c_str(), cell(r, "vqad_qat_fwd_kernel_nosplit_ms").c_str(),
                r.value("vqad_qat_fwd_split", false) ? "" : " (no split planned)");
    if (r.contains("vqad_qat_fwd_nograd_ms") && r.contains("cudnn_fwd_ms"))
      r["ratio_fwd_nograd_vs_cudnn"] = r["vqad_qat_fwd_nograd_ms"].get<double>() / r["cudnn_fwd_ms"].get<double>();
    std::printf("%-14s | qat fwd without gradient (no O_hp, m, l; pre-pass included) %s ms, /cudnn %s\n", "",
                cell(r, "vqad_qat_fwd_nograd_ms").c_str(), cell(r, "ratio_fwd_nograd_vs_cudnn").c_str());
    // The ratio of each round's two times (one clock state), median and range over the rounds.
    const auto spread = [&](const std::string& key) {
      if (!r.contains(key + "_rounds")) return std::string("-");
      const std::vector<double> q = r[key + "_rounds"].get<std::vector<double>>();
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.3f (%.3f - %.3f)", r[key + "_round_median"].get<double>(),
                    *std::min_element(q.begin(), q.end()), *std::max_element(q.begin(), q.end()));
      return std::string(buf);
    };
    std::printf("%-14s | per-round ratios, median (range) of %d rounds: fwd/cudnn %s, bwd/cudnn %s\n", "", o.rounds,
                spread("ratio_fwd_vs_cudnn").c_str(), spread("ratio_bwd_vs_cudnn").c_str());
    results.push_back(std::move(r));
  }
  const nlohmann::json doc = {{"bench", "attention"},
                              {"device", prop.name},
                              {"sm", prop.major * 10 + prop.minor},
                              {"block_n", ka::kAttnQatBlockN},
                              {"warmup", o.warmup},
                              {"iters", o.iters},
                              {"statistic", "median"},
                              {"check", check},
                              {"results", results}};
  std::printf("wrote %s\n", vqad::bench::write_json(o.out_dir, "bench_attention.json", doc).c_str());
  return 0;
}
#else
int run_attention_bench(const AttentionBenchOptions& o) {
  for (const std::string& s : o.shapes) parse_shape(s);  // bad input is reported first
  fail("bench attention: this build has no LibTorch CUDA (configure on a GPU machine)");
}
#endif

}  // namespace

void register_bench_attention_commands(CLI::App& app) {
  CLI::App* bench = bench_command(app);
  auto opts = std::make_shared<AttentionBenchOptions>();
  CLI::App* sub = bench->add_subcommand(
      "attention", "ATTN_QAT_TRAIN CUDA kernels vs LibTorch SDPA (cuDNN, flash), forward and backward");
  sub->add_option("--shape", opts->shapes, "B,H,L or B,H,L,D (D = 128 or 64; default 128), repeatable")->capture_default_str();
  sub->add_option("--warmup", opts->warmup, "warm-up calls")->capture_default_str();
  sub->add_option("--iters", opts->iters, "timed calls (median reported)")->capture_default_str();
  sub->add_option("--rounds", opts->rounds, "alternating rounds of all variants (median of the round medians)")
      ->capture_default_str();
  sub->add_flag("!--no-backward", opts->backward, "skip the backward timings");
  sub->add_option("--out", opts->out_dir, "directory for bench_attention.json")->capture_default_str();
  set_action(sub, [opts] { return run_attention_bench(*opts); });
}

}  // namespace vqad::cli
