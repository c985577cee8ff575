// The wgmma shared-memory matrix descriptor encoding of kernels/common/gmma_desc.h, the one
// every sm_90a kernel uses: field positions against a hand-encoded descriptor, the fields
// read back, and the offset form desc_at against desc over the whole shared window.
#include <gtest/gtest.h>

#include <cstdint>

#include "vqad/kernels/common/gmma_desc.h"

namespace g = vqad::kernels::gmma;

namespace {

// Written out bit by bit from the field table: start 0x2400 >> 4 = 0x240 (bits 0-13), LBO
// 16 >> 4 = 1 (bits 16-29), SBO 1024 >> 4 = 64 (bits 32-45), 128-byte swizzle = 1 (62-63).
constexpr uint64_t kHandEncoded = 0x4000004000010240ull;
static_assert(g::desc(0x2400, 16, 1024, g::Swizzle::k128B) == kHandEncoded);
static_assert(g::desc_at(0x2000, 16, 1024, 0x400, g::Swizzle::k128B) == kHandEncoded);

TEST(GmmaDesc, HandEncodedFields) {
  EXPECT_EQ(g::desc(0x2400, 16, 1024, g::Swizzle::k128B), kHandEncoded);
  // No swizzle: the top two bits clear; the ones block of the forward (LBO 128, SBO 256).
  EXPECT_EQ(g::desc(0x2400, 128, 256, g::Swizzle::kNone), 0x0000001000080240ull);
  // The address is taken in the 18-bit shared window (a generic address's high bits drop).
  EXPECT_EQ(g::desc(0x40000 + 0x2400, 16, 1024, g::Swizzle::k128B), kHandEncoded);
}

TEST(GmmaDesc, FieldsReadBack) {
  for (uint32_t addr = 0; addr < (1u << 18); addr += 16 * 37) {
    for (uint32_t lbo : {16u, 128u, 1024u, 8192u, 16384u, 0x3FFF0u}) {
      for (uint32_t sbo : {16u, 256u, 1024u, 0x3FFF0u}) {
        for (g::Swizzle sw : {g::Swizzle::kNone, g::Swizzle::k128B}) {
          const g::Fields f = g::fields(g::desc(addr, lbo, sbo, sw));
          ASSERT_EQ(f.addr, addr);
          ASSERT_EQ(f.lbo, lbo);
          ASSERT_EQ(f.sbo, sbo);
          ASSERT_EQ(f.base_offset, 0u);
          ASSERT_EQ(f.swizzle, static_cast<uint32_t>(sw));
          ASSERT_EQ(f.reserved, 0u) << "addr " << addr << " lbo " << lbo << " sbo " << sbo;
        }
      }
    }
  }
}

// The kernels' operand offsets: every 1024-byte aligned tile of the shared window and every
// 16-byte offset that stays inside it, with the (LBO, SBO) pairs the forward and backward use.
TEST(GmmaDesc, OffsetFormEqualsAddressFormInTheSharedWindow) {
  const uint32_t pairs[][2] = {{16, 1024}, {128 * 128, 1024}, {64 * 128, 1024}, {128, 256}};
  int64_t checked = 0;
  for (const auto& pr : pairs) {
    for (g::Swizzle sw : {g::Swizzle::kNone, g::Swizzle::k128B}) {
      for (uint32_t tile = 0; tile < (1u << 18); tile += 1024) {
        for (uint32_t off = 0; tile + off < (1u << 18); off += 16) {
          const uint64_t a = g::desc_at(tile, pr[0], pr[1], off, sw);
          const uint64_t b = g::desc(tile + off, pr[0], pr[1], sw);
          if (a != b) {
            FAIL() << "tile " << tile << " off " << off << " lbo " << pr[0] << " sbo " << pr[1] << ": desc_at "
                   << std::hex << a << ", desc " << b;
          }
          ++checked;
        }
      }
    }
  }
  // 256 tiles; tile i has (2^18 - 1024 i) / 16 = 64 (256 - i) offsets
  EXPECT_EQ(checked, 4 * 2 * int64_t{64} * (256 * 257 / 2));
}

// The precondition is needed: past the window the offset carries out of the 14-bit field
// (into the reserved bits 14-15), where desc wraps the address instead.
TEST(GmmaDesc, OffsetFormNeedsTheWindowBound) {
  const uint32_t tile = (1u << 18) - 1024, off = 1024;
  EXPECT_NE(g::desc_at(tile, 16, 1024, off, g::Swizzle::k128B), g::desc(tile + off, 16, 1024, g::Swizzle::k128B));
  EXPECT_NE(g::fields(g::desc_at(tile, 16, 1024, off, g::Swizzle::k128B)).reserved, 0u);
}

}  // namespace
