#include "vqad/kernels/common/cublaslt.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "vqad/kernels/common/cuda_check.h"

namespace vqad::kernels {

void cublaslt_check(cublasStatus_t st, const char* what, const char* op) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string("cuBLASLt error in ") + op + " (" + what + "): " +
                           cublasLtGetStatusString(st) + " (" + std::to_string(int(st)) + ")");
}

cublasLtHandle_t cublaslt_handle() {
  static std::mutex mu;
  static std::vector<cublasLtHandle_t> handles;
  int device = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (handles.size() <= size_t(device)) handles.resize(device + 1, nullptr);
  if (!handles[device]) VQAD_LT_CHECK("handle", cublasLtCreate(&handles[device]));
  return handles[device];
}

LtDescs::~LtDescs() {
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (op) cublasLtMatmulDescDestroy(op);
}

}  // namespace vqad::kernels
