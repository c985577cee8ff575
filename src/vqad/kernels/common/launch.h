// The launch convention of vqad's kernel families (plain C++, no torch), shared by the
// attention forward and backward (kernels/attention) and the VSA kernels (kernels/vsa):
//   - a BF16 [B, L, H, D] (BLHD) tensor is a view: a device pointer and its element
//     strides (BlhdIn for inputs, BlhdOut for outputs; bf16 stored as 16-bit words);
//   - every launcher checks its arguments before it launches, and a failed check is a
//     one-line vqad::Error "<op>: <what was expected>, found <what was found> (<shape>;
//     <device>)", where the shape is the call's and the device the current one with its
//     arch. CUDA API failures after the checks throw std::runtime_error (cuda_check.h).
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "vqad/core/error.h"

namespace vqad::kernels {

// Element strides of a [B, L, H, D] view.
struct BlhdStrides {
  int64_t b = 0, l = 0, h = 0, d = 1;
};

// Strides of a contiguous [B, L, H, D] tensor.
inline BlhdStrides contiguous_blhd(int64_t len, int64_t heads, int64_t head_dim) {
  return BlhdStrides{len * heads * head_dim, heads * head_dim, head_dim, 1};
}

struct BlhdIn {
  const void* data = nullptr;
  BlhdStrides stride;
};
struct BlhdOut {
  void* data = nullptr;
  BlhdStrides stride;
};

// "B=2 H=3 Lq=1000 Lkv=777 D=128": the shape of an attention call, for messages.
inline std::string attention_shape_str(int64_t batch, int64_t heads, int64_t len_q, int64_t len_kv,
                                       int64_t head_dim) {
  return "B=" + std::to_string(batch) + " H=" + std::to_string(heads) + " Lq=" + std::to_string(len_q) +
         " Lkv=" + std::to_string(len_kv) + " D=" + std::to_string(head_dim);
}

// The current CUDA device for messages, "device 0 NVIDIA H200 (sm_90)", or why there is
// none ("no CUDA device: ..."). Never throws (kernels/common/device.cu).
std::string current_device_str();

// Throws the launch error: vqad::Error "<op>: <what...> (<shape>; <device>)".
template <typename... Args>
[[noreturn]] void launch_fail(const char* op, const std::string& shape, Args&&... what) {
  ::vqad::fail(op, ": ", std::forward<Args>(what)..., " (", shape, "; ", current_device_str(), ")");
}

}  // namespace vqad::kernels

// VQAD_LAUNCH_CHECK(cond, op, shape, what...) calls launch_fail(op, shape, what...) when
// !cond; `shape` (a std::string expression) is evaluated only then.
#define VQAD_LAUNCH_CHECK(cond, op, shape, ...)                         \
  do {                                                                  \
    if (!(cond)) ::vqad::kernels::launch_fail(op, shape, __VA_ARGS__);  \
  } while (0)

namespace vqad::kernels {

// The layout every BLHD operand of the kernels needs (rows read and written as 16-byte
// vectors): a non-null, 16-byte aligned start, the head dim contiguous and the b, l, h
// strides non-negative multiples of 8 elements. `shape` is a callable returning the
// call's shape string (called only on failure).
template <typename View, typename ShapeFn>
void check_blhd(const char* op, const char* tensor, const View& view, ShapeFn&& shape) {
  const BlhdStrides& s = view.stride;
  VQAD_LAUNCH_CHECK(view.data != nullptr, op, shape(), "tensor ", tensor, ": expected a device pointer, found null");
  VQAD_LAUNCH_CHECK(reinterpret_cast<uintptr_t>(view.data) % 16 == 0, op, shape(), "tensor ", tensor,
                    ": expected a 16-byte aligned start, found address ", view.data);
  VQAD_LAUNCH_CHECK(s.d == 1, op, shape(), "tensor ", tensor, ": expected head-dim stride 1, found ", s.d);
  VQAD_LAUNCH_CHECK(s.b >= 0 && s.l >= 0 && s.h >= 0 && s.b % 8 == 0 && s.l % 8 == 0 && s.h % 8 == 0, op, shape(),
                    "tensor ", tensor,
                    ": expected strides (b, l, h) that are non-negative multiples of 8 elements (16-byte rows), "
                    "found (",
                    s.b, ", ", s.l, ", ", s.h, ")");
}

}  // namespace vqad::kernels
