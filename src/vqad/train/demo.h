// `vqad demo`: the QAD recipe end to end at tiny scale on synthetic data, on CPU in
// a few minutes: a BF16 teacher is trained (stage 0) and exported, stage 1
// (Attn-QAT + NVFP4 linear QAT SFT from the teacher) runs and is exported, the
// lineage is printed and verified, and a report compares on held-out samples the
// teacher, NVFP4 post-training quantization of the teacher (no training), and the
// QAT student; stage 2 (DMD2, 3-step NVFP4 student) follows and the report compares its
// samples with the many-step teacher's on held-out prompts.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

namespace vqad::train {

struct DemoOptions {
  std::string out = "vqad-demo";
  torch::Device device = torch::kCPU;
  int64_t train_rows = 64;
  int64_t heldout_rows = 16;
  long teacher_steps = 0;  // 0: as in configs/demo/teacher.yaml
  long stage1_steps = 0;   // 0: as in configs/demo/stage1_attn_qat_sft.yaml
  long stage2_steps = 0;   // 0: as in configs/demo/stage2_dmd.yaml
  bool stage2 = true;      // run stage 2 (DMD2)
  // Keep --out and skip every stage whose export is already there (re-run a later stage
  // after editing its recipe: delete that stage's export first).
  bool reuse = false;
  std::vector<std::string> stage2_set;  // "a.b=value" overrides of the stage-2 recipe
  bool progress = true;
};

struct DemoReport {
  double teacher_loss = 0, ptq_loss = 0, qat_loss = 0;       // held-out flow-matching loss
  double ptq_error = 0, qat_error = 0;                       // ||v - v_teacher||^2 / ||v_teacher||^2
  double teacher_train_first = 0, teacher_train_last = 0;    // stage-0 loss, first/last 10 steps mean
  double stage1_train_first = 0, stage1_train_last = 0;
  double seconds = 0;
  bool lineage_verified = false;
  std::string stage1_export;
  // Stage 2 (DMD2): samples of each sampler vs the 48-step CFG teacher's from the same
  // initial noise: feature distance (diagonal, standardized; 0 = same moments) and
  // relative MSE ||x - x_ref||^2 / ||x_ref||^2.
  bool stage2_ran = false;
  int64_t samples = 0;
  double stage2_train_first = 0, stage2_train_last = 0;
  double fd_teacher_3 = 0, fd_stage1_3 = 0, fd_dmd_3 = 0;
  double mse_teacher_3 = 0, mse_stage1_3 = 0, mse_dmd_3 = 0;
};

DemoReport run_demo(const DemoOptions& options);
// The report as a table (what `vqad demo` prints last).
std::string demo_report_text(const DemoReport& r);

}  // namespace vqad::train
