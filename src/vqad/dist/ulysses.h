// Ulysses sequence parallelism: the all-to-all exchanges around self-attention.
//
// A rank of an SP group of P ranks holds a contiguous 1/P of the sequence with every head:
// [B, S/P, H, D]. Before self-attention, seq_to_heads gives it the whole sequence for H/P of
// the heads, [B, S, H/P, D] (rank r gets heads [r H/P, (r+1) H/P), sequence in rank order);
// after it, heads_to_seq is the inverse. Each is one all_to_all over the SP group, and each is
// the other's backward, so gradients flow exactly (no reduction, no scaling). H must be a
// multiple of P (FastVideo asserts the same).
#pragma once
#include <torch/torch.h>

#include "vqad/dist/process_group.h"

namespace vqad::dist {

// [B, S/P, H, D] -> [B, S, H/P, D]; differentiable.
torch::Tensor seq_to_heads(const torch::Tensor& x, ProcessGroup& sp_group, const std::string& what);
// [B, S, H/P, D] -> [B, S/P, H, D]; differentiable.
torch::Tensor heads_to_seq(const torch::Tensor& x, ProcessGroup& sp_group, const std::string& what);

// The sequence split of a whole-model forward under SP. The contract: every rank of the SP
// group runs the same model on the same batch, noise and timesteps, holds the sequence slice
// of its rank, and computes the same loss from the gathered output.
//
// [B, S, C] -> this rank's [B, S/P, C] (tokens [r S/P, (r+1) S/P)); differentiable (a slice).
// The error names `what` and the sizes when S is not a multiple of P.
torch::Tensor shard_sequence(const torch::Tensor& x, ProcessGroup& sp_group, const std::string& what);
// [B, S/P, C] -> [B, S, C] on every rank (rank order), one all_gather; differentiable. Its
// backward keeps this rank's slice of the incoming gradient: under the contract above every
// rank receives the same gradient of the gathered tensor, so the slice is exactly the
// gradient of this rank's part (no reduction, no scaling). The parameter gradients of the SP
// ranks are partial sums over their tokens; the data-parallel reduction sums them over the
// SP group (dist::DataParallel::average_gradients).
torch::Tensor gather_sequence(const torch::Tensor& x, ProcessGroup& sp_group, const std::string& what);

// The SP group that whole-model forwards (model::WanModel::forward) of this thread shard the
// sequence over, while the scope lives; none outside (validation and sampling on one rank run
// the full sequence). The trainer opens it around the method's micro-steps.
class SequenceParallelScope {
 public:
  explicit SequenceParallelScope(ProcessGroup* group);  // nullptr or a group of size 1: no SP
  ~SequenceParallelScope();
  SequenceParallelScope(const SequenceParallelScope&) = delete;
  SequenceParallelScope& operator=(const SequenceParallelScope&) = delete;

 private:
  ProcessGroup* previous_;
};
// nullptr outside a scope (or in a scope of one rank).
ProcessGroup* sequence_parallel_group();

}  // namespace vqad::dist
