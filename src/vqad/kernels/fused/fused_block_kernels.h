// Fused CUDA kernels for the per-block fp32 elementwise work of the Wan DiT
// (ops/fused_block.h holds the torch ops and their composite CPU reference):
//
//   modulated layer norm  out = T((layer_norm(f32(x)) * (1 + scale) + shift))
//   gated residual        out = T(f32(x) + f32(a) * gate)
//   RMSNorm (+ RoPE)      out = T(rope(f32(T(f32(T(f32(x) * r)) * f32(T(w))))))
//                         r = rsqrt(mean(f32(x)^2) + eps), rope optional
//
// T is the activation dtype (bf16 or fp32); every product and sum is rounded to fp32
// where the composite rounds it (no FMA contraction across those points) and to T
// where the composite casts. Activations are row-major contiguous [batch, len, cols];
// per-batch vectors (scale, shift, gate) are fp32 [batch or 1, cols] with contiguous
// cols. Column sums over rows (dscale, dshift, dgate, dweight) are deterministic: each
// CTA reduces a fixed chunk of rows into a partial, then one kernel adds the partials in
// a fixed order. The chunking depends only on the shape. Plain C++ interface, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace vqad::kernels::fused {

enum class ElemType { kF32, kBF16 };

// x [batch, len, cols] (rows = batch * len).
struct RowShape {
  int64_t batch = 0, len = 0, cols = 0;
};

// fp32 [batch or 1, cols], cols contiguous; batch_stride 0 broadcasts one row.
struct BatchVector {
  const float* data = nullptr;
  int64_t batch_stride = 0;
};

// Whether this build holds the kernels for `device`'s architecture. On false, *why names
// the device, its arch and the fix.
bool kernels_available(int device, std::string* why);

// Whether the row kernels take rows of `cols` elements; on false *why says the limit.
// Inputs and outputs must be 16-byte aligned (the ops copy misaligned views).
// `paired` (RoPE) additionally needs an even cols.
bool supports_cols(int64_t cols, bool paired, std::string* why);

// Row chunks per batch of the column reductions, and the fp32 workspace they need
// (one [batch, chunks, cols] partial per reduced vector).
int64_t reduction_chunks(const RowShape& s);
size_t partials_floats(const RowShape& s);

// ---- modulated layer norm --------------------------------------------------------------
// out = T(((x - mean) * rstd) * (1 + scale) + shift), biased variance, rstd =
// rsqrt(var + eps). Writes mean and rstd per row (fp32 [rows]) for the backward.
void launch_modulated_layer_norm_fwd(const void* x, ElemType type, const RowShape& s, BatchVector scale,
                                     BatchVector shift, float eps, void* out, float* mean, float* rstd,
                                     cudaStream_t stream);

// From grad (T, like x): dx = T(layer_norm_backward(grad * (1 + scale))),
// dscale[b, c] = sum_l grad * n, dshift[b, c] = sum_l grad (fp32 [batch, cols]).
// dx, dscale, dshift may be null (not computed). workspace: 2 * partials_floats(s).
void launch_modulated_layer_norm_bwd(const void* grad, const void* x, ElemType type, const RowShape& s,
                                     BatchVector scale, const float* mean, const float* rstd, void* dx,
                                     float* dscale, float* dshift, float* workspace, cudaStream_t stream);

// ---- gated residual ----------------------------------------------------------------------
// out = T(x + a * gate) (x, a, out of one type T).
void launch_gated_residual_fwd(const void* x, const void* a, ElemType type, const RowShape& s, BatchVector gate,
                               void* out, cudaStream_t stream);

// da = T(grad * gate), dgate[b, c] = sum_l grad * a (fp32 [batch, cols]); da or dgate may
// be null. workspace: partials_floats(s). (dx is grad itself.)
void launch_gated_residual_bwd(const void* grad, const void* a, ElemType type, const RowShape& s, BatchVector gate,
                               void* da, float* dgate, float* workspace, cudaStream_t stream);

// ---- RMSNorm (+ RoPE) ---------------------------------------------------------------------
// weight: fp32 [cols] (rounded to T inside, like the composite's cast). rope: cos, sin
// fp32 [len, head_dim / 2] contiguous, pairs (2i, 2i+1) of each head_dim-wide head
// rotated by table column i; cos == nullptr: no rotation. Writes rstd per row.
struct RopeTables {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t head_dim = 0;
};
void launch_rms_norm_fwd(const void* x, ElemType type, const RowShape& s, const float* weight, float eps,
                         RopeTables rope, void* out, float* rstd, cudaStream_t stream);

// dx = T(rms_backward(T(T(rope^T(grad)) * T(w)))), dweight[c] = T(sum over all rows of
// T(T(rope^T(grad)) * T(x * r))) as fp32 [cols] (the composite's per-element products and
// the sum are rounded to T). dx or dweight may be null. workspace: partials_floats(s).
void launch_rms_norm_bwd(const void* grad, const void* x, ElemType type, const RowShape& s, const float* weight,
                         RopeTables rope, const float* rstd, void* dx, float* dweight, float* workspace,
                         cudaStream_t stream);

}  // namespace vqad::kernels::fused
