#include "vqad/ops/nvfp4_fake_quant.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "vqad/core/error.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "vqad/kernels/nvfp4/nvfp4_kernels.h"
#endif

namespace vqad::ops {
namespace {

std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type() << " on " << t.device();
  return os.str();
}

void check_input(const torch::Tensor& x, const char* op) {
  VQAD_CHECK(x.defined(), op, ": the input tensor is undefined");
  VQAD_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, op,
             ": input ", describe(x), ": expected dtype Float or BFloat16");
  VQAD_CHECK(x.dim() >= 1 && x.size(-1) % nvfp4::kBlock == 0, op, ": input ", describe(x),
             ": the last dim must be a multiple of 16 (one scale per 16 elements)");
  VQAD_CHECK(x.device().is_cpu() || x.device().is_cuda(), op, ": input ", describe(x),
             ": unsupported device (NVFP4 runs on CPU or CUDA)");
#ifndef VQAD_WITH_TORCH_CUDA
  VQAD_CHECK(!x.device().is_cuda(), op, ": input ", describe(x),
             ": this vqad build has no LibTorch CUDA support (build on a GPU machine)");
#endif
}

void check_scale(ScaleMode mode, float s_enc, const char* op) {
  if (mode == ScaleMode::kStatic) {
    VQAD_CHECK(std::isfinite(s_enc) && s_enc > 0.0f, op, ": static mode needs a finite s_enc > 0 (2688 / calibrated amax), got ",
               s_enc);
  } else {
    VQAD_CHECK(s_enc == 1.0f, op, ": ", nvfp4::scale_mode_name(mode),
               " mode takes no s_enc (got ", s_enc, "); pass it only with static mode");
  }
}

// --- CPU: the scalar reference, parallel over blocks ----------------------------------

float cpu_amax(const torch::Tensor& xf) {
  const float* p = xf.data_ptr<float>();
  const int64_t n = xf.numel();
  constexpr int64_t kChunk = 1 << 16;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<float> part(static_cast<size_t>(nchunks), 0.0f);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kChunk, e = std::min(n, b + kChunk);
      part[c] = nvfp4::amax(p + b, static_cast<size_t>(e - b));
    }
  });
  return nvfp4::amax(part.data(), part.size());
}

float cpu_encode_scale(const torch::Tensor& xf, ScaleMode mode, float s_enc) {
  switch (mode) {
    case ScaleMode::kUnit: return 1.0f;
    case ScaleMode::kStatic: return s_enc;
    case ScaleMode::kDynamic: return nvfp4::encode_scale_from_amax(cpu_amax(xf));
  }
  return 1.0f;
}

torch::Tensor cpu_fake_quant(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();
  const float se = cpu_encode_scale(xf, mode, s_enc);
  torch::Tensor y = torch::empty_like(xf);
  const float* px = xf.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t nblocks = xf.numel() / nvfp4::kBlock;
  at::parallel_for(0, nblocks, 2048, [&](int64_t b0, int64_t b1) {
    nvfp4::fake_quantize(px + b0 * nvfp4::kBlock, py + b0 * nvfp4::kBlock,
                         static_cast<size_t>((b1 - b0) * nvfp4::kBlock), se);
  });
  // Float -> BFloat16 in torch rounds to nearest even: the one rounding the spec allows.
  return y.to(x.scalar_type());
}

// Outputs of nvfp4_quantize for x (packed codes, both scale layouts, s_enc), on x's device.
Nvfp4Quantized empty_quantized(const torch::Tensor& x, float se) {
  const int64_t K = x.size(-1), rows = x.numel() / std::max<int64_t>(K, 1), scale_cols = K / 16;
  auto codes_shape = x.sizes().vec(), scales_shape = x.sizes().vec();
  codes_shape.back() = K / 2;
  scales_shape.back() = scale_cols;
  Nvfp4Quantized q;
  const auto u8 = x.options().dtype(torch::kUInt8);
  q.packed_codes = torch::empty(codes_shape, u8);
  q.scales = torch::empty(scales_shape, u8);
  q.scales_swizzled = torch::empty({nvfp4::swizzled_scales_size(rows, scale_cols)}, u8);
  q.s_enc = torch::tensor(se, torch::TensorOptions().dtype(torch::kFloat));
  return q;
}

Nvfp4Quantized cpu_quantize(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();
  const float se = cpu_encode_scale(xf, mode, s_enc);
  const int64_t K = x.size(-1), rows = x.numel() / std::max<int64_t>(K, 1), scale_cols = K / 16;
  Nvfp4Quantized q = empty_quantized(x, se);
  const float* px = xf.data_ptr<float>();
  uint8_t* pc = q.packed_codes.data_ptr<uint8_t>();
  uint8_t* ps = q.scales.data_ptr<uint8_t>();
  at::parallel_for(0, rows * scale_cols, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const nvfp4::BlockQuant bq = nvfp4::quantize_block(px + b * 16, se);
      ps[b] = bq.scale_bits;
      nvfp4::pack_codes(bq.codes, 16, pc + b * 8);
    }
  });
  nvfp4::swizzle_scales(ps, rows, scale_cols, q.scales_swizzled.data_ptr<uint8_t>());
  return q;
}

// --- CUDA: kernels/nvfp4 ----------------------------------------------------------------
#ifdef VQAD_WITH_TORCH_CUDA
namespace kn = vqad::kernels::nvfp4;

// Views need a contiguous last dim and at most kMaxDims dims; anything else is
// copied into that form first (same numerics, only the memory layout changes).
torch::Tensor kernel_ready(const torch::Tensor& x) {
  torch::Tensor t = x;
  if (t.dim() > kn::kMaxDims) t = t.reshape({-1, t.size(-1)});
  if (t.stride(-1) != 1) t = t.contiguous();
  return t;
}

kn::TensorView view_of(const torch::Tensor& t) {
  kn::TensorView v;
  v.data = t.data_ptr();
  v.dtype = t.scalar_type() == torch::kBFloat16 ? kn::DType::kBF16 : kn::DType::kF32;
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.sizes[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

torch::Tensor cuda_amax(const torch::Tensor& xk, cudaStream_t stream) {
  torch::Tensor amax = torch::empty({}, xk.options().dtype(torch::kFloat));
  kn::launch_amax(view_of(xk), amax.data_ptr<float>(), stream);
  return amax;
}

torch::Tensor cuda_fake_quant(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const torch::Tensor xk = kernel_ready(x);
  torch::Tensor y = torch::empty(xk.sizes(), xk.options().memory_format(at::MemoryFormat::Contiguous));
  kn::EncodeScale sc;
  torch::Tensor amax;  // keeps the device amax alive until the kernel is queued
  if (mode == ScaleMode::kStatic) sc.value = s_enc;
  if (mode == ScaleMode::kDynamic) {
    amax = cuda_amax(xk, stream);
    sc.amax_device = amax.data_ptr<float>();
  }
  kn::launch_fake_quantize(view_of(xk), view_of(y), sc, stream);
  return y.view(x.sizes());
}

Nvfp4Quantized cuda_quantize(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const torch::Tensor xk = kernel_ready(x);
  float se = mode == ScaleMode::kStatic ? s_enc : 1.0f;
  if (mode == ScaleMode::kDynamic) {
    // Export and tools path: one sync to report s_enc on the host is fine here.
    se = nvfp4::encode_scale_from_amax(cuda_amax(xk, stream).item<float>());
  }
  Nvfp4Quantized q = empty_quantized(x, se);
  kn::QuantizeOutputs out;
  out.packed_codes = q.packed_codes.data_ptr<uint8_t>();
  out.scales_linear = q.scales.data_ptr<uint8_t>();
  out.scales_swizzled = q.scales_swizzled.data_ptr<uint8_t>();
  kn::EncodeScale sc;
  sc.value = se;
  kn::launch_quantize(view_of(xk), sc, out, stream);
  return q;
}
#endif

class Nvfp4FakeQuantFunction : public torch::autograd::Function<Nvfp4FakeQuantFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const torch::Tensor& x,
                               int64_t mode, double s_enc) {
    const auto m = static_cast<ScaleMode>(mode);
    const float se = static_cast<float>(s_enc);
#ifdef VQAD_WITH_TORCH_CUDA
    if (x.device().is_cuda()) return cuda_fake_quant(x, m, se);
#endif
    return cpu_fake_quant(x, m, se);
  }
  // Straight-through estimator: dFQ/dx = I.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grad_out) {
    return {grad_out[0], torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor nvfp4_fake_quant(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  check_input(x, "nvfp4_fake_quant");
  check_scale(mode, s_enc, "nvfp4_fake_quant");
  return Nvfp4FakeQuantFunction::apply(x, static_cast<int64_t>(mode), static_cast<double>(s_enc));
}

torch::Tensor nvfp4_amax(const torch::Tensor& x) {
  check_input(x, "nvfp4_amax");
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.device().is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    return cuda_amax(kernel_ready(x), at::cuda::getCurrentCUDAStream(x.device().index()).stream());
  }
#endif
  return torch::tensor(cpu_amax(x.detach().to(torch::kFloat).contiguous()),
                       torch::TensorOptions().dtype(torch::kFloat));
}

Nvfp4Quantized nvfp4_quantize(const torch::Tensor& x, ScaleMode mode, float s_enc) {
  check_input(x, "nvfp4_quantize");
  check_scale(mode, s_enc, "nvfp4_quantize");
  const torch::NoGradGuard no_grad;
#ifdef VQAD_WITH_TORCH_CUDA
  if (x.device().is_cuda()) return cuda_quantize(x, mode, s_enc);
#endif
  return cpu_quantize(x, mode, s_enc);
}

torch::Tensor nvfp4_dequantize(const Nvfp4Quantized& q, torch::ScalarType dtype) {
  VQAD_CHECK(q.packed_codes.defined() && q.scales.defined() && q.s_enc.defined(),
             "nvfp4_dequantize: incomplete quantized tensor (codes, scales and s_enc are required)");
  VQAD_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16,
             "nvfp4_dequantize: output dtype ", dtype, ": expected Float or BFloat16");
  VQAD_CHECK(q.packed_codes.scalar_type() == torch::kUInt8 && q.scales.scalar_type() == torch::kUInt8,
             "nvfp4_dequantize: codes and scales must be uint8, got codes ", describe(q.packed_codes),
             " and scales ", describe(q.scales));
  const int64_t K = q.packed_codes.size(-1) * 2;
  VQAD_CHECK(K % 16 == 0 && q.scales.size(-1) * 16 == K &&
                 q.scales.numel() * 16 == q.packed_codes.numel() * 2,
             "nvfp4_dequantize: codes ", describe(q.packed_codes), " and scales ",
             describe(q.scales), " do not describe the same [rows, K] tensor (K a multiple of 16)");
  const float s_enc = q.s_enc.to(torch::kCPU).item<float>();
  auto shape = q.packed_codes.sizes().vec();
  shape.back() = K;
#ifdef VQAD_WITH_TORCH_CUDA
  if (q.packed_codes.device().is_cuda()) {
    const c10::cuda::CUDAGuard guard(q.packed_codes.device());
    const torch::Tensor codes = q.packed_codes.contiguous(), scales = q.scales.to(codes.device()).contiguous();
    torch::Tensor y = torch::empty(shape, codes.options().dtype(dtype));
    kernels::nvfp4::EncodeScale sc;
    sc.value = s_enc;
    kernels::nvfp4::launch_dequantize(codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), false, sc,
                                      view_of(y.view({-1, K})),
                                      at::cuda::getCurrentCUDAStream(codes.device().index()).stream());
    return y;
  }
#endif
  VQAD_CHECK(q.packed_codes.device().is_cpu(), "nvfp4_dequantize: codes ", describe(q.packed_codes),
             ": unsupported device");
  const torch::Tensor codes = nvfp4_unpack_codes(q.packed_codes.contiguous()).contiguous();
  const torch::Tensor scales = q.scales.contiguous();
  torch::Tensor y = torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat));
  const int64_t rows = codes.numel() / K;
  nvfp4::dequantize_matrix(codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), rows, K, s_enc,
                           y.data_ptr<float>());
  return y.to(dtype);
}

torch::Tensor nvfp4_unpack_codes(const torch::Tensor& packed_codes) {
  VQAD_CHECK(packed_codes.defined() && packed_codes.scalar_type() == torch::kUInt8 &&
                 packed_codes.dim() >= 1,
             "nvfp4_unpack_codes: expected a uint8 tensor of packed codes");
  const torch::Tensor lo = torch::bitwise_and(packed_codes, 0xF);
  const torch::Tensor hi = torch::bitwise_right_shift(packed_codes, 4);
  return torch::stack({lo, hi}, -1).flatten(-2);
}

}  // namespace vqad::ops
