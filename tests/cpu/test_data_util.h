// Helpers shared by the data tests.
#pragma once
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <fstream>
#include <iterator>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <sys/wait.h>

namespace vqad::test_data {

inline std::filesystem::path fresh_dir(const std::string& tag) {
  std::random_device rd;
  auto p = std::filesystem::temp_directory_path() /
           ("vqad_data_" + tag + "_" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

struct CommandResult {
  int status = -1;
  std::string output;
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  int st = pclose(pipe);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Overwrites up to max_bytes of a parquet file's data pages with 0xff, keeping the
// footer (its length sits in the 4 bytes before the trailing "PAR1") intact.
inline void corrupt_data_pages(const std::filesystem::path& path, size_t max_bytes) {
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  ASSERT_GT(bytes.size(), 12u);
  uint32_t footer_len = 0;
  std::memcpy(&footer_len, bytes.data() + bytes.size() - 8, 4);
  const size_t footer_start = bytes.size() - 8 - footer_len;
  ASSERT_GT(footer_start, 4u);
  for (size_t i = 4; i < footer_start && i < 4 + max_bytes; ++i) bytes[i] = char(0xff);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

inline std::string python_exe() {
#ifdef VQAD_PYTHON_EXE
  return VQAD_PYTHON_EXE;
#else
  return "";
#endif
}

// The formulas of scripts/make_parquet_fixture.py.
inline float fixture_latent(int64_t g, int64_t i) { return float(100.0 * g + 0.5 * double(i % 251) - 60.0); }
inline float fixture_text(int64_t g, int64_t i) { return float(double(g) + 0.125 * double(i % 13) - 0.75); }

inline std::string fixture_root() { return std::string(VQAD_SOURCE_DIR) + "/tests/data/fastvideo"; }

}  // namespace vqad::test_data
