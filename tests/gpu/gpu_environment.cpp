// The GPU suite on a machine without a GPU: every test reports SKIPPED (GTEST_SKIP in the
// global environment's SetUp skips them all) instead of failing on its first CUDA call.
#include <gtest/gtest.h>

#include "vqad/kernels/common/device.h"

namespace {

class RequireCudaDevice : public ::testing::Environment {
 public:
  void SetUp() override {
    if (vqad::kernels::device_count() == 0)
      GTEST_SKIP() << "no CUDA device visible: the GPU tests run on a GPU machine";
  }
};

[[maybe_unused]] ::testing::Environment* const kRequireCudaDevice =
    ::testing::AddGlobalTestEnvironment(new RequireCudaDevice);

}  // namespace
