// SHA-256 (FIPS 180-4), torch-free. Used for config hashes, file hashes in
// checkpoint metadata and lineage checks.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace vqad {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::array<uint8_t, 32> digest();  // finalizes; the object must not be updated after
  std::string hex_digest();          // lowercase hex of digest()

 private:
  void compress(const uint8_t* block);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
  bool finalized_ = false;
};

std::string sha256_hex(std::string_view data);
// Streams the file; throws vqad::Error naming the path if it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace vqad
