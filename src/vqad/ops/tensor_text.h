// How ops name tensors in error messages: "[2, 16, 3, 64]" and "q [..], k [..], v [..]".
#pragma once
#include <torch/torch.h>

#include <sstream>
#include <string>

namespace vqad::ops {

inline std::string shape_str(c10::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}
inline std::string shape_str(const torch::Tensor& t) { return shape_str(t.sizes()); }

inline std::string describe_qkv(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return "q " + shape_str(q) + ", k " + shape_str(k) + ", v " + shape_str(v);
}

}  // namespace vqad::ops
