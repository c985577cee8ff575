// The message of the vqad::Error a callable throws, for tests of error paths: "" when it
// throws none (so `EXPECT_NE(error_of(f).find("key"), npos) << error_of(f)` fails with the
// missing text visible, and `.empty()` asserts that nothing was refused). An exception of
// another type (a std::runtime_error of a CUDA call, a c10::Error of torch) is caught too:
// it is a test failure of its own (user-facing errors are vqad::Error), reported with its
// message, and the text returned is "not a vqad::Error: <message>".
#pragma once
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>

#include "vqad/core/error.h"

namespace vqad::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const vqad::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a vqad::Error, found another exception: " << e.what();
    return std::string("not a vqad::Error: ") + e.what();
  }
  return "";
}

}  // namespace vqad::test
