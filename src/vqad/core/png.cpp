#include "vqad/core/png.h"

#include <array>
#include <fstream>
#include <iterator>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"

namespace vqad::png {

namespace {
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> v{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      v[n] = c;
    }
    return v;
  }();
  return t;
}

void put32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
uint32_t get32(const std::string& s, size_t p) {
  return (uint32_t(uint8_t(s[p])) << 24) | (uint32_t(uint8_t(s[p + 1])) << 16) | (uint32_t(uint8_t(s[p + 2])) << 8) |
         uint32_t(uint8_t(s[p + 3]));
}

void chunk(std::string& out, const char* type, const std::string& data) {
  put32(out, static_cast<uint32_t>(data.size()));
  std::string td = std::string(type, 4) + data;
  out += td;
  put32(out, crc32(reinterpret_cast<const uint8_t*>(td.data()), td.size()));
}

uint32_t adler32(const std::string& d) {
  uint32_t a = 1, b = 0;
  for (unsigned char c : d) {
    a = (a + c) % 65521u;
    b = (b + a) % 65521u;
  }
  return (b << 16) | a;
}

const char kSignature[] = "\x89PNG\r\n\x1a\n";
}  // namespace

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc) {
  const auto& t = crc_table();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void write(const std::string& path, const Image& img) {
  VQAD_CHECK(img.width > 0 && img.height > 0 && img.rgb.size() == size_t(img.width) * img.height * 3, "png ", path,
             ": bad image ", img.width, " x ", img.height, " with ", img.rgb.size(), " bytes");
  std::string raw;  // filter byte 0 + one RGB row per scanline
  raw.reserve(size_t(img.height) * (1 + size_t(img.width) * 3));
  for (int y = 0; y < img.height; ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(&img.rgb[size_t(y) * img.width * 3]), size_t(img.width) * 3);
  }
  std::string z = "\x78\x01";
  for (size_t p = 0; p < raw.size() || p == 0; p += 65535) {
    const size_t n = std::min<size_t>(65535, raw.size() - p);
    const bool last = p + n >= raw.size();
    z.push_back(last ? '\x01' : '\x00');
    z.push_back(static_cast<char>(n & 0xFF));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xFF));
    z.push_back(static_cast<char>((~n >> 8) & 0xFF));
    z.append(raw, p, n);
    if (last) break;
  }
  put32(z, adler32(raw));
  std::string ihdr;
  put32(ihdr, static_cast<uint32_t>(img.width));
  put32(ihdr, static_cast<uint32_t>(img.height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit, truecolour, deflate, filter 0, no interlace
  std::string out(kSignature, 8);
  chunk(out, "IHDR", ihdr);
  chunk(out, "IDAT", z);
  chunk(out, "IEND", "");
  st::write_file_atomic(path, {out});
}

Image read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  VQAD_CHECK(f.good(), "png ", path, ": cannot open");
  const std::string s((std::istreambuf_iterator<char>(f)), {});
  VQAD_CHECK(s.size() >= 8 && s.compare(0, 8, std::string(kSignature, 8)) == 0, "png ", path, ": not a PNG file");
  Image img;
  std::string z;
  for (size_t p = 8; p + 12 <= s.size();) {
    const uint32_t len = get32(s, p);
    VQAD_CHECK(p + 12 + len <= s.size(), "png ", path, ": truncated chunk");
    const std::string type = s.substr(p + 4, 4);
    const uint32_t crc = get32(s, p + 8 + len);
    VQAD_CHECK(crc32(reinterpret_cast<const uint8_t*>(s.data() + p + 4), 4 + len) == crc, "png ", path, ": bad CRC in ",
               type);
    if (type == "IHDR") {
      img.width = static_cast<int>(get32(s, p + 8));
      img.height = static_cast<int>(get32(s, p + 12));
      VQAD_CHECK(s[p + 16] == 8 && s[p + 17] == 2, "png ", path, ": only 8-bit RGB is read");
    } else if (type == "IDAT") {
      z += s.substr(p + 8, len);
    }
    p += 12 + len;
  }
  VQAD_CHECK(img.width > 0 && z.size() >= 6, "png ", path, ": no image data");
  std::string raw;
  size_t q = 2;
  for (;;) {
    VQAD_CHECK(q + 5 <= z.size(), "png ", path, ": truncated deflate stream");
    const uint8_t hdr = uint8_t(z[q]);
    VQAD_CHECK((hdr & 6) == 0, "png ", path, ": compressed blocks are not supported by this reader");
    const size_t n = uint8_t(z[q + 1]) | (size_t(uint8_t(z[q + 2])) << 8);
    raw.append(z, q + 5, n);
    q += 5 + n;
    if (hdr & 1) break;
  }
  VQAD_CHECK(adler32(raw) == get32(z, q), "png ", path, ": bad Adler-32");
  const size_t row = 1 + size_t(img.width) * 3;
  VQAD_CHECK(raw.size() == row * img.height, "png ", path, ": pixel data size mismatch");
  img.rgb.resize(size_t(img.width) * img.height * 3);
  for (int y = 0; y < img.height; ++y) {
    VQAD_CHECK(raw[y * row] == 0, "png ", path, ": only filter type 0 is read");
    std::copy(raw.begin() + long(y * row + 1), raw.begin() + long((y + 1) * row), img.rgb.begin() + long(y * (row - 1)));
  }
  return img;
}

}  // namespace vqad::png
