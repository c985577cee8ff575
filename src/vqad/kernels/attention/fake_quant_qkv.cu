// Q/K/V pre-pass of ATTN_QAT_TRAIN: NVFP4 fake quantization with unit scale, one
// 16-channel block of one token per thread, bit-exact with nvfp4::quantize_block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "vqad/kernels/attention/attention_qat.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/nvfp4_math.h"

namespace vqad::kernels::attention {
namespace {

using nvfp4_device::e2m1_rne_magnitude;
using nvfp4_device::e4m3_rn_satfinite;

struct Bf16x16 {
  uint4 lo, hi;
};

__device__ __forceinline__ void unpack(const Bf16x16& in, float* x) {
  const __nv_bfloat162* p0 = reinterpret_cast<const __nv_bfloat162*>(&in.lo);
  const __nv_bfloat162* p1 = reinterpret_cast<const __nv_bfloat162*>(&in.hi);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(p0[i]);
    const float2 b = __bfloat1622float2(p1[i]);
    x[2 * i] = a.x;
    x[2 * i + 1] = a.y;
    x[8 + 2 * i] = b.x;
    x[8 + 2 * i + 1] = b.y;
  }
}

__device__ __forceinline__ Bf16x16 pack(const float* y) {
  Bf16x16 out;
  __nv_bfloat162* p0 = reinterpret_cast<__nv_bfloat162*>(&out.lo);
  __nv_bfloat162* p1 = reinterpret_cast<__nv_bfloat162*>(&out.hi);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    p0[i] = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
    p1[i] = __floats2bfloat162_rn(y[8 + 2 * i], y[8 + 2 * i + 1]);
  }
  return out;
}

// In place on 16 values; order of fp32 operations as spec/nvfp4.md with s_enc = 1.
__device__ __forceinline__ void fake_quantize16(float* x) {
  float amax = 0.0f;
  bool has_nan = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    has_nan |= (x[i] != x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  const float S = e4m3_rn_satfinite(__fdiv_rn(amax, 6.0f));
  const float inv = __frcp_rn(S);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = copysignf(e2m1_rne_magnitude(fabsf(x[i]) * inv) * S, x[i]);
    x[i] = has_nan ? __int_as_float(0x7fc00000) : (S == 0.0f ? 0.0f : y);
  }
}

struct Job {
  const __nv_bfloat16* src;
  __nv_bfloat16* dst;
  BlhdStrides stride;
  int len;
  bool quantize;
};

// One thread per (b, l, h, 16-channel block); the output is contiguous, so the
// linear block index is also the output offset / 16.
__global__ void fake_quant_qkv_kernel(Job j0, Job j1, Job j2, int heads, int head_dim,
                                      int batch) {
  // Field-wise selects keep the parameters out of local memory.
  const int which = blockIdx.y;
  Job job;
  job.src = which == 0 ? j0.src : (which == 1 ? j1.src : j2.src);
  job.dst = which == 0 ? j0.dst : (which == 1 ? j1.dst : j2.dst);
  job.stride.b = which == 0 ? j0.stride.b : (which == 1 ? j1.stride.b : j2.stride.b);
  job.stride.l = which == 0 ? j0.stride.l : (which == 1 ? j1.stride.l : j2.stride.l);
  job.stride.h = which == 0 ? j0.stride.h : (which == 1 ? j1.stride.h : j2.stride.h);
  job.len = which == 0 ? j0.len : (which == 1 ? j1.len : j2.len);
  job.quantize = which == 0 ? j0.quantize : (which == 1 ? j1.quantize : j2.quantize);
  const int nb = head_dim / 16;
  const int64_t total = static_cast<int64_t>(batch) * job.len * heads * nb;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int db = static_cast<int>(idx % nb);
    int64_t rest = idx / nb;
    const int h = static_cast<int>(rest % heads);
    rest /= heads;
    const int64_t l = rest % job.len;
    const int64_t b = rest / job.len;
    const __nv_bfloat16* src =
        job.src + b * job.stride.b + l * job.stride.l + h * job.stride.h + db * 16;
    Bf16x16 in;
    in.lo = __ldg(reinterpret_cast<const uint4*>(src));
    in.hi = __ldg(reinterpret_cast<const uint4*>(src + 8));
    Bf16x16 out = in;
    if (job.quantize) {
      float x[16];
      unpack(in, x);
      fake_quantize16(x);
      out = pack(x);
    }
    uint4* dst = reinterpret_cast<uint4*>(job.dst + idx * 16);
    dst[0] = out.lo;
    dst[1] = out.hi;
  }
}

constexpr const char* kOp = "fake_quant_qkv";

std::string shape_str(const FakeQuantQkvParams& p) {
  return attention_shape_str(p.batch, p.heads, p.len_q, p.len_kv, p.head_dim);
}

void check_operand(const char* name, const char* out_name, const BlhdIn& in, const void* out,
                   const FakeQuantQkvParams& p) {
  const auto shape = [&] { return shape_str(p); };
  check_blhd(kOp, name, in, shape);
  VQAD_LAUNCH_CHECK(out != nullptr && reinterpret_cast<uintptr_t>(out) % 16 == 0, kOp, shape(), "tensor ",
                    out_name, ": expected a 16-byte aligned device pointer, found address ", out);
}

}  // namespace

void launch_fake_quant_qkv(const FakeQuantQkvParams& p, cudaStream_t stream) {
  VQAD_LAUNCH_CHECK(p.batch > 0 && p.heads > 0 && p.len_q > 0 && p.len_kv > 0 && p.head_dim > 0 &&
                        p.head_dim % 16 == 0,
                    kOp, shape_str(p), "unsupported shape: expected positive sizes and a head dim that is a "
                    "multiple of 16");
  check_operand("q", "q_out", p.q, p.q_out, p);
  check_operand("k", "k_out", p.k, p.k_out, p);
  check_operand("v", "v_out", p.v, p.v_out, p);
  using bf = __nv_bfloat16;
  Job jq{static_cast<const bf*>(p.q.data), static_cast<bf*>(p.q_out), p.q.stride, p.len_q, p.quant_qk};
  Job jk{static_cast<const bf*>(p.k.data), static_cast<bf*>(p.k_out), p.k.stride, p.len_kv, p.quant_qk};
  Job jv{static_cast<const bf*>(p.v.data), static_cast<bf*>(p.v_out), p.v.stride, p.len_kv, p.quant_v};
  const int64_t max_blocks =
      static_cast<int64_t>(p.batch) * (p.len_q > p.len_kv ? p.len_q : p.len_kv) * p.heads * (p.head_dim / 16);
  const int threads = 256;
  int64_t grid = (max_blocks + threads - 1) / threads;
  if (grid > 65535LL * 16) grid = 65535LL * 16;  // grid-stride beyond this
  fake_quant_qkv_kernel<<<dim3(static_cast<unsigned>(grid), 3), threads, 0, stream>>>(
      jq, jk, jv, p.heads, p.head_dim, p.batch);
  VQAD_CUDA_CHECK_LAUNCH("fake_quant_qkv_kernel");
}

}  // namespace vqad::kernels::attention
