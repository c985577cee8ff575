// Building blocks of the float64 attention formulas that the CPU tests check the numeric
// references against (tests/cpu/test_attention_qat.cpp, test_vsa_ref.cpp): the values a
// kernel actually sees (BF16 inputs, NVFP4 operands with unit scale) written in float64, so
// an independent formula of the attention can be evaluated on them in plain torch ops.
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "vqad/numerics/nvfp4.h"

namespace vqad::test {

constexpr double kLog2e = 1.4426950408889634;

// x rounded to BF16, as float64.
inline torch::Tensor bf16_f64(const torch::Tensor& x) { return x.to(torch::kBFloat16).to(torch::kDouble); }

// NVFP4 (unit scale) of the last dim in 16-element blocks, the last block zero-padded, as
// float64 (the reference module's fake quantization, vqad::nvfp4::fake_quantize).
inline torch::Tensor nvfp4_last_f64(const torch::Tensor& x) {
  using torch::indexing::Slice;
  const int64_t n = x.size(-1);
  const int64_t padded = (n + 15) / 16 * 16;
  auto sz = x.sizes().vec();
  sz.back() = padded;
  torch::Tensor f = torch::zeros(sz, torch::kFloat32);
  f.index_put_({"...", Slice(0, n)}, x.to(torch::kFloat32));
  f = f.contiguous();
  vqad::nvfp4::fake_quantize(f.data_ptr<float>(), f.data_ptr<float>(), f.numel(), 1.0f);
  return f.index({"...", Slice(0, n)}).to(torch::kDouble);
}

}  // namespace vqad::test
