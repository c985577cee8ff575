// `vqad launch --nproc N <subcommand> ...`: the ranks of a one-node job without torchrun.
//
// The launcher hosts the rendezvous store (c10d::TCPStore on a free loopback port, so two
// jobs on one machine never collide), starts N copies of this executable with torchrun's
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_USE_AGENT_STORE=True), forwards SIGINT / SIGTERM / SIGHUP to them and waits.
// When a rank fails it records that in the store (the other ranks name it in their own
// error), gives the others --grace seconds to stop by themselves, then terminates them. The
// exit status is 0 when every rank succeeded, else 1 with a line naming the first rank that
// failed and how. The ranks write to the launcher's terminal (the trainer logs and writes
// metrics from rank 0 only), or with --log-dir DIR each to DIR/rank_<r>.log.
#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/dist/check.h"
#include "vqad/dist/fully_sharded.h"
#include "vqad/dist/process_group.h"
#include "vqad/dist/ulysses.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"

extern char** environ;

namespace vqad::cli {
namespace {

// `vqad dist check`, Ulysses through the Wan model: a tiny model (2 heads per rank, fp32
// compute) run once whole and once under a SequenceParallelScope over the world, with and
// without block checkpointing (whose recomputation exchanges again in backward), with dense
// attention (8 W tokens) and with VSA_TRAIN at sparsity 0.5 (128 tokens = two 4x4x4 cubes, a
// random compression gate, so the exchanged gate and the cube selection on the whole
// sequence matter). The prediction and every parameter's gradient (summed over the ranks, as
// the trainer's reduction does) must equal the whole run's to fp32 rounding (rel-L2 <= 1e-5;
// a missing sum, a wrong RoPE slice or a swapped exchange is off by O(1e-2) or more).
// On CUDA, VSA_TRAIN runs the VSA kernels, which take head_dim 128 and BF16 operands: the
// VSA model there has 128-channel heads, and its bound is 2e-3, since the fp32 linears of
// the two runs see different row counts (W > 1) and a last-bit difference can flip one BF16
// rounding of an attention operand (2^-8 relative on that element); a world of one computes
// both runs identically.
int wan_sequence_parallel_check(dist::ProcessGroup& pg) {
  const int W = pg.size();
  const auto dev = pg.device();
  int checks = 0;
  for (const bool vsa : {false, true}) {
    ops::AttentionSpec spec;
    if (vsa) {
      spec.backend = AttentionBackend::kVsaTrain;
      spec.vsa.sparsity = 0.5;
    }
    ops::AttentionBackendScope backend(spec);
    const bool bf16_kernels = vsa && dev.is_cuda();
    const double bound = bf16_kernels ? 2e-3 : 1e-5;
    model::WanConfig c = model::WanConfig::tiny();
    c.num_attention_heads = 2 * W;
    c.attention_head_dim = bf16_kernels ? 128 : 16;
    model::WanModelOptions mo;
    mo.device = dev;
    mo.compute_dtype = torch::kFloat32;
    model::WanModel m(c, mo);
    if (vsa) m.set_vsa_sparsity(0.5);
    {
      torch::NoGradGuard ng;
      for (int64_t i = 0; i < m.num_blocks(); ++i)
        if (auto& gc = m.block(i).to_gate_compress) gc->weight.normal_(0.0, 0.2);
      for (auto& p : m.parameters()) {
        auto d = p.detach();
        pg.broadcast(d, 0, "model check parameters");
      }
    }
    // Latent grids whose token counts W divides (the patch is 1 x 2 x 2): dense W x 2 x 4
    // tokens; VSA 4 x 4 x 8 (two 4x4x4 cubes) or, when W does not divide 128, W times as many frames.
    const std::vector<int64_t> grid = vsa ? std::vector<int64_t>{128 % W == 0 ? 4 : 4 * W, 8, 16}
                                          : std::vector<int64_t>{W, 4, 8};
    auto g = at::make_generator<at::CPUGeneratorImpl>(5);
    const auto f32 = torch::TensorOptions(torch::kFloat32);
    auto x = at::randn({2, c.in_channels, grid[0], grid[1], grid[2]}, g, f32).to(dev);
    auto text = at::randn({2, 7, c.text_dim}, g, f32).to(dev);
    auto w = at::randn({2, c.out_channels, grid[0], grid[1], grid[2]}, g, f32).to(dev);
    auto t = torch::tensor({500.0f, 120.0f}).to(dev);
    auto run = [&](bool sp, bool ckpt) {
      m.set_gradient_checkpointing(ckpt);
      for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
      dist::SequenceParallelScope scope(sp ? &pg : nullptr);
      auto y = m.forward(x, t, text);
      (y * w).sum().backward();
      std::vector<std::pair<std::string, torch::Tensor>> grads;
      for (const auto& item : m.named_parameters()) {
        auto gr = item.value().grad();
        grads.emplace_back(item.key(), gr.defined() ? gr.detach().clone() : torch::zeros_like(item.value()));
      }
      return std::make_pair(y.detach(), grads);
    };
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
      const double den = b.to(torch::kFloat64).norm().item<double>();
      return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).norm().item<double>() / std::max(den, 1e-30);
    };
    const auto whole = run(false, false);
    for (bool ckpt : {false, true}) {
      auto sp = run(true, ckpt);
      const std::string how = std::string(vsa ? " (VSA_TRAIN" : " (dense") + (ckpt ? ", block checkpointing)" : ")");
      const double ey = rel(sp.first, whole.first);
      VQAD_CHECK(ey <= bound, "dist check: Wan forward under sequence parallelism", how,
                 ": prediction differs from the whole-sequence run, rel-L2 ", ey, " (bound ", bound, ")");
      for (size_t i = 0; i < sp.second.size(); ++i) {
        auto& gr = sp.second[i].second;
        pg.all_reduce(gr, dist::ReduceOp::kSum, "model check gradient " + sp.second[i].first);
        const double e = rel(gr, whole.second[i].second);
        VQAD_CHECK(e <= bound, "dist check: Wan backward under sequence parallelism", how, ": gradient of ",
                   sp.second[i].first, " (summed over the SP ranks) differs from the whole-sequence run, rel-L2 ", e,
                   " (bound ", bound, ")");
      }
      ++checks;
    }
  }
  return checks;
}

// Sharded data parallelism through the same tiny Wan model (fp32, TORCH_SDPA), the world
// as the shard group: each rank runs its own batch. The prediction must equal the unsharded
// model's on the same rank (the gathered weights are the same fp32 values), and the
// reduce-scattered shard gradients, gathered in full, the sum over the ranks of the unsharded
// gradients (rel-L2 <= 1e-5; a shard gathered to the wrong place or a gradient reduced twice
// is off by O(1)). Variants: a unit per block, released after forward; with block
// checkpointing (the recomputation after the backward gather); two blocks per unit kept
// gathered from forward to backward; BF16 compute with the linear weights gathered as BF16
// (every parameter perturbed off the BF16 grid first, so a parameter gathered as BF16 that some
// reader uses in fp32, e.g. a LayerNorm weight, changes the prediction), which must still give the
// unsharded prediction bit for bit, at less than 0.6x the bytes of the fp32 gathers.
int wan_sharded_check(dist::ProcessGroup& pg) {
  const auto dev = pg.device();
  struct Variant {
    bool ckpt, reshard;
    int64_t blocks_per_unit;
    bool bf16;
    const char* name;
  };
  int checks = 0;
  int64_t fp32_gather_bytes = 0;
  for (const Variant v : {Variant{false, true, 1, false, "a unit per block"},
                          Variant{true, true, 1, false, "a unit per block, block checkpointing"},
                          Variant{false, false, 2, false, "two blocks per unit, no reshard after forward"},
                          Variant{false, true, 1, true, "a unit per block, BF16 compute, BF16 gathers"}}) {
    model::WanConfig c = model::WanConfig::tiny();
    c.attention_head_dim = 16;
    model::WanModelOptions mo;
    mo.device = dev;
    mo.compute_dtype = v.bf16 ? torch::kBFloat16 : torch::kFloat32;
    model::WanModel m(c, mo);
    {
      torch::NoGradGuard ng;
      auto noise = at::make_generator<at::CPUGeneratorImpl>(3);
      for (auto& p : m.parameters()) {
        auto d = p.detach();
        if (v.bf16) d.add_(at::randn(d.sizes(), noise, torch::TensorOptions(torch::kFloat32)).to(dev), 1e-2);
        pg.broadcast(d, 0, "sharded check parameters");
      }
    }
    m.set_gradient_checkpointing(v.ckpt);
    auto g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(7 + pg.rank()));
    const auto f32 = torch::TensorOptions(torch::kFloat32);
    auto x = at::randn({2, c.in_channels, 2, 4, 8}, g, f32).to(dev);
    auto text = at::randn({2, 7, c.text_dim}, g, f32).to(dev);
    auto w = at::randn({2, c.out_channels, 2, 4, 8}, g, f32).to(dev);
    auto t = torch::tensor({500.0f, 120.0f}).to(dev);
    auto step = [&] {
      auto y = m.forward(x, t, text);
      (y * w).sum().backward();
      return y.detach();
    };
    const auto y_whole = step();
    std::map<std::string, torch::Tensor> summed;
    for (const auto& item : m.named_parameters()) {
      auto gr = item.value().grad();
      auto s = gr.defined() ? gr.detach().clone() : torch::zeros_like(item.value());
      pg.all_reduce(s, dist::ReduceOp::kSum, "sharded check gradient " + item.key());
      summed[item.key()] = s;
      item.value().mutable_grad() = torch::Tensor();
    }
    dist::FullyShardedModel sharded("check", m.shard_units(v.blocks_per_unit),
                                    dist::ShardingOptions{&pg, nullptr, 1, v.reshard, /*gather_bf16=*/true});
    m.set_sharding(&sharded, v.blocks_per_unit);
    const auto y = step();
    sharded.finish_backward();
    const std::string how = std::string(" (") + v.name + ")";
    VQAD_CHECK(torch::equal(y, y_whole), "dist check: Wan forward under sharded data parallelism", how,
               ": prediction differs from the unsharded model's, max |diff| ",
               (y - y_whole).abs().max().item<double>());
    for (const auto& [name, gr] : sharded.gather_gradients()) {
      const auto& want = summed.at(name);
      const double den = want.to(torch::kFloat64).norm().item<double>();
      const double e = (gr.to(torch::kFloat64) - want.to(torch::kFloat64)).norm().item<double>() / std::max(den, 1e-30);
      VQAD_CHECK(e <= 1e-5, "dist check: Wan backward under sharded data parallelism", how, ": gradient of ", name,
                 " (reduce-scattered) differs from the sum of the ranks' unsharded gradients, rel-L2 ", e);
    }
    // gather_bf16 is on in every variant: under fp32 compute nothing is read as BF16, so
    // every gather moves fp32; under BF16 compute the linear weights move as BF16.
    if (v.bf16) {
      VQAD_CHECK(sharded.bf16_gathered_elements() > sharded.parameter_elements() / 2,
                 "dist check: BF16 gathers", how, ": only ", sharded.bf16_gathered_elements(), " of ",
                 sharded.parameter_elements(), " parameter elements are gathered as BF16");
      VQAD_CHECK(sharded.all_gather_bytes() < fp32_gather_bytes * 0.6, "dist check: BF16 gathers", how,
                 ": received ", sharded.all_gather_bytes(), " bytes, the fp32 gathers ", fp32_gather_bytes);
    } else if (v.blocks_per_unit == 1 && !v.ckpt) {
      VQAD_CHECK(sharded.bf16_gathered_elements() == 0, "dist check: fp32 compute", how, ": ",
                 sharded.bf16_gathered_elements(), " parameter elements gathered as BF16");
      fp32_gather_bytes = sharded.all_gather_bytes();
    }
    m.set_sharding(nullptr, 1);
    ++checks;
  }
  return checks;
}

volatile sig_atomic_t g_signal = 0;
pid_t g_children[1024];
volatile sig_atomic_t g_nchildren = 0;

void forward_signal(int sig) {
  g_signal = sig;
  for (int i = 0; i < g_nchildren; ++i)
    if (g_children[i] > 0) ::kill(g_children[i], sig);
}

std::string how(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::strsignal(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (") + name + ")" : "");
  }
  return "stopped (status " + std::to_string(status) + ")";
}

struct LaunchOptions {
  int nproc = 1;
  int master_port = 0;  // 0: a free port
  double grace_s = 60;
  std::string log_dir;  // non-empty: rank r's stdout and stderr go to log_dir/rank_<r>.log
  std::vector<std::string> args;
};

int launch(const LaunchOptions& o) {
  VQAD_CHECK(o.nproc >= 1 && o.nproc <= 1024, "launch --nproc: expected 1..1024, found ", o.nproc);
  VQAD_CHECK(!o.args.empty(), "launch: no command given (e.g. vqad launch --nproc 4 train recipe.yaml)");
  VQAD_CHECK(o.args[0] != "launch", "launch: the command to run is `launch` again");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(o.master_port);
  so.isServer = true;
  so.waitWorkers = false;
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (const std::exception& e) {
    fail("launch: could not host the rendezvous store on 127.0.0.1:", o.master_port, ": ", e.what());
  }
  const int port = store->getPort();

  // Everything the children need is built before fork (only exec follows in the child).
  std::vector<std::string> argv_s;
  argv_s.push_back("vqad");
  for (const auto& a : o.args) argv_s.push_back(a);
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const char* ours[] = {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                        "TORCHELASTIC_USE_AGENT_STORE=", "GROUP_RANK=", "ROLE_RANK="};
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    bool skip = false;
    for (const char* k : ours) skip = skip || std::strncmp(*e, k, std::strlen(k)) == 0;
    if (!skip) base.emplace_back(*e);
  }
  std::vector<std::vector<std::string>> envs(o.nproc);
  std::vector<std::vector<char*>> envp(o.nproc);
  for (int r = 0; r < o.nproc; ++r) {
    envs[r] = base;
    for (const auto& kv : {std::string("RANK=") + std::to_string(r), "WORLD_SIZE=" + std::to_string(o.nproc),
                           "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(o.nproc),
                           std::string("GROUP_RANK=0"), std::string("MASTER_ADDR=127.0.0.1"),
                           "MASTER_PORT=" + std::to_string(port), std::string("TORCHELASTIC_USE_AGENT_STORE=True")})
      envs[r].push_back(kv);
    for (auto& kv : envs[r]) envp[r].push_back(kv.data());
    envp[r].push_back(nullptr);
  }

  // Per-rank logs: the files are named here, opened by each child before exec.
  std::vector<std::string> logs;
  if (!o.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.log_dir, ec);
    VQAD_CHECK(!ec && std::filesystem::is_directory(o.log_dir), "launch --log-dir ", o.log_dir,
               ": cannot create the directory (", ec.message(), ")");
    for (int r = 0; r < o.nproc; ++r)
      logs.push_back((std::filesystem::path(o.log_dir) / ("rank_" + std::to_string(r) + ".log")).string());
    std::fprintf(stderr, "vqad launch: the output of rank r goes to %s/rank_<r>.log\n", o.log_dir.c_str());
  }

  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);

  std::vector<pid_t> pids(o.nproc, -1);
  for (int r = 0; r < o.nproc; ++r) {
    pid_t pid = ::fork();
    VQAD_CHECK(pid >= 0, "launch: fork failed for rank ", r, ": ", std::strerror(errno));
    if (pid == 0) {
      if (!logs.empty()) {  // open / dup2 / close only between fork and exec
        const int fd = ::open(logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) ::_exit(126);
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      ::execve("/proc/self/exe", argv.data(), envp[r].data());
      ::_exit(127);
    }
    pids[r] = pid;
    g_children[r] = pid;
    g_nchildren = r + 1;
  }

  using Clock = std::chrono::steady_clock;
  int running = o.nproc, first_failed = -1, first_status = 0;
  std::vector<int> failed;
  std::vector<bool> done(o.nproc, false);
  Clock::time_point grace_end{}, kill_at{};
  bool terminated = false, killed = false;
  while (running > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      int r = -1;
      for (int k = 0; k < o.nproc; ++k)
        if (pids[k] == pid) r = k;
      if (r < 0) continue;
      done[r] = true;
      g_children[r] = -1;
      --running;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && !terminated) {
        failed.push_back(r);
        try {
          store->set("vqad/failed/" + std::to_string(r), [&] {
            std::string m = how(status);
            return std::vector<uint8_t>(m.begin(), m.end());
          }());
        } catch (const std::exception&) {
        }
        if (first_failed < 0) {
          first_failed = r;
          first_status = status;
          grace_end = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
          std::fprintf(stderr, "vqad launch: rank %d %s%s; waiting up to %g s for the other ranks to stop\n", r,
                       how(status).c_str(), logs.empty() ? "" : (" (its output: " + logs[r] + ")").c_str(),
                       o.grace_s);
        }
      }
      continue;
    }
    if (first_failed >= 0 && !terminated && Clock::now() >= grace_end) {
      for (int k = 0; k < o.nproc; ++k)
        if (!done[k]) ::kill(pids[k], SIGTERM);
      terminated = true;
      kill_at = Clock::now() + std::chrono::seconds(5);
    }
    if (terminated && !killed && Clock::now() >= kill_at) {
      for (int k = 0; k < o.nproc; ++k)
        if (!done[k]) ::kill(pids[k], SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (g_signal != 0 && first_failed < 0) {
    std::fprintf(stderr, "vqad launch: stopped by signal %d (forwarded to every rank)\n", static_cast<int>(g_signal));
    return 1;
  }
  if (first_failed < 0) return 0;
  std::string others;
  for (int r : failed)
    if (r != first_failed) others += (others.empty() ? "" : ", ") + std::to_string(r);
  fail("launch: rank ", first_failed, " of ", o.nproc, " failed first (", how(first_status), ")",
       others.empty() ? std::string() : "; ranks that failed after it: " + others,
       terminated ? "; the remaining ranks were terminated after the grace period" : "",
       logs.empty() ? std::string() : "; its output: " + logs[static_cast<size_t>(first_failed)]);
}

}  // namespace

void register_launch_commands(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "launch", "Run a vqad command as N ranks on this machine (torchrun's environment; e.g. launch --nproc 4 train recipe.yaml)");
  auto o = std::make_shared<LaunchOptions>();
  sub->add_option("--nproc", o->nproc, "number of ranks (processes; one per GPU)")->required();
  sub->add_option("--master-port", o->master_port, "port of the rendezvous store on 127.0.0.1 (default: a free one)");
  sub->add_option("--grace", o->grace_s,
                  "seconds the other ranks get to stop by themselves after one failed (default 60), then SIGTERM");
  sub->add_option("--log-dir", o->log_dir,
                  "write each rank's stdout and stderr to DIR/rank_<r>.log instead of this terminal");
  sub->prefix_command();  // everything from the first positional on is the rank's command line
  sub->footer("Example: vqad launch --nproc 4 train recipe.yaml --training.distributed.num_gpus 4");
  set_action(sub, [=] {
    o->args = sub->remaining();
    return launch(*o);
  });

  auto* d = app.add_subcommand("dist", "Distributed tools");
  d->require_subcommand(1);
  auto* chk = d->add_subcommand(
      "check", "Run and verify every collective across the launched ranks (e.g. vqad launch --nproc 4 dist check)");
  auto c = std::make_shared<dist::CheckOptions>();
  chk->add_option("--device", c->device, "cpu (Gloo, default) | cuda (NCCL, GPU = LOCAL_RANK)");
  chk->add_option("--timeout", c->timeout_s, "collective timeout in seconds (default 60)");
  chk->add_option("--elements", c->elements, "elements per rank of each collective (default 4099)");
  chk->add_option("--fault-rank", c->fault_rank, "rank that misbehaves (fault injection)");
  chk->add_option("--fault", c->fault, "none (default) | exit | kill | hang | error, after the first collective");
  set_action(chk, [=] {
    c->extra = {wan_sequence_parallel_check, wan_sharded_check};
    return dist::run_collective_check(*c);
  });
}

}  // namespace vqad::cli
