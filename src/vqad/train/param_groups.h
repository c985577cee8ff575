// Trainable scope (`trainable_scope: quantized_path` + `trainable_modules`, seeds/004 and
// spec/sparse_qad.md "Trainable scope").
//
// A parameter trains exactly when its module path (the parameter name without its last
// component, e.g. blocks.3.attn1.to_q for blocks.3.attn1.to_q.weight) or the FastVideo
// name of that module path (blocks.3.to_q) contains one of the listed names as a
// substring. Everything else gets requires_grad = false and stays out of the optimizer.
#pragma once
#include <string>
#include <vector>

#include "vqad/model/wan/model.h"

namespace vqad::train {

// FastVideo's name of a Wan module path given its Diffusers path (blocks.N.attn1.to_q ->
// blocks.N.to_q, blocks.N.attn1.norm_q -> blocks.N.norm_q, blocks.N.norm2 ->
// blocks.N.self_attn_residual_norm.norm, blocks.N.ffn.net.0.proj -> blocks.N.ffn.fc_in, ...).
std::string wan_fastvideo_module_path(const std::string& diffusers_module_path);

// Whether the parameter `param_name` is inside the scope of `modules`.
bool in_trainable_scope(const std::string& param_name, const std::vector<std::string>& modules);

// Sets requires_grad on the model's parameters per the scope and returns the names of
// the trainable ones, in named_parameters() order. `key` names the config key in errors
// (a scope that selects nothing, or a listed name that matches no parameter).
std::vector<std::string> apply_trainable_scope(model::WanModel& model, const std::vector<std::string>& modules,
                                               const std::string& key);

}  // namespace vqad::train
