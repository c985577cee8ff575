// CUDA NVFP4 kernels (spec/nvfp4.md): fake quantization, quantize + pack,
// dequantize and the per-tensor amax of dynamic mode. Plain C++ launch API:
// raw device pointers, element strides, a stream; no torch.
//
// Tensors are quantized along their last dim, which must be contiguous and a
// multiple of 16; the leading dims may have any sizes and strides. The
// logical rows (leading dims flattened in row-major order) index the packed
// outputs, which are always dense.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace vqad::kernels::nvfp4 {

enum class DType { kF32, kBF16 };
const char* dtype_name(DType d);

inline constexpr int kMaxDims = 8;

// A strided view; `data` is read for inputs and written for outputs.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements; strides[ndim - 1] must be 1
  int64_t rows() const;            // product of the leading dims
  int64_t cols() const { return ndim > 0 ? sizes[ndim - 1] : 0; }
  std::string shape_str() const;   // "[31200, 1536] bf16"
};

// Builds a view of a dense row-major tensor.
TensorView dense_view(void* data, DType dtype, int64_t rows, int64_t cols);

// Where a kernel gets s_enc: a host value (unit: 1, static: 2688 / calibrated
// amax), or (dynamic) from an amax in device memory, so that no host sync is
// needed between the amax reduction and the quantization.
struct EncodeScale {
  float value = 1.0f;
  const float* amax_device = nullptr;  // if set: s_enc = 2688 / max(*amax_device, 1e-12)
};

// amax_out[0] = max |x| over the whole view (NaN propagates). One float on the device.
void launch_amax(const TensorView& x, float* amax_out, cudaStream_t stream);

// y = dequantize(quantize(x)) in y's dtype (F32 or BF16); x and y have the same sizes.
void launch_fake_quantize(const TensorView& x, const TensorView& y, EncodeScale scale,
                          cudaStream_t stream);

// Outputs of quantize + pack, all dense over the logical rows; null pointers are skipped.
struct QuantizeOutputs {
  uint8_t* packed_codes = nullptr;     // [rows, cols / 2], element 2i in the low nibble (4-byte aligned)
  uint8_t* scales_linear = nullptr;    // [rows, cols / 16] E4M3 bytes
  uint8_t* scales_swizzled = nullptr;  // 128x4 layout, swizzled_size(rows, cols / 16) bytes, pad zeroed
};
int64_t swizzled_size(int64_t rows, int64_t scale_cols);
void launch_quantize(const TensorView& x, EncodeScale scale, const QuantizeOutputs& out,
                     cudaStream_t stream);

// y = (e2m1(code) * S) * (1 / s_enc) from packed codes [rows, cols / 2] and scales in
// the linear layout or (scales_swizzled) the 128x4 layout; y has `rows` logical rows
// of `cols` elements.
void launch_dequantize(const uint8_t* packed_codes, const uint8_t* scales, bool scales_swizzled,
                       EncodeScale scale, const TensorView& y, cudaStream_t stream);

}  // namespace vqad::kernels::nvfp4
