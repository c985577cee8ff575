// Blackwell (sm_100a / sm_120a) routes for the NVFP4 linears: a quantizer built on the
// hardware conversion cvt.rn.satfinite.e2m1x2.f32 and a cuBLASLt block-scaled FP4 GEMM
// (CUDA_R_4F_E2M1 operands, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 block scales in the
// 128x4 swizzled layout of spec/nvfp4.md). Compiled in their own CUDA target
// (vqad_kernels_fp4, archs VQAD_FP4_CUDA_ARCHS) so that the sm_90a kernels are not
// rebuilt for more architectures. Plain C++ interface, no torch.
//
// Numerics: the quantizer follows spec/nvfp4.md's block recipe (fp32, in the spec's order)
// with the E2M1 rounding done by the conversion instruction, which rounds to nearest even
// on the E2M1 grid and saturates at +-6 - the spec's e2m1_rne_satfinite; the codes and
// scale bytes must equal the CPU reference's (tests/gpu/test_fp4_blackwell.cpp). The GEMM
// accumulates the exact products e2m1 * S in the tensor cores' fp32 (its summation order
// is the library's), scales by alpha and rounds once to BF16.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace vqad::kernels::fp4 {

// Whether this build holds the FP4 routes for `device` (-1: the current one) and the
// device has FP4 tensor cores (compute capability 10.x or 12.x). On false, *why names the
// device, its capability and what is missing (e.g. "sm_90: no FP4 instructions").
bool fp4_routes_available(int device, std::string* why);

// Quantizes x [rows, cols] row-major contiguous (bf16 when x_is_bf16, else fp32 values as
// they are - the linears pass their bf16 operands), cols % 16 == 0, with the encode scale
// *s_enc (device float): codes [rows, cols / 2] (E2M1 codes, even element in the low nibble)
// and scales [rows, cols / 16] (E4M3 bytes, row-major). NaN blocks: scale 0x7F, codes 7|sign.
void launch_quantize_e2m1x2(const void* x, bool x_is_bf16, int64_t rows, int64_t cols, const float* s_enc,
                            uint8_t* codes, uint8_t* scales, cudaStream_t stream);

// scales [rows, scale_cols] row-major -> the 128x4 swizzled layout (rows padded to 128, scale
// columns to 4, pads zero); out holds swizzled_bytes(rows, scale_cols) bytes.
void launch_swizzle_scales(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out,
                           cudaStream_t stream);
int64_t swizzled_bytes(int64_t rows, int64_t scale_cols);

// d[M, N] (row-major) = alpha * a[M, K] . b[N, K]^T, a and b packed E2M1 codes ([M, K/2],
// [N, K/2]) with swizzled VEC16_UE4M3 scales of [M, K/16] and [N, K/16]; K % 32 == 0;
// alpha_beta = two device floats {alpha, 0}. workspace: kFp4GemmWorkspaceBytes. d is bf16
// (one rounding of alpha * acc) or, with Fp4GemmOut::kF32, fp32 alpha * acc (what the nvfp4
// linears' fp4 route takes, so that it adds the bias in the fake-quant route's order).
inline constexpr size_t kFp4GemmWorkspaceBytes = size_t{32} << 20;
enum class Fp4GemmOut { kBF16, kF32 };
void gemm_fp4_nt(const uint8_t* a, const uint8_t* a_scales_swizzled, const uint8_t* b,
                 const uint8_t* b_scales_swizzled, void* d, int64_t m, int64_t n, int64_t k,
                 const float* alpha_beta, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                 Fp4GemmOut out = Fp4GemmOut::kBF16);

}  // namespace vqad::kernels::fp4
