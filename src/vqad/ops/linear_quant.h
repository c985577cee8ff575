// The hook through which a quant plan replaces a linear layer's math.
// model::Linear calls quant->forward(x, weight, bias) instead of x W^T + b when a
// LinearQuant is attached (student role only); ops/nvfp4_linear implements it.
#pragma once
#include <torch/torch.h>

#include <string>

namespace vqad::ops {

class LinearQuant {
 public:
  virtual ~LinearQuant() = default;
  // x [..., K], weight [N, K] (fp32 master), bias [N] or undefined -> [..., N].
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& weight,
                                const torch::Tensor& bias) = 0;
  // e.g. "nvfp4 W:dynamic A:static(amax=3.2)" for plans, logs and metadata.
  virtual std::string describe() const = 0;
};

}  // namespace vqad::ops
