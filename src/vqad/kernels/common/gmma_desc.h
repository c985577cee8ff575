// wgmma shared-memory matrix descriptors (sm_90a), host and device: one encoding for every
// kernel, and the CPU tests check it (tests/cpu/test_gmma_desc.cpp).
//
//   bits  0-13  start address >> 4 (byte address in the shared window, below 2^18)
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  base offset: 0 (every operand tile is 1024-byte aligned)
//   bits 62-63  swizzle: 1 = 128-byte, 0 = none
//
// desc_at(tile, ..., off) is the descriptor of the operand at tile + off written as the
// tile's encoded fields plus off >> 4 in the start-address field: the same bits as
// desc(tile + off, ...) whenever tile + off < 2^18 (no carry leaves the 14-bit field, bits
// 14-15 stay 0) and both are multiples of 16. In a kernel loop the tile's fields are then
// formed once and each k-step's descriptor is one add; written as desc(tile + off), ptxas
// re-derives every field per wgmma (about 7 uniform instructions each).
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define VQAD_GMMA_HD __host__ __device__ __forceinline__ constexpr
#else
#define VQAD_GMMA_HD inline constexpr
#endif

namespace vqad::kernels::gmma {

enum class Swizzle : uint32_t { kNone = 0, k128B = 1 };

VQAD_GMMA_HD uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, Swizzle sw) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (static_cast<uint64_t>(sw) << 62);
}

VQAD_GMMA_HD uint64_t desc_at(uint32_t tile, uint32_t lbo, uint32_t sbo, uint32_t off, Swizzle sw) {
  const uint32_t lo = ((((tile & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16)) + (off >> 4));
  const uint32_t hi = ((sbo >> 4) & 0x3FFF) | (static_cast<uint32_t>(sw) << 30);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// The fields back (the tests' view of a descriptor).
struct Fields {
  uint32_t addr, lbo, sbo, base_offset, swizzle, reserved;
};
VQAD_GMMA_HD Fields fields(uint64_t d) {
  return Fields{static_cast<uint32_t>(d & 0x3FFF) << 4,
                static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4,
                static_cast<uint32_t>((d >> 49) & 0x7),
                static_cast<uint32_t>(d >> 62),
                // bits that must stay 0: 14-15, 30-31, 46-48, 52-61
                static_cast<uint32_t>(((d >> 14) & 0x3) | (((d >> 30) & 0x3) << 2) | (((d >> 46) & 0x7) << 4) |
                                      (((d >> 52) & 0x3FF) << 7))};
}

}  // namespace vqad::kernels::gmma
