// Process groups and collectives on c10d.
//
// Rendezvous is a c10d::TCPStore at MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by the
// launcher when it says so). The collectives run on a c10d::Backend: Gloo for CPU tensors,
// NCCL for CUDA tensors (a build with LibTorch's CUDA libraries). Every collective has a
// name (what it moves, e.g. "all_reduce(grads student)") and a per-group sequence number.
//
// Faults: each process runs a heartbeat thread that writes "<time> <group> <seq> <name>"
// into the store every 200 ms. When a collective fails or exceeds the group's timeout, the
// error names the collective and diagnoses the other ranks from their heartbeats: a rank
// whose heartbeat stopped (it died or froze), a rank that has not reached this collective
// (it hangs elsewhere, its last collective is named), or a rank that reported its own
// error before exiting. No collective waits past the timeout.
//
// Determinism: all_reduce SUM of floating tensors is performed by the backend in an order
// that depends only on the group size (Gloo: ring; NCCL: its algorithm for the topology), so
// every rank receives the same bits; kAvg is SUM followed by one division by the group size
// (the same on Gloo and NCCL).
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "vqad/dist/env.h"

namespace vqad::dist {

enum class ReduceOp { kSum, kAvg, kMax };

struct GroupOptions {
  std::chrono::milliseconds timeout{600000};  // every collective and the rendezvous
  torch::Device device = torch::kCPU;          // CPU -> Gloo, CUDA -> NCCL
};

// A collective issued and not yet waited for (ProcessGroup::all_gather_async). The backend
// runs it in the background (NCCL on its own stream, so device work issued after it overlaps
// it; Gloo on its worker threads); wait() completes it within the group's timeout (errors as
// for any collective) and returns the output. Every rank must wait for it, in the same
// order relative to its other collectives of the group.
class ProcessGroup;
class PendingCollective {
 public:
  PendingCollective() = default;
  bool active() const { return group_ != nullptr; }
  torch::Tensor wait();

 private:
  friend class ProcessGroup;
  ProcessGroup* group_ = nullptr;  // the group outlives its pending collectives
  std::shared_ptr<void> work_;     // the backend's c10d::Work (null: already complete)
  torch::Tensor input_, output_;
  std::string label_;
  uint64_t seq_ = 0;
};

class ProcessGroup {
 public:
  // The world group of this process (blocks until every rank has joined, or the timeout).
  static std::shared_ptr<ProcessGroup> init(const LaunchEnv& env, const GroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // A group over `ranks` (global ranks, strictly ascending, containing this rank). Every
  // member calls it with the same name and ranks; non-members do not call it.
  std::shared_ptr<ProcessGroup> subgroup(const std::string& name, const std::vector<int>& ranks);

  int rank() const;        // within this group
  int size() const;
  int global_rank() const;
  const std::string& name() const;
  std::chrono::milliseconds timeout() const;
  torch::Device device() const;  // where this group's tensors live
  const std::vector<int>& global_ranks() const;

  // In place; every rank passes a tensor of the same shape and dtype.
  void all_reduce(torch::Tensor& t, ReduceOp op, const std::string& what);
  void broadcast(torch::Tensor& t, int root, const std::string& what);
  // Concatenation of every rank's `local` along dim 0 (rank order).
  torch::Tensor all_gather(const torch::Tensor& local, const std::string& what);
  // The same, issued now and completed by the returned handle's wait().
  PendingCollective all_gather_async(const torch::Tensor& local, const std::string& what);
  // `full` split into size() equal chunks along dim 0; rank r receives the reduction of chunk r.
  torch::Tensor reduce_scatter(const torch::Tensor& full, ReduceOp op, const std::string& what);
  // The same (kSum or kMax), issued now and completed by the returned handle's wait().
  PendingCollective reduce_scatter_async(const torch::Tensor& full, const std::string& what,
                                         ReduceOp op = ReduceOp::kSum);
  // `in` split into size() equal chunks along dim 0; chunk j goes to rank j, the output holds
  // the chunks received from ranks 0..size-1 in order.
  torch::Tensor all_to_all(const torch::Tensor& in, const std::string& what);
  void barrier(const std::string& what);
  // Every rank's string, in rank order (through the store; small values: hashes, ids).
  std::vector<std::string> all_gather_string(const std::string& value, const std::string& what);

  // Called on the way out of a failing rank: the others name this error in theirs.
  void report_failure(const std::string& message);

  // Point-to-point messages through the rendezvous store, usable from any thread (their own
  // store connection, opened on first use): post() publishes `value` under `key` (keys are
  // global to the job: callers make them unique, e.g. with a step and a rank); await() waits
  // for the key up to `timeout`, naming `what` and, when a rank stopped, that rank in its
  // error. Checkpoint writers use them to hand their files to rank 0 in the background.
  void post(const std::string& key, const std::string& value);
  std::string await(const std::string& key, const std::string& what, std::chrono::milliseconds timeout);

  struct Impl;

 private:
  friend class PendingCollective;
  torch::Tensor complete(PendingCollective& pending);
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The process's world group once init() has run (nullptr before, and in single-process runs).
std::shared_ptr<ProcessGroup> world();

}  // namespace vqad::dist
