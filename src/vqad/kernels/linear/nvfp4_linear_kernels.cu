#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "vqad/kernels/common/cublaslt.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/common/launch.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/kernels/linear/nvfp4_linear_kernels.h"

namespace vqad::kernels::linear {
namespace {

constexpr const char* kGemmWhat = "nvfp4 linear BF16 GEMM";
#define LT_CHECK_GEMM(expr) VQAD_LT_CHECK(kGemmWhat, expr)
constexpr int kThreads = 256;

__device__ __forceinline__ float to_bf16_value(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float to_bf16_value(__nv_bfloat16 v) { return __bfloat162float(v); }

// Loads 8 consecutive elements (16-byte aligned for bf16, 32-byte for fp32) as the
// fp32 values of their bf16 rounding.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]);

template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = to_bf16_value(a.x), v[1] = to_bf16_value(a.y), v[2] = to_bf16_value(a.z), v[3] = to_bf16_value(a.w);
  v[4] = to_bf16_value(b.x), v[5] = to_bf16_value(b.y), v[6] = to_bf16_value(b.z), v[7] = to_bf16_value(b.w);
}

// Non-negative floats order like their bit patterns, so an integer atomicMax is a
// float max (fmaxf drops NaN before we get here).
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <typename T>
__global__ void bf16_amax_kernel(const T* __restrict__ x, int64_t n, bool vectorized, float* amax_out) {
  float m = 0.0f;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t scalar_from = 0;
  if (vectorized) {
    const int64_t groups = n / 8;
    for (int64_t g = tid; g < groups; g += stride) {
      float v[8];
      load8<T>(x + g * 8, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
    }
    scalar_from = groups * 8;
  }
  for (int64_t i = scalar_from + tid; i < n; i += stride) m = fmaxf(m, fabsf(to_bf16_value(x[i])));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (threadIdx.x == 0) atomic_max_nonneg(amax_out, m);
  }
}

// nvfp4::encode_scale_from_amax (reciprocal, then multiply by 2688) of max(amax, 1e-12):
// the comparison takes a NaN amax to the floor (this op's contract), where the scalar
// form alone would propagate it; for every other amax the floor is the scalar form's own.
__device__ __forceinline__ float encode_scale_from_amax(float amax) {
  return nvfp4::encode_scale_from_amax(amax > 1e-12f ? amax : 1e-12f);
}

__global__ void linear_scales_kernel(const float* amax_x, float act_s_enc, const float* amax_w, float* scales) {
  const float sx = amax_x ? encode_scale_from_amax(*amax_x) : act_s_enc;
  const float sw = encode_scale_from_amax(*amax_w);
  scales[0] = sx;
  scales[1] = sw;
  scales[2] = __fmul_rn(__fdiv_rn(1.0f, sx), __fdiv_rn(1.0f, sw));
  scales[3] = 0.0f;
}

// E2M1 magnitude of a >= 0 after round-to-nearest-even (ties to the even code),
// saturating at 6; NaN gives 6 (its block is NaN anyway): the scalar form, equal to the
// reference's comparison chain on every non-negative float (tests/cpu/test_nvfp4.cpp on
// the host, tests/gpu/test_nvfp4_device_forms_cuda.cu on the device).
using nvfp4::e2m1_round_magnitude;
using nvfp4_device::e4m3_rn_satfinite;

// Two adjacent lanes share one 16-element block, 8 elements each, so a warp reads
// 512 contiguous bytes (bf16) per step. Every pair is either fully in range or fully
// out of range because the number of half-blocks is even and the stride is a
// multiple of the warp size; all lanes stay in the loop for the shuffles.
template <typename T>
__global__ void unit_operand_kernel(const T* __restrict__ x, int64_t half_blocks, const float* s_enc_ptr,
                                    __nv_bfloat16* __restrict__ out) {
  const float s_enc = *s_enc_ptr;
  const float s_dec = __fdiv_rn(1.0f, s_enc);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t loop_end = (half_blocks + 31) / 32 * 32;
  for (int64_t h = first; h < loop_end; h += stride) {
    const bool valid = h < half_blocks;
    float v[8];
    if (valid) {
      load8<T>(x + h * 8, v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    }
    float amax_b = 0.0f;
    bool has_nan = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      amax_b = fmaxf(amax_b, fabsf(v[i]));
      has_nan = has_nan || isnan(v[i]);
    }
    amax_b = fmaxf(amax_b, __shfl_xor_sync(0xffffffffu, amax_b, 1));
    has_nan = __shfl_xor_sync(0xffffffffu, int(has_nan), 1) != 0 || has_nan;

    const float S = e4m3_rn_satfinite(__fmul_rn(__fdiv_rn(amax_b, 6.0f), s_enc));
    float y[8];
    if (has_nan) {
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = __int_as_float(0x7fc00000);
    } else if (S == 0.0f) {
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = 0.0f;
    } else {
      const float inv = __fdiv_rn(1.0f, __fmul_rn(S, s_dec));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // e2m1 * S has at most 6 significant bits: exact in fp32 and in bf16.
        y[i] = copysignf(e2m1_round_magnitude(__fmul_rn(fabsf(v[i]), inv)) * S, v[i]);
      }
    }
    if (valid) {
      uint4 packed;
      __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
      *reinterpret_cast<uint4*>(out + h * 8) = packed;
    }
  }
}

// d[r, c] = bf16(d32[r, c] + bias[c]): the bias epilogue for the staged (fp32) GEMM
// output, in the order of the CPU reference (alpha * acc in fp32, + bias in fp32, one
// rounding to bf16). Threads run along the columns, CTAs' y over the rows.
__global__ void bias_add_bf16_kernel(const float* __restrict__ d32, const __nv_bfloat16* __restrict__ bias,
                                     int64_t m, int64_t n, __nv_bfloat16* __restrict__ d) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const float b = __bfloat162float(bias[c]);
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) {
    d[r * n + c] = __float2bfloat16_rn(__fadd_rn(d32[r * n + c], b));
  }
}

int grid_for(int64_t work_items) {
  const int64_t blocks = (work_items + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(blocks, 8192)));
}

void check_aligned(const char* op, const std::string& shape, const void* p, size_t bytes, const char* what) {
  VQAD_LAUNCH_CHECK(reinterpret_cast<uintptr_t>(p) % bytes == 0, op, shape, what, ": expected a ", bytes,
                    "-byte aligned address, found ", p);
}

std::string matrix_str(int64_t rows, int64_t cols) {
  return "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols);
}
std::string gemm_str(int64_t m, int64_t n, int64_t k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

}  // namespace

bool kernels_available(int device, std::string* why) {
  return kernel_family_available("NVFP4 linear", reinterpret_cast<const void*>(unit_operand_kernel<__nv_bfloat16>), device,
                                 why);
}

void launch_bf16_amax(const void* x, ElemType type, int64_t n, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  if (type == ElemType::kBF16) {
    const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    bf16_amax_kernel<__nv_bfloat16><<<grid_for(vec ? n / 8 + 1 : n), kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), n, vec, amax_out);
  } else {
    const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    bf16_amax_kernel<float><<<grid_for(vec ? n / 8 + 1 : n), kThreads, 0, stream>>>(static_cast<const float*>(x),
                                                                                      n, vec, amax_out);
  }
  VQAD_CUDA_CHECK_LAUNCH("nvfp4 linear: bf16_amax_kernel");
}

void launch_linear_scales(const float* amax_x, float act_s_enc, const float* amax_w, float* scales,
                          cudaStream_t stream) {
  linear_scales_kernel<<<1, 1, 0, stream>>>(amax_x, act_s_enc, amax_w, scales);
  VQAD_CUDA_CHECK_LAUNCH("nvfp4 linear: linear_scales_kernel");
}

void launch_unit_operand(const void* x, ElemType type, int64_t rows, int64_t cols, const float* s_enc,
                         void* out_bf16, cudaStream_t stream) {
  constexpr const char* kOp = "nvfp4 linear unit operand";
  VQAD_LAUNCH_CHECK(cols % 16 == 0, kOp, matrix_str(rows, cols), "expected cols a multiple of 16, found ", cols);
  const int64_t half_blocks = rows * cols / 8;
  if (half_blocks == 0) return;
  check_aligned(kOp, matrix_str(rows, cols), x, 16, "operand input");
  check_aligned(kOp, matrix_str(rows, cols), out_bf16, 16, "operand output");
  const int grid = grid_for(half_blocks);
  if (type == ElemType::kBF16) {
    unit_operand_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), half_blocks, s_enc, static_cast<__nv_bfloat16*>(out_bf16));
  } else {
    unit_operand_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), half_blocks, s_enc,
                                                              static_cast<__nv_bfloat16*>(out_bf16));
  }
  VQAD_CUDA_CHECK_LAUNCH("nvfp4 linear: unit_operand_kernel");
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether cuBLASLt's bias epilogue rounds only once for this output: measured on sm_90
// (cuBLASLt 13.1), its kernels for BF16 outputs whose rows are not 16-byte aligned
// (N = 77, 83, 301), or for a bias pointer that is not, add the bias to alpha * acc
// already rounded to bf16; the aligned ones (N = 8, 24, 80, 88, 128, 1536) round
// alpha * acc + bias once.
bool bias_epilogue_rounds_once(int64_t n, const void* bias, const void* d) {
  return n % 8 == 0 && aligned16(bias) && aligned16(d);
}

size_t staging_bytes(int64_t m, int64_t n) { return (size_t(m) * size_t(n) * sizeof(float) + 255) / 256 * 256; }
}  // namespace

size_t gemm_workspace_bytes(int64_t m, int64_t n, const void* bias, const void* d) {
  const bool stage = bias != nullptr && !bias_epilogue_rounds_once(n, bias, d);
  return kGemmWorkspaceBytes + (stage ? staging_bytes(m, n) : 0);
}

void gemm_bf16_nt(const void* a, const void* b, const void* bias, void* d, int64_t m, int64_t n, int64_t k,
                  const float* alpha_beta, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const bool stage = bias != nullptr && !bias_epilogue_rounds_once(n, bias, d);
  const size_t need = gemm_workspace_bytes(m, n, bias, d);
  constexpr const char* kOp = "nvfp4 linear GEMM";
  VQAD_LAUNCH_CHECK(workspace_bytes >= need, kOp, gemm_str(m, n, k), "expected a workspace of ", need,
                    " bytes (gemm_workspace_bytes), found ", workspace_bytes);
  void* d_gemm = d;
  size_t lt_workspace_bytes = workspace_bytes;
  if (stage) {
    check_aligned(kOp, gemm_str(m, n, k), workspace, 256, "GEMM workspace");
    d_gemm = static_cast<char*>(workspace) + kGemmWorkspaceBytes;
    lt_workspace_bytes = kGemmWorkspaceBytes;
  }
  // Row-major d[M,N] is column-major d^T[N,M] = b[N,K] . a[M,K]^T; in cuBLASLt terms
  // A := b (column-major K x N, transposed), B := a (column-major K x M). The bias
  // epilogue adds a vector of length rows(D) = N, i.e. bias[n] along d's columns.
  cublasLtHandle_t handle = cublaslt_handle();
  LtDescs desc;
  LT_CHECK_GEMM(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const cublasLtPointerMode_t pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
  LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode,
                                               sizeof(pointer_mode)));
  if (bias && !stage) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    LT_CHECK_GEMM(
        cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    const cudaDataType_t bias_type = CUDA_R_16BF;
    LT_CHECK_GEMM(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                 sizeof(bias_type)));
  }
  const cudaDataType_t d_type = stage ? CUDA_R_32F : CUDA_R_16BF;
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_16BF, uint64_t(k), uint64_t(n), k));
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_16BF, uint64_t(k), uint64_t(m), k));
  LT_CHECK_GEMM(cublasLtMatrixLayoutCreate(&desc.d, d_type, uint64_t(n), uint64_t(m), n));
  LT_CHECK_GEMM(cublasLtMatmulPreferenceCreate(&desc.pref));
  LT_CHECK_GEMM(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &lt_workspace_bytes, sizeof(lt_workspace_bytes)));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  LT_CHECK_GEMM(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                               &heuristic, &found));
  VQAD_LAUNCH_CHECK(found != 0, kOp, gemm_str(m, n, k), "expected a cuBLASLt BF16 GEMM algorithm, found none");
  LT_CHECK_GEMM(cublasLtMatmul(handle, desc.op, alpha_beta, b, desc.a, a, desc.b, alpha_beta + 1, d_gemm, desc.d,
                               d_gemm, desc.d, &heuristic.algo, workspace, lt_workspace_bytes, stream));
  if (stage) {
    const dim3 grid(unsigned((n + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(m, 4096)));
    bias_add_bf16_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(d_gemm),
                                                        static_cast<const __nv_bfloat16*>(bias), m, n,
                                                        static_cast<__nv_bfloat16*>(d));
    VQAD_CUDA_CHECK_LAUNCH("nvfp4 linear: bias_add_bf16_kernel");
  }
}

}  // namespace vqad::kernels::linear
