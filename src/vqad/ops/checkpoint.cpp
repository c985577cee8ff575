#include "vqad/ops/checkpoint.h"

#include <memory>

#include "vqad/core/error.h"

namespace vqad::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Travels in the autograd context as an IValue capsule. Parameters are referenced, not
// saved: they are module-owned leaves, and modifying them between forward and backward
// would invalidate any autograd graph anyway.
struct MultiCheckpointState : torch::CustomClassHolder {
  CheckpointedMultiFn fn;
  size_t num_inputs = 0;
  std::vector<torch::Tensor> params;
};

class MultiCheckpointFunction : public torch::autograd::Function<MultiCheckpointFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<MultiCheckpointState> state,
                               at::TensorList all) {
    std::vector<torch::Tensor> inputs(all.begin(), all.begin() + state->num_inputs);
    state->params.assign(all.begin() + state->num_inputs, all.end());
    std::vector<torch::Tensor> out;
    {
      torch::NoGradGuard no_grad;
      out = state->fn(inputs);
    }
    VQAD_CHECK(!out.empty(), "checkpoint: the checkpointed function returned no tensor");
    for (size_t i = 0; i < out.size(); ++i)
      VQAD_CHECK(out[i].defined(), "checkpoint: output ", i, " of the checkpointed function is undefined");
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto capsule = ctx->saved_data["state"].toCapsule();
    auto* state = static_cast<MultiCheckpointState*>(capsule.get());
    auto saved = ctx->get_saved_variables();
    const auto& params = state->params;

    std::vector<torch::Tensor> inputs;
    inputs.reserve(saved.size());
    for (const auto& t : saved) {
      auto d = t.detach();
      d.requires_grad_(t.requires_grad());
      inputs.push_back(d);
    }
    std::vector<torch::Tensor> out;
    {
      torch::AutoGradMode enable(true);
      out = state->fn(inputs);
    }
    variable_list result(1 + inputs.size() + params.size());
    // Only the outputs that received a gradient and depend on something trainable.
    std::vector<torch::Tensor> outs, gouts;
    for (size_t i = 0; i < out.size() && i < grad_outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !out[i].requires_grad()) continue;
      outs.push_back(out[i]);
      gouts.push_back(grad_outputs[i]);
    }
    if (outs.empty()) return result;
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].requires_grad()) wrt.push_back(inputs[i]), slot.push_back(1 + i);
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].requires_grad()) wrt.push_back(params[i]), slot.push_back(1 + inputs.size() + i);
    if (wrt.empty()) return result;
    auto grads = torch::autograd::grad(outs, wrt, gouts, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
    for (size_t i = 0; i < grads.size(); ++i) result[slot[i]] = grads[i];
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_multi(CheckpointedMultiFn fn, const std::vector<torch::Tensor>& inputs,
                                            const std::vector<torch::Tensor>& params) {
  VQAD_CHECK(static_cast<bool>(fn), "checkpoint: no function given");
  for (size_t i = 0; i < inputs.size(); ++i)
    VQAD_CHECK(inputs[i].defined(), "checkpoint: input ", i, " is undefined");
  for (size_t i = 0; i < params.size(); ++i)
    VQAD_CHECK(params[i].defined(), "checkpoint: parameter ", i, " is undefined");
  auto state = c10::make_intrusive<MultiCheckpointState>();
  state->fn = std::move(fn);
  state->num_inputs = inputs.size();
  std::vector<torch::Tensor> all(inputs);
  all.insert(all.end(), params.begin(), params.end());
  return MultiCheckpointFunction::apply(state, at::TensorList(all));
}

torch::Tensor checkpoint(CheckpointedFn fn, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& params) {
  VQAD_CHECK(static_cast<bool>(fn), "checkpoint: no function given");
  auto one = [fn = std::move(fn)](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in)}; };
  return checkpoint_multi(std::move(one), inputs, params).at(0);
}

}  // namespace vqad::ops
