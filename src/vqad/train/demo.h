// `vqad demo`: the QAD recipe end to end at tiny scale on synthetic data, on CPU in
// a few minutes: a BF16 teacher is trained (stage 0) and exported, stage 1
// (Attn-QAT + NVFP4 linear QAT SFT from the teacher) runs and is exported, the
// lineage is printed and verified, and a report compares on held-out samples the
// teacher, NVFP4 post-training quantization of the teacher (no training), and the
// QAT student.
#pragma once
#include <torch/torch.h>

#include <string>

namespace vqad::train {

struct DemoOptions {
  std::string out = "vqad-demo";
  torch::Device device = torch::kCPU;
  int64_t train_rows = 64;
  int64_t heldout_rows = 16;
  long teacher_steps = 0;  // 0: as in configs/demo/teacher.yaml
  long stage1_steps = 0;   // 0: as in configs/demo/stage1_attn_qat_sft.yaml
  bool progress = true;
};

struct DemoReport {
  double teacher_loss = 0, ptq_loss = 0, qat_loss = 0;       // held-out flow-matching loss
  double ptq_error = 0, qat_error = 0;                       // ||v - v_teacher||^2 / ||v_teacher||^2
  double teacher_train_first = 0, teacher_train_last = 0;    // stage-0 loss, first/last 10 steps mean
  double stage1_train_first = 0, stage1_train_last = 0;
  double seconds = 0;
  bool lineage_verified = false;
};

DemoReport run_demo(const DemoOptions& options);
// The report as a table (what `vqad demo` prints last).
std::string demo_report_text(const DemoReport& r);

}  // namespace vqad::train
