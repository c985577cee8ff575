// CUDA pieces of the NVFP4 W4A4 linear on GPUs without FP4 tensor cores (sm_90):
// per-tensor amax, the encode/decode scales, a fused quantize-dequantize producing
// the unit-scaled operand e2m1*S (exact in BF16), and a cuBLASLt BF16 GEMM whose
// alpha (the product of the two global decode scales) is read from device memory.
// The math follows spec/nvfp4.md bit for bit; ops/nvfp4_linear.cpp holds the CPU
// reference. Plain C++ interface, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace vqad::kernels::linear {

enum class ElemType { kF32, kBF16 };

// Whether this build holds the kernels for `device`'s architecture. On false, *why
// names the device, its arch and the archs that were built.
bool kernels_available(int device, std::string* why);

// *amax_out = max(*amax_out, max_i |bf16(x_i)|) over n contiguous elements; NaN
// elements are ignored. *amax_out must hold a value >= 0 before the call.
void launch_bf16_amax(const void* x, ElemType type, int64_t n, float* amax_out, cudaStream_t stream);

// Fills scales[0..3] = {s_enc_x, s_enc_w, alpha, 0}:
//   s_enc_x = amax_x ? 2688 / max(*amax_x, 1e-12) : act_s_enc
//   s_enc_w = 2688 / max(*amax_w, 1e-12)
//   alpha   = (1 / s_enc_x) * (1 / s_enc_w)
// scales[3] is the GEMM's beta.
void launch_linear_scales(const float* amax_x, float act_s_enc, const float* amax_w, float* scales,
                          cudaStream_t stream);

// out[r, c] (bf16) = e2m1(q) * S of x rounded to bf16, quantized per 16 along c with
// encode scale *s_enc; x row-major [rows, cols] contiguous, cols % 16 == 0.
void launch_unit_operand(const void* x, ElemType type, int64_t rows, int64_t cols, const float* s_enc,
                         void* out_bf16, cudaStream_t stream);

// d[M, N] (row-major bf16) = alpha * a[M, K] . b[N, K]^T + bias[N], accumulated in
// fp32, rounded once to bf16. a, b row-major bf16; bias bf16 or nullptr.
// alpha_beta points to two device floats {alpha, beta}; beta must be 0.
// The bias goes through cuBLASLt's bias epilogue when d's rows are 16-byte aligned
// (n % 8 == 0, d and bias 16-byte aligned). Otherwise cuBLASLt's BF16 kernels round
// alpha * acc to bf16 before adding the bias (a second rounding, up to two bf16 ulps
// off), so the GEMM writes an fp32 staging copy of d into the workspace and a small
// kernel adds the bias and rounds once. The workspace must hold
// gemm_workspace_bytes(m, n, bias, d) bytes (256-byte aligned).
void gemm_bf16_nt(const void* a, const void* b, const void* bias, void* d, int64_t m, int64_t n, int64_t k,
                  const float* alpha_beta, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// cuBLASLt's own workspace (the whole workspace when no staging copy is needed).
inline constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

// Workspace gemm_bf16_nt needs for these arguments: kGemmWorkspaceBytes, plus the fp32
// staging copy of d when the bias cannot use the epilogue.
size_t gemm_workspace_bytes(int64_t m, int64_t n, const void* bias, const void* d);

}  // namespace vqad::kernels::linear
