// Activation checkpointing (`enable_gradient_checkpointing_type: full`): the forward runs
// `fn` without recording a graph and keeps only its inputs; the backward runs `fn` again
// with grad enabled and differentiates that recomputation.
//
// `params` are the parameters `fn` reads (a block's weights). They are inputs of the
// checkpoint node, so their gradients reach the autograd engine like any other edge:
// they accumulate into .grad under backward() and are returned by autograd::grad(), and a
// block whose inputs are detached (layer reconstruction from cached activations) still
// trains. `fn` must be deterministic (no dropout, no RNG): it is run twice.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace vqad::ops {

using CheckpointedFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

// All `inputs` and `params` must be defined. Returns fn(inputs); differentiable with
// respect to every input and parameter that requires grad.
torch::Tensor checkpoint(CheckpointedFn fn, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& params);

// Several outputs: returns fn(inputs) (one or more tensors), each differentiable. Outputs
// that the loss does not use (no incoming gradient) are left out of the recomputed
// backward, so a block can return its output together with tapped intermediates
// (reconstruction targets) and still be recomputed instead of keeping its activations.
using CheckpointedMultiFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& inputs)>;
std::vector<torch::Tensor> checkpoint_multi(CheckpointedMultiFn fn, const std::vector<torch::Tensor>& inputs,
                                            const std::vector<torch::Tensor>& params);

}  // namespace vqad::ops
