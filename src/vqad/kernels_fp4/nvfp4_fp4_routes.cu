#include "vqad/kernels_fp4/nvfp4_fp4_routes.h"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include "vqad/kernels/common/cublaslt.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/common/launch.h"
#include "vqad/kernels/common/nvfp4_math.h"

namespace vqad::kernels::fp4 {
namespace {

constexpr int kThreads = 256;
constexpr const char* kGemmWhat = "nvfp4 block-scaled FP4 GEMM";
#define LT_CHECK_GEMM(expr) VQAD_LT_CHECK(kGemmWhat, expr)

using nvfp4_device::e4m3_byte;
using nvfp4_device::e4m3_value;

// Two E2M1 codes in one byte: lo in bits 0..3, hi in bits 4..7 (the instruction puts its
// first source operand in the upper half).
__device__ __forceinline__ uint8_t cvt_e2m1x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000)
  uint16_t out;
  asm("{\n"
      ".reg .b8 t;\n"
      "cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n"
      "cvt.u16.u8 %0, t;\n"
      "}"
      : "=h"(out)
      : "f"(hi), "f"(lo));
  return static_cast<uint8_t>(out);
#else
  __trap();  // never built for an architecture without the instruction (VQAD_FP4_CUDA_ARCHS)
  return 0;
#endif
}

template <typename T>
__device__ __forceinline__ float load_value(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load_value<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <>
__device__ __forceinline__ float load_value<float>(const float* p, int64_t i) {
  return p[i];
}

// One thread per 16-element block (spec/nvfp4.md "Quantize one block", fp32 in that order).
template <typename T>
__global__ void quantize_e2m1x2_kernel(const T* x, int64_t blocks, const float* s_enc_ptr, uint8_t* codes,
                                       uint8_t* scales) {
  const float s_enc = *s_enc_ptr;
  const float s_dec = __fdiv_rn(1.0f, s_enc);
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks; b += int64_t(gridDim.x) * blockDim.x) {
    float v[16];
    float amax = 0.0f;
    bool nan = false;
    for (int i = 0; i < 16; ++i) {
      v[i] = load_value<T>(x, b * 16 + i);
      nan = nan || isnan(v[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    uint8_t* c = codes + b * 8;
    if (nan) {
      scales[b] = 0x7F;
      for (int i = 0; i < 8; ++i) {
        const uint8_t lo = 7 | (signbit(v[2 * i]) ? 8 : 0), hi = 7 | (signbit(v[2 * i + 1]) ? 8 : 0);
        c[i] = static_cast<uint8_t>(lo | (hi << 4));
      }
      continue;
    }
    const uint8_t sb = e4m3_byte(__fmul_rn(__fdiv_rn(amax, 6.0f), s_enc));
    scales[b] = sb;
    const float S = e4m3_value(sb);
    if (S == 0.0f) {
      for (int i = 0; i < 8; ++i) c[i] = 0;
      continue;
    }
    const float inv = __fdiv_rn(1.0f, __fmul_rn(S, s_dec));
    for (int i = 0; i < 8; ++i) {
      // |x| * inv carries the sign of x (the spec's sign bit, -0 included); the conversion
      // rounds to nearest even on the E2M1 grid and saturates at 6 (inf included).
      const float lo = copysignf(__fmul_rn(fabsf(v[2 * i]), inv), v[2 * i]);
      const float hi = copysignf(__fmul_rn(fabsf(v[2 * i + 1]), inv), v[2 * i + 1]);
      c[i] = cvt_e2m1x2(lo, hi);
    }
  }
}

__global__ void swizzle_kernel(const uint8_t* scales, int64_t rows, int64_t cols, int64_t col_tiles, uint8_t* out,
                               int64_t total) {
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total; o += int64_t(gridDim.x) * blockDim.x) {
    // Inverse of offset = tile*512 + (m%32)*16 + ((m%128)/32)*4 + k%4, tile = (m/128)*col_tiles + k/4.
    const int64_t tile = o / 512, r = o % 512;
    const int64_t m = (tile / col_tiles) * 128 + ((r % 16) / 4) * 32 + r / 16;
    const int64_t k = (tile % col_tiles) * 4 + r % 4;
    out[o] = (m < rows && k < cols) ? scales[m * cols + k] : 0;
  }
}

int grid_for(int64_t n) { return int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

}  // namespace

bool fp4_routes_available(int device, std::string* why) {
  if (device_count() == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  const DeviceInfo info = device_info(device);
  if (info.sm_major != 10 && info.sm_major != 12) {
    if (why)
      *why = "device " + std::to_string(info.index) + " (" + info.name + ") is sm_" + std::to_string(info.arch()) +
             ": no FP4 tensor cores or cvt.e2m1x2 (the FP4 routes need sm_100 or sm_120; the sm_90 path is the "
             "BF16 GEMM on dequantized operands)";
    return false;
  }
  return kernel_family_available("NVFP4 FP4 routes (sm_100a / sm_120a)",
                                 reinterpret_cast<const void*>(quantize_e2m1x2_kernel<__nv_bfloat16>), info.index,
                                 why);
}

void launch_quantize_e2m1x2(const void* x, bool x_is_bf16, int64_t rows, int64_t cols, const float* s_enc,
                            uint8_t* codes, uint8_t* scales, cudaStream_t stream) {
  VQAD_LAUNCH_CHECK(cols % 16 == 0, "nvfp4 FP4 quantize", "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols),
                    "expected cols a multiple of 16, found ", cols);
  const int64_t blocks = rows * cols / 16;
  if (blocks == 0) return;
  if (x_is_bf16) {
    quantize_e2m1x2_kernel<__nv_bfloat16><<<grid_for(blocks), kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), blocks, s_enc, codes, scales);
  } else {
    quantize_e2m1x2_kernel<float><<<grid_for(blocks), kThreads, 0, stream>>>(static_cast<const float*>(x), blocks,
                                                                               s_enc, codes, scales);
  }
  VQAD_CUDA_CHECK_LAUNCH("nvfp4 FP4 quantize: quantize_e2m1x2_kernel");
}

int64_t swizzled_bytes(int64_t rows, int64_t scale_cols) {
  return (rows + 127) / 128 * 128 * ((scale_cols + 3) / 4 * 4);
}

void launch_swizzle_scales(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out,
                           cudaStream_t stream) {
  const int64_t total = swizzled_bytes(rows, scale_cols);
  if (total == 0) return;
  swizzle_kernel<<<grid_for(total), kThreads, 0, stream>>>(scales, rows, scale_cols, (scale_cols + 3) / 4, out, total);
  VQAD_CUDA_CHECK_LAUNCH("nvfp4 FP4: swizzle_kernel");
}

void gemm_fp4_nt(const uint8_t* a, const uint8_t* a_sf, const uint8_t* b, const uint8_t* b_sf, void* d, int64_t m,
                 int64_t n, int64_t k, const float* alpha_beta, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, Fp4GemmOut out) {
  constexpr const char* kOp = "nvfp4 FP4 GEMM";
  const auto shape = [&] { return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k); };
  VQAD_LAUNCH_CHECK(k % 32 == 0 && m > 0 && n > 0, kOp, shape(), "unsupported shape: expected M, N > 0 and K a "
                    "multiple of 32");
  VQAD_LAUNCH_CHECK(workspace_bytes >= kFp4GemmWorkspaceBytes, kOp, shape(), "expected a workspace of ",
                    kFp4GemmWorkspaceBytes, " bytes, found ", workspace_bytes);
  cublasLtHandle_t handle = cublaslt_handle();
  LtDescs desc;
  LT_CHECK_GEMM(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Row-major d[M, N] = a[M, K] . b[N, K]^T is column-major d^T = b . a^T: "A" = b (T), "B" = a (N).
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const cublasLtPointerMode_t pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode,
                                                   sizeof(pointer_mode)));
  const cublasLtMatmulMatrixScale_t vec16 = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec16, sizeof(vec16)));
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec16, sizeof(vec16)));
  const void* sa = b_sf;
  const void* sb = a_sf;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_4F_E2M1, uint64_t(k), uint64_t(n), k));
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_4F_E2M1, uint64_t(k), uint64_t(m), k));
  const cudaDataType_t d_type = out == Fp4GemmOut::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.d, d_type, uint64_t(n), uint64_t(m), n));
  LT_CHECK_GEMM(cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t ws = kFp4GemmWorkspaceBytes;
  LT_CHECK_GEMM(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                         sizeof(ws)));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  LT_CHECK_GEMM(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                                   &heuristic, &found));
  VQAD_LAUNCH_CHECK(found != 0, kOp, shape(), "expected a cuBLASLt block-scaled FP4 algorithm for ",
                    out == Fp4GemmOut::kF32 ? "fp32" : "bf16", " output, found none");
  LT_CHECK_GEMM(cublasLtMatmul(handle, desc.op, alpha_beta, b, desc.a, a, desc.b, alpha_beta + 1, d, desc.d, d,
                                   desc.d, &heuristic.algo, workspace, ws, stream));
}

}  // namespace vqad::kernels::fp4
