#include "vqad/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/core/sha256.h"

namespace vqad {

std::string write_error_text(int err) {
  std::string s = std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) s += " (the filesystem is full)";
  if (err == EFBIG) s += " (the file size limit of this process, ulimit -f, was reached)";
  if (err == EROFS) s += " (read-only filesystem)";
  return s;
}

std::string write_file_hashed(const std::string& path, const std::vector<std::string_view>& parts) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("writing ", path, ": cannot create: ", write_error_text(errno));
  std::string digest;
  std::thread hasher([&] {
    Sha256 h;
    for (auto part : parts) h.update(part.data(), part.size());
    digest = h.hex_digest();
  });
  int err = 0;
  std::string what;
  constexpr size_t kChunk = size_t(64) << 20;
  for (auto part : parts) {
    const char* p = part.data();
    size_t left = part.size();
    while (left > 0 && !err) {
      const ssize_t w = ::write(fd, p, std::min(left, kChunk));
      if (w < 0) {
        if (errno == EINTR) continue;
        err = errno;
        what = "write failed";
        break;
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
    if (err) break;
  }
  if (!err && ::fsync(fd) != 0) {
    err = errno;
    what = "fsync failed";
  }
  if (::close(fd) != 0 && !err) {
    err = errno;
    what = "close failed";
  }
  hasher.join();
  if (err) {
    ::unlink(path.c_str());
    fail("writing ", path, ": ", what, ": ", write_error_text(err));
  }
  return digest;
}

}  // namespace vqad
