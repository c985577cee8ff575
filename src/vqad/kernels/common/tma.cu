#include "vqad/kernels/common/tma.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>

namespace vqad::kernels {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link).
PFN_cuTensorMapEncodeTiled_v12000 encode_fn(std::string* why) {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || ptr == nullptr) {
      cudaGetLastError();
      error = std::string("the driver has no cuTensorMapEncodeTiled (") + cudaGetErrorString(err) + ")";
    } else {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  if (fn == nullptr) *why = error;
  return fn;
}

}  // namespace

std::string make_blhd_tensor_map(CUtensorMap* map, const void* data, const BlhdStrides& stride, int batch, int len,
                                 int heads, int head_dim, int box_rows) {
  std::string why;
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn(&why);
  if (encode == nullptr) return why;
  if (head_dim % 64 != 0) return "expected a head dim that is a multiple of 64, found " + std::to_string(head_dim);
  if (stride.d != 1) return "expected head-dim stride 1, found " + std::to_string(stride.d);
  // TMA needs byte strides that are positive multiples of 16 (check_blhd already asks for
  // multiples of 8 elements); a size-1 dimension may take any positive stride.
  const auto pos = [](int64_t s, int n) { return static_cast<cuuint64_t>(s > 0 ? s : (n == 1 ? 8 : 0)); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(len),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {pos(stride.l, len) * 2, pos(stride.h, heads) * 2, pos(stride.b, batch) * 2};
  for (int i = 0; i < 3; ++i)
    if (strides[i] == 0 || strides[i] % 16 != 0 || strides[i] >= (1ull << 40))
      return "expected (l, h, b) strides that are positive multiples of 8 elements below 2^39, found (" +
             std::to_string(stride.l) + ", " + std::to_string(stride.h) + ", " + std::to_string(stride.b) + ")";
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t estride[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(data), dims, strides, box,
                            estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return "cuTensorMapEncodeTiled refused the view (CUresult " + std::to_string(static_cast<int>(r)) + ")";
  return {};
}

std::string make_f32x4_rows_tensor_map(CUtensorMap* map, const void* data, int rows, int slices, int box_rows) {
  std::string why;
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn(&why);
  if (encode == nullptr) return why;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0 || rows < 1 || slices < 1)
    return "expected a 16-byte aligned [slices][rows][4] fp32 array, found " + std::to_string(slices) + " x " +
           std::to_string(rows) + " rows at " + std::to_string(reinterpret_cast<uintptr_t>(data));
  const cuuint64_t dims[3] = {4, static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(slices)};
  const cuuint64_t strides[2] = {16, static_cast<cuuint64_t>(rows) * 16};
  const cuuint32_t box[3] = {4, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t estride[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<void*>(data), dims, strides, box,
                            estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return "cuTensorMapEncodeTiled refused the rows (CUresult " + std::to_string(static_cast<int>(r)) + ")";
  return {};
}

}  // namespace vqad::kernels
