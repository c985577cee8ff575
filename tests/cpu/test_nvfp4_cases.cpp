// The case generator of the NVFP4 kernel checks (tests/support/nvfp4_cases.h), which the GPU
// test and the kernel playground share: every layout places each logical element where its
// view says and leaves every other byte poisoned; the distributions hold what their names
// promise (ties on E2M1 midpoints under an exact block scale, all-zero blocks, infinities,
// NaNs) and are reproducible from the seed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "tests/support/nvfp4_cases.h"

namespace {

namespace kn = vqad::kernels::nvfp4;
using vqad::test::Nvfp4Dist;
using vqad::test::Nvfp4Layout;

TEST(Nvfp4Cases, EveryLayoutPlacesEachElementWhereItsViewSaysAndPoisonsTheRest) {
  for (const int64_t rows : {6, 7}) {  // 6: permuted as [3, 2]; 7: no divisor, a plain [1, 7]
    const int64_t cols = 32;
    const std::vector<float> x = vqad::test::nvfp4_case_input(rows * cols, Nvfp4Dist::kNormal, 11);
    for (const kn::DType dt : {kn::DType::kF32, kn::DType::kBF16}) {
      for (const Nvfp4Layout l : {Nvfp4Layout::kDense, Nvfp4Layout::kRowStride, Nvfp4Layout::kMisaligned,
                                  Nvfp4Layout::kPermuted3d}) {
        SCOPED_TRACE(std::string(vqad::test::layout_name(l)) + " " + kn::dtype_name(dt) + " rows " +
                     std::to_string(rows));
        const auto h = vqad::test::lay_out(x, rows, cols, dt, l);
        const size_t es = dt == kn::DType::kBF16 ? 2 : 4;
        ASSERT_EQ(h.view.dtype, dt);
        ASSERT_EQ(h.view.strides[h.view.ndim - 1], 1);
        ASSERT_EQ(h.view.sizes[h.view.ndim - 1], cols);
        int64_t logical_rows = 1;
        for (int d = 0; d + 1 < h.view.ndim; ++d) logical_rows *= h.view.sizes[d];
        ASSERT_EQ(logical_rows, rows);
        if (l == Nvfp4Layout::kPermuted3d && rows == 6) EXPECT_EQ(h.view.ndim, 3);
        std::vector<bool> covered(h.bytes.size(), false);
        for (int64_t r = 0; r < rows; ++r) {
          // Row r of the logical [rows, cols] is index (r / sizes[1], r % sizes[1]) of a 3-d view.
          const auto& v = h.view;
          const int64_t off =
              v.ndim == 3 ? (r / v.sizes[1]) * v.strides[0] + (r % v.sizes[1]) * v.strides[1] : r * v.strides[0];
          for (int64_t c = 0; c < cols; ++c) {
            const size_t at = static_cast<size_t>(off + c) * es;
            ASSERT_LE(at + es, h.bytes.size());
            if (dt == kn::DType::kBF16) {
              uint16_t got;
              std::memcpy(&got, &h.bytes[at], 2);
              ASSERT_EQ(got, vqad::test::bf16_bits(x[r * cols + c])) << "row " << r << " col " << c;
            } else {
              float got;
              std::memcpy(&got, &h.bytes[at], 4);
              ASSERT_EQ(got, x[r * cols + c]) << "row " << r << " col " << c;
            }
            for (size_t k = 0; k < es; ++k) {
              ASSERT_FALSE(covered[at + k]) << "two elements share byte " << at + k;
              covered[at + k] = true;
            }
          }
        }
        size_t gaps = 0;
        for (size_t i = 0; i < h.bytes.size(); ++i)
          if (!covered[i]) {
            ++gaps;
            ASSERT_EQ(h.bytes[i], vqad::test::kPoisonByte) << "gap byte " << i;
          }
        const bool strided = l == Nvfp4Layout::kRowStride || l == Nvfp4Layout::kMisaligned;
        EXPECT_EQ(gaps > 0, strided);
      }
    }
  }
}

TEST(Nvfp4Cases, DistributionsHoldWhatTheirNamesSayAndRepeatForASeed) {
  const int64_t n = 16 * 300;
  for (int d = 0; d <= static_cast<int>(Nvfp4Dist::kTies); ++d) {
    const auto dist = static_cast<Nvfp4Dist>(d);
    SCOPED_TRACE(vqad::test::dist_name(dist));
    const auto x = vqad::test::nvfp4_case_input(n, dist, 5);
    const auto again = vqad::test::nvfp4_case_input(n, dist, 5);
    ASSERT_EQ(std::memcmp(x.data(), again.data(), n * sizeof(float)), 0);
    const auto other = vqad::test::nvfp4_case_input(n, dist, 6);
    EXPECT_NE(std::memcmp(x.data(), other.data(), n * sizeof(float)), 0);
    int inf = 0, nan = 0;
    for (float v : x) inf += std::isinf(v), nan += std::isnan(v);
    EXPECT_EQ(inf > 0, dist == Nvfp4Dist::kInf);
    EXPECT_EQ(nan > 0, dist == Nvfp4Dist::kNaN);
  }
  const auto z = vqad::test::nvfp4_case_input(n, Nvfp4Dist::kZeroBlocks, 3);
  for (int64_t b = 0; b < n / 16; b += 3)
    for (int i = 0; i < 16; ++i) ASSERT_EQ(z[b * 16 + i], 0.0f) << "block " << b;
  // Ties: the first element of each block is 6 * 2^e, the others +-{grid point or midpoint} * 2^e.
  const std::set<float> pts = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 0.0f};
  const auto t = vqad::test::nvfp4_case_input(n, Nvfp4Dist::kTies, 9);
  int midpoints = 0;
  for (int64_t b = 0; b < n / 16; ++b) {
    int e = 0;
    const float m = std::frexp(t[b * 16] / 6.0f, &e);
    ASSERT_EQ(m, 0.5f) << "block " << b << " starts with " << t[b * 16];
    const float sc = t[b * 16] / 6.0f;
    for (int i = 1; i < 16; ++i) {
      const float u = std::fabs(t[b * 16 + i]) / sc;
      ASSERT_TRUE(pts.count(u)) << "block " << b << " element " << i << ": " << u;
      midpoints += u == 0.25f || u == 0.75f || u == 1.25f || u == 1.75f || u == 2.5f || u == 3.5f || u == 5.0f;
    }
  }
  EXPECT_GT(midpoints, n / 8);
}

TEST(Nvfp4Cases, Bf16InputsAreRoundedToNearestEvenAndNaNsBecomeTheQuietNaN) {
  const std::vector<float> x = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -0.0f, std::nanf(""), -INFINITY};
  const auto r = vqad::test::as_input_dtype(x, kn::DType::kBF16);
  EXPECT_EQ(r[0], 1.0f);                  // a tie goes to the even 1.0
  EXPECT_EQ(r[1], 1.0f + 4.0f / 256);     // a tie goes to the even 1 + 2^-6
  EXPECT_TRUE(std::signbit(r[2]) && r[2] == 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &r[3], 4);
  EXPECT_EQ(bits, 0x7FC00000u);
  EXPECT_EQ(r[4], -INFINITY);
  EXPECT_EQ(vqad::test::as_input_dtype(x, kn::DType::kF32).size(), x.size());
}

}  // namespace
