// CUDA NVFP4 kernels (kernels/nvfp4/) against the CPU reference (numerics/nvfp4.h):
// the golden vectors bit-exactly, and fresh random inputs of several shapes,
// layouts and distributions with NaN-poisoned outputs and sentinels past the end.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/support/device_buffers.h"
#include "tests/support/metrics.h"
#include "tests/support/nvfp4_cases.h"
#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/common/device.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"
#include "vqad/numerics/nvfp4.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <torch/torch.h>

#include "vqad/ops/nvfp4_fake_quant.h"
#endif

namespace nv = vqad::nvfp4;
namespace kn = vqad::kernels::nvfp4;

namespace {

constexpr size_t kSentinel = 256;  // bytes past every output that must stay untouched
constexpr uint8_t kPoison = 0xFF;  // as F32 or BF16 this is NaN; as a code/scale it is invalid

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
using vqad::test::bf16_bits;  // round to nearest even, NaN -> 0x7FC0
using vqad::test::bf16_value;

std::string current_test() { return ::testing::UnitTest::GetInstance()->current_test_info()->name(); }

void require_gpu() {
  ASSERT_GT(vqad::kernels::device_count(), 0) << "no CUDA device visible: GPU tests need a GPU machine";
}

// Device bytes filled with poison, with a sentinel zone after them (tests/support).
struct DeviceBuffer : vqad::test::DeviceBuffer<uint8_t> {
  explicit DeviceBuffer(size_t bytes) : vqad::test::DeviceBuffer<uint8_t>(bytes, kPoison, kSentinel) {}
};

// Every byte after the buffer's end still holds the poison.
void expect_sentinel(const DeviceBuffer& buf, const std::string& what) {
  size_t first = 0;
  const size_t bad = buf.sentinel_damage(&first);
  ASSERT_EQ(bad, 0u) << what << ": " << bad << " bytes written past the end, the first at byte " << first;
}

using Dist = vqad::test::Nvfp4Dist;
using Layout = vqad::test::Nvfp4Layout;
using vqad::test::as_input_dtype;
using vqad::test::dist_name;
using vqad::test::layout_name;
using vqad::test::nvfp4_case_input;

struct Expected {
  std::vector<uint8_t> codes, scales, swizzled;  // codes one per element
  std::vector<float> values;
  float s_enc = 1.0f;
};

Expected reference(const std::vector<float>& x, int64_t rows, int64_t cols, nv::ScaleMode mode,
                   float static_s_enc) {
  Expected e;
  e.s_enc = mode == nv::ScaleMode::kUnit ? 1.0f
            : mode == nv::ScaleMode::kStatic ? static_s_enc
                                             : nv::encode_scale_from_amax(nv::amax(x.data(), x.size()));
  const nv::QuantizedMatrix q = nv::quantize_matrix(x.data(), rows, cols, e.s_enc);
  e.codes = q.codes;
  e.scales = q.scales;
  e.swizzled = q.scales_swizzled;
  e.values = q.values;
  return e;
}

bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

struct DeviceInput {
  std::unique_ptr<DeviceBuffer> buf;
  kn::TensorView view;
};

// Places logical x [rows, cols] into a poisoned device buffer with the given layout and dtype.
DeviceInput place(const std::vector<float>& x, int64_t rows, int64_t cols, kn::DType dtype, Layout layout) {
  vqad::test::Nvfp4HostLayout h = vqad::test::lay_out(x, rows, cols, dtype, layout);
  DeviceInput in;
  in.buf = std::make_unique<DeviceBuffer>(h.bytes.size());
  in.buf->upload(h.bytes.data(), h.bytes.size());
  in.view = h.view;
  in.view.data = in.buf->get();
  return in;
}

void run_case(int64_t rows, int64_t cols, Dist dist, kn::DType in_dt, kn::DType out_dt, nv::ScaleMode mode,
              Layout layout, uint32_t seed) {
  const std::string what = std::string("[") + std::to_string(rows) + ", " + std::to_string(cols) + "] " +
                           dist_name(dist) + " " + kn::dtype_name(in_dt) + "->" + kn::dtype_name(out_dt) +
                           " " + nv::scale_mode_name(mode) + " " + layout_name(layout) + " seed " + std::to_string(seed);
  SCOPED_TRACE(what);
  const std::vector<float> x = as_input_dtype(nvfp4_case_input(rows * cols, dist, seed), in_dt);
  const float static_s_enc = nv::encode_scale_from_amax(7.5f);
  const Expected e = reference(x, rows, cols, mode, static_s_enc);
  DeviceInput in = place(x, rows, cols, in_dt, layout);
  const int64_t n = rows * cols, scale_cols = cols / 16;

  kn::EncodeScale sc;
  DeviceBuffer amax(sizeof(float));
  if (mode == nv::ScaleMode::kStatic) sc.value = static_s_enc;
  if (mode == nv::ScaleMode::kDynamic) {
    kn::launch_amax(in.view, amax.as<float>(), nullptr);
    const float got = amax.download_as<float>(1)[0];
    const float want = nv::amax(x.data(), x.size());
    ASSERT_TRUE(same(got, want)) << "amax " << got << " vs " << want;
    expect_sentinel(amax, "amax");
    sc.amax_device = amax.as<float>();
  }

  // Fake quantization into a dense output.
  const size_t oes = out_dt == kn::DType::kBF16 ? 2 : 4;
  DeviceBuffer y(n * oes);
  kn::TensorView yv = kn::dense_view(y.get(), out_dt, rows, cols);
  if (layout == Layout::kPermuted3d) {  // output in the same logical 3-d shape, dense
    yv.ndim = 3;
    for (int d = 0; d < 3; ++d) yv.sizes[d] = in.view.sizes[d];
    yv.strides[2] = 1;
    yv.strides[1] = cols;
    yv.strides[0] = cols * in.view.sizes[1];
  }
  kn::launch_fake_quantize(in.view, yv, sc, nullptr);
  int bad = 0;
  if (out_dt == kn::DType::kBF16) {
    const auto got = y.download_as<uint16_t>(n);
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      const uint16_t want = bf16_bits(e.values[i]);
      if (!(got[i] == want || (std::isnan(e.values[i]) && std::isnan(bf16_value(got[i]))))) {
        ADD_FAILURE() << "fake-quant elem " << i << " x=" << x[i] << ": got " << bf16_value(got[i])
                      << " want " << bf16_value(want);
        ++bad;
      }
    }
  } else {
    const auto got = y.download_as<float>(n);
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      if (!same(got[i], e.values[i])) {
        ADD_FAILURE() << "fake-quant elem " << i << " x=" << x[i] << ": got " << got[i] << " want "
                      << e.values[i];
        ++bad;
      }
    }
  }
  expect_sentinel(y, "fake-quant output");

  // Quantize + pack.
  const int64_t swz = kn::swizzled_size(rows, scale_cols);
  ASSERT_EQ(swz, nv::swizzled_scales_size(rows, scale_cols));
  DeviceBuffer codes(n / 2), scales(rows * scale_cols), swizzled(swz);
  kn::QuantizeOutputs qo;
  qo.packed_codes = codes.as<uint8_t>();
  qo.scales_linear = scales.as<uint8_t>();
  qo.scales_swizzled = swizzled.as<uint8_t>();
  kn::launch_quantize(in.view, sc, qo, nullptr);
  const auto got_codes = nv::unpack_codes(codes.download_as<uint8_t>(n / 2));
  const auto got_scales = scales.download_as<uint8_t>(rows * scale_cols);
  const auto got_swz = swizzled.download_as<uint8_t>(swz);
  for (int64_t i = 0; i < n && bad < 10; ++i) {
    if (got_codes[i] != e.codes[i]) {
      ADD_FAILURE() << "code elem " << i << " x=" << x[i] << ": got " << int(got_codes[i]) << " want "
                    << int(e.codes[i]);
      ++bad;
    }
  }
  for (int64_t i = 0; i < rows * scale_cols && bad < 10; ++i) {
    if (got_scales[i] != e.scales[i]) {
      ADD_FAILURE() << "scale " << i << ": got " << int(got_scales[i]) << " want " << int(e.scales[i]);
      ++bad;
    }
  }
  EXPECT_EQ(got_swz, e.swizzled) << "swizzled scales (pad bytes must be zero)";
  expect_sentinel(codes, "packed codes");
  expect_sentinel(scales, "linear scales");
  expect_sentinel(swizzled, "swizzled scales");

  // Dequantize from the CPU reference's packed codes, both scale layouts.
  DeviceBuffer ref_codes(n / 2), ref_scales(rows * scale_cols), ref_swz(swz);
  const auto packed = nv::pack_codes(e.codes);
  ref_codes.upload(packed.data(), packed.size());
  ref_scales.upload(e.scales.data(), e.scales.size());
  ref_swz.upload(e.swizzled.data(), e.swizzled.size());
  std::vector<float> want_dq(n);
  nv::dequantize_matrix(e.codes.data(), e.scales.data(), rows, cols, e.s_enc, want_dq.data());
  kn::EncodeScale dsc;
  dsc.value = e.s_enc;
  for (bool use_swz : {false, true}) {
    DeviceBuffer dq(n * 4);
    kn::launch_dequantize(ref_codes.as<uint8_t>(), use_swz ? ref_swz.as<uint8_t>() : ref_scales.as<uint8_t>(),
                          use_swz, dsc, kn::dense_view(dq.get(), kn::DType::kF32, rows, cols), nullptr);
    const auto got = dq.download_as<float>(n);
    for (int64_t i = 0; i < n && bad < 15; ++i) {
      if (!same(got[i], want_dq[i])) {
        ADD_FAILURE() << "dequantize (" << (use_swz ? "swizzled" : "linear") << ") elem " << i << ": got "
                      << got[i] << " want " << want_dq[i];
        ++bad;
      }
    }
    expect_sentinel(dq, "dequantize output");
  }
}

}  // namespace

TEST(Nvfp4Cuda, RandomInputsMatchReferenceBitExactly) {
  require_gpu();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 16}, {3, 48}, {37, 80}, {130, 80}, {257, 1536}, {129, 208}};
  const Dist dists[] = {Dist::kNormal, Dist::kHeavy, Dist::kTiny,   Dist::kHuge,
                        Dist::kZeroBlocks, Dist::kInf, Dist::kNaN, Dist::kTies};
  uint32_t seed = static_cast<uint32_t>(vqad::test::test_seed(current_test()));
  for (const auto& [rows, cols] : shapes) {
    for (Dist d : dists) {
      for (nv::ScaleMode mode : {nv::ScaleMode::kUnit, nv::ScaleMode::kDynamic, nv::ScaleMode::kStatic}) {
        run_case(rows, cols, d, kn::DType::kBF16, kn::DType::kBF16, mode, Layout::kDense, ++seed);
        run_case(rows, cols, d, kn::DType::kF32, kn::DType::kF32, mode, Layout::kDense, ++seed);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(Nvfp4Cuda, DtypeCombinationsAndLayouts) {
  require_gpu();
  uint32_t seed = static_cast<uint32_t>(vqad::test::test_seed(current_test()));
  for (kn::DType in : {kn::DType::kBF16, kn::DType::kF32}) {
    for (kn::DType out : {kn::DType::kBF16, kn::DType::kF32}) {
      for (Layout l : {Layout::kDense, Layout::kRowStride, Layout::kMisaligned, Layout::kPermuted3d}) {
        for (nv::ScaleMode mode : {nv::ScaleMode::kUnit, nv::ScaleMode::kDynamic, nv::ScaleMode::kStatic}) {
          run_case(99, 144, Dist::kHeavy, in, out, mode, l, ++seed);
          run_case(6, 32, Dist::kNormal, in, out, mode, l, ++seed);
          // 4 blocks per row: quantize+pack writes the scales four at a time.
          run_case(61, 64, Dist::kTies, in, out, mode, l, ++seed);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(Nvfp4Cuda, LargeRowsUseEveryThread) {
  require_gpu();
  // More blocks than one grid-stride pass covers; odd block counts per row.
  const uint32_t seed = static_cast<uint32_t>(vqad::test::test_seed(current_test()));
  run_case(4099, 1024, Dist::kNormal, kn::DType::kBF16, kn::DType::kBF16, nv::ScaleMode::kDynamic, Layout::kDense,
           seed);
  run_case(20001, 656, Dist::kHeavy, kn::DType::kF32, kn::DType::kBF16, nv::ScaleMode::kStatic, Layout::kRowStride,
           seed + 1);
}

TEST(Nvfp4Cuda, GoldenVectorsBitExact) {
  require_gpu();
  const auto f = vqad::st::File::open(std::string(VQAD_GOLDEN_FILE));
  for (bool dynamic : {false, true}) {
    const std::string p = dynamic ? "g_" : "";
    SCOPED_TRACE(dynamic ? "dynamic section" : "unit section");
    const int64_t rows = f.info(p + "x").shape.at(0);
    std::vector<float> x(rows * 16), y(rows * 16);
    std::vector<uint8_t> codes(rows * 16), scales(rows);
    std::memcpy(x.data(), f.data(p + "x"), x.size() * 4);
    std::memcpy(y.data(), f.data(p + "y"), y.size() * 4);
    std::memcpy(codes.data(), f.data(p + "codes"), codes.size());
    std::memcpy(scales.data(), f.data(p + "scale_bits"), scales.size());
    std::vector<float> tensor_amax(rows, 0.0f);
    if (dynamic) std::memcpy(tensor_amax.data(), f.data("g_tensor_amax"), rows * 4);
    // Unit: the whole section is one [rows, 16] tensor. Dynamic: tensors of 64 rows,
    // each with its own device amax.
    const int64_t group = dynamic ? std::stoll(f.metadata().at("rows_per_global_tensor")) : rows;
    DeviceBuffer dx(x.size() * 4), dy(y.size() * 4), dcodes(rows * 8), dscales(rows), damax(rows * 4);
    dx.upload(x.data(), x.size() * 4);
    for (int64_t g0 = 0; g0 < rows; g0 += group) {
      const kn::TensorView xv = kn::dense_view(dx.as<float>() + g0 * 16, kn::DType::kF32, group, 16);
      const kn::TensorView yv = kn::dense_view(dy.as<float>() + g0 * 16, kn::DType::kF32, group, 16);
      kn::EncodeScale sc;
      if (dynamic) {
        kn::launch_amax(xv, damax.as<float>() + g0, nullptr);
        sc.amax_device = damax.as<float>() + g0;
      }
      kn::launch_fake_quantize(xv, yv, sc, nullptr);
      kn::QuantizeOutputs qo;
      qo.packed_codes = dcodes.as<uint8_t>() + g0 * 8;
      qo.scales_linear = dscales.as<uint8_t>() + g0;
      kn::launch_quantize(xv, sc, qo, nullptr);
    }
    const auto got_y = dy.download_as<float>(y.size());
    const auto got_codes = nv::unpack_codes(dcodes.download_as<uint8_t>(rows * 8));
    const auto got_scales = dscales.download_as<uint8_t>(rows);
    int bad = 0;
    if (dynamic) {
      const auto got_amax = damax.download_as<float>(rows);
      for (int64_t g0 = 0; g0 < rows; g0 += group) {
        EXPECT_EQ(got_amax[g0], tensor_amax[g0]) << "tensor amax of rows " << g0 << "..";
      }
    }
    for (int64_t r = 0; r < rows && bad < 10; ++r) {
      if (got_scales[r] != scales[r]) {
        ADD_FAILURE() << "row " << r << ": scale " << int(got_scales[r]) << " golden " << int(scales[r]);
        ++bad;
      }
      for (int i = 0; i < 16; ++i) {
        const int64_t k = r * 16 + i;
        if (got_codes[k] != codes[k] || !same(got_y[k], y[k])) {
          ADD_FAILURE() << "row " << r << " elem " << i << " x=" << x[k] << ": code " << int(got_codes[k])
                        << " value " << got_y[k] << ", golden " << int(codes[k]) << " " << y[k];
          ++bad;
          break;
        }
      }
    }
    EXPECT_EQ(bad, 0);
    expect_sentinel(dy, "golden fake-quant output");
    expect_sentinel(dcodes, "golden packed codes");
  }
}

TEST(Nvfp4Cuda, BadShapesAreErrors) {
  require_gpu();
  DeviceBuffer x(64 * 24 * 4), y(64 * 24 * 4);
  const kn::TensorView xv = kn::dense_view(x.get(), kn::DType::kF32, 64, 24);
  const kn::TensorView yv = kn::dense_view(y.get(), kn::DType::kF32, 64, 24);
  try {
    kn::launch_fake_quantize(xv, yv, {}, nullptr);
    FAIL() << "expected an error for a last dim of 24";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[64, 24]"), std::string::npos) << e.what();
  }
  kn::TensorView strided = kn::dense_view(x.get(), kn::DType::kF32, 16, 32);
  strided.strides[1] = 2;
  strided.strides[0] = 64;
  EXPECT_THROW(kn::launch_quantize(strided, {}, kn::QuantizeOutputs{}, nullptr), vqad::Error);
  EXPECT_THROW(kn::launch_amax(xv, x.as<float>(), nullptr), vqad::Error);
}

#ifdef VQAD_WITH_TORCH_CUDA
TEST(Nvfp4CudaOp, FakeQuantMatchesCpuAndIsStraightThrough) {
  require_gpu();
  torch::manual_seed(std::random_device{}());
  for (auto dtype : {torch::kBFloat16, torch::kFloat}) {
    // Non-contiguous leading dims: a transposed [L, B, 64] view of [B, L, 64].
    const torch::Tensor base = torch::randn({3, 50, 64}, torch::TensorOptions().dtype(dtype)) * 4;
    const torch::Tensor xc = base.transpose(0, 1);
    const torch::Tensor xg = base.cuda().transpose(0, 1);
    for (auto mode : {vqad::ops::ScaleMode::kUnit, vqad::ops::ScaleMode::kDynamic, vqad::ops::ScaleMode::kStatic}) {
      const float s_enc = mode == vqad::ops::ScaleMode::kStatic ? nv::encode_scale_from_amax(9.0f) : 1.0f;
      const torch::Tensor yc = vqad::ops::nvfp4_fake_quant(xc, mode, s_enc);
      const torch::Tensor yg = vqad::ops::nvfp4_fake_quant(xg, mode, s_enc);
      ASSERT_EQ(yg.scalar_type(), dtype);
      ASSERT_EQ(yg.sizes(), xc.sizes());
      EXPECT_TRUE(torch::equal(yg.cpu(), yc)) << nv::scale_mode_name(mode) << " " << dtype;
    }
    torch::Tensor xr = xg.detach().clone().requires_grad_(true);
    const torch::Tensor g = torch::randn_like(xr);
    vqad::ops::nvfp4_fake_quant(xr, vqad::ops::ScaleMode::kDynamic).backward(g);
    EXPECT_TRUE(torch::equal(xr.grad(), g));
  }
}

TEST(Nvfp4CudaOp, QuantizeMatchesCpu) {
  require_gpu();
  const torch::Tensor x = torch::randn({5, 33, 96}) * 10;
  for (auto mode : {vqad::ops::ScaleMode::kUnit, vqad::ops::ScaleMode::kDynamic}) {
    const auto qc = vqad::ops::nvfp4_quantize(x, mode);
    const auto qg = vqad::ops::nvfp4_quantize(x.cuda(), mode);
    EXPECT_TRUE(torch::equal(qg.packed_codes.cpu(), qc.packed_codes));
    EXPECT_TRUE(torch::equal(qg.scales.cpu(), qc.scales));
    EXPECT_TRUE(torch::equal(qg.scales_swizzled.cpu(), qc.scales_swizzled));
    EXPECT_EQ(qg.s_enc.item<float>(), qc.s_enc.item<float>());
    EXPECT_TRUE(torch::equal(vqad::ops::nvfp4_dequantize(qg, torch::kFloat).cpu(),
                             vqad::ops::nvfp4_dequantize(qc, torch::kFloat)));
  }
}
#endif
