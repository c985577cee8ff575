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

}  // namespace vqad::dist
