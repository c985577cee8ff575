// The method registry (train/methods/registry.h): names -> registrations, the optimizer
// specs each method declares (dmd2's critic AdamW included), the roles, and the
// per-device peak table that MFU divides by (train/throughput.h).
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "vqad/core/error.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/throughput.h"

using namespace vqad;

namespace {
train::RunConfig stage2_recipe() {
  std::ifstream f(std::string(VQAD_SOURCE_DIR) + "/configs/qad_wan2_1_mixkit/stage2_attn_qat_dmd.yaml");
  return train::parse_run_config(std::string(std::istreambuf_iterator<char>(f), {}));
}
}  // namespace

TEST(MethodRegistry, NamesMapToRegistrationsAndUnknownMethodsAreClearErrors) {
  EXPECT_EQ(train::registered_method_names(),
            (std::vector<std::string>{"sft", "dmd2", "layer_recon", "recon_ode"}));
  for (const auto& name : train::registered_method_names()) {
    const auto* m = train::find_method(name);
    ASSERT_NE(m, nullptr) << name;
    EXPECT_EQ(m->name, name);
    EXPECT_TRUE(m->optimizers && m->create && m->supervision && m->validation_sampler) << name;
  }
  // The reconstruction methods restrict the trainable scope and check the ODE cache / the
  // architecture at load; recon_ode picks the dataset's anchors; dmd2 records a distillation.
  for (const char* name : {"layer_recon", "recon_ode"}) {
    const auto* m = train::find_method(name);
    EXPECT_TRUE(m->validate && m->prepare_roles) << name;
    EXPECT_FALSE(m->records_distillation) << name;
  }
  EXPECT_TRUE(static_cast<bool>(train::find_method("recon_ode")->ode_anchor_indices));
  EXPECT_FALSE(static_cast<bool>(train::find_method("layer_recon")->ode_anchor_indices));
  EXPECT_TRUE(train::find_method("dmd2")->records_distillation);
  EXPECT_EQ(train::find_method("no_such_method"), nullptr);
}

TEST(MethodRegistry, Dmd2DeclaresTheCriticsOwnAdamW) {
  auto run = stage2_recipe();
  run.method.dmd2.fake_score_betas = {0.0, 0.99};
  run.method.dmd2.fake_score_lr_scheduler = train::LrSchedule::kCosine;
  const auto specs = train::method_registration(run).optimizers(run);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].role, "student");
  EXPECT_DOUBLE_EQ(specs[0].learning_rate, run.training.optimizer.learning_rate);
  EXPECT_EQ(specs[0].betas, run.training.optimizer.betas);
  EXPECT_EQ(specs[0].schedule, run.training.optimizer.lr_scheduler);
  EXPECT_EQ(specs[1].role, "critic");
  EXPECT_DOUBLE_EQ(specs[1].learning_rate, run.method.dmd2.fake_score_learning_rate);
  EXPECT_EQ(specs[1].betas, (std::array<double, 2>{0.0, 0.99}));
  EXPECT_EQ(specs[1].schedule, train::LrSchedule::kCosine);
  EXPECT_DOUBLE_EQ(specs[1].weight_decay, run.training.optimizer.weight_decay);
  EXPECT_DOUBLE_EQ(specs[1].eps, run.training.optimizer.eps);
  // Roles: student and critic train and are checkpointed, the teacher is frozen.
  const auto roles = train::method_role_specs(run);
  ASSERT_EQ(roles.size(), 3u);
  EXPECT_TRUE(roles[0].trainable && roles[0].checkpointed);  // student
  EXPECT_FALSE(roles[1].trainable || roles[1].checkpointed);  // teacher
  EXPECT_TRUE(roles[2].trainable && roles[2].checkpointed);  // critic
  EXPECT_FALSE(train::method_registration(run).mfu_is_student_forward_backward);
}

TEST(Throughput, PeakTableMatchesDeviceNameAndCapability) {
  EXPECT_DOUBLE_EQ(train::device_peak_flops("NVIDIA H100 80GB HBM3", 9, 0)->bf16_dense_flops, 989e12);
  EXPECT_DOUBLE_EQ(train::device_peak_flops("NVIDIA H200", 9, 0)->bf16_dense_flops, 989e12);
  EXPECT_DOUBLE_EQ(train::device_peak_flops("NVIDIA H100 PCIe", 9, 0)->bf16_dense_flops, 756e12);
  EXPECT_DOUBLE_EQ(train::device_peak_flops("NVIDIA A100-SXM4-80GB", 8, 0)->bf16_dense_flops, 312e12);
  EXPECT_DOUBLE_EQ(train::device_peak_flops("NVIDIA B200", 10, 0)->bf16_dense_flops, 2250e12);
  EXPECT_FALSE(train::device_peak_flops("NVIDIA H100 80GB HBM3", 8, 0).has_value());  // capability must match
  EXPECT_FALSE(train::device_peak_flops("Some Future GPU", 11, 0).has_value());       // no guess
  EXPECT_FALSE(train::device_peak_flops(torch::Device(torch::kCPU)).has_value());
}
