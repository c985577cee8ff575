// Attention-backend registry and role scopes (spec/attention.md "Backends and role scopes").
//
// A role (student, teacher, critic) builds its model inside an AttentionBackendScope; every
// self-attention layer reads current_attention_spec() once, at construction, and keeps it.
// So two models built in one process under different scopes keep their own backends, and
// nothing global changes when a model runs. Cross-attention is always dense.
#pragma once
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "vqad/core/attention_backend.h"
#include "vqad/ops/attention_qat.h"
#include "vqad/ops/vsa_attention.h"

namespace vqad::ops {

// What a self-attention layer captured at construction.
struct AttentionSpec {
  AttentionBackend backend = AttentionBackend::kFlashAttn;
  AttnQatOptions qat;  // used by ATTN_QAT_TRAIN only
  VsaOptions vsa;      // used by the VSA backends only
};

// What a VSA self-attention call needs besides q, k, v: the compression gate
// [B, L, H, D] (undefined = zero gate) and the token grid (T, H, W) after patchify.
struct VsaInputs {
  torch::Tensor gate;
  std::array<int64_t, 3> grid{0, 0, 0};
};

// Backend used when no scope is active: the fastest dense attention.
constexpr AttentionBackend kDefaultAttentionBackend = AttentionBackend::kFlashAttn;

// Thread-local; the innermost scope wins and the previous spec is restored on destruction.
class AttentionBackendScope {
 public:
  explicit AttentionBackendScope(AttentionBackend backend, const AttnQatOptions& qat = {});
  explicit AttentionBackendScope(const AttentionSpec& spec);
  ~AttentionBackendScope();
  AttentionBackendScope(const AttentionBackendScope&) = delete;
  AttentionBackendScope& operator=(const AttentionBackendScope&) = delete;

 private:
  AttentionSpec previous_;
  bool previous_active_;
};

AttentionSpec current_attention_spec();
bool attention_scope_active();

// Config-time validation: `where` names the config key (e.g. "models.student.attention_backend").
AttentionBackend parse_attention_backend_or_throw(std::string_view name, std::string_view where);

// q [B, Lq, H, D], k/v [B, Lkv, H, D] (BLHD). Returns [B, Lq, H, D] in q's dtype.
// Softmax scale 1/sqrt(D). Differentiable for every backend. The VSA backends need `vsa`
// (the grid; without it they fail naming the backend).
torch::Tensor self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionSpec& spec, const VsaInputs& vsa = {});
torch::Tensor self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             AttentionBackend backend);

// Dense attention (cross-attention, TORCH_SDPA, FLASH_ATTN). CPU: the reference math
// (fp32 scores and softmax); CUDA: LibTorch's scaled_dot_product_attention.
torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// The CPU reference math on any device (used by tests as ground truth).
torch::Tensor dense_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v);

}  // namespace vqad::ops
