// FNV-1a (64-bit) of raw bytes, torch-free: the synthetic dataset's per-word text keys
// (data/synthetic.cpp) and the output digests the kernel playgrounds print, so that two
// builds of a kernel can be shown to produce the same bits on the same fixed inputs. Chain
// several buffers by passing the previous value as `h`. Not a cryptographic hash (sha256.h).
#pragma once
#include <cstddef>
#include <cstdint>

namespace vqad {

inline constexpr uint64_t kFnv1aOffset = 1469598103934665603ull;

inline uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = kFnv1aOffset) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

}  // namespace vqad
