#include "vqad/dist/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <sstream>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/dist/backend.h"

namespace vqad::dist {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kHeartbeatEvery = std::chrono::milliseconds(200);
constexpr int64_t kStaleMs = 2000;  // no heartbeat for this long: the process is gone or frozen

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string first_line(const std::string& s) {
  auto n = s.find('\n');
  std::string l = n == std::string::npos ? s : s.substr(0, n);
  return l.size() > 300 ? l.substr(0, 300) + "..." : l;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::string seconds_text(int64_t ms) {
  std::ostringstream os;
  os.precision(3);
  os << static_cast<double>(ms) / 1000.0 << " s";
  return os.str();
}

// A heartbeat record: "<unix ms>|<group>|<seq>|<state>|<collective>".
struct Beat {
  int64_t t = 0;
  std::string group;
  uint64_t seq = 0;
  std::string state;  // in | done
  std::string what;
  static Beat parse(const std::string& s) {
    Beat b;
    std::vector<std::string> f;
    size_t start = 0;
    for (int i = 0; i < 4; ++i) {
      size_t bar = s.find('|', start);
      if (bar == std::string::npos) return b;
      f.push_back(s.substr(start, bar - start));
      start = bar + 1;
    }
    b.t = std::stoll(f[0]);
    b.group = f[1];
    b.seq = std::stoull(f[2]);
    b.state = f[3];
    b.what = s.substr(start);
    return b;
  }
  std::string text() const {
    if (seq == 0) return "no collective yet";
    return detail::concat(state == "in" ? "waiting in " : "finished ", what, " #", seq, " of group ", group);
  }
};

std::mutex g_world_mu;
std::weak_ptr<ProcessGroup> g_world;

}  // namespace

// Per process: the store connections, the heartbeat thread, the collective in flight.
struct Shared {
  LaunchEnv env;
  GroupOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Store> hb_store;
  c10d::TCPStoreOptions client_options;       // for the connections opened later
  std::mutex side_mu;                          // post() / await() from any thread
  c10::intrusive_ptr<c10d::Store> side_store;  // their connection (opened on first use)
  std::mutex mu;
  std::string beat;  // the record the heartbeat thread publishes
  std::atomic<bool> stop{false};
  std::thread hb;

  std::string store_text() const {
    return detail::concat("the rendezvous store at ", env.master_addr, ":", env.master_port,
                          env.agent_store ? " (hosted by the launcher)" : " (hosted by rank 0)");
  }
  void set_beat(const std::string& group, uint64_t seq, const char* state, const std::string& what) {
    std::lock_guard<std::mutex> l(mu);
    beat = detail::concat("|", group, "|", seq, "|", state, "|", what);
  }
  void publish() {
    std::string b;
    {
      std::lock_guard<std::mutex> l(mu);
      b = std::to_string(unix_ms()) + beat;
    }
    hb_store->set("vqad/hb/" + std::to_string(env.rank), to_bytes(b));
  }
  void start_heartbeat() {
    set_beat("world", 0, "done", "init");
    publish();
    hb = std::thread([this] {
      while (!stop.load()) {
        std::this_thread::sleep_for(kHeartbeatEvery);
        try {
          publish();
        } catch (const std::exception&) {
          return;  // the store is gone; the next collective reports it
        }
      }
    });
  }
  ~Shared() {
    stop = true;
    if (hb.joinable()) hb.join();
  }
};

namespace {
// "rank k failed: ..." when rank k reported its own error, "rank k stopped responding ..."
// when its heartbeat is stale; "" otherwise (also when it has sent none yet).
std::string rank_gone(c10d::Store& store, int k) {
  const std::string fk = "vqad/failed/" + std::to_string(k);
  if (store.check({fk})) return detail::concat("rank ", k, " failed: ", to_string(store.get(fk)));
  const std::string hk = "vqad/hb/" + std::to_string(k);
  if (!store.check({hk})) return "";
  const Beat b = Beat::parse(to_string(store.get(hk)));
  const int64_t age = unix_ms() - b.t;
  if (age <= kStaleMs) return "";
  return detail::concat("rank ", k, " stopped responding (no heartbeat for ", seconds_text(age), "; it was ",
                        b.text(), ")");
}
}  // namespace

struct ProcessGroup::Impl {
  std::shared_ptr<Shared> shared;
  std::string name;
  std::vector<int> ranks;  // global ranks of the members
  int rank = 0;            // within the group
  c10::intrusive_ptr<c10d::Backend> backend;
  uint64_t seq = 0;

  int size() const { return static_cast<int>(ranks.size()); }

  // Names the rank at fault from the heartbeats (waiting until a dead rank's heartbeat is
  // stale), then throws.
  [[noreturn]] void diagnose_and_fail(const std::string& label, uint64_t my_seq, const std::string& err) {
    auto& S = *shared;
    std::string culprit;
    const auto deadline = Clock::now() + std::chrono::milliseconds(kStaleMs + 500);
    try {
      while (true) {
        std::string behind;
        for (int k : ranks) {
          if (k == S.env.rank) continue;
          if (std::string gone = rank_gone(*S.store, k); !gone.empty()) {
            culprit = std::move(gone);
            break;
          }
          const std::string hk = "vqad/hb/" + std::to_string(k);
          if (!S.store->check({hk})) {
            culprit = detail::concat("rank ", k, " never sent a heartbeat");
            continue;
          }
          const Beat b = Beat::parse(to_string(S.store->get(hk)));
          if (behind.empty() && !(b.group == name && b.seq == my_seq && b.state == "in"))
            behind = detail::concat("rank ", k, " has not reached it (it is ", b.text(), ")");
        }
        if (!culprit.empty() && culprit.find("never sent") == std::string::npos) break;
        if (Clock::now() >= deadline) {
          if (culprit.empty()) culprit = behind;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception& e) {
      culprit = detail::concat(S.store_text(), " is unreachable (", first_line(e.what()), ")");
    }
    if (culprit.empty()) culprit = "every rank reached it";
    fail("distributed: ", label, " #", my_seq, " of group ", name, " (", size(), " ranks, timeout ",
         seconds_text(S.options.timeout.count()), ") failed on rank ", S.env.rank, ": ", culprit,
         "; backend: ", first_line(err));
  }

  template <class F>
  void run(const char* op, const std::string& what, F&& f) {
    const uint64_t s = ++seq;
    const std::string label = detail::concat(op, "(", what, ")");
    shared->set_beat(name, s, "in", label);
    try {
      c10::intrusive_ptr<c10d::Work> work = f();
      work->wait(shared->options.timeout);
    } catch (const vqad::Error&) {
      throw;
    } catch (const std::exception& e) {
      diagnose_and_fail(label, s, e.what());
    }
    shared->set_beat(name, s, "done", label);
  }

  // Issues f() (a c10d::Work) as the collective `pending` waits for later.
  template <class F>
  void issue(std::shared_ptr<void>& work, uint64_t& seq_out, std::string& label, const char* op,
             const std::string& what, F&& f) {
    seq_out = ++seq;
    label = detail::concat(op, "(", what, ")");
    shared->set_beat(name, seq_out, "in", label);
    try {
      work = std::make_shared<c10::intrusive_ptr<c10d::Work>>(f());
    } catch (const vqad::Error&) {
      throw;
    } catch (const std::exception& e) {
      diagnose_and_fail(label, seq_out, e.what());
    }
  }

  void check_tensor(const torch::Tensor& t, const std::string& what) const {
    VQAD_CHECK(t.defined(), "distributed: ", what, ": undefined tensor");
    const bool want_cuda = shared->options.device.is_cuda();
    VQAD_CHECK(t.is_cuda() == want_cuda, "distributed: ", what, ": tensor on ", t.device().str(), " but group ", name,
               " runs on ", want_cuda ? "CUDA (NCCL)" : "CPU (Gloo)");
  }
};

namespace {

c10::intrusive_ptr<c10d::Backend> make_backend(const std::shared_ptr<Shared>& S, const std::string& name, int rank,
                                               int size) {
  auto store = c10::make_intrusive<c10d::PrefixStore>("vqad/pg/" + name, S->store);
  if (S->options.device.is_cuda())
    return make_nccl_backend(store, rank, size, S->options.timeout,
                             S->options.device.has_index() ? S->options.device.index() : S->env.local_rank);
  return make_gloo_backend(store, rank, size, S->options.timeout, is_loopback(S->env.master_addr));
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::init(const LaunchEnv& env, const GroupOptions& options) {
  VQAD_CHECK(options.timeout.count() > 0, "distributed: the collective timeout must be positive");
  auto S = std::make_shared<Shared>();
  S->env = env;
  S->options = options;
  log::set_rank(env.rank);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = std::nullopt;
  so.waitWorkers = false;
  so.timeout = options.timeout;
  try {
    S->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    so.isServer = false;
    S->hb_store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    S->client_options = so;
  } catch (const std::exception& e) {
    fail("distributed: rank ", env.rank, " could not ", so.isServer ? "host" : "reach", " ", S->store_text(), ": ",
         first_line(e.what()));
  }
  S->start_heartbeat();

  // Join: every rank announces itself; the missing ones are named when the timeout passes.
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  S->store->set("vqad/join/" + std::to_string(env.rank), to_bytes(detail::concat(host, " pid ", ::getpid())));
  const auto deadline = Clock::now() + options.timeout;
  while (true) {
    std::vector<int> missing;
    for (int k = 0; k < env.world_size; ++k)
      if (!S->store->check({"vqad/join/" + std::to_string(k)})) missing.push_back(k);
    if (missing.empty()) break;
    if (Clock::now() >= deadline) {
      std::string m;
      for (int k : missing) m += (m.empty() ? "" : ", ") + std::to_string(k);
      fail("distributed: rendezvous at ", S->store_text(), ": rank", missing.size() > 1 ? "s " : " ", m,
           " did not join within ", seconds_text(options.timeout.count()), " (world size ", env.world_size, ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  auto impl = std::make_unique<Impl>();
  impl->shared = S;
  impl->name = "world";
  for (int k = 0; k < env.world_size; ++k) impl->ranks.push_back(k);
  impl->rank = env.rank;
  try {
    impl->backend = make_backend(S, "world", env.rank, env.world_size);
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    impl->diagnose_and_fail("connect", 0, e.what());
  }
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup(std::move(impl)));
  {
    std::lock_guard<std::mutex> l(g_world_mu);
    g_world = pg;
  }
  log::debug("distributed: ", describe(env), ", ", options.device.is_cuda() ? "NCCL" : "Gloo");
  return pg;
}

std::shared_ptr<ProcessGroup> world() {
  std::lock_guard<std::mutex> l(g_world_mu);
  return g_world.lock();
}

std::shared_ptr<ProcessGroup> ProcessGroup::subgroup(const std::string& name, const std::vector<int>& ranks) {
  VQAD_CHECK(!ranks.empty(), "distributed: group ", name, " has no ranks");
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    VQAD_CHECK(ranks[i] >= 0 && ranks[i] < impl_->shared->env.world_size && (i == 0 || ranks[i] > ranks[i - 1]),
               "distributed: group ", name, ": ranks must be ascending and inside the world of ",
               impl_->shared->env.world_size);
    if (ranks[i] == impl_->shared->env.rank) mine = static_cast<int>(i);
  }
  VQAD_CHECK(mine >= 0, "distributed: rank ", impl_->shared->env.rank, " is not a member of group ", name);
  auto impl = std::make_unique<Impl>();
  impl->shared = impl_->shared;
  impl->name = name;
  impl->ranks = ranks;
  impl->rank = mine;
  try {
    impl->backend = make_backend(impl->shared, name, mine, static_cast<int>(ranks.size()));
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    impl->diagnose_and_fail("connect", 0, e.what());
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size(); }
int ProcessGroup::global_rank() const { return impl_->shared->env.rank; }
const std::string& ProcessGroup::name() const { return impl_->name; }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->shared->options.timeout; }
const std::vector<int>& ProcessGroup::global_ranks() const { return impl_->ranks; }
torch::Device ProcessGroup::device() const { return impl_->shared->options.device; }

void ProcessGroup::all_reduce(torch::Tensor& t, ReduceOp op, const std::string& what) {
  impl_->check_tensor(t, what);
  if (size() == 1) return;
  std::vector<at::Tensor> v{t.is_contiguous() ? t : t.contiguous()};
  c10d::AllreduceOptions o;
  o.reduceOp = op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  o.timeout = timeout();
  impl_->run("all_reduce", what, [&] { return impl_->backend->allreduce(v, o); });
  if (op == ReduceOp::kAvg) v[0].div_(static_cast<double>(size()));
  if (!v[0].is_same(t)) t.copy_(v[0]);
}

void ProcessGroup::broadcast(torch::Tensor& t, int root, const std::string& what) {
  impl_->check_tensor(t, what);
  VQAD_CHECK(root >= 0 && root < size(), "distributed: ", what, ": broadcast root ", root, " outside group ",
             name());
  if (size() == 1) return;
  std::vector<at::Tensor> v{t.is_contiguous() ? t : t.contiguous()};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = timeout();
  impl_->run("broadcast", what, [&] { return impl_->backend->broadcast(v, o); });
  if (!v[0].is_same(t)) t.copy_(v[0]);
}

torch::Tensor ProcessGroup::all_gather(const torch::Tensor& local, const std::string& what) {
  return all_gather_async(local, what).wait();
}

PendingCollective ProcessGroup::all_gather_async(const torch::Tensor& local, const std::string& what) {
  impl_->check_tensor(local, what);
  PendingCollective p;
  p.group_ = this;
  p.input_ = local.contiguous();
  if (size() == 1) {
    p.output_ = p.input_.clone();
    return p;
  }
  auto sizes = p.input_.sizes().vec();
  VQAD_CHECK(!sizes.empty(), "distributed: ", what, ": all_gather needs a tensor with a leading dimension");
  sizes[0] *= size();
  p.output_ = torch::empty(sizes, p.input_.options());
  c10d::AllgatherOptions o;
  o.timeout = timeout();
  impl_->issue(p.work_, p.seq_, p.label_, "all_gather", what,
               [&] { return impl_->backend->_allgather_base(p.output_, p.input_, o); });
  return p;
}

torch::Tensor ProcessGroup::complete(PendingCollective& p) {
  if (p.work_) {
    try {
      (*static_cast<c10::intrusive_ptr<c10d::Work>*>(p.work_.get()))->wait(impl_->shared->options.timeout);
    } catch (const vqad::Error&) {
      throw;
    } catch (const std::exception& e) {
      impl_->diagnose_and_fail(p.label_, p.seq_, e.what());
    }
    impl_->shared->set_beat(impl_->name, p.seq_, "done", p.label_);
    p.work_.reset();
  }
  auto out = p.output_;
  p = PendingCollective();
  return out;
}

torch::Tensor PendingCollective::wait() {
  VQAD_CHECK(group_ != nullptr, "distributed: waiting for a collective that was not issued (or already waited for)");
  return group_->complete(*this);
}

torch::Tensor ProcessGroup::reduce_scatter(const torch::Tensor& full, ReduceOp op, const std::string& what) {
  auto out = reduce_scatter_async(full, what, op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum).wait();
  if (op == ReduceOp::kAvg && size() > 1) out.div_(static_cast<double>(size()));
  return out;
}

PendingCollective ProcessGroup::reduce_scatter_async(const torch::Tensor& full, const std::string& what,
                                                     ReduceOp op) {
  VQAD_CHECK(op != ReduceOp::kAvg, "distributed: ", what, ": reduce_scatter_async sums or takes the max (kAvg: "
             "reduce_scatter divides after the wait)");
  impl_->check_tensor(full, what);
  VQAD_CHECK(full.dim() >= 1 && full.size(0) % size() == 0, "distributed: ", what, ": reduce_scatter needs dim 0 (",
             full.dim() ? full.size(0) : 0, ") divisible by the group size ", size());
  PendingCollective p;
  p.group_ = this;
  p.input_ = full.contiguous();
  if (size() == 1) {
    p.output_ = p.input_.clone();
    return p;
  }
  auto sizes = p.input_.sizes().vec();
  sizes[0] /= size();
  p.output_ = torch::empty(sizes, p.input_.options());
  c10d::ReduceScatterOptions o;
  o.reduceOp = op == ReduceOp::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  o.timeout = timeout();
  impl_->issue(p.work_, p.seq_, p.label_, "reduce_scatter", what,
               [&] { return impl_->backend->_reduce_scatter_base(p.output_, p.input_, o); });
  return p;
}

torch::Tensor ProcessGroup::all_to_all(const torch::Tensor& in_, const std::string& what) {
  impl_->check_tensor(in_, what);
  VQAD_CHECK(in_.dim() >= 1 && in_.size(0) % size() == 0, "distributed: ", what, ": all_to_all needs dim 0 (",
             in_.dim() ? in_.size(0) : 0, ") divisible by the group size ", size());
  if (size() == 1) return in_.clone();
  auto in = in_.contiguous();
  auto out = torch::empty_like(in);
  std::vector<int64_t> splits;  // empty: equal splits
  c10d::AllToAllOptions o;
  o.timeout = timeout();
  impl_->run("all_to_all", what, [&] { return impl_->backend->alltoall_base(out, in, splits, splits, o); });
  return out;
}

void ProcessGroup::barrier(const std::string& what) {
  if (size() == 1) return;
  auto t = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(impl_->shared->options.device));
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.timeout = timeout();
  impl_->run("barrier", what, [&] { return impl_->backend->allreduce(v, o); });
  if (t.is_cuda()) (void)t.item<float>();  // the barrier is complete when the host sees the result
}

std::vector<std::string> ProcessGroup::all_gather_string(const std::string& value, const std::string& what) {
  auto& I = *impl_;
  if (size() == 1) return {value};
  const uint64_t s = ++I.seq;
  const std::string label = "all_gather_string(" + what + ")";
  I.shared->set_beat(I.name, s, "in", label);
  const std::string base = detail::concat("vqad/pg/", I.name, "/str/", s, "/");
  std::vector<std::string> out;
  try {
    I.shared->store->set(base + std::to_string(rank()), to_bytes(value));
    const auto deadline = Clock::now() + timeout();
    for (int k = 0; k < size(); ++k) {
      const std::string key = base + std::to_string(k);
      while (!I.shared->store->check({key})) {
        if (Clock::now() >= deadline) I.diagnose_and_fail(label, s, "timed out waiting for rank " + std::to_string(k));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      out.push_back(to_string(I.shared->store->get(key)));
    }
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    I.diagnose_and_fail(label, s, e.what());
  }
  I.shared->set_beat(I.name, s, "done", label);
  return out;
}

void ProcessGroup::report_failure(const std::string& message) {
  // A rank that only diagnosed another rank's failure does not report: the others name the cause.
  if (message.rfind("distributed: ", 0) == 0) return;
  try {
    impl_->shared->store->set("vqad/failed/" + std::to_string(impl_->shared->env.rank),
                              to_bytes(first_line(message)));
  } catch (const std::exception&) {
    // The store is gone too; the others see this rank's heartbeat stop.
  }
}

namespace {
c10d::Store& side_store(Shared& S) {
  if (!S.side_store) {
    try {
      S.side_store = c10::make_intrusive<c10d::TCPStore>(S.env.master_addr, S.client_options);
    } catch (const std::exception& e) {
      fail("distributed: rank ", S.env.rank, " could not reach ", S.store_text(), ": ", first_line(e.what()));
    }
  }
  return *S.side_store;
}
}  // namespace

void ProcessGroup::post(const std::string& key, const std::string& value) {
  auto& S = *impl_->shared;
  std::lock_guard<std::mutex> l(S.side_mu);
  try {
    side_store(S).set("vqad/msg/" + key, to_bytes(value));
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("distributed: rank ", S.env.rank, ": posting ", key, " to ", S.store_text(), " failed: ", first_line(e.what()));
  }
}

std::string ProcessGroup::await(const std::string& key, const std::string& what, std::chrono::milliseconds timeout) {
  auto& S = *impl_->shared;
  const std::string k = "vqad/msg/" + key;
  const auto deadline = Clock::now() + timeout;
  auto last_scan = Clock::now() - std::chrono::seconds(1);
  try {
    while (true) {
      {
        std::lock_guard<std::mutex> l(S.side_mu);
        auto& store = side_store(S);
        if (store.check({k})) return to_string(store.get(k));
        // A rank that failed or stopped will never post: say so at once (once a second).
        if (Clock::now() - last_scan >= std::chrono::seconds(1)) {
          last_scan = Clock::now();
          for (int r = 0; r < S.env.world_size; ++r)
            if (r != S.env.rank)
              if (const std::string gone = rank_gone(store, r); !gone.empty())
                fail("distributed: rank ", S.env.rank, " waiting for ", what, ": ", gone);
        }
      }
      if (Clock::now() >= deadline)
        fail("distributed: rank ", S.env.rank, " waiting for ", what, ": nothing arrived within ",
             seconds_text(timeout.count()), " (every rank's heartbeat is current)");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("distributed: rank ", S.env.rank, " waiting for ", what, ": ", S.store_text(), " is unreachable (",
         first_line(e.what()), ")");
  }
}

}  // namespace vqad::dist
