#include "vqad/dist/check.h"

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <iostream>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/dist/process_group.h"
#include "vqad/dist/ulysses.h"

namespace vqad::dist {
namespace {

torch::Generator gen_for(int rank, int salt) {
  return at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000003 * salt + rank));
}
// Rank k's float input (any rank can compute any rank's).
torch::Tensor floats(int k, int64_t n, int salt = 1) {
  auto g = gen_for(k, salt);
  return at::randn({n}, g, torch::TensorOptions(torch::kFloat32));
}
// Rank k's integer-valued input (exact sums in fp32).
torch::Tensor ints(int k, int64_t n, int salt = 2) {
  auto g = gen_for(k, salt);
  return at::randint(-1000, 1000, {n}, g, torch::TensorOptions(torch::kFloat32));
}

void expect_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  auto g = got.cpu(), w = want.cpu();
  VQAD_CHECK(g.sizes() == w.sizes() && g.dtype() == w.dtype(), "dist check: ", what, ": shape/dtype ", g.sizes(),
             " ", g.dtype(), ", expected ", w.sizes(), " ", w.dtype());
  if (torch::equal(g, w)) return;
  auto diff = (g.to(torch::kFloat64) - w.to(torch::kFloat64)).abs();
  const int64_t at = diff.argmax().item<int64_t>();
  fail("dist check: ", what, ": result differs from the expected values (element ", at, ": ",
       g.reshape({-1})[at].item<double>(), " vs ", w.reshape({-1})[at].item<double>(), ")");
}

void inject(const CheckOptions& o, int rank) {
  if (rank != o.fault_rank || o.fault == "none") return;
  log::warn("dist check: injecting fault '", o.fault, "' on rank ", rank);
  if (o.fault == "exit") ::_exit(3);
  if (o.fault == "kill") ::raise(SIGKILL);
  if (o.fault == "hang") std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 3000)));
  if (o.fault == "error") fail("dist check: injected failure on rank ", rank);
}

}  // namespace

int run_collective_check(const CheckOptions& o) {
  VQAD_CHECK(o.device == "cpu" || o.device == "cuda", "dist check --device: expected cpu or cuda, found '", o.device,
             "'");
  VQAD_CHECK(o.fault == "none" || o.fault == "exit" || o.fault == "kill" || o.fault == "hang" || o.fault == "error",
             "dist check --fault: expected none, exit, kill, hang or error, found '", o.fault, "'");
  VQAD_CHECK(o.elements >= 1, "dist check --elements must be >= 1");
  const auto env = launch_env();
  VQAD_CHECK(env.launched(), "dist check: this process is not a rank of a launched job (run it as `vqad launch "
             "--nproc N dist check`, or under torchrun / srun)");
  GroupOptions go;
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  go.device = o.device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))
                                 : torch::Device(torch::kCPU);
  auto pg = ProcessGroup::init(env, go);
  try {
    const int W = pg->size(), r = pg->rank();
    const auto dev = go.device;
    const int64_t n = o.elements, m = (n + W - 1) / W;  // m: chunk of the scatter-type collectives
    int checks = 0;
    auto on = [&](torch::Tensor t) { return t.to(dev); };

    {  // all_reduce SUM (exact: integer values)
      auto t = on(ints(r, n));
      pg->all_reduce(t, ReduceOp::kSum, "check ints");
      auto want = torch::zeros({n});
      for (int k = 0; k < W; ++k) want += ints(k, n);
      expect_equal(t, want, "all_reduce sum");
      ++checks;
    }
    inject(o, r);
    {  // all_reduce AVG of floats: every rank holds the same bits, close to the fp64 mean
      auto t = on(floats(r, n));
      pg->all_reduce(t, ReduceOp::kAvg, "check floats");
      auto want = torch::zeros({n}, torch::kFloat64);
      for (int k = 0; k < W; ++k) want += floats(k, n).to(torch::kFloat64);
      want /= W;
      const double err = (t.cpu().to(torch::kFloat64) - want).abs().max().item<double>();
      VQAD_CHECK(err <= 1e-5 * W, "dist check: all_reduce avg: max error ", err, " against the fp64 mean");
      auto all = pg->all_gather(t.reshape({1, n}), "check avg bits");
      for (int k = 0; k < W; ++k) expect_equal(all[k], t, "all_reduce avg on rank " + std::to_string(k));
      checks += 2;
    }
    {  // all_reduce MAX
      auto t = on(floats(r, n));
      pg->all_reduce(t, ReduceOp::kMax, "check max");
      auto want = floats(0, n);
      for (int k = 1; k < W; ++k) want = torch::maximum(want, floats(k, n));
      expect_equal(t, want, "all_reduce max");
      ++checks;
    }
    {  // broadcast from the last rank
      auto t = on(floats(r, n, 3));
      pg->broadcast(t, W - 1, "check broadcast");
      expect_equal(t, floats(W - 1, n, 3), "broadcast");
      ++checks;
    }
    {  // all_gather (fp32 and bf16)
      auto g = pg->all_gather(on(floats(r, n)), "check gather");
      std::vector<torch::Tensor> parts;
      for (int k = 0; k < W; ++k) parts.push_back(floats(k, n));
      expect_equal(g, torch::cat(parts), "all_gather fp32");
      auto gb = pg->all_gather(on(floats(r, n).to(torch::kBFloat16)), "check gather bf16");
      expect_equal(gb, torch::cat(parts).to(torch::kBFloat16), "all_gather bf16");
      checks += 2;
    }
    {  // reduce_scatter SUM (exact)
      auto in = on(ints(r, W * m, 4));
      auto out = pg->reduce_scatter(in, ReduceOp::kSum, "check reduce_scatter");
      auto want = torch::zeros({m});
      for (int k = 0; k < W; ++k) want += ints(k, W * m, 4).narrow(0, r * m, m);
      expect_equal(out, want, "reduce_scatter sum");
      ++checks;
    }
    {  // all_to_all
      auto out = pg->all_to_all(on(floats(r, W * m, 5)), "check all_to_all");
      std::vector<torch::Tensor> parts;
      for (int k = 0; k < W; ++k) parts.push_back(floats(k, W * m, 5).narrow(0, r * m, m));
      expect_equal(out, torch::cat(parts), "all_to_all");
      ++checks;
    }
    {  // strings through the store
      auto s = pg->all_gather_string("rank-" + std::to_string(r), "check strings");
      for (int k = 0; k < W; ++k)
        VQAD_CHECK(s[k] == "rank-" + std::to_string(k), "dist check: all_gather_string: rank ", k, " sent '", s[k],
                   "'");
      ++checks;
    }
    if (W >= 2) {  // two subgroups (the halves of the world), each reduces on its own
      const int h = W / 2;
      std::vector<int> mine;
      for (int k = (r < h ? 0 : h); k < (r < h ? h : W); ++k) mine.push_back(k);
      auto sub = pg->subgroup(r < h ? "check_low" : "check_high", mine);
      auto t = on(ints(r, n));
      sub->all_reduce(t, ReduceOp::kSum, "check subgroup");
      auto want = torch::zeros({n});
      for (int k : mine) want += ints(k, n);
      expect_equal(t, want, "subgroup all_reduce");
      ++checks;
    }
    {  // Ulysses: self-attention with the sequence sharded over the world equals full attention,
       // forward and gradients (q, k, v exchanged seq -> heads, the output heads -> seq)
      const int64_t B = 2, Sl = 3, H = 2 * W, D = 8, S = Sl * W;
      auto g = gen_for(0, 7);  // the same full tensors on every rank
      auto opts = torch::TensorOptions(torch::kFloat32);
      auto q = at::randn({B, S, H, D}, g, opts), k = at::randn({B, S, H, D}, g, opts);
      auto v = at::randn({B, S, H, D}, g, opts), w = at::randn({B, S, H, D}, g, opts);
      auto attn = [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
        return at::scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2))
            .transpose(1, 2);
      };
      auto qf = q.clone().requires_grad_(), kf = k.clone().requires_grad_(), vf = v.clone().requires_grad_();
      auto of = attn(qf, kf, vf);
      (of * w).sum().backward();
      auto mine = [&](const torch::Tensor& t) { return t.narrow(1, r * Sl, Sl).contiguous(); };
      auto ql = on(mine(q)).requires_grad_(), kl = on(mine(k)).requires_grad_(), vl = on(mine(v)).requires_grad_();
      auto o = heads_to_seq(attn(seq_to_heads(ql, *pg, "q"), seq_to_heads(kl, *pg, "k"), seq_to_heads(vl, *pg, "v")),
                            *pg, "attention out");
      (o * on(mine(w))).sum().backward();
      auto close = [&](const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
        const double err = (got.cpu() - want).abs().max().item<double>();
        VQAD_CHECK(err <= 1e-5, "dist check: ulysses ", what, ": max error ", err, " against full attention");
      };
      close(o.detach(), mine(of.detach()), "output");
      close(ql.grad(), mine(qf.grad()), "dq");
      close(kl.grad(), mine(kf.grad()), "dk");
      close(vl.grad(), mine(vf.grad()), "dv");
      ++checks;
    }
    for (const auto& check : o.extra) checks += check(*pg);
    pg->barrier("check done");
    ++checks;
    std::cout << "dist check: rank " << r << " of " << W << " (" << (dev.is_cuda() ? "NCCL" : "Gloo") << "): " << checks
              << " checks passed\n";
    std::cout.flush();
  } catch (const std::exception& e) {
    pg->report_failure(e.what());
    throw;
  }
  return 0;
}

}  // namespace vqad::dist
