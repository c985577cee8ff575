// Sharded data parallelism (mesh hsdp_replicate_dim x hsdp_shard_dim, FSDP/ZeRO-3 semantics)
// for one model: its parameters, gradients and AdamW state are split over the shard group;
// a unit's parameters exist in full only while the unit computes.
//
// Layout. The model's parameters are grouped into units (WanModel::shard_units: one root unit
// with everything outside the blocks, then the blocks, fsdp_modules_per_group to a unit).
// Every parameter p (fp32, n elements) is flattened and padded to a multiple of the shard
// group size S; rank r owns elements [r n', (r + 1) n') with n' = ceil(n / S) as its own fp32
// tensor (the "shard", what the optimizer updates: one AdamW state per parameter shard, so a
// parameter that got no gradient is skipped exactly as in an unsharded run). Between uses the
// module parameter keeps its shape but holds no memory (its storage is released; reading it
// then is an error, not stale data).
//
// Use. The model calls gather(root) before its embedding and head, and enter_block /
// leave_block around each block:
//  - enter: all-gather the unit (the forward is the same arithmetic as unsharded: fp32, or
//    with gather_bf16 the parameters that are only read rounded to BF16 as BF16) and
//    mark the block input so that, when its gradient is complete, the unit's backward is
//    done (post-backward);
//  - leave: release the unit (reshard_after_forward) and mark the block output so that its
//    backward first gathers the unit again (pre-backward); with activation checkpointing
//    the recomputation runs after that gather;
//  - post-backward: reduce-scatter (SUM) the unit's full gradients into the parameter
//    shards' gradients (accumulating: a unit used by several forwards reduces the sum), free
//    the full gradients and release the unit once no pending backward needs it.
// The trainer calls finish_backward() after each micro-step (reduces what no hook reduced,
// e.g. the root unit, and releases everything), then finish_step() once per optimizer step:
// one all-reduce SUM of the shard gradients over the replicate group and a division by the
// data-parallel degree, so the result equals DataParallel::average_gradients on replicated
// weights. Gradient accumulation reduce-scatters once per micro-step over the shard group and
// all-reduces over the replicate group once per step; with set_gradient_sync(false) for the
// micro-steps before the last, a unit's full gradients instead stay on the parameters and
// accumulate there (no communication), and the last micro-step reduce-scatters their sum
// (training.distributed.accumulate_unreduced_gradients).
//
// Overlap: when a unit is gathered for its forward, the next unit's all-gather is issued at
// once and completed when that unit enters (prefetch); likewise in backward for the unit
// before it. At most one prefetch is in flight, so at most two units are gathered. A unit's
// gradient reduce-scatter is issued when its backward is done and completed when the next
// unit's is issued (or at finish_backward), so it overlaps the backward of the unit before
// it; one is in flight at a time, and the shard gradients receive the sums in issue order.
//
// Every collective is on the shard (or replicate) group, issued in the same order on every
// rank because every rank runs the same graph. Validation samples through the same hooks on
// every rank of the shard group (no backward: a unit is released after its forward), then
// release_all(); checkpoints use visit_written_state() (one unit and its AdamW moments in
// full at a time, handed to the rank that writes it).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "vqad/dist/process_group.h"

namespace vqad::dist {

struct ShardParam {
  std::string name;
  torch::Tensor tensor;  // the module parameter (fp32)
  // Every reader of the parameter in forward and backward uses it rounded to BF16 (the
  // linear layers under BF16 compute), so gathering bf16(shard) computes exactly what
  // gathering the fp32 shard does (ShardingOptions::gather_bf16).
  bool read_as_bf16 = false;
};

struct ShardUnitSpec {
  std::string name;  // "root", "blocks.0-1", ...
  std::vector<ShardParam> params;
};

struct ShardingOptions {
  ProcessGroup* shard = nullptr;      // the ranks that split the state (size S >= 1)
  ProcessGroup* replicate = nullptr;  // the ranks holding the same shard (nullptr: none)
  int64_t dp_size = 1;                // the divisor of the summed gradients
  bool reshard_after_forward = true;  // false: a unit stays gathered until its backward
  // The forward and backward all-gathers move the parameters marked read_as_bf16 as BF16 (the
  // rest as fp32): about half the bytes, the same arithmetic. Checkpoints and exports always
  // gather fp32 (training.distributed.gather_dtype).
  bool gather_bf16 = false;
};

class FullyShardedModel {
 public:
  // Takes this rank's shards from the (identical on every rank) full parameters and releases
  // them. `what` names the model in errors and collectives ("student").
  FullyShardedModel(std::string what, std::vector<ShardUnitSpec> units, ShardingOptions options);
  ~FullyShardedModel();
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  size_t num_units() const;
  const std::string& what() const { return what_; }

  // --- the model's forward ---
  void gather(size_t unit);
  // `first`: the block opens its unit (the input marks the unit's post-backward); `last`:
  // the block closes it (released after forward, the output marks the pre-backward gather).
  torch::Tensor enter_block(size_t unit, bool first, torch::Tensor hidden);
  torch::Tensor leave_block(size_t unit, bool last, torch::Tensor out);

  // --- the trainer ---
  // false: the backwards that follow keep the units' full gradients (accumulating) instead of
  // reduce-scattering them; true (the default): the next backward reduces everything held.
  void set_gradient_sync(bool sync) { sync_ = sync; }
  // Gradient reduce-scatters issued so far (one per unit that had gradients to reduce).
  int64_t reduce_scatters_issued() const { return reduce_scatters_; }
  // Bytes this rank has received in the forward / backward parameter all-gathers so far (the
  // checkpoint gathers not included).
  int64_t all_gather_bytes() const { return gather_bytes_; }
  // Elements of the model's parameters that the forward / backward gathers move as BF16.
  int64_t bf16_gathered_elements() const;
  int64_t parameter_elements() const;
  void finish_backward();
  void finish_step();
  // The trainable parameters' shards (requires_grad), in parameter order: the optimizer's
  // parameter list. `names` receives the full parameters' names.
  std::vector<torch::Tensor> trainable_shards(std::vector<std::string>* names = nullptr) const;
  // sqrt(sum of squares) of the whole gradient (every rank gets the same value).
  double grad_norm();
  // torch's clip_grad_norm_ semantics on the whole gradient; returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // Names of the parameters whose gradients (or weights) hold NaN/Inf anywhere on any rank
  // (collective; the same list on every rank).
  std::vector<std::string> nonfinite_parameters(bool gradients);

  // Releases every unit (after forwards without a backward, e.g. validation sampling, which
  // leaves the root unit gathered).
  void release_all();
  // The inverse: `shards` gets this rank's slices of `full`'s state (resume).
  void shard_adamw_state(const torch::optim::AdamW& full, torch::optim::AdamW& shards) const;
  // One parameter in full, for a checkpoint: the weight and, for a trainable parameter the
  // optimizer has updated, its AdamW moments (else undefined) and step.
  struct FullParameter {
    std::string name;
    torch::Tensor weight, exp_avg, exp_avg_sq, max_exp_avg_sq;
    int64_t step = -1;  // -1: no AdamW state
  };
  // The rank of the shard group that writes each unit to a checkpoint: units are assigned in
  // order to the rank with the fewest bytes so far (fp32 weights, plus two moments when
  // trainable), the same on every rank.
  std::vector<int> unit_writers() const;
  // The parameters (name, shape, trainable) of the units this rank writes.
  std::vector<std::tuple<std::string, std::vector<int64_t>, bool>> written_parameters() const;
  // Checkpointing without the whole model on any device: unit after unit, the shard group
  // gathers its parameters and the AdamW moments of `shard_state` (an optimizer over
  // trainable_shards(); nullptr: weights only), `sink` receives each of the unit's parameters
  // in full on the unit's writer (unit_writers()), and the unit is released again. At most
  // one unit (and its moments) is gathered at a time. Collective over the shard group.
  void visit_written_state(const torch::optim::AdamW* shard_state,
                           const std::function<void(const FullParameter&)>& sink);
  // Every trainable parameter's gradient in full, from the shard gradients (zeros where a
  // shard has none): collective; for checks.
  std::vector<std::pair<std::string, torch::Tensor>> gather_gradients();

  // Called by the autograd hooks.
  void pre_backward(size_t unit);
  void post_backward(size_t unit);

  struct Unit;

 private:
  // exact: the fp32 values whatever gather_bf16 says (checkpoints); a unit gathered with
  // BF16 entries is gathered again.
  void gather_unit(Unit& u, bool exact = false);
  torch::Tensor send_buffer(const Unit& u, bool bf16);
  void fill_unit(Unit& u, const torch::Tensor& gathered, bool bf16);
  void prefetch(size_t unit);
  void complete_prefetch();
  void release_unit(Unit& u);
  void reduce_unit_grads(Unit& u);
  void complete_reduce();

  std::string what_;
  ShardingOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;
  size_t prefetch_unit_ = 0;
  PendingCollective prefetch_;
  bool prefetch_bf16_ = false;
  struct PendingReduce {
    PendingCollective work;
    size_t unit = 0;
    std::vector<size_t> entries;  // the unit's entries whose shard gradients receive the result
  };
  PendingReduce reduce_;
  bool sync_ = true;
  int64_t reduce_scatters_ = 0;
  int64_t gather_bytes_ = 0;
};

}  // namespace vqad::dist
