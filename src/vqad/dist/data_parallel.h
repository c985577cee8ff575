// Data parallelism for the trainer over the mesh hsdp_replicate_dim R x hsdp_shard_dim S
// (R S = world), with optional Ulysses sequence parallelism (sp_size P | world: the SP groups
// are the consecutive ranks {g P, ..., g P + P - 1}; the ranks of one group share batch and
// noise and split the sequence, dist/ulysses.h). With S = 1 the parameters are replicated
// (this class reduces the gradients); with S > 1 they are sharded over the shard groups, the
// consecutive ranks {g S, ..., g S + S - 1}, and replicated over the replicate groups
// {r, r + S, r + 2 S, ...} (dist/fully_sharded.h reduces the gradients of sharded models).
//
// What the trainer calls:
//  - at start: check_same_run (every rank runs the same resolved config and the same vqad
//    executable, by sha256), then broadcast_parameters from rank 0;
//  - after the last micro-batch's backward of a step: average_gradients per updated role
//    (fp32, flat buckets, one all-reduce SUM per bucket over the world then one division by
//    the data-parallel degree world / P: the SP ranks' partial gradients of one sample add
//    up to its gradient, the DP groups' gradients are averaged; with P = 1 this is the mean;
//    gradient accumulation communicates once per optimizer step), then average_metrics (the
//    losses every rank logs and checks are the global ones, so clipping and the NaN guard
//    decide alike everywhere);
//  - checkpoints: rank 0 writes (the state is replicated), every rank waits at a barrier.
// A one-process run has no DataParallel (no collectives at all).
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "vqad/dist/process_group.h"

namespace vqad::dist {

struct MeshSpec {
  int64_t num_gpus = 1;
  int64_t sp_size = 1;
  int64_t hsdp_replicate_dim = 1;
  int64_t hsdp_shard_dim = 1;
};

class DataParallel {
 public:
  // nullptr for a one-process run. Checks the mesh against the launched world (errors name
  // the training.distributed key).
  static std::unique_ptr<DataParallel> create(const MeshSpec& mesh);
  explicit DataParallel(std::shared_ptr<ProcessGroup> world, MeshSpec mesh);

  int rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  bool is_main() const { return world_->rank() == 0; }
  int64_t dp_rank() const { return world_->rank() / mesh_.sp_size; }
  int64_t dp_size() const { return world_->size() / mesh_.sp_size; }
  ProcessGroup& group() { return *world_; }
  int64_t sp_size() const { return mesh_.sp_size; }
  // This rank's SP group (nullptr when sp_size is 1).
  ProcessGroup* sp_group() { return sp_.get(); }
  // Sharded data parallelism (hsdp_shard_dim > 1): this rank's shard group and replicate
  // group (nullptr when hsdp_replicate_dim is 1).
  bool sharded() const { return mesh_.hsdp_shard_dim > 1; }
  ProcessGroup* shard_group() { return shard_ ? shard_.get() : nullptr; }
  ProcessGroup* replicate_group() { return replicate_.get(); }
  // This rank is in the first shard group (global ranks 0 .. S-1, the one holding rank 0): the
  // ranks that write a sharded checkpoint and sample validation together.
  bool in_first_shard_group() const { return sharded() && rank() < mesh_.hsdp_shard_dim; }

  // Every rank must present the same value (e.g. a sha256); the error names the first rank
  // that differs from rank 0 and both values.
  void check_same(const std::string& what, const std::string& value);
  void broadcast_parameters(const std::vector<torch::Tensor>& params, const std::string& what);
  void average_gradients(const std::vector<torch::Tensor>& params, const std::string& what);
  void average_metrics(std::map<std::string, double>& values, const std::string& what);
  double sum(double local, const std::string& what);
  // A count every SP rank of a group makes alike (tokens of the group's batch), summed over
  // the data-parallel groups.
  double sum_over_dp(double local, const std::string& what) { return sum(local, what) / static_cast<double>(mesh_.sp_size); }
  void barrier(const std::string& what) { world_->barrier(what); }
  nlohmann::json mesh_json() const;

 private:
  std::shared_ptr<ProcessGroup> world_;
  std::shared_ptr<ProcessGroup> sp_, shard_, replicate_;
  MeshSpec mesh_;
};

// sha256 of this process's executable (/proc/self/exe): "the same vqad build" on every rank.
std::string executable_sha256();

}  // namespace vqad::dist
