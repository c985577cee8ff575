// Video sparse attention (VSA_TRAIN_C64 / _C128, VSA_QAT_TRAIN_C64 / _C128) as one torch
// autograd op (spec/attention.md "VSA"): q, k, v and the compression gate [B, L, H, D] in
// raster token order of a T x H x W grid -> out [B, L, H, D]. The CPU path runs the
// reference (numerics/vsa_ref.h); CUDA tensors go to the kernels (ops/vsa_attention_cuda.h)
// when this build has them. There is no fallback between the paths or to dense attention.
#pragma once
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>

#include "vqad/core/attention_backend.h"
#include "vqad/numerics/vsa_ref.h"
#include "vqad/ops/attention_qat.h"

namespace vqad::ops {

// Visited physical blocks per running-max tile, by cube shape: the CUDA kernels' choice
// (kernels/vsa/vsa_kernels.h vsa_tile_blocks: C128 runs on 128-key wgmma tiles of two
// visited blocks, C64 on one block per step); the CPU and CUDA paths both run with it,
// so CPU and GPU training compute the same function.
inline constexpr int kVsaTileBlocksC128 = 2;
inline constexpr int kVsaTileBlocksC64 = 1;
inline int vsa_tile_blocks(vsa_ref::CubeShape cube) {
  const int blocks_per_cube = (cube.volume() + vsa_ref::kPhysicalBlockTokens - 1) / vsa_ref::kPhysicalBlockTokens;
  return blocks_per_cube == 2 ? kVsaTileBlocksC128 : kVsaTileBlocksC64;
}

// What a VSA layer takes besides the backend (training.vsa.*).
struct VsaOptions {
  double sparsity = 0.0;  // fraction of KV cubes skipped, [0, 1) (training.vsa.sparsity default)
  vsa_ref::Selection selection = vsa_ref::Selection::kTopK;
  double top_p = 1.0;     // top-p threshold, (0, 1]
  bool quant_p = true;    // VSA_QAT_*: P fake-quantized per 16 keys
  bool quant_v = true;    // VSA_QAT_*: V fake-quantized
  AttnQatBwdMode bwd_mode = AttnQatBwdMode::kConsistent;
  // A CUDA call that records no graph runs the forward without the O_hp product and the
  // saved statistics (same output bits, less work); true runs the full forward anyway,
  // for same-run comparisons (bench step --qat-full-nograd-forward). Not a config key.
  bool full_forward_without_grad = false;
};

bool is_vsa_backend(AttentionBackend b);
// Cube shape of a VSA backend (C64 = 4x4x4, C128 = 4x4x8); vqad::Error for other backends.
vsa_ref::CubeShape vsa_cube_of(AttentionBackend b);
// True for VSA_QAT_TRAIN_* (NVFP4 fine stage), false for VSA_TRAIN_* (BF16).
bool vsa_quantized(AttentionBackend b);
// The reference options of a call (softmax scale 1/sqrt(D), tile_blocks = vsa_tile_blocks(cube)).
vsa_ref::Options vsa_ref_options(AttentionBackend b, const VsaOptions& o);
// "top-k" | "top-p"; vqad::Error naming `where` otherwise.
vsa_ref::Selection parse_vsa_selection(const std::string& s, const std::string& where);
const char* vsa_selection_name(vsa_ref::Selection s);

// Whether this build holds the CUDA path (the VSA kernels); without it CUDA tensors are
// refused with an error naming the device.
bool vsa_cuda_path_built();

// q, k, v [B, L, H, D] (BLHD, any strides, one device, floating dtypes), L = T * H * W of
// `grid` in raster (t, h, w) order; gate: same shape or undefined (zero gate). Returns o in
// q's dtype. Differentiable with respect to q, k, v and gate (straight-through through the
// quantizers; no gradient through the selection). `selection`, when given, receives the
// selected KV cubes per (batch, head, query cube) of this call.
torch::Tensor vsa_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& gate, std::array<int64_t, 3> grid,
                            AttentionBackend backend, const VsaOptions& opts,
                            vsa_ref::SelectionLists* selection = nullptr);

}  // namespace vqad::ops
