// Packed NVFP4 linears in a Diffusers weight file (ModelOpt's layout, spec/linear_qat.md
// "Packed export"): <m>.weight U8 [N, K/2], <m>.weight_scale F8_E4M3 [N, K/16],
// <m>.weight_scale_2 F32 scalar, optionally <m>.input_scale F32 scalar and
// <m>.weight_scale_swizzled (the 128x4 layout, checked against the linear one).
// read_weights (weights.h) replaces them by their dequantized fp32 weights, so every
// loader (init_from, overrides, resume) sees an ordinary Diffusers state.
#pragma once
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>

#include "vqad/model/wan/weights.h"

namespace vqad::model {

struct PackedNvfp4Linear {
  std::string module;
  torch::Tensor unit_weight;          // fp32 [N, K]: e2m1(code) * f32(weight_scale)
  float weight_scale_2 = 0.0f;        // the weight's decode scale
  std::optional<float> input_scale;   // the activation's decode scale, when stored
};

// Replaces every packed linear of `state` by one fp32 <m>.weight =
// (e2m1(code) * f32(weight_scale)) * weight_scale_2 - the fake-quantized weight of
// training - and returns them by module name. A malformed one is an error naming the tensor.
std::map<std::string, PackedNvfp4Linear> unpack_nvfp4_linears(WeightState& state);

// The packed linears of a weight source (see locate_weights); empty when it has none.
std::map<std::string, PackedNvfp4Linear> read_packed_nvfp4_linears(const std::string& path);

}  // namespace vqad::model
