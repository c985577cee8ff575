// Launch interface of the VSA CUDA kernels (spec/attention.md "VSA"; the numerics are
// numerics/vsa_ref.h's). Plain C++ (no torch): raw device pointers and a stream.
//
// Layouts:
//   raster  BF16 [B, L, H, D] (BLHD) views (BlhdIn / BlhdOut of kernels/common/launch.h):
//           element strides, d contiguous, rows 16-byte aligned;
//   tiled   BF16 [B, H, padded_len, D] contiguous; slot s of (b, h) holds the token
//           slot_to_token[s] (cube-major, vsa_ref.h "tiling"); padding slots hold zeros;
//   coarse  FP32 [B, H, num_cubes, D] (bf16-valued means and out_c), [B, H, nc, nc] scores/probs;
//   lists   INT32 [B, H, nc, max_kv] ascending KV cube indices (-1 past the count) + [B, H, nc] counts.
//
// Kernels (all deterministic: no floating-point atomics, fixed summation orders):
//   tiling gather (+ NVFP4 fake quant of Q / K / V, bit-exact with fake_quant_qkv) with
//   the coarse pooling in the same pass, the coarse forward (scores + softmax + out_c +
//   top-k / top-p selection) in one kernel, the fine-stage forward over the lists
//   (vsa_fine_forward_kernel below; empty blocks skipped, partial ones masked), the gated
//   combine; backward: the dO pass (tiling, d out_c, row statistics, dgate), the coarse
//   backward, the inverse (KV cube -> query cubes) lists, the fine-stage backward (dK/dV
//   per KV block over the query cubes that selected it, dQ per query block over its list;
//   C128 on the ATTN_QAT_TRAIN wgmma backward with visit lists, one CTA per cube, writing
//   the raster rows with the coarse terms added; C64 on mma.sync, then a scatter back to
//   raster order).
// Errors (shapes, strides, alignment, devices) throw vqad::Error naming the stage, the
// tensor, the shape and the device with its arch (the launch convention of
// kernels/common/launch.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "vqad/kernels/common/launch.h"

namespace vqad::kernels::vsa {

// Tokens per physical block: BLOCK_N of the mma.sync fine kernels and half the KV tile
// of the wgmma forward.
inline constexpr int kVsaBlockTokens = 64;

// Fine-stage forward kernel by cube shape (blocks_per_cube), chosen by the launcher:
//   kWgmmaPairs (C128, 2 blocks per cube): the ATTN_QAT_TRAIN wgmma forward of
//     kernels/attention/sm90 with its visit-list KV source (attn_qat_fwd_visit.h): one
//     CTA of 128 query rows = one query cube (its two physical blocks share one list),
//     KV tiles of 128 keys = two consecutive visited blocks (a last odd one leaves the
//     other half masked), the dense kernel's skewed two-warpgroup schedule.
//   kMmaSyncBlocks (C64, 1 block per cube): vsa_fine.cu's mma.sync forward, 64 query
//     rows per CTA, one visited block per step (a 128-row CTA would span two query
//     cubes with different lists).
enum class VsaFineForward { kWgmmaPairs, kMmaSyncBlocks };
constexpr VsaFineForward vsa_fine_forward_kernel(int blocks_per_cube) {
  return blocks_per_cube == 2 ? VsaFineForward::kWgmmaPairs : VsaFineForward::kMmaSyncBlocks;
}
// Visited physical blocks per running-max tile of that forward (vsa_ref Options::tile_blocks):
// the running max, the 16-key P quantization groups and the row sums restart per tile, so
// the CPU reference must run with this value for the cube shape.
inline constexpr int kVsaTileBlocksC128 = 2;
inline constexpr int kVsaTileBlocksC64 = 1;
constexpr int vsa_tile_blocks(int blocks_per_cube) {
  return vsa_fine_forward_kernel(blocks_per_cube) == VsaFineForward::kWgmmaPairs ? kVsaTileBlocksC128
                                                                                   : kVsaTileBlocksC64;
}
// The only head dimension the kernels support.
inline constexpr int kVsaHeadDim = 128;

// Device copies of one vsa_ref::Tiling (int32).
struct TilingDev {
  int len = 0;              // L = T * H * W raster tokens
  int num_cubes = 0;
  int blocks_per_cube = 0;  // ceil(cube volume / 64)
  int padded_len = 0;       // num_cubes * blocks_per_cube * 64
  int max_cube_tokens = 0;  // largest cube_tokens entry (for messages and checks)
  const int32_t* slot_to_token = nullptr;  // [padded_len], -1 for padding
  const int32_t* token_to_slot = nullptr;  // [len]
  const int32_t* cube_tokens = nullptr;    // [num_cubes]
  const int32_t* block_tokens = nullptr;   // [num_cubes * blocks_per_cube]
};

struct VsaConfig {
  int batch = 0, heads = 0, head_dim = kVsaHeadDim;
  int grid_t = 0, grid_h = 0, grid_w = 0;  // for messages
  TilingDev tiling;
  int topk = 1;            // effective_topk; also max_kv of the lists
  bool top_p_mode = false;  // false: top-k
  float top_p = 1.0f;
  bool quantize = true;     // VSA_QAT_*: Q, K (and V when quant_v) fake-quantized, P per quant_p
  bool quant_p = true;
  bool quant_v = true;
  bool bwd_fastvideo = false;  // BwdMode::kFastVideo (else consistent)
  float softmax_scale = 0.0f;  // 0 -> 1/sqrt(D)
};

// Forward: inputs, the output, what the backward needs (caller-owned; lives until the
// backward) and the scratch workspace (vsa_forward_workspace_bytes, 256-byte aligned).
// A forward that no backward follows passes o_fine_hp, m and l null (all three): the fine
// stage then runs without the O_hp product and writes neither statistic; o is the same
// bits. Its workspace is vsa_forward_workspace_bytes(c, /*saves=*/false).
struct VsaForwardArgs {
  BlhdIn q, k, v;  // BF16 [B, L, H, D]
  BlhdIn gate;     // gate.data == nullptr: zero gate
  BlhdOut o;       // BF16 [B, L, H, D]
  // saved
  void* tiled_q = nullptr;    // BF16 [B, H, P, D]: fine-stage operands (quantized for QAT)
  void* tiled_k = nullptr;
  void* tiled_v = nullptr;
  void* o_fine_hp = nullptr;  // BF16 [B, H, P, D]: fine output on the unquantized-P path (or null, see above)
  float* m = nullptr;         // [B, H, P] (log2 domain; padding rows unspecified; or null)
  float* l = nullptr;         // [B, H, P] (or null)
  int32_t* sel_index = nullptr;  // [B, H, nc, topk]
  int32_t* sel_count = nullptr;  // [B, H, nc]
  float* q_c = nullptr;  // [B, H, nc, D]
  float* k_c = nullptr;
  float* v_c = nullptr;
  float* probs = nullptr;  // [B, H, nc, nc]
  float* out_c = nullptr;  // [B, H, nc, D]
  void* workspace = nullptr;
};
size_t vsa_forward_workspace_bytes(const VsaConfig& c, bool saves = true);
void vsa_forward(const VsaConfig& c, const VsaForwardArgs& a, cudaStream_t stream);

struct VsaBackwardArgs {
  BlhdIn gate;  // as in the forward (data == nullptr: zero gate)
  BlhdIn d_o;   // BF16 [B, L, H, D]
  // saved by the forward
  const void* tiled_q = nullptr;
  const void* tiled_k = nullptr;
  const void* tiled_v = nullptr;
  const void* o_fine_hp = nullptr;
  const float* m = nullptr;
  const float* l = nullptr;
  const int32_t* sel_index = nullptr;
  const int32_t* sel_count = nullptr;
  const float* q_c = nullptr;
  const float* k_c = nullptr;
  const float* v_c = nullptr;
  const float* probs = nullptr;
  const float* out_c = nullptr;
  // outputs BF16 [B, L, H, D]; dgate.data may be null (not wanted)
  BlhdOut dq, dk, dv, dgate;
  void* workspace = nullptr;  // vsa_backward_workspace_bytes, 256-byte aligned
};
size_t vsa_backward_workspace_bytes(const VsaConfig& c);
void vsa_backward(const VsaConfig& c, const VsaBackwardArgs& a, cudaStream_t stream);

// --- single stages (used by the pipeline above; exposed for tests and benches) ---------

// Tiled BF16 copy of a raster tensor, padding slots zero; NVFP4 fake quantization with
// unit scale per 16 channels when `quantize` (bit-exact with launch_fake_quant_qkv).
void launch_tile(const VsaConfig& c, BlhdIn src, void* dst_tiled, bool quantize, cudaStream_t stream);

// Fine-stage forward over the lists: o (quantized-P path) and o_hp (BF16-P path; equal to
// o without P quantization, when o_hp_tiled may be o_tiled: written once) tiled BF16, m
// and l [B, H, P]; o_hp, m and l all null: o alone (no O_hp product); scratch holds
// fine_forward_scratch_bytes(c) (256-byte aligned; the C128 visit lists). Rows of empty
// query blocks are not written.
size_t fine_forward_scratch_bytes(const VsaConfig& c);
void launch_fine_forward(const VsaConfig& c, const void* tiled_q, const void* tiled_k,
                         const void* tiled_v, const int32_t* sel_index, const int32_t* sel_count,
                         void* o_tiled, void* o_hp_tiled, float* m, float* l, void* scratch,
                         cudaStream_t stream);

}  // namespace vqad::kernels::vsa
