// Errors with context. Every user-facing failure in vqad is a vqad::Error whose
// message names the thing at fault (file, key, tensor), what was expected and
// what was found. Code below the CLI throws; the CLI prints and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace vqad {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// fail("file ", path, ": expected ", a, ", found ", b) -> throws vqad::Error.
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace vqad

// VQAD_CHECK(cond, "tensor ", name, ": expected ...") throws vqad::Error if !cond.
#define VQAD_CHECK(cond, ...)                 \
  do {                                        \
    if (!(cond)) ::vqad::fail(__VA_ARGS__);   \
  } while (0)
