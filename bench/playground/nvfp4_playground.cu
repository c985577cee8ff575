// Standalone playground for the NVFP4 kernels (kernels/nvfp4/) and the NVFP4
// linear's CUDA pieces (kernels/linear/): checks first, then times. No torch.
//   check     CUDA vs the CPU reference (numerics/nvfp4.h) bit for bit on random
//             inputs (shapes, distributions, dtypes, layouts, scale modes) with
//             poisoned outputs and sentinels past the end, the golden file, and the
//             full benchmark shapes; exhaustive device checks of the E2M1 rounding
//             and of the hardware E4M3 conversion the kernels use.
//   time      fake-quant / quantize+pack / amax bandwidth vs a device copy of the
//             same bytes, same run, at [31200, 1536] and [31200, 8960] BF16.
//   linear    kl::gemm_bf16_nt (device alpha, bias) and raw cuBLASLt variants vs a
//             float64 reference, and the linear forward pipeline vs its CPU emulation.
//   profile   one launch of each kernel at [31200, 8960] (for ncu).
// Build on a GPU machine (one nvcc command):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -I. \
//     bench/playground/nvfp4_playground.cu src/vqad/kernels/nvfp4/nvfp4_kernels.cu \
//     src/vqad/kernels/linear/nvfp4_linear_kernels.cu src/vqad/kernels/common/cublaslt.cu \
//     src/vqad/kernels/common/device.cu src/vqad/numerics/nvfp4.cpp -lcublasLt -o /tmp/nvfp4_pg
//   /tmp/nvfp4_pg check time linear [golden tests/data/nvfp4_golden_public.safetensors]
// -DPG_KERNELS_ONLY leaves out the parts that need this tree's common/nvfp4_math.h
// and the linear kernels (to time an older kernel file with the same driver: put the
// older nvfp4_kernels.cu/.h under OLD/src/vqad/kernels/nvfp4/ and the nvfp4_math.h it
// includes at its path under OLD/src, and build with -IOLD/src -Isrc
// OLD/src/vqad/kernels/nvfp4/nvfp4_kernels.cu).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/device_buffers.h"
#include "tests/support/metrics.h"
#include "tests/support/nvfp4_cases.h"
#include "vqad/kernels/common/cuda_check.h"
#include "vqad/kernels/nvfp4/nvfp4_kernels.h"
#include "vqad/numerics/nvfp4.h"

#ifndef PG_KERNELS_ONLY
#include <cublasLt.h>

#include "vqad/kernels/linear/nvfp4_linear_kernels.h"
#include "vqad/kernels/common/nvfp4_math.h"
#endif

namespace nvr = vqad::nvfp4;
namespace kn = vqad::kernels::nvfp4;

namespace {

int g_failures = 0;
#define PG_FAIL(...)                    \
  do {                                  \
    ++g_failures;                       \
    std::printf("FAIL: " __VA_ARGS__);  \
    std::printf("\n");                  \
  } while (0)

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
using vqad::test::bf16_bits;  // round to nearest even, a NaN -> the quiet NaN 0x7FC0
using vqad::test::bf16_value;
float bf16_round(float f) { return bf16_value(bf16_bits(f)); }  // NaN -> the quiet NaN too
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

template <typename F>
void parallel_for(int64_t n, F f) {
  const int nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> ts;
  for (int t = 0; t < nt; ++t) {
    ts.emplace_back([=] {
      const int64_t a = n * t / nt, b = n * (t + 1) / nt;
      for (int64_t i = a; i < b; ++i) f(i);
    });
  }
  for (auto& t : ts) t.join();
}

constexpr size_t kSentinel = 256;

// Device bytes with a poisoned sentinel zone past the end (tests/support/device_buffers.h,
// the buffers of the GPU tests), in the byte-sized interface the cases below use.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : buf_(bytes, vqad::test::kPoisonByte, kSentinel) {}
  template <typename T = void>
  T* get() const { return buf_.as<T>(); }
  void upload(const void* src, size_t n) { buf_.upload(src, n); }
  template <typename T>
  std::vector<T> download(size_t count) const { return buf_.download_as<T>(count); }
  bool sentinel_ok(const char* what) const {
    size_t first = 0;
    if (buf_.sentinel_damage(&first) == 0) return true;
    PG_FAIL("%s: write past the end at byte %zu", what, first);
    return false;
  }

 private:
  vqad::test::DeviceBuffer<uint8_t> buf_;
};

// --- random cases (the GPU test's run_case, without gtest) ------------------------------
using Dist = vqad::test::Nvfp4Dist;
using Layout = vqad::test::Nvfp4Layout;
using vqad::test::as_input_dtype;
using vqad::test::dist_name;
using vqad::test::layout_name;
using vqad::test::nvfp4_case_input;

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

bool run_case(int64_t rows, int64_t cols, Dist dist, kn::DType in_dt, kn::DType out_dt, nvr::ScaleMode mode,
              Layout layout, uint32_t seed) {
  char what[256];
  std::snprintf(what, sizeof(what), "[%lld, %lld] %s %s->%s %s %s seed %u", (long long)rows, (long long)cols,
                dist_name(dist), kn::dtype_name(in_dt), kn::dtype_name(out_dt), nvr::scale_mode_name(mode),
                layout_name(layout), seed);
  const int before = g_failures;
  const std::vector<float> x = as_input_dtype(nvfp4_case_input(rows * cols, dist, seed), in_dt);
  const float static_s_enc = nvr::encode_scale_from_amax(7.5f);
  const float s_enc = mode == nvr::ScaleMode::kUnit     ? 1.0f
                      : mode == nvr::ScaleMode::kStatic ? static_s_enc
                                                       : nvr::encode_scale_from_amax(nvr::amax(x.data(), x.size()));
  const nvr::QuantizedMatrix e = nvr::quantize_matrix(x.data(), rows, cols, s_enc);
  DeviceInput in = place(x, rows, cols, in_dt, layout);
  const int64_t n = rows * cols, scale_cols = cols / 16;

  kn::EncodeScale sc;
  DeviceBuffer amax(sizeof(float));
  if (mode == nvr::ScaleMode::kStatic) sc.value = static_s_enc;
  if (mode == nvr::ScaleMode::kDynamic) {
    kn::launch_amax(in.view, amax.get<float>(), nullptr);
    const float got = amax.download<float>(1)[0];
    const float want = nvr::amax(x.data(), x.size());
    if (!same(got, want)) PG_FAIL("%s: amax %g vs %g", what, got, want);
    amax.sentinel_ok("amax");
    sc.amax_device = amax.get<float>();
  }

  const size_t oes = out_dt == kn::DType::kBF16 ? 2 : 4;
  DeviceBuffer y(n * oes);
  kn::TensorView yv = kn::dense_view(y.get(), out_dt, rows, cols);
  if (layout == Layout::kPermuted3d) {
    yv.ndim = 3;
    for (int d = 0; d < 3; ++d) yv.sizes[d] = in.view.sizes[d];
    yv.strides[2] = 1;
    yv.strides[1] = cols;
    yv.strides[0] = cols * in.view.sizes[1];
  }
  kn::launch_fake_quantize(in.view, yv, sc, nullptr);
  int bad = 0;
  if (out_dt == kn::DType::kBF16) {
    const auto got = y.download<uint16_t>(n);
    for (int64_t i = 0; i < n && bad < 3; ++i) {
      const uint16_t want = bf16_bits(e.values[i]);
      if (!(got[i] == want || (std::isnan(e.values[i]) && std::isnan(bf16_value(got[i]))))) {
        PG_FAIL("%s: fake-quant elem %lld x=%g: got %g want %g", what, (long long)i, x[i], bf16_value(got[i]),
                bf16_value(want));
        ++bad;
      }
    }
  } else {
    const auto got = y.download<float>(n);
    for (int64_t i = 0; i < n && bad < 3; ++i) {
      if (!same(got[i], e.values[i])) {
        PG_FAIL("%s: fake-quant elem %lld x=%g: got %g want %g", what, (long long)i, x[i], got[i], e.values[i]);
        ++bad;
      }
    }
  }
  y.sentinel_ok("fake-quant output");

  const int64_t swz = kn::swizzled_size(rows, scale_cols);
  if (swz != nvr::swizzled_scales_size(rows, scale_cols)) PG_FAIL("%s: swizzled size", what);
  DeviceBuffer codes(n / 2), scales(rows * scale_cols), swizzled(swz);
  kn::QuantizeOutputs qo;
  qo.packed_codes = codes.get<uint8_t>();
  qo.scales_linear = scales.get<uint8_t>();
  qo.scales_swizzled = swizzled.get<uint8_t>();
  kn::launch_quantize(in.view, sc, qo, nullptr);
  const auto got_codes = nvr::unpack_codes(codes.download<uint8_t>(n / 2));
  const auto got_scales = scales.download<uint8_t>(rows * scale_cols);
  const auto got_swz = swizzled.download<uint8_t>(swz);
  for (int64_t i = 0; i < n && bad < 6; ++i) {
    if (got_codes[i] != e.codes[i]) {
      PG_FAIL("%s: code elem %lld x=%g: got %d want %d", what, (long long)i, x[i], got_codes[i], e.codes[i]);
      ++bad;
    }
  }
  for (int64_t i = 0; i < rows * scale_cols && bad < 9; ++i) {
    if (got_scales[i] != e.scales[i]) {
      PG_FAIL("%s: scale %lld: got %d want %d", what, (long long)i, got_scales[i], e.scales[i]);
      ++bad;
    }
  }
  if (got_swz != e.scales_swizzled) PG_FAIL("%s: swizzled scales differ (pad bytes must be zero)", what);
  codes.sentinel_ok("packed codes");
  scales.sentinel_ok("linear scales");
  swizzled.sentinel_ok("swizzled scales");

  DeviceBuffer ref_codes(n / 2), ref_scales(rows * scale_cols), ref_swz(swz);
  const auto packed = nvr::pack_codes(e.codes);
  ref_codes.upload(packed.data(), packed.size());
  ref_scales.upload(e.scales.data(), e.scales.size());
  ref_swz.upload(e.scales_swizzled.data(), e.scales_swizzled.size());
  std::vector<float> want_dq(n);
  nvr::dequantize_matrix(e.codes.data(), e.scales.data(), rows, cols, s_enc, want_dq.data());
  kn::EncodeScale dsc;
  dsc.value = s_enc;
  for (bool use_swz : {false, true}) {
    for (kn::DType dq_dt : {kn::DType::kF32, kn::DType::kBF16}) {
      const size_t des = dq_dt == kn::DType::kBF16 ? 2 : 4;
      DeviceBuffer dq(n * des);
      kn::launch_dequantize(ref_codes.get<uint8_t>(), use_swz ? ref_swz.get<uint8_t>() : ref_scales.get<uint8_t>(),
                            use_swz, dsc, kn::dense_view(dq.get(), dq_dt, rows, cols), nullptr);
      if (dq_dt == kn::DType::kF32) {
        const auto got = dq.download<float>(n);
        for (int64_t i = 0; i < n && bad < 12; ++i) {
          if (!same(got[i], want_dq[i])) {
            PG_FAIL("%s: dequantize f32 (%s) elem %lld: got %g want %g", what, use_swz ? "swizzled" : "linear",
                    (long long)i, got[i], want_dq[i]);
            ++bad;
          }
        }
      } else {
        const auto got = dq.download<uint16_t>(n);
        for (int64_t i = 0; i < n && bad < 12; ++i) {
          const uint16_t want = bf16_bits(want_dq[i]);
          if (!(got[i] == want || (std::isnan(want_dq[i]) && std::isnan(bf16_value(got[i]))))) {
            PG_FAIL("%s: dequantize bf16 (%s) elem %lld: got %g want %g", what, use_swz ? "swizzled" : "linear",
                    (long long)i, bf16_value(got[i]), want_dq[i]);
            ++bad;
          }
        }
      }
      dq.sentinel_ok("dequantize output");
    }
  }
  return g_failures == before;
}

void check_random() {
  uint32_t seed = 20261129u;
  int cases = 0;
  const std::pair<int64_t, int64_t> shapes[] = {{1, 16}, {3, 48}, {37, 80}, {130, 80}, {257, 1536}, {129, 208}};
  const Dist dists[] = {Dist::kNormal, Dist::kHeavy,      Dist::kTiny, Dist::kHuge,
                        Dist::kZeroBlocks, Dist::kInf, Dist::kNaN,  Dist::kTies};
  for (const auto& [rows, cols] : shapes) {
    for (Dist d : dists) {
      for (nvr::ScaleMode mode : {nvr::ScaleMode::kUnit, nvr::ScaleMode::kDynamic, nvr::ScaleMode::kStatic}) {
        run_case(rows, cols, d, kn::DType::kBF16, kn::DType::kBF16, mode, Layout::kDense, ++seed);
        run_case(rows, cols, d, kn::DType::kF32, kn::DType::kF32, mode, Layout::kDense, ++seed);
        cases += 2;
        if (g_failures > 20) return;
      }
    }
  }
  for (kn::DType in : {kn::DType::kBF16, kn::DType::kF32}) {
    for (kn::DType out : {kn::DType::kBF16, kn::DType::kF32}) {
      for (Layout l : {Layout::kDense, Layout::kRowStride, Layout::kMisaligned, Layout::kPermuted3d}) {
        for (nvr::ScaleMode mode : {nvr::ScaleMode::kUnit, nvr::ScaleMode::kDynamic, nvr::ScaleMode::kStatic}) {
          run_case(99, 144, Dist::kHeavy, in, out, mode, l, ++seed);
          run_case(6, 32, Dist::kNormal, in, out, mode, l, ++seed);
          run_case(61, 64, Dist::kTies, in, out, mode, l, ++seed);
          cases += 3;
          if (g_failures > 20) return;
        }
      }
    }
  }
  // More blocks than one grid-stride pass covers; odd block counts.
  run_case(4099, 1024, Dist::kNormal, kn::DType::kBF16, kn::DType::kBF16, nvr::ScaleMode::kDynamic, Layout::kDense,
           ++seed);
  run_case(20001, 656, Dist::kHeavy, kn::DType::kF32, kn::DType::kBF16, nvr::ScaleMode::kStatic, Layout::kRowStride,
           ++seed);
  run_case(8191, 400, Dist::kNormal, kn::DType::kBF16, kn::DType::kF32, nvr::ScaleMode::kUnit, Layout::kPermuted3d,
           ++seed);
  cases += 3;
  std::printf("random cases: %d run, failures so far %d\n", cases, g_failures);
}

// --- golden file (minimal safetensors header parsing) ----------------------------------------
struct Golden {
  std::vector<uint8_t> bytes;
  size_t data0 = 0;
  std::string header;
  bool find(const std::string& name, size_t& off, size_t& len) const {
    const size_t k = header.find("\"" + name + "\"");
    if (k == std::string::npos) return false;
    const size_t d = header.find("data_offsets", k);
    const size_t lb = header.find('[', d), comma = header.find(',', lb), rb = header.find(']', lb);
    const size_t a = std::stoull(header.substr(lb + 1, comma - lb - 1));
    const size_t b = std::stoull(header.substr(comma + 1, rb - comma - 1));
    off = data0 + a;
    len = b - a;
    return true;
  }
  template <typename T>
  std::vector<T> tensor(const std::string& name) const {
    size_t off, len;
    if (!find(name, off, len)) {
      PG_FAIL("golden: no tensor %s", name.c_str());
      return {};
    }
    std::vector<T> v(len / sizeof(T));
    std::memcpy(v.data(), bytes.data() + off, len);
    return v;
  }
  int meta_int(const std::string& key) const {
    const size_t k = header.find("\"" + key + "\"");
    const size_t q1 = header.find('"', header.find(':', k) + 1);
    return std::stoi(header.substr(q1 + 1));
  }
};

void check_golden(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    PG_FAIL("golden: cannot open %s", path.c_str());
    return;
  }
  Golden g;
  g.bytes.assign(std::istreambuf_iterator<char>(f), {});
  uint64_t hlen;
  std::memcpy(&hlen, g.bytes.data(), 8);
  g.header.assign(reinterpret_cast<const char*>(g.bytes.data()) + 8, hlen);
  g.data0 = 8 + hlen;
  for (bool dynamic : {false, true}) {
    const std::string p = dynamic ? "g_" : "";
    const auto x = g.tensor<float>(p + "x");
    const auto y = g.tensor<float>(p + "y");
    const auto codes = g.tensor<uint8_t>(p + "codes");
    const auto scales = g.tensor<uint8_t>(p + "scale_bits");
    const int64_t rows = static_cast<int64_t>(scales.size());
    std::vector<float> tensor_amax(rows, 0.0f);
    if (dynamic) tensor_amax = g.tensor<float>("g_tensor_amax");
    const int64_t group = dynamic ? g.meta_int("rows_per_global_tensor") : rows;
    for (kn::DType out_dt : {kn::DType::kF32, kn::DType::kBF16}) {
      const size_t oes = out_dt == kn::DType::kBF16 ? 2 : 4;
      DeviceBuffer dx(x.size() * 4), dy(y.size() * oes), dcodes(rows * 8), dscales(rows), damax(rows * 4);
      dx.upload(x.data(), x.size() * 4);
      for (int64_t g0 = 0; g0 < rows; g0 += group) {
        const kn::TensorView xv = kn::dense_view(dx.get<float>() + g0 * 16, kn::DType::kF32, group, 16);
        const kn::TensorView yv = kn::dense_view(dy.get<uint8_t>() + g0 * 16 * oes, out_dt, group, 16);
        kn::EncodeScale sc;
        if (dynamic) {
          kn::launch_amax(xv, damax.get<float>() + g0, nullptr);
          sc.amax_device = damax.get<float>() + g0;
        }
        kn::launch_fake_quantize(xv, yv, sc, nullptr);
        kn::QuantizeOutputs qo;
        qo.packed_codes = dcodes.get<uint8_t>() + g0 * 8;
        qo.scales_linear = dscales.get<uint8_t>() + g0;
        kn::launch_quantize(xv, sc, qo, nullptr);
      }
      const auto got_codes = nvr::unpack_codes(dcodes.download<uint8_t>(rows * 8));
      const auto got_scales = dscales.download<uint8_t>(rows);
      std::vector<float> got_y(y.size());
      if (out_dt == kn::DType::kF32) {
        got_y = dy.download<float>(y.size());
      } else {
        const auto h = dy.download<uint16_t>(y.size());
        for (size_t i = 0; i < h.size(); ++i) got_y[i] = bf16_value(h[i]);
      }
      int bad = 0;
      if (dynamic) {
        const auto got_amax = damax.download<float>(rows);
        for (int64_t g0 = 0; g0 < rows; g0 += group) {
          if (!same(got_amax[g0], tensor_amax[g0])) PG_FAIL("golden: tensor amax of rows %lld..", (long long)g0);
        }
      }
      for (int64_t r = 0; r < rows && bad < 10; ++r) {
        if (got_scales[r] != scales[r]) {
          PG_FAIL("golden %s row %lld: scale %d vs %d", p.c_str(), (long long)r, got_scales[r], scales[r]);
          ++bad;
        }
        for (int i = 0; i < 16; ++i) {
          const int64_t k = r * 16 + i;
          const float want = out_dt == kn::DType::kF32 ? y[k] : bf16_round(y[k]);
          if (got_codes[k] != codes[k] || !same(got_y[k], want)) {
            PG_FAIL("golden %s (%s out) row %lld elem %d x=%g: code %d value %g, golden %d %g", p.c_str(),
                    kn::dtype_name(out_dt), (long long)r, i, x[k], got_codes[k], got_y[k], codes[k], want);
            ++bad;
            break;
          }
        }
      }
      dy.sentinel_ok("golden fake-quant output");
      dcodes.sentinel_ok("golden packed codes");
      std::printf("golden %s section, %s output: %lld rows, %s\n", dynamic ? "dynamic" : "unit",
                  kn::dtype_name(out_dt), (long long)rows, bad ? "MISMATCH" : "bit-exact");
    }
  }
}

// --- the benchmark shapes, checked in full, then timed ------------------------------------------
struct BigCase {
  int64_t M, K;
  std::vector<uint16_t> xh;  // bf16 input
  uint16_t* x = nullptr;
  uint16_t* y = nullptr;
  uint16_t* copy_dst = nullptr;
  float* amax = nullptr;
  uint8_t *codes = nullptr, *scales = nullptr, *swz = nullptr;
  int64_t swz_bytes = 0;
};

void big_alloc(BigCase& c, uint32_t seed) {
  const int64_t n = c.M * c.K;
  c.xh.resize(n);
  parallel_for(64, [&](int64_t part) {
    std::mt19937 rng(seed + static_cast<uint32_t>(part));
    std::normal_distribution<float> nd(0.0f, 3.0f);
    for (int64_t i = n * part / 64; i < n * (part + 1) / 64; ++i) c.xh[i] = bf16_bits(nd(rng));
  });
  VQAD_CUDA_CHECK(cudaMalloc(&c.x, n * 2));
  VQAD_CUDA_CHECK(cudaMalloc(&c.y, n * 2));
  VQAD_CUDA_CHECK(cudaMalloc(&c.copy_dst, n * 2));
  VQAD_CUDA_CHECK(cudaMalloc(&c.amax, 4));
  c.swz_bytes = kn::swizzled_size(c.M, c.K / 16);
  VQAD_CUDA_CHECK(cudaMalloc(&c.codes, n / 2));
  VQAD_CUDA_CHECK(cudaMalloc(&c.scales, n / 16));
  VQAD_CUDA_CHECK(cudaMalloc(&c.swz, c.swz_bytes));
  VQAD_CUDA_CHECK(cudaMemcpy(c.x, c.xh.data(), n * 2, cudaMemcpyHostToDevice));
}

void big_free(BigCase& c) {
  cudaFree(c.x);
  cudaFree(c.y);
  cudaFree(c.copy_dst);
  cudaFree(c.amax);
  cudaFree(c.codes);
  cudaFree(c.scales);
  cudaFree(c.swz);
}

void big_check(BigCase& c) {
  const int64_t n = c.M * c.K, nb = n / 16;
  const kn::TensorView xv = kn::dense_view(c.x, kn::DType::kBF16, c.M, c.K);
  const kn::TensorView yv = kn::dense_view(c.y, kn::DType::kBF16, c.M, c.K);
  std::vector<float> xf(n);
  parallel_for(64, [&](int64_t p) {
    for (int64_t i = n * p / 64; i < n * (p + 1) / 64; ++i) xf[i] = bf16_value(c.xh[i]);
  });
  float amax_cpu = 0;
  for (int64_t i = 0; i < n; ++i) amax_cpu = std::max(amax_cpu, std::fabs(xf[i]));
  for (int mode = 0; mode < 3; ++mode) {
    kn::EncodeScale sc;
    float s_enc = 1.0f;
    if (mode == 1) {
      kn::launch_amax(xv, c.amax, nullptr);
      sc.amax_device = c.amax;
      s_enc = nvr::encode_scale_from_amax(amax_cpu);
      float got;
      VQAD_CUDA_CHECK(cudaMemcpy(&got, c.amax, 4, cudaMemcpyDeviceToHost));
      if (got != amax_cpu) PG_FAIL("[%lld, %lld] amax %g vs %g", (long long)c.M, (long long)c.K, got, amax_cpu);
    }
    if (mode == 2) sc.value = s_enc = nvr::encode_scale_from_amax(7.5f);
    VQAD_CUDA_CHECK(cudaMemset(c.y, 0xFF, n * 2));
    VQAD_CUDA_CHECK(cudaMemset(c.codes, 0xFF, n / 2));
    VQAD_CUDA_CHECK(cudaMemset(c.scales, 0xFF, n / 16));
    VQAD_CUDA_CHECK(cudaMemset(c.swz, 0xFF, c.swz_bytes));
    kn::launch_fake_quantize(xv, yv, sc, nullptr);
    kn::QuantizeOutputs qo;
    qo.packed_codes = c.codes;
    qo.scales_linear = c.scales;
    qo.scales_swizzled = c.swz;
    kn::launch_quantize(xv, sc, qo, nullptr);
    VQAD_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> y(n);
    std::vector<uint8_t> codes(n / 2), scales(nb), swz(c.swz_bytes);
    VQAD_CUDA_CHECK(cudaMemcpy(y.data(), c.y, n * 2, cudaMemcpyDeviceToHost));
    VQAD_CUDA_CHECK(cudaMemcpy(codes.data(), c.codes, n / 2, cudaMemcpyDeviceToHost));
    VQAD_CUDA_CHECK(cudaMemcpy(scales.data(), c.scales, nb, cudaMemcpyDeviceToHost));
    VQAD_CUDA_CHECK(cudaMemcpy(swz.data(), c.swz, c.swz_bytes, cudaMemcpyDeviceToHost));
    std::vector<int64_t> bad(64, 0);
    std::vector<uint8_t> swz_want(c.swz_bytes, 0);
    const int64_t scale_cols = c.K / 16;
    parallel_for(64, [&](int64_t p) {
      for (int64_t b = nb * p / 64; b < nb * (p + 1) / 64; ++b) {
        const nvr::BlockQuant q = nvr::quantize_block(&xf[b * 16], s_enc);
        bool ok = scales[b] == q.scale_bits;
        for (int i = 0; i < 16; ++i) {
          ok = ok && y[b * 16 + i] == bf16_bits(q.values[i]);
          ok = ok && ((codes[b * 8 + i / 2] >> (4 * (i & 1))) & 0xF) == q.codes[i];
        }
        swz_want[nvr::swizzled_scale_offset(b / scale_cols, b % scale_cols, scale_cols)] = q.scale_bits;
        if (!ok) ++bad[p];
      }
    });
    int64_t nbad = 0;
    for (int64_t v : bad) nbad += v;
    const bool swz_ok = swz == swz_want;
    if (nbad || !swz_ok) {
      PG_FAIL("[%lld, %lld] mode %s: %lld blocks differ from the CPU reference, swizzled %s", (long long)c.M,
              (long long)c.K, nvr::scale_mode_name(static_cast<nvr::ScaleMode>(mode)), (long long)nbad,
              swz_ok ? "ok" : "DIFFERS");
    } else {
      std::printf("[%lld, %lld] bf16 %s: fake-quant, codes, linear + swizzled scales == CPU reference\n",
                  (long long)c.M, (long long)c.K, nvr::scale_mode_name(static_cast<nvr::ScaleMode>(mode)));
    }
  }
}

double time_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) VQAD_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    VQAD_CUDA_CHECK(cudaEventRecord(ev[2 * i], nullptr));
    fn();
    VQAD_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], nullptr));
  }
  VQAD_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    float ms;
    VQAD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end());
  return iters % 2 ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
}

void big_time(BigCase& c, const char* label) {
  const int64_t n = c.M * c.K;
  const double in_bytes = 2.0 * n;
  const kn::TensorView xv = kn::dense_view(c.x, kn::DType::kBF16, c.M, c.K);
  const kn::TensorView yv = kn::dense_view(c.y, kn::DType::kBF16, c.M, c.K);
  kn::EncodeScale unit, dyn, stat;
  dyn.amax_device = c.amax;
  stat.value = nvr::encode_scale_from_amax(7.5f);
  kn::QuantizeOutputs qo;
  qo.packed_codes = c.codes;
  qo.scales_linear = c.scales;
  qo.scales_swizzled = c.swz;
  kn::QuantizeOutputs qo_codes;
  qo_codes.packed_codes = c.codes;
  qo_codes.scales_linear = c.scales;
  struct Case {
    const char* name;
    std::function<void()> fn;
    double bytes;
  };
  const double q_bytes = in_bytes + n / 2.0 + n / 16.0 + static_cast<double>(c.swz_bytes);
  const std::vector<Case> cases = {
      {"copy D2D", [&] { VQAD_CUDA_CHECK(cudaMemcpyAsync(c.copy_dst, c.x, n * 2, cudaMemcpyDeviceToDevice)); },
       2 * in_bytes},
      {"fq unit", [&] { kn::launch_fake_quantize(xv, yv, unit, nullptr); }, 2 * in_bytes},
      {"fq static", [&] { kn::launch_fake_quantize(xv, yv, stat, nullptr); }, 2 * in_bytes},
      {"fq dynamic (amax+fq)",
       [&] {
         kn::launch_amax(xv, c.amax, nullptr);
         kn::launch_fake_quantize(xv, yv, dyn, nullptr);
       },
       3 * in_bytes},
      {"amax", [&] { kn::launch_amax(xv, c.amax, nullptr); }, in_bytes},
      {"quantize+pack (codes, lin+swz scales)", [&] { kn::launch_quantize(xv, unit, qo, nullptr); }, q_bytes},
      {"quantize+pack (codes, lin scales)", [&] { kn::launch_quantize(xv, unit, qo_codes, nullptr); },
       in_bytes + n / 2.0 + n / 16.0},
  };
  double copy_gbps = 0;
  for (const Case& k : cases) {
    const double ms = time_ms(k.fn, 5, 30);
    const double gbps = k.bytes / (ms * 1e-3) / 1e9;
    if (copy_gbps == 0) copy_gbps = gbps;
    std::printf("TIME %s [%lld, %lld] %-40s %8.4f ms %8.1f GB/s %6.1f %% of copy\n", label, (long long)c.M,
                (long long)c.K, k.name, ms, gbps, 100.0 * gbps / copy_gbps);
  }
}

#ifndef PG_KERNELS_ONLY
// --- exhaustive device check of the E2M1 rounding ----------------------------------------------
__device__ unsigned long long g_bad_e2m1;

__device__ uint32_t old_code_magnitude(float a) {
  namespace km = vqad::kernels::nvfp4;
  const float small = __fmaf_rn(a, 2.0f, 8388608.0f);
  const uint32_t code_small = km::f2u(small) - 0x4B000000u;
  const uint32_t u = km::f2u(a);
  const uint32_t r = u + 0x1FFFFFu + ((u >> 22) & 1u);
  uint32_t code_big = (r >> 22) - 252u;
  code_big = code_big < 7u ? code_big : 7u;
  return a < 1.0f ? code_small : code_big;
}

__global__ void e2m1_exhaustive_kernel() {
  namespace km = vqad::kernels::nvfp4;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0x7FFFFFFFull; u += stride) {
    const float a = __uint_as_float(uint32_t(u));
    const uint32_t oc = old_code_magnitude(a);
    const uint32_t nc = km::e2m1_code_magnitude(a);
    const float nvv = km::e2m1_round_magnitude(a);
    if (oc != nc || __float_as_uint(nvv) != __float_as_uint(km::e2m1_magnitude(oc))) ++bad;
  }
  if (bad) atomicAdd(&g_bad_e2m1, bad);
}

__device__ unsigned long long g_bad_e4m3;

// The hardware E4M3 conversion the kernels use (sm_89+) against the integer
// e4m3_encode_nonneg the CPU tests check, on every float in [0, +inf].
__global__ void e4m3_exhaustive_kernel() {
  namespace km = vqad::kernels::nvfp4;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0x7F800000ull; u += stride) {
    const float v = __uint_as_float(uint32_t(u));
    const uint32_t hw = vqad::kernels::nvfp4_device::e4m3_byte(v);
    if (hw != km::e4m3_encode_nonneg(v)) ++bad;
  }
  if (bad) atomicAdd(&g_bad_e4m3, bad);
}

void check_e2m1_exhaustive() {
  {
    const unsigned long long zero = 0;
    VQAD_CUDA_CHECK(cudaMemcpyToSymbol(g_bad_e4m3, &zero, sizeof(zero)));
    e4m3_exhaustive_kernel<<<132 * 16, 256>>>();
    VQAD_CUDA_CHECK(cudaGetLastError());
    unsigned long long bad = 0;
    VQAD_CUDA_CHECK(cudaMemcpyFromSymbol(&bad, g_bad_e4m3, sizeof(bad)));
    if (bad) PG_FAIL("hardware E4M3 conversion differs from e4m3_encode_nonneg on %llu inputs", bad);
    else std::printf("hardware E4M3 conversion == e4m3_encode_nonneg on every float in [0, +inf]\n");
  }
  const unsigned long long zero = 0;
  VQAD_CUDA_CHECK(cudaMemcpyToSymbol(g_bad_e2m1, &zero, sizeof(zero)));
  e2m1_exhaustive_kernel<<<132 * 16, 256>>>();
  VQAD_CUDA_CHECK(cudaGetLastError());
  unsigned long long bad = 0;
  VQAD_CUDA_CHECK(cudaMemcpyFromSymbol(&bad, g_bad_e2m1, sizeof(bad)));
  if (bad) PG_FAIL("device E2M1 rounding differs from the previous kernel formula on %llu of 2^31 inputs", bad);
  else std::printf("device E2M1 code/value: identical to the previous formula on all 2^31 non-negative floats\n");
}

// --- linear: cuBLASLt GEMM with device alpha and bias epilogue ------------------------------------
namespace kl = vqad::kernels::linear;

#define LT(expr)                                                                                   \
  do {                                                                                             \
    const cublasStatus_t st_ = (expr);                                                             \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                            \
      std::printf("cuBLASLt status %d in %s\n", int(st_), #expr);                                 \
      return false;                                                                                \
    }                                                                                              \
  } while (0)

struct GemmVariant {
  const char* name;
  bool set_bias_type = true;
  bool host_alpha = false;
  bool f32_out = false;
  int algo = 0;  // index into the heuristic list
};

// d = alpha * a[m,k] . b[n,k]^T (+ bias[n]); the layout of kl::gemm_bf16_nt, with knobs.
bool gemm_variant(const GemmVariant& v, const void* a, const void* b, const void* bias, void* d, int64_t m, int64_t n,
                  int64_t k, const float* alpha_beta_dev, const float* alpha_beta_host, void* ws, size_t ws_bytes,
                  int* n_algos) {
  static cublasLtHandle_t h = nullptr;
  if (!h) LT(cublasLtCreate(&h));
  cublasLtMatmulDesc_t op;
  LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtPointerMode_t pm = v.host_alpha ? CUBLASLT_POINTER_MODE_HOST : CUBLASLT_POINTER_MODE_DEVICE;
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm)));
  if (bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    if (v.set_bias_type) {
      const cudaDataType_t bt = v.f32_out ? CUDA_R_32F : CUDA_R_16BF;
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
  }
  const cudaDataType_t dt = v.f32_out ? CUDA_R_32F : CUDA_R_16BF;
  cublasLtMatrixLayout_t la, lb, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
  LT(cublasLtMatrixLayoutCreate(&ld, dt, n, m, n));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                          sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t heur[16] = {};
  int found = 0;
  LT(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 16, heur, &found));
  if (n_algos) *n_algos = found;
  bool ok = false;
  if (v.algo < found) {
    const void* alpha = v.host_alpha ? static_cast<const void*>(alpha_beta_host) : alpha_beta_dev;
    const void* beta = v.host_alpha ? static_cast<const void*>(alpha_beta_host + 1) : alpha_beta_dev + 1;
    const cublasStatus_t st = cublasLtMatmul(h, op, alpha, b, la, a, lb, beta, d, ld, d, ld, &heur[v.algo].algo, ws,
                                             ws_bytes, nullptr);
    ok = st == CUBLAS_STATUS_SUCCESS;
    if (!ok) std::printf("  cublasLtMatmul status %d\n", int(st));
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatmulDescDestroy(op);
  return ok;
}

// Fallback candidate: fp32 GEMM output, then bf16(d32 + bias[col]) in one pass.
__global__ void bias_to_bf16_kernel(const float* __restrict__ d32, const uint16_t* __restrict__ bias, int64_t m,
                                    int64_t n, uint16_t* __restrict__ out) {
  const int64_t total = m * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const float b = __uint_as_float(uint32_t(bias[i % n]) << 16);
    const __nv_bfloat16 h = __float2bfloat16_rn(__fadd_rn(d32[i], b));
    out[i] = *reinterpret_cast<const uint16_t*>(&h);
  }
}

std::vector<float> heavy(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    const float a = nd(rng), b = nd(rng);
    x = a * std::exp(b * 1.5f);
  }
  return v;
}

// Values e2m1 * S of bf16(x) quantized with s_enc (the CPU reference of the unit operand).
std::vector<float> unit_operand_cpu(const std::vector<float>& x, int64_t rows, int64_t cols, float s_enc) {
  std::vector<float> xb(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = bf16_round(x[i]);
  for (int64_t b = 0; b < rows * cols / 16; ++b) {
    const nvr::BlockQuant q = nvr::quantize_block(&xb[b * 16], s_enc);
    const float S = nvr::e4m3_decode(q.scale_bits);
    for (int i = 0; i < 16; ++i) {
      out[b * 16 + i] = q.scale_bits == nvr::kE4M3NaN ? std::nanf("") : nvr::e2m1_decode(q.codes[i]) * S;
    }
  }
  return out;
}

float bf16_amax_cpu(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::fmax(m, std::fabs(bf16_round(v)));
  return m;
}

struct GemmRef {
  std::vector<double> acc;  // a . b^T in float64 (exact: products and sums of few-bit values)
  std::vector<double> abs_acc;
};
GemmRef gemm_ref(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n, int64_t k) {
  GemmRef r;
  r.acc.resize(m * n);
  r.abs_acc.resize(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (int64_t t = 0; t < k; ++t) {
        s += double(a[i * k + t]) * b[j * k + t];
        sa += std::fabs(double(a[i * k + t]) * b[j * k + t]);
      }
      r.acc[i * n + j] = s;
      r.abs_acc[i * n + j] = sa;
    }
  }
  return r;
}

struct BiasView {
  uint16_t* p;
  template <typename T = void>
  T* get() const { return reinterpret_cast<T*>(p); }
};

// One GEMM case: the GPU test GemmWithDeviceAlphaMatchesCpu at (m, n, k), for each variant.
void linear_gemm_case(int64_t m, int64_t n, int64_t k, uint32_t seed, bool bias_misaligned = false) {
  const float sa = 2688.0f / 50.0f, sb = 2688.0f / 20.0f;
  const std::vector<float> a = unit_operand_cpu(heavy(m * k, seed), m, k, sa);
  const std::vector<float> b = unit_operand_cpu(heavy(n * k, seed + 1), n, k, sb);
  std::mt19937 rng(seed + 2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> bias_h(n);
  std::vector<float> bias_f(n);
  for (int64_t j = 0; j < n; ++j) {
    bias_h[j] = bf16_bits(nd(rng));
    bias_f[j] = bf16_value(bias_h[j]);
  }
  const float alpha = (1.0f / sa) * (1.0f / sb);
  const float ab_host[2] = {alpha, 0.0f};
  std::vector<uint16_t> ah(a.size()), bh(b.size());
  for (size_t i = 0; i < a.size(); ++i) ah[i] = bf16_bits(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bh[i] = bf16_bits(b[i]);
  DeviceBuffer da(ah.size() * 2), db(bh.size() * 2), dbias_store(n * 2 + 16), dbias32(n * 4), dab(8), dd(m * n * 4),
      ws(kl::kGemmWorkspaceBytes + size_t(m) * n * 4 + 256);
  const BiasView dbias{dbias_store.get<uint16_t>() + (bias_misaligned ? 1 : 0)};
  da.upload(ah.data(), ah.size() * 2);
  db.upload(bh.data(), bh.size() * 2);
  VQAD_CUDA_CHECK(cudaMemcpy(dbias.get(), bias_h.data(), n * 2, cudaMemcpyHostToDevice));
  dbias32.upload(bias_f.data(), n * 4);
  dab.upload(ab_host, 8);
  const GemmRef ref = gemm_ref(a, b, m, n, k);

  auto evaluate = [&](const char* name, bool with_bias, bool f32_out) {
    std::vector<float> got(m * n);
    if (f32_out) {
      got = dd.download<float>(m * n);
    } else {
      const auto h = dd.download<uint16_t>(m * n);
      for (int64_t i = 0; i < m * n; ++i) got[i] = bf16_value(h[i]);
    }
    int64_t bad = 0, nan = 0, bad_cols = 0;
    double max_err = 0, max_err_nobias = 0;
    std::vector<int> col_bad(n, 0), row_bad(m, 0);
    int64_t first_i = -1, first_j = -1;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const double want = ref.acc[i * n + j] * alpha + (with_bias ? bias_f[j] : 0.0);
        const double g = got[i * n + j];
        if (std::isnan(g)) ++nan;
        const double tol = std::fabs(want) * (f32_out ? std::ldexp(1.0, -22) : std::ldexp(1.0, -8)) +
                           std::ldexp(double(k), -23) * ref.abs_acc[i * n + j] * alpha;
        const double err = std::fabs(g - want);
        max_err = std::max(max_err, err);
        max_err_nobias = std::max(max_err_nobias, std::fabs(g - ref.acc[i * n + j] * alpha));
        if (!(err <= tol)) {
          if (bad == 0) first_i = i, first_j = j;
          ++bad;
          col_bad[j] = 1;
          row_bad[i] = 1;
        }
      }
    }
    for (int v : col_bad) bad_cols += v;
    int64_t bad_rows = 0;
    for (int v : row_bad) bad_rows += v;
    std::printf("LINEAR gemm m=%lld n=%lld k=%lld %-28s bias=%d: %s max err %.4g (vs no-bias result %.4g), %lld bad "
                "(%lld cols, %lld rows), %lld NaN",
                (long long)m, (long long)n, (long long)k, name, with_bias, bad || nan ? "FAIL" : "ok", max_err,
                max_err_nobias, (long long)bad, (long long)bad_cols, (long long)bad_rows, (long long)nan);
    if (bad) {
      int first_bad_col = -1, last_bad_col = -1;
      for (int64_t j = 0; j < n; ++j) {
        if (col_bad[j]) {
          if (first_bad_col < 0) first_bad_col = int(j);
          last_bad_col = int(j);
        }
      }
      const double acc = ref.acc[first_i * n + first_j] * alpha;
      std::printf("; bad cols %d..%d; first (%lld, %lld): got %.6g, alpha*acc %.6g, bias[n] %.6g, diff/bias %.4g",
                  first_bad_col, last_bad_col, (long long)first_i, (long long)first_j, got[first_i * n + first_j], acc,
                  bias_f[first_j], (got[first_i * n + first_j] - acc) / bias_f[first_j]);
      if (first_i < n) std::printf(", bias[m] %.6g", bias_f[first_i]);
    }
    std::printf("\n");
    return bad == 0 && nan == 0;
  };

  for (bool with_bias : {false, true}) {
    // The library function.
    VQAD_CUDA_CHECK(cudaMemset(dd.get(), 0xFF, m * n * 4));
    const void* bias_ptr = with_bias ? dbias.get() : nullptr;
    const size_t ws_bytes = kl::gemm_workspace_bytes(m, n, bias_ptr, dd.get());
    kl::gemm_bf16_nt(da.get(), db.get(), bias_ptr, dd.get(), m, n, k, dab.get<float>(), ws.get(), ws_bytes, nullptr);
    char name[64];
    std::snprintf(name, sizeof(name), "kl::gemm_bf16_nt%s%s", bias_misaligned ? " bias+2B" : "",
                  ws_bytes > kl::kGemmWorkspaceBytes ? " (staged)" : "");
    if (!evaluate(name, with_bias, false)) PG_FAIL("gemm_bf16_nt m=%lld n=%lld k=%lld bias=%d", (long long)m,
                                                  (long long)n, (long long)k, with_bias);
  }
  // Diagnostic variants (bias on).
  GemmVariant variants[] = {{"lt default bias type", false}, {"lt host alpha", true, true},
                            {"lt f32 out + f32 bias", true, false, true}};
  for (const GemmVariant& v : variants) {
    VQAD_CUDA_CHECK(cudaMemset(dd.get(), 0xFF, m * n * 4));
    if (gemm_variant(v, da.get(), db.get(), v.f32_out ? dbias32.get() : dbias.get(), dd.get(), m, n, k,
                     dab.get<float>(), ab_host, ws.get(), kl::kGemmWorkspaceBytes, nullptr)) {
      evaluate(v.name, true, v.f32_out);
    }
  }
  {  // fp32 D without epilogue, then the bias + bf16 rounding kernel
    GemmVariant v{"lt f32 out, bias kernel", true, false, true};
    DeviceBuffer d32(m * n * 4);
    VQAD_CUDA_CHECK(cudaMemset(dd.get(), 0xFF, m * n * 4));
    if (gemm_variant(v, da.get(), db.get(), nullptr, d32.get(), m, n, k, dab.get<float>(), ab_host, ws.get(),
                     kl::kGemmWorkspaceBytes, nullptr)) {
      bias_to_bf16_kernel<<<256, 256>>>(d32.get<float>(), dbias.get<uint16_t>(), m, n, dd.get<uint16_t>());
      evaluate(v.name, true, false);
    }
  }
  int n_algos = 0;
  GemmVariant probe{"probe"};
  VQAD_CUDA_CHECK(cudaMemset(dd.get(), 0xFF, m * n * 4));
  gemm_variant(probe, da.get(), db.get(), dbias.get(), dd.get(), m, n, k, dab.get<float>(), ab_host, ws.get(),
               kl::kGemmWorkspaceBytes, &n_algos);
  for (int i = 1; i < std::min(n_algos, 3); ++i) {
    GemmVariant v{"lt heuristic algo #", true};
    v.algo = i;
    char name[64];
    std::snprintf(name, sizeof(name), "lt heuristic algo #%d/%d", i, n_algos);
    v.name = name;
    VQAD_CUDA_CHECK(cudaMemset(dd.get(), 0xFF, m * n * 4));
    if (gemm_variant(v, da.get(), db.get(), dbias.get(), dd.get(), m, n, k, dab.get<float>(), ab_host, ws.get(),
                     kl::kGemmWorkspaceBytes, nullptr)) {
      evaluate(name, true, false);
    }
  }
}

// The forward pipeline of ops/nvfp4_linear.cpp (forward_cuda) with the kernels, against
// an emulation of forward_cpu: bf16(alpha * (X_u . W_u^T) + bf16(b)), then the input dtype.
void linear_forward_case(bool x_f32, int mode, bool with_bias, int64_t n) {
  const int64_t m = 303, k = 160;
  std::vector<float> x = heavy(m * k, 10);
  std::vector<float> w = heavy(n * k, 11);
  for (auto& v : w) v *= 0.03f;
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> bias(n);
  for (auto& v : bias) v = bf16_round(nd(rng));
  if (!x_f32) {
    for (auto& v : x) v = bf16_round(v);
  }
  const float act_amax = 6.5f;
  const float s_enc_x = mode == 0 ? nvr::encode_scale_from_amax(bf16_amax_cpu(x))
                                  : (mode == 1 ? nvr::encode_scale_from_amax(act_amax) : 1.0f);
  const float s_enc_w = nvr::encode_scale_from_amax(bf16_amax_cpu(w));
  const float alpha = (1.0f / s_enc_x) * (1.0f / s_enc_w);
  const std::vector<float> xu = unit_operand_cpu(x, m, k, s_enc_x), wu = unit_operand_cpu(w, n, k, s_enc_w);
  const GemmRef ref = gemm_ref(xu, wu, m, n, k);
  // CPU emulation with an fp32 sequential accumulation (what a plain sgemm does).
  std::vector<float> cpu(m * n), cpu64(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0;
      for (int64_t t = 0; t < k; ++t) s += xu[i * k + t] * wu[j * k + t];
      s *= alpha;
      if (with_bias) s += bias[j];
      cpu[i * n + j] = bf16_round(s);
      double d = float(ref.acc[i * n + j]) * alpha;
      if (with_bias) d = float(d) + bias[j];
      cpu64[i * n + j] = bf16_round(float(d));
    }
  }
  // GPU pipeline.
  DeviceBuffer dx(m * k * 4), dw(n * k * 4), dbias(n * 2), dscal(32), dxu(m * k * 2), dwu(n * k * 2), dy(m * n * 2),
      ws(kl::kGemmWorkspaceBytes + size_t(m) * n * 4 + 256);
  if (x_f32) {
    dx.upload(x.data(), m * k * 4);
  } else {
    std::vector<uint16_t> xh(m * k);
    for (int64_t i = 0; i < m * k; ++i) xh[i] = bf16_bits(x[i]);
    dx.upload(xh.data(), m * k * 2);
  }
  dw.upload(w.data(), n * k * 4);
  std::vector<uint16_t> bh(n);
  for (int64_t j = 0; j < n; ++j) bh[j] = bf16_bits(bias[j]);
  dbias.upload(bh.data(), n * 2);
  VQAD_CUDA_CHECK(cudaMemset(dscal.get(), 0, 32));
  float* s = dscal.get<float>();
  const bool dynamic = mode == 0;
  const kl::ElemType xt = x_f32 ? kl::ElemType::kF32 : kl::ElemType::kBF16;
  if (dynamic) kl::launch_bf16_amax(dx.get(), xt, m * k, s + 0, nullptr);
  kl::launch_bf16_amax(dw.get(), kl::ElemType::kF32, n * k, s + 1, nullptr);
  kl::launch_linear_scales(dynamic ? s + 0 : nullptr, dynamic ? 0.0f : s_enc_x, s + 1, s + 2, nullptr);
  kl::launch_unit_operand(dx.get(), xt, m, k, s + 2, dxu.get(), nullptr);
  kl::launch_unit_operand(dw.get(), kl::ElemType::kF32, n, k, s + 3, dwu.get(), nullptr);
  const void* bias_ptr = with_bias ? dbias.get() : nullptr;
  kl::gemm_bf16_nt(dxu.get(), dwu.get(), bias_ptr, dy.get(), m, n, k, s + 4, ws.get(),
                   kl::gemm_workspace_bytes(m, n, bias_ptr, dy.get()), nullptr);
  const auto yh = dy.download<uint16_t>(m * n);
  const auto scal = dscal.download<float>(8);
  int64_t same_cpu = 0, same_cpu64 = 0, out_tol = 0;
  float cmax = 0;
  for (float v : cpu) cmax = std::max(cmax, std::fabs(v));
  double max_err = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    const float g = bf16_value(yh[i]);
    same_cpu += g == cpu[i];
    same_cpu64 += g == cpu64[i];
    const double tol = std::fabs(cpu[i]) * std::ldexp(1.0, -7) + 1e-5 * cmax;
    max_err = std::max(max_err, double(std::fabs(g - cpu[i])));
    out_tol += !(std::fabs(g - cpu[i]) <= tol);
  }
  const char* mn[] = {"dynamic", "static", "unit"};
  const bool pass = out_tol == 0 && same_cpu > 0.9 * m * n;
  std::printf("LINEAR forward N=%lld x=%s %-7s bias=%d: %s identical to the fp32-sgemm emulation %.4f, "
              "to float64-acc %.4f, out of tol %lld, max err %.4g; scales x %.8g/%.8g w %.8g/%.8g alpha %.8g/%.8g\n",
              (long long)n, x_f32 ? "f32 " : "bf16", mn[mode], with_bias, pass ? "ok" : "FAIL",
              double(same_cpu) / (m * n), double(same_cpu64) / (m * n), (long long)out_tol, max_err, scal[2], s_enc_x,
              scal[3], s_enc_w, scal[4], alpha);
  if (!pass) PG_FAIL("linear forward N=%lld x=%s mode %s bias=%d", (long long)n, x_f32 ? "f32" : "bf16", mn[mode],
                     with_bias);
}

void check_linear() {
  int ver = int(cublasLtGetVersion());
  std::printf("cuBLASLt version %d\n", ver);
  const int64_t shapes[][3] = {{301, 77, 96},   {303, 83, 160}, {301, 80, 96},     {304, 88, 96}, {256, 128, 128},
                               {77, 301, 96},   {64, 8, 32},    {100, 24, 48},     {1000, 1536, 256}};
  uint32_t seed = 8;
  for (const auto& s : shapes) linear_gemm_case(s[0], s[1], s[2], seed += 3);
  linear_gemm_case(301, 80, 96, seed += 3, true);  // 16-byte aligned rows, misaligned bias
  for (int64_t n : {83, 88}) {
    for (int mode = 0; mode < 3; ++mode) {
      for (bool x_f32 : {true, false}) {
        for (bool with_bias : {true, false}) linear_forward_case(x_f32, mode, with_bias, n);
      }
    }
  }
}
#endif  // PG_KERNELS_ONLY

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp prop{};
  VQAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  std::string golden;
  bool check = false, time = false, linear = false, profile = false;
  const char* label = "new";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "check") check = true;
    else if (a == "time") time = true;
    else if (a == "linear") linear = true;
    else if (a == "profile") profile = true;
    else if (a == "golden" && i + 1 < argc) golden = argv[++i];
    else if (a == "label" && i + 1 < argc) label = argv[++i];
  }
  try {
#ifndef PG_KERNELS_ONLY
    if (check) check_e2m1_exhaustive();
#endif
    if (check) check_random();
    if (!golden.empty()) check_golden(golden);
    if (check || time) {
      for (const auto& [M, K] : {std::pair<int64_t, int64_t>{31200, 1536}, {31200, 8960}}) {
        BigCase c;
        c.M = M;
        c.K = K;
        big_alloc(c, 20261129u + uint32_t(K));
        if (check) big_check(c);
        if (time) big_time(c, label);
        big_free(c);
      }
    }
#ifndef PG_KERNELS_ONLY
    if (linear) check_linear();
#else
    (void)linear;
#endif
    if (profile) {  // one launch of each kernel at [31200, 8960], for a profiler
      BigCase c;
      c.M = 31200;
      c.K = 8960;
      big_alloc(c, 1u);
      const kn::TensorView xv = kn::dense_view(c.x, kn::DType::kBF16, c.M, c.K);
      const kn::TensorView yv = kn::dense_view(c.y, kn::DType::kBF16, c.M, c.K);
      kn::QuantizeOutputs qo;
      qo.packed_codes = c.codes;
      qo.scales_linear = c.scales;
      qo.scales_swizzled = c.swz;
      kn::launch_fake_quantize(xv, yv, kn::EncodeScale{}, nullptr);
      kn::launch_quantize(xv, kn::EncodeScale{}, qo, nullptr);
      kn::launch_amax(xv, c.amax, nullptr);
      VQAD_CUDA_CHECK(cudaDeviceSynchronize());
      big_free(c);
    }
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    ++g_failures;
  }
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
