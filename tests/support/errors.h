// The message of the vqad::Error a callable throws, for tests of error paths: "" when it
// throws none (so `EXPECT_NE(error_of(f).find("key"), npos) << error_of(f)` fails with the
// missing text visible, and `.empty()` asserts that nothing was refused).
#pragma once
#include <functional>
#include <string>

#include "vqad/core/error.h"

namespace vqad::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const vqad::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace vqad::test
