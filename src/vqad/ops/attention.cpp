#include "vqad/ops/attention.h"

#include <cmath>
#include <sstream>

#include "vqad/core/error.h"

namespace vqad::ops {
namespace {

thread_local AttentionSpec t_current_spec{};
thread_local bool t_scope_active = false;

std::string describe(const torch::Tensor& q, const torch::Tensor& k) {
  std::ostringstream os;
  os << "q " << q.sizes() << " " << q.dtype() << ", k/v " << k.sizes() << ", device "
     << q.device();
  return os.str();
}

void check_blhd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const char* who) {
  VQAD_CHECK(q.defined() && k.defined() && v.defined(), who, ": q, k and v must be defined");
  VQAD_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who,
             ": expected BLHD tensors [B, L, H, D], found q ", q.sizes(), ", k ", k.sizes(),
             ", v ", v.sizes());
  VQAD_CHECK(k.sizes() == v.sizes(), who, ": k and v must have the same shape, found k ",
             k.sizes(), ", v ", v.sizes());
  VQAD_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), who,
             ": q and k/v must agree in batch, heads and head_dim, found q ", q.sizes(), ", k ",
             k.sizes());
  VQAD_CHECK(q.device() == k.device() && q.device() == v.device(), who,
             ": q, k, v must be on one device, found ", q.device(), ", ", k.device(), ", ",
             v.device());
  VQAD_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who,
             ": q, k, v must share a dtype, found ", q.dtype(), ", ", k.dtype(), ", ", v.dtype());
}

}  // namespace

AttentionBackendScope::AttentionBackendScope(AttentionBackend backend, const AttnQatOptions& qat)
    : AttentionBackendScope(AttentionSpec{backend, qat, {}}) {}

AttentionBackendScope::AttentionBackendScope(const AttentionSpec& spec)
    : previous_(t_current_spec), previous_active_(t_scope_active) {
  t_current_spec = spec;
  t_scope_active = true;
}

AttentionBackendScope::~AttentionBackendScope() {
  t_current_spec = previous_;
  t_scope_active = previous_active_;
}

AttentionSpec current_attention_spec() {
  if (t_scope_active) return t_current_spec;
  return AttentionSpec{kDefaultAttentionBackend, {}, {}};
}

bool attention_scope_active() { return t_scope_active; }

AttentionBackend parse_attention_backend_or_throw(std::string_view name, std::string_view where) {
  auto b = parse_attention_backend(name);
  if (!b)
    fail(where, ": unknown attention backend '", name, "'; valid names: ",
         attention_backend_choices());
  return *b;
}

torch::Tensor dense_attention_reference(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v) {
  check_blhd(q, k, v, "dense attention");
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  // [B, H, L, D] views; fp32 scores and softmax whatever the input dtype.
  auto qf = q.transpose(1, 2).to(torch::kFloat32);
  auto kf = k.transpose(1, 2).to(torch::kFloat32);
  auto vf = v.transpose(1, 2).to(torch::kFloat32);
  auto scores = torch::matmul(qf, kf.transpose(-2, -1)) * scale;
  auto probs = torch::softmax(scores, -1);
  auto out = torch::matmul(probs, vf);
  return out.transpose(1, 2).to(q.scalar_type());
}

torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  check_blhd(q, k, v, "dense attention");
  if (q.device().is_cpu() || q.device().is_meta()) return dense_attention_reference(q, k, v);
  if (q.device().is_cuda()) {
    // SDPA picks flash / cuDNN / memory-efficient kernels for BHLD; the transposes are views.
    auto o = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2));
    return o.transpose(1, 2);
  }
  fail("dense attention: no implementation for device ", q.device(), " (", describe(q, k), ")");
}

torch::Tensor self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionSpec& spec, const VsaInputs& vsa) {
  check_blhd(q, k, v, attention_backend_name(spec.backend));
  switch (spec.backend) {
    case AttentionBackend::kTorchSdpa:
    case AttentionBackend::kFlashAttn:
      return dense_attention(q, k, v);
    case AttentionBackend::kAttnQatTrain:
      return attention_qat(q, k, v, spec.qat);
    case AttentionBackend::kVsaTrain:
    case AttentionBackend::kVsaTrainC128:
    case AttentionBackend::kVsaQatTrainC64:
    case AttentionBackend::kVsaQatTrainC128:
      return vsa_attention(q, k, v, vsa.gate, vsa.grid, spec.backend, spec.vsa);
  }
  fail("attention backend ", attention_backend_name(spec.backend), ": unknown backend (", describe(q, k), ")");
}

torch::Tensor self_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             AttentionBackend backend) {
  return self_attention(q, k, v, AttentionSpec{backend, {}, {}});
}

}  // namespace vqad::ops
