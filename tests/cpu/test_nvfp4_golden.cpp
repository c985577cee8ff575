// The public golden vectors (testdata/nvfp4_golden_public.safetensors, made by an
// independent implementation) reproduced bit-exactly by the scalar reference and
// by the kernels' shared arithmetic compiled for the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "vqad/core/safetensors.h"
#include "vqad/kernels/common/nvfp4_math.h"
#include "vqad/numerics/nvfp4.h"

namespace nv = vqad::nvfp4;
namespace km = vqad::kernels::nvfp4;

namespace {

const std::string kGolden = std::string(VQAD_GOLDEN_FILE);

template <typename T>
std::vector<T> read_tensor(const vqad::st::File& f, const std::string& name, vqad::st::DType dtype,
                           const std::vector<int64_t>& shape) {
  EXPECT_TRUE(f.contains(name)) << kGolden << " has no tensor " << name;
  const auto& info = f.info(name);
  EXPECT_EQ(info.dtype, dtype) << name;
  EXPECT_EQ(info.shape, shape) << name;
  std::vector<T> out(info.nbytes / sizeof(T));
  std::memcpy(out.data(), f.data(name), info.nbytes);
  return out;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Section {
  std::vector<float> x, y;
  std::vector<uint8_t> codes, scales;
  std::vector<float> s_enc;  // per row (reference)
  std::vector<float> amax;   // per row (dynamic only)
  int64_t rows = 0;
};

Section load_section(const vqad::st::File& f, bool dynamic) {
  using vqad::st::DType;
  const std::string p = dynamic ? "g_" : "";
  Section s;
  s.rows = f.info(p + "x").shape.at(0);
  s.x = read_tensor<float>(f, p + "x", DType::F32, {s.rows, 16});
  s.y = read_tensor<float>(f, p + "y", DType::F32, {s.rows, 16});
  s.codes = read_tensor<uint8_t>(f, p + "codes", DType::U8, {s.rows, 16});
  s.scales = read_tensor<uint8_t>(f, p + "scale_bits", DType::U8, {s.rows});
  s.s_enc.assign(s.rows, 1.0f);
  if (dynamic) {
    s.amax = read_tensor<float>(f, "g_tensor_amax", DType::F32, {s.rows});
    for (int64_t r = 0; r < s.rows; ++r) s.s_enc[r] = nv::encode_scale_from_amax(s.amax[r]);
  }
  return s;
}

// Compares one row's result with the golden row; returns the number of mismatching fields.
int compare_row(const Section& s, int64_t r, uint32_t scale_bits, const uint8_t* codes,
                const float* values, const char* path) {
  int bad = 0;
  if (scale_bits != s.scales[r]) {
    ADD_FAILURE() << path << " row " << r << ": scale byte " << scale_bits << ", golden "
                  << int(s.scales[r]);
    ++bad;
  }
  for (int i = 0; i < 16 && bad < 3; ++i) {
    const size_t k = r * 16 + i;
    if (codes[i] != s.codes[k]) {
      ADD_FAILURE() << path << " row " << r << " elem " << i << " x=" << s.x[k] << ": code "
                    << int(codes[i]) << ", golden " << int(s.codes[k]);
      ++bad;
    }
    const bool both_nan = std::isnan(values[i]) && std::isnan(s.y[k]);
    if (!both_nan && bits_of(values[i]) != bits_of(s.y[k])) {
      ADD_FAILURE() << path << " row " << r << " elem " << i << " x=" << s.x[k] << ": value "
                    << values[i] << ", golden " << s.y[k];
      ++bad;
    }
  }
  return bad;
}

void check_reference(const Section& s, const char* what) {
  int bad_rows = 0;
  for (int64_t r = 0; r < s.rows && bad_rows < 10; ++r) {
    const nv::BlockQuant q = nv::quantize_block(&s.x[r * 16], s.s_enc[r]);
    if (compare_row(s, r, q.scale_bits, q.codes, q.values, what)) ++bad_rows;
  }
  EXPECT_EQ(bad_rows, 0);
}

void check_kernel_math(const Section& s, const char* what) {
  int bad_rows = 0;
  for (int64_t r = 0; r < s.rows && bad_rows < 10; ++r) {
    const float* x = &s.x[r * 16];
    uint32_t m = 0;
    for (int i = 0; i < 16; ++i) m = std::max(m, km::abs_bits(x[i]));
    const float s_enc = s.amax.empty() ? 1.0f : km::encode_scale_from_amax(s.amax[r]);
    const km::BlockScale b = km::block_scale(m, s_enc);
    uint8_t codes[16];
    float values[16];
    for (int i = 0; i < 16; ++i) {
      codes[i] = static_cast<uint8_t>(km::element_code(x[i], b));
      values[i] = km::code_value(codes[i], b);
    }
    if (compare_row(s, r, b.bits, codes, values, what)) ++bad_rows;
  }
  EXPECT_EQ(bad_rows, 0);
}

}  // namespace

TEST(Nvfp4Golden, UnitModeReference) {
  const auto f = vqad::st::File::open(kGolden);
  const Section s = load_section(f, false);
  ASSERT_GT(s.rows, 1000);
  check_reference(s, "unit/reference");
}

TEST(Nvfp4Golden, DynamicModeReference) {
  const auto f = vqad::st::File::open(kGolden);
  const Section s = load_section(f, true);
  ASSERT_GT(s.rows, 100);
  // g_tensor_amax is the amax of the 64-row tensor each row belongs to.
  const int64_t group = std::stoll(f.metadata().at("rows_per_global_tensor"));
  ASSERT_EQ(s.rows % group, 0);
  const auto amax = read_tensor<float>(f, "g_tensor_amax", vqad::st::DType::F32, {s.rows});
  for (int64_t g = 0; g < s.rows / group; ++g) {
    const float a = nv::amax(&s.x[g * group * 16], group * 16);
    for (int64_t r = g * group; r < (g + 1) * group; ++r) ASSERT_EQ(amax[r], a) << "row " << r;
  }
  check_reference(s, "dynamic/reference");
}

TEST(Nvfp4Golden, KernelArithmeticOnHost) {
  const auto f = vqad::st::File::open(kGolden);
  check_kernel_math(load_section(f, false), "unit/kernel-math");
  check_kernel_math(load_section(f, true), "dynamic/kernel-math");
}

TEST(Nvfp4Golden, DequantizeFromGoldenCodes) {
  const auto f = vqad::st::File::open(kGolden);
  for (bool dynamic : {false, true}) {
    const Section s = load_section(f, dynamic);
    std::vector<float> y(s.rows * 16);
    int bad = 0;
    for (int64_t r = 0; r < s.rows; ++r) {
      nv::dequantize_matrix(&s.codes[r * 16], &s.scales[r], 1, 16, s.s_enc[r], &y[r * 16]);
    }
    for (size_t k = 0; k < y.size() && bad < 10; ++k) {
      if (!(std::isnan(y[k]) && std::isnan(s.y[k])) && bits_of(y[k]) != bits_of(s.y[k])) {
        ADD_FAILURE() << (dynamic ? "dynamic" : "unit") << " element " << k << ": " << y[k]
                      << ", golden " << s.y[k];
        ++bad;
      }
    }
  }
}

// The in-tree copy of the golden file (used where the shared test data is not beside
// the checkout) must stay byte-identical to the shared original.
TEST(Nvfp4Golden, InTreeCopyMatchesSharedFile) {
  const std::string shared = std::string(VQAD_SHARED_DIR) + "/testdata/nvfp4_golden_public.safetensors";
  const std::string copy = std::string(VQAD_SOURCE_DIR) + "/tests/data/nvfp4_golden_public.safetensors";
  if (!std::ifstream(shared).good()) GTEST_SKIP() << "shared test data not beside the checkout";
  std::ifstream a(shared, std::ios::binary), b(copy, std::ios::binary);
  ASSERT_TRUE(b.good()) << copy;
  const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_EQ(sa.size(), sb.size());
  EXPECT_TRUE(sa == sb) << copy << " differs from " << shared;
}
