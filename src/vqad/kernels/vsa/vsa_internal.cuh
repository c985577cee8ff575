// Internal launchers of the VSA kernels, shared by vsa_fine.cu (fine stage) and
// vsa_pipeline.cu (tiling, coarse stage, selection, combine, orchestration).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/launch.h"
#include "vqad/kernels/vsa/vsa_kernels.h"

namespace vqad::kernels::vsa::detail {

// "B=.. H=.. grid TxHxW L=.. cubes=.. P=.. topk=.." for error messages.
std::string shape_str(const VsaConfig& c);

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device: a
// one-line error naming the op, the stage and the shape when its static plus dynamic
// shared memory exceeds what a block may opt in to; otherwise the attribute is set (on
// every call: the default 48 KiB covers static plus dynamic memory, so a dynamic size
// just under it can still need the opt-in).
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes, const char* op, const char* stage, const VsaConfig& c) {
  int device = 0, optin = 0;
  VQAD_CUDA_CHECK(cudaGetDevice(&device));
  VQAD_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  VQAD_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t limit = static_cast<size_t>(optin) > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  VQAD_LAUNCH_CHECK(bytes <= limit, op, shape_str(c), stage, ": expected at most ", limit,
                    " bytes of dynamic shared memory per block (the device's ", optin, " less ", attr.sharedSizeBytes,
                    " static), found ", bytes, " bytes for ", c.tiling.num_cubes, " cubes");
  VQAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// dK, dV (fine parts, tiled BF16) per KV block over the query cubes of the inverse lists
// inv_index [B, H, nc, nc] / inv_count [B, H, nc].
void launch_fine_dkdv(const VsaConfig& c, const void* tiled_q, const void* tiled_k,
                      const void* tiled_v, const void* d_o_tiled, const void* stats,
                      const int32_t* inv_index, const int32_t* inv_count, void* dk_tiled,
                      void* dv_tiled, cudaStream_t stream);
// dQ (fine part, tiled BF16) per query block over its selected KV cubes.
void launch_fine_dq(const VsaConfig& c, const void* tiled_q, const void* tiled_k,
                    const void* tiled_v, const void* d_o_tiled, const void* stats,
                    const int32_t* sel_index, const int32_t* sel_count, void* dq_tiled,
                    cudaStream_t stream);

// C128 (vsa_fine_forward_kernel == kWgmmaPairs): dQ, dK, dV in one launch of the
// ATTN_QAT_TRAIN wgmma backward over visit lists (attn_bwd
// launch_wgmma_visit_kernels): dK/dV per KV cube over the query blocks of the inverse
// lists, dQ per query cube over the forward's visited blocks; scratch holds
// fine_backward_scratch_bytes(c).
// The results go to the raster outputs directly (the untiling fused into the kernel's
// epilogue): dX = bf16(bf16(dX_fine) + dX_c[cube]) for X = q, k, v, dX_c the coarse
// gradients already divided by the cube's count (null: zero gate, no coarse term).
struct FineBwdRaster {
  BlhdOut dq, dk, dv;
  const float* dq_c = nullptr;
  const float* dk_c = nullptr;
  const float* dv_c = nullptr;
};
size_t fine_backward_scratch_bytes(const VsaConfig& c);
void launch_fine_bwd_wgmma(const VsaConfig& c, const void* tiled_q, const void* tiled_k, const void* tiled_v,
                           const void* d_o_tiled, const void* stats, const int32_t* sel_index,
                           const int32_t* sel_count, const int32_t* inv_index, const int32_t* inv_count,
                           const FineBwdRaster& out, void* scratch, cudaStream_t stream);

}  // namespace vqad::kernels::vsa::detail
