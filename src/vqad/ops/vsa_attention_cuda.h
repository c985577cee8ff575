// CUDA path of the VSA op (spec/attention.md "VSA"): the whole forward and backward
// of vsa_ref (numerics/vsa_ref.h) on device tensors, through the kernels in
// kernels/vsa/. Called by the autograd op in ops/vsa_attention.cpp for CUDA tensors;
// compiled only when the CUDA kernels are built (VQAD_WITH_CUDA).
#pragma once
#include <torch/torch.h>

#include "vqad/numerics/vsa_ref.h"

namespace vqad::ops::vsa_cuda {

// What the backward needs; every tensor lives on the inputs' device and only for one
// call pair (no step-lifetime cache).
struct Saved {
  torch::Tensor tiled_q, tiled_k, tiled_v;  // fine-stage operands, tiled [B, H, padded_len, D] (quantized for QAT)
  torch::Tensor o_fine_hp;                  // tiled [B, H, padded_len, D]
  torch::Tensor m, l;                       // FP32 [B, H, padded_len]
  torch::Tensor sel_index, sel_count;       // INT32 [B, H, nq, max_kv], [B, H, nq]
  torch::Tensor q_c, k_c, v_c, probs, out_c;  // coarse stage, [B, H, nc, D] / [B, H, nc, nc]
};

// q, k, v: CUDA BF16 [B, L, H, D] (BLHD, any strides with d contiguous), L = tiling.num_tokens();
// gate: same shape or undefined (zero gate). Returns o BF16 [B, L, H, D]. Throws vqad::Error
// naming the shape and device on anything the kernels do not support.
// for_backward = false (a call that records no graph): the fine stage runs without the
// O_hp product and saved->o_fine_hp, m and l stay undefined (the other stage buffers,
// the selection among them, are filled); o is the same bits.
torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& gate, const vsa_ref::Tiling& tiling,
                      const vsa_ref::Options& opts, Saved* saved, bool for_backward = true);

struct Grads {
  torch::Tensor dq, dk, dv, dgate;  // BF16 [B, L, H, D]; dgate undefined when gate was undefined
};
Grads backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
               const torch::Tensor& gate, const Saved& saved, const torch::Tensor& d_o,
               const vsa_ref::Tiling& tiling, const vsa_ref::Options& opts);

// The selected KV cubes of a forward (for `vqad op attention` and tests).
vsa_ref::SelectionLists selection_to_host(const Saved& saved);

}  // namespace vqad::ops::vsa_cuda
