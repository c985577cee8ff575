// cuBLASLt helpers shared by the GEMMs of kernels/linear (BF16) and kernels_fp4 (block-scaled
// FP4): the status check, one handle per device, and the descriptors of one call. Plain C++,
// no torch.
#pragma once
#include <cublasLt.h>

namespace vqad::kernels {

// Throws std::runtime_error "cuBLASLt error in <op> (<what>): <status name> (<status>)" unless
// st is CUBLAS_STATUS_SUCCESS; `what` names the GEMM ("nvfp4 linear BF16 GEMM", ...).
void cublaslt_check(cublasStatus_t st, const char* what, const char* op);
#define VQAD_LT_CHECK(what, expr) ::vqad::kernels::cublaslt_check((expr), (what), #expr)

// The cuBLASLt handle of the current device (created on first use, kept for the process).
cublasLtHandle_t cublaslt_handle();

// Owns the cuBLASLt descriptors of one matmul call (D = op(A) . op(B), preference).
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtDescs() = default;
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;
  ~LtDescs();
};

}  // namespace vqad::kernels
