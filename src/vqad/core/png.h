// Minimal PNG writer (8-bit RGB, no compression: zlib "stored" blocks), for sample grids
// and plots without an image library. The reader reads back what the writer writes
// (stored blocks only) and checks every CRC and the Adler-32; it is for tests and tools.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace vqad::png {

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel
  Image() = default;
  Image(int w, int h, uint8_t fill = 0) : width(w), height(h), rgb(size_t(w) * h * 3, fill) {}
  uint8_t* at(int x, int y) { return &rgb[(size_t(y) * width + x) * 3]; }
};

// Atomic (temporary file + rename); errors name the path.
void write(const std::string& path, const Image& image);
Image read(const std::string& path);
uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);

}  // namespace vqad::png
