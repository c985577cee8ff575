// Video sparse attention (VSA_TRAIN_*, VSA_QAT_TRAIN_*) CPU reference
// (spec/attention.md "VSA"). Torch-free, plain float arrays, fixed summation
// order: the definition that the CUDA kernels and the autograd op are compared with.
//
// Pipeline of one call (B batches, H heads, D head dim, a T x Hg x Wg token grid,
// L = T*Hg*Wg tokens in raster (t, h, w) order):
//   1. tiling: tokens reordered cube-major; each logical cube (C128 = 4x4x8,
//      C64 = 4x4x4, (t, h, w)) holds its valid tokens first, in (t, h, w) raster
//      order inside the cube, then padding slots up to whole 64-token physical
//      blocks. padded_len = num_cubes * blocks_per_cube * 64.
//   2. coarse stage (not quantized): per cube mean of q, k, v over its valid tokens
//      (fp32 sum in slot order / count, rounded to bf16); scores = q_c . k_c^T * scale
//      (fp32, sum over d in order); probs = softmax(scores) (fp32);
//      out_c = bf16(probs . v_c) per cube, broadcast to every token of the cube.
//   3. selection per (b, h, query cube), no gradient: effective_topk cubes by score
//      (top-k) or by cumulative probability (top-p); ties: lower cube index first.
//      Lists are stored in ascending cube index.
//   4. fine stage: each query cube attends over the valid tokens of its selected KV
//      cubes, visited in ascending cube index, physical block by physical block
//      (empty blocks skipped). Exactly ATTN_QAT_TRAIN (attention_qat_ref.h) over that
//      key sequence when quantized, with the running max and the 16-key P
//      quantization groups restarted at each tile of `tile_blocks` visited physical
//      blocks (a tile's keys: the valid keys of its blocks, in order; a partial group
//      is quantized over its valid keys only); plain BF16 flash attention otherwise.
//   5. out = bf16(out_c * gate + out_fine) per token and channel (gate [B, L, H, D];
//      a null gate is a zero gate).
// Backward: straight-through as ATTN_QAT_TRAIN for the fine stage (both BwdModes),
// ordinary gradients through the coarse path and the gate; none through selection.
#pragma once
#include <cstdint>
#include <vector>

#include "vqad/numerics/attention_qat_ref.h"

namespace vqad::vsa_ref {

inline constexpr int kPhysicalBlockTokens = 64;

struct CubeShape {
  int t = 4, h = 4, w = 8;
  int volume() const { return t * h * w; }
};
inline constexpr CubeShape kCubeC128{4, 4, 8};
inline constexpr CubeShape kCubeC64{4, 4, 4};

struct Tiling {
  int64_t grid_t = 0, grid_h = 0, grid_w = 0;
  CubeShape cube;
  int64_t cubes_t = 0, cubes_h = 0, cubes_w = 0, num_cubes = 0;
  int64_t blocks_per_cube = 0;  // ceil(cube.volume() / 64)
  int64_t padded_len = 0;       // num_cubes * blocks_per_cube * 64
  std::vector<int32_t> cube_tokens;    // [num_cubes] valid tokens per cube
  std::vector<int32_t> block_tokens;   // [num_cubes * blocks_per_cube] valid tokens per physical block
  std::vector<int64_t> slot_to_token;  // [padded_len] raster token index, -1 for padding
  std::vector<int64_t> token_to_slot;  // [grid_t * grid_h * grid_w]
  int64_t num_tokens() const { return grid_t * grid_h * grid_w; }
};
// Throws vqad::Error on a non-positive grid dimension.
Tiling make_tiling(int64_t grid_t, int64_t grid_h, int64_t grid_w, CubeShape cube);

// max(1, min(ceil((1 - sparsity) * num_cubes), num_cubes)); sparsity in [0, 1).
int64_t effective_topk(double sparsity, int64_t num_cubes);

enum class Selection { kTopK, kTopP };

struct Options {
  CubeShape cube = kCubeC128;
  double sparsity = 0.9;
  Selection selection = Selection::kTopK;
  double top_p = 1.0;     // top-p: cumulative probability to reach (1.0 -> effective_topk cubes)
  bool quantize = true;   // VSA_QAT_TRAIN_*: NVFP4 fine stage; false: VSA_TRAIN_* (BF16)
  bool quant_p = true;    // when quantize: P fake-quantized per 16 keys
  bool quant_v = true;    // when quantize: V fake-quantized
  attn_qat_ref::BwdMode bwd_mode = attn_qat_ref::BwdMode::kConsistent;
  int tile_blocks = 1;    // visited physical blocks per running-max tile (the kernel's choice)
  float softmax_scale = 0.0f;  // 0 -> 1/sqrt(D)
  int num_threads = 0;         // 0 -> all hardware threads
};

struct Dims {
  int64_t batch = 0, heads = 0, head_dim = 0;  // head_dim: multiple of 16
};

// Selected KV cubes per (b, h, query cube), ascending cube index.
struct SelectionLists {
  int64_t batch = 0, heads = 0, num_q_cubes = 0, max_kv = 0;
  std::vector<int32_t> index;  // [B, H, num_q_cubes, max_kv]; entries at and past count are -1
  std::vector<int32_t> count;  // [B, H, num_q_cubes]
  const int32_t* row(int64_t b, int64_t h, int64_t qc) const {
    return index.data() + ((b * heads + h) * num_q_cubes + qc) * max_kv;
  }
};

// Coarse stage outputs, [B, H, num_cubes, D] / [B, H, num_cubes, num_cubes], contiguous.
struct Coarse {
  std::vector<float> q_c, k_c, v_c;  // bf16-valued cube means
  std::vector<float> scores;         // fp32 q_c . k_c * scale
  std::vector<float> probs;          // fp32 softmax over kv cubes
  std::vector<float> out_c;          // bf16-valued probs . v_c
};

// What the backward needs from the forward.
struct Saved {
  Coarse coarse;
  SelectionLists selection;
  std::vector<float> o_fine_hp;  // [B, L, H, D] raster order: fine output on the unquantized-P path
  std::vector<float> m, l;       // [B, H, L] raster order: fine-stage row statistics (log2 domain)
};

// --- stages (exposed so that each kernel is checked on its own) ---------------------
// Views are BLHD in raster token order (attention_qat_ref.h), L = tiling.num_tokens().
Coarse coarse_forward(const Dims& dims, const Tiling& tiling, attn_qat_ref::ConstView q,
                      attn_qat_ref::ConstView k, attn_qat_ref::ConstView v, const Options& opts);
SelectionLists select_cubes(const Dims& dims, const Tiling& tiling, const Coarse& coarse,
                            const Options& opts);
// Fine stage over given lists; o / o_hp [B, L, H, D]; m, l [B, H, L] (either may be null).
void fine_forward(const Dims& dims, const Tiling& tiling, attn_qat_ref::ConstView q,
                  attn_qat_ref::ConstView k, attn_qat_ref::ConstView v, const SelectionLists& sel,
                  const Options& opts, attn_qat_ref::View o, attn_qat_ref::View o_hp, float* m,
                  float* l);
void fine_backward(const Dims& dims, const Tiling& tiling, attn_qat_ref::ConstView q,
                   attn_qat_ref::ConstView k, attn_qat_ref::ConstView v,
                   attn_qat_ref::ConstView o_hp, attn_qat_ref::ConstView d_o, const float* m,
                   const float* l, const SelectionLists& sel, const Options& opts,
                   attn_qat_ref::View dq, attn_qat_ref::View dk, attn_qat_ref::View dv);

// --- whole op -----------------------------------------------------------------------------
// gate.data may be null (zero gate). saved may be null.
void forward(const Dims& dims, const Tiling& tiling, attn_qat_ref::ConstView q,
             attn_qat_ref::ConstView k, attn_qat_ref::ConstView v, attn_qat_ref::ConstView gate,
             const Options& opts, attn_qat_ref::View o, Saved* saved);
// dgate.data may be null (not wanted); with a null gate it is written as the gradient of a zero gate.
void backward(const Dims& dims, const Tiling& tiling, attn_qat_ref::ConstView q,
              attn_qat_ref::ConstView k, attn_qat_ref::ConstView v, attn_qat_ref::ConstView gate,
              const Saved& saved, attn_qat_ref::ConstView d_o, const Options& opts,
              attn_qat_ref::View dq, attn_qat_ref::View dk, attn_qat_ref::View dv,
              attn_qat_ref::View dgate);

}  // namespace vqad::vsa_ref
