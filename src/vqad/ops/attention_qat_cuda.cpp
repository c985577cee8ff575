#include "vqad/ops/attention_qat_cuda.h"

#ifdef VQAD_WITH_TORCH_CUDA

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <exception>
#include <sstream>
#include <string>

#include "vqad/core/error.h"
#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/attention/attention_qat_bwd.h"
#include "vqad/ops/tensor_text.h"

namespace vqad::ops {
namespace {

namespace ka = vqad::kernels::attention;
namespace kb = vqad::kernels;

constexpr const char* kOp = "attention_qat (ATTN_QAT_TRAIN, CUDA)";

// The op's list (attention_qat_cuda_head_dim_supported) is the kernels' list.
constexpr bool head_dim_lists_agree() {
  for (int64_t d = 0; d <= 512; ++d)
    if (attention_qat_cuda_head_dim_supported(d) != ka::attn_qat_head_dim_supported(d)) return false;
  return true;
}
static_assert(head_dim_lists_agree(), "ops and kernels disagree on the supported head dims");

std::string device_str(const torch::Tensor& t) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
  std::ostringstream os;
  os << t.device() << " (" << prop->name << ", sm_" << prop->major << prop->minor << ")";
  return os.str();
}

// The forward kernel refuses anything but sm_90 and was validated only there; the
// backward would pick an untested mma.sync build elsewhere. Refusing up front keeps
// one clear message for both directions.
void check_device(const torch::Tensor& q, const std::string& shapes) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q.get_device());
  VQAD_CHECK(prop->major == 9 && prop->minor == 0, kOp, ": no kernel for device ", device_str(q),
             "; the ATTN_QAT_TRAIN kernels are for sm_90 (Hopper) only, shape ", shapes,
             "; there is no fallback to another attention path");
}

void check_supported(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const AttnQatOptions& opts) {
  const std::string shapes = describe_qkv(q, k, v);
  VQAD_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), kOp, ": expected CUDA tensors, found ",
             q.device(), ", ", k.device(), ", ", v.device(), " (", shapes, ")");
  VQAD_CHECK(q.device() == k.device() && q.device() == v.device(), kOp,
             ": q, k and v must be on one device, found ", q.device(), ", ", k.device(), ", ",
             v.device());
  VQAD_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                 q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
             kOp, ": expected q [B, Lq, H, D] and k, v [B, Lkv, H, D], found ", shapes);
  VQAD_CHECK(attention_qat_cuda_head_dim_supported(q.size(3)), kOp, ": the CUDA kernels need head_dim 64 or 128, found head_dim ",
             q.size(3), " (", shapes, ") on ",
             device_str(q), "; there is no fallback to another attention path");
  VQAD_CHECK(opts.block_n == ka::kAttnQatBlockN, kOp, ": block_n ", opts.block_n,
             " is not supported, the CUDA forward kernel quantizes P over KV tiles of ",
             ka::kAttnQatBlockN, " keys (set block_n = ", ka::kAttnQatBlockN, "), shape ", shapes);
  VQAD_CHECK(q.size(0) <= 65535 && q.size(2) <= 65535 && q.size(1) <= INT32_MAX &&
                 k.size(1) <= INT32_MAX,
             kOp, ": batch and heads must be <= 65535 and lengths < 2^31, found ", shapes);
  check_device(q, shapes);
}

// The kernels read rows of D contiguous BF16 values with 16-byte vector loads, so a
// view is used in place when its head dim is contiguous, its other strides are
// multiples of 8 elements and its start is 16-byte aligned; otherwise it is copied.
bool kernel_layout_ok(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 && t.stride(3) == 1 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 && t.stride(0) >= 0 && t.stride(1) >= 0 &&
         t.stride(2) >= 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

torch::Tensor as_kernel_operand(const torch::Tensor& t) {
  torch::Tensor r = t.scalar_type() == torch::kBFloat16 ? t : t.to(torch::kBFloat16);
  if (!kernel_layout_ok(r)) r = r.contiguous();
  if (!kernel_layout_ok(r)) r = r.clone(at::MemoryFormat::Contiguous);  // misaligned storage offset
  return r;
}

// BLHD views of the launch convention (kernels/common/launch.h).
kb::BlhdStrides blhd_strides(const torch::Tensor& t) {
  return kb::BlhdStrides{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}
kb::BlhdIn blhd_in(const torch::Tensor& t) { return kb::BlhdIn{t.data_ptr(), blhd_strides(t)}; }
kb::BlhdOut blhd_out(const torch::Tensor& t) { return kb::BlhdOut{t.data_ptr(), blhd_strides(t)}; }

// The launchers' checks throw vqad::Error (op, tensor, shape, device), passed on as is;
// a CUDA failure (std::runtime_error) becomes a vqad::Error that also names the
// torch-level device and shapes.
template <class Fn>
void run_launcher(const char* what, const std::string& context, Fn&& fn) {
  try {
    fn();
  } catch (const vqad::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(kOp, " ", what, " (", context, "): ", e.what());
  }
}

}  // namespace

AttnQatCudaForward attention_qat_cuda_forward(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const AttnQatOptions& opts,
                                              bool for_backward) {
  check_supported(q, k, v, opts);
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const std::string context = describe_qkv(q, k, v) + " on " + device_str(q);

  const torch::Tensor qb = as_kernel_operand(q);
  const torch::Tensor kb16 = as_kernel_operand(k);
  const torch::Tensor vb = as_kernel_operand(v);
  const int64_t B = q.size(0), Lq = q.size(1), Lkv = k.size(1), H = q.size(2), D = q.size(3);
  const auto bf16 = q.options().dtype(torch::kBFloat16);
  const auto f32 = q.options().dtype(torch::kFloat32);

  AttnQatCudaForward r;
  r.q_hat = torch::empty({B, Lq, H, D}, bf16);
  r.k_hat = torch::empty({B, Lkv, H, D}, bf16);
  r.v_hat = torch::empty({B, Lkv, H, D}, bf16);
  ka::FakeQuantQkvParams fq;
  fq.q = blhd_in(qb);
  fq.k = blhd_in(kb16);
  fq.v = blhd_in(vb);
  fq.q_out = r.q_hat.data_ptr();
  fq.k_out = r.k_hat.data_ptr();
  fq.v_out = r.v_hat.data_ptr();
  fq.batch = static_cast<int>(B);
  fq.heads = static_cast<int>(H);
  fq.len_q = static_cast<int>(Lq);
  fq.len_kv = static_cast<int>(Lkv);
  fq.head_dim = static_cast<int>(D);
  fq.quant_qk = opts.quant_qk;
  fq.quant_v = opts.quant_v;
  run_launcher("Q/K/V fake-quant pre-pass", context, [&] { ka::launch_fake_quant_qkv(fq, stream); });

  torch::Tensor o = torch::empty({B, Lq, H, D}, bf16);
  ka::AttnQatFwdParams fp;
  fp.q = blhd_in(r.q_hat);
  fp.k = blhd_in(r.k_hat);
  fp.v = blhd_in(r.v_hat);
  fp.o = blhd_out(o);
  if (for_backward) {
    // O_hp is written in every mode (with quant_p off it equals O) so the backward
    // always finds the tensor its delta pre-pass reads.
    r.o_hp = torch::empty({B, Lq, H, D}, bf16);
    r.m = torch::empty({B, H, Lq}, f32);
    r.l = torch::empty({B, H, Lq}, f32);
    fp.o_hp = blhd_out(r.o_hp);
    fp.m = r.m.data_ptr<float>();
    fp.l = r.l.data_ptr<float>();
  }  // else O alone: o_hp, m and l null (the kernel without the high-precision product)
  fp.batch = static_cast<int>(B);
  fp.heads = static_cast<int>(H);
  fp.len_q = static_cast<int>(Lq);
  fp.len_kv = static_cast<int>(Lkv);
  fp.head_dim = static_cast<int>(D);
  fp.softmax_scale = 0.0f;  // 1/sqrt(D), as the CPU reference
  fp.quant_p = opts.quant_p;
  // The key split of the grid's last wave (attention_qat.h) needs a workspace for the
  // split tiles' partial states; none when this shape and device split nothing.
  size_t fwd_ws_bytes = 0;
  run_launcher("forward", context, [&] { fwd_ws_bytes = ka::attn_qat_fwd_workspace_bytes(fp); });
  torch::Tensor fwd_ws;
  if (fwd_ws_bytes > 0) {
    fwd_ws = torch::empty({static_cast<int64_t>(fwd_ws_bytes)}, q.options().dtype(torch::kUInt8));
    fp.workspace = fwd_ws.data_ptr();
    fp.workspace_bytes = fwd_ws_bytes;
  }
  run_launcher("forward", context, [&] { ka::launch_attn_qat_fwd(fp, stream); });

  r.o = q.scalar_type() == torch::kBFloat16 ? o : o.to(q.scalar_type());
  if (!for_backward) r.q_hat = r.k_hat = r.v_hat = torch::Tensor();  // released with the call
  return r;
}

AttnQatCudaGrads attention_qat_cuda_backward(const torch::Tensor& d_o, const torch::Tensor& q_hat,
                                             const torch::Tensor& k_hat, const torch::Tensor& v_hat,
                                             const torch::Tensor& o_hp, const torch::Tensor& m,
                                             const torch::Tensor& l, const AttnQatOptions& opts,
                                             torch::ScalarType q_dtype, torch::ScalarType k_dtype,
                                             torch::ScalarType v_dtype) {
  const std::string shapes = describe_qkv(q_hat, k_hat, v_hat);
  VQAD_CHECK(d_o.defined() && d_o.sizes() == o_hp.sizes(), kOp, ": backward expected dO of shape ",
             shape_str(o_hp), ", found ", d_o.defined() ? shape_str(d_o) : std::string("undefined"));
  VQAD_CHECK(d_o.is_cuda() && d_o.device() == q_hat.device(), kOp, ": backward expected dO on ",
             q_hat.device(), ", found ", d_o.device());
  for (const torch::Tensor* t : {&q_hat, &k_hat, &v_hat, &o_hp}) {
    VQAD_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(), kOp,
               ": saved Q^/K^/V^/O_hp must be contiguous BF16 (", shapes, ")");
  }
  VQAD_CHECK(m.scalar_type() == torch::kFloat32 && l.scalar_type() == torch::kFloat32 &&
                 m.is_contiguous() && l.is_contiguous(),
             kOp, ": saved m and l must be contiguous FP32 [B, H, Lq] (", shapes, ")");
  check_supported(q_hat, k_hat, v_hat, opts);
  const c10::cuda::CUDAGuard guard(q_hat.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(q_hat.get_device()).stream();
  const std::string context = shapes + " on " + device_str(q_hat);

  const torch::Tensor dob = as_kernel_operand(d_o);
  const int64_t B = q_hat.size(0), Lq = q_hat.size(1), Lkv = k_hat.size(1), H = q_hat.size(2),
                D = q_hat.size(3);
  const auto bf16 = q_hat.options().dtype(torch::kBFloat16);
  torch::Tensor dq = torch::empty({B, Lq, H, D}, bf16);
  torch::Tensor dk = torch::empty({B, Lkv, H, D}, bf16);
  torch::Tensor dv = torch::empty({B, Lkv, H, D}, bf16);

  kb::AttnQatBwdParams p;
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(H);
  p.len_q = static_cast<int>(Lq);
  p.len_kv = static_cast<int>(Lkv);
  p.head_dim = static_cast<int>(D);
  p.softmax_scale = 0.0f;
  // With P unquantized the forward's O is plain attention, so dV takes P itself.
  p.p_mode = !opts.quant_p ? kb::AttnQatBwdPMode::kNone
             : opts.bwd_mode == AttnQatBwdMode::kFastVideo ? kb::AttnQatBwdPMode::kFastVideo
                                                           : kb::AttnQatBwdPMode::kConsistent;
  p.impl = kb::AttnQatBwdImpl::kAuto;
  p.q_hat = blhd_in(q_hat);
  p.k_hat = blhd_in(k_hat);
  p.v_hat = blhd_in(v_hat);
  p.d_out = blhd_in(dob);
  p.o_hp = blhd_in(o_hp);
  p.m = m.data_ptr<float>();
  p.l = l.data_ptr<float>();
  p.d_q = blhd_out(dq);
  p.d_k = blhd_out(dk);
  p.d_v = blhd_out(dv);
  // From the caching allocator, so the scratch is stream-ordered like every other
  // tensor of the step (blocks are at least 512-byte aligned).
  const int64_t ws_bytes = static_cast<int64_t>(kb::attn_qat_bwd_workspace_bytes(p));
  torch::Tensor workspace =
      torch::empty({ws_bytes > 0 ? ws_bytes : 16}, q_hat.options().dtype(torch::kUInt8));
  p.workspace = workspace.data_ptr();
  run_launcher("backward", context, [&] { kb::launch_attn_qat_bwd(p, stream); });

  AttnQatCudaGrads g;
  g.dq = q_dtype == torch::kBFloat16 ? dq : dq.to(q_dtype);
  g.dk = k_dtype == torch::kBFloat16 ? dk : dk.to(k_dtype);
  g.dv = v_dtype == torch::kBFloat16 ? dv : dv.to(v_dtype);
  return g;
}

}  // namespace vqad::ops

#endif  // VQAD_WITH_TORCH_CUDA
