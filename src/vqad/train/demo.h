// `vqad demo`: the QAD recipe end to end at tiny scale on synthetic data, on CPU in
// a few minutes: a BF16 teacher is trained (stage 0) and exported, stage 1
// (Attn-QAT + NVFP4 linear QAT SFT from the teacher) runs and is exported, the
// lineage is printed and verified, and a report compares on held-out samples the
// teacher, NVFP4 post-training quantization of the teacher (no training), and the
// QAT student; stage 2 (DMD2, 3-step NVFP4 student) follows and the report compares its
// samples with the many-step teacher's on held-out prompts.
//
// `--recipe sparse` runs the sparse QAD lineage (configs/sparse_qad/*) at tiny scale
// instead: teacher -> ODE cache of the teacher (anchors 0, 16, 32 of 48 shift-8 steps)
// -> S0 layer_recon (ATTN_QAT_TRAIN + NVFP4) -> S1 recon_ode (VSA_QAT_TRAIN_C128, the CPU
// reference, sparsity 0.9) -> S2 DMD2 (3 steps on the exact shifted schedule), each
// stage exported; the report gives the per-block output error vs the teacher (PTQ, S0,
// S1), the 3-step sample distance to the 48-step teacher (teacher Euler, S1, S2) and
// `lineage --verify` of the three exports.
//
// Both demos draw multi-modal synthetic data (data::SynthOptions::modes): each caption's
// videos come from a few well-separated modes plus per-row detail, so that few steps
// of the teacher's Euler solver average modes and wash out detail.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

namespace vqad::train {

// The valid values of DemoOptions::recipe.
inline constexpr const char* kDemoRecipes = "dense, sparse";

struct DemoOptions {
  std::string out = "vqad-demo";
  std::string recipe = "dense";  // dense | sparse (anything else: an error listing both)
  torch::Device device = torch::kCPU;
  int64_t train_rows = 64;
  int64_t heldout_rows = 16;
  long teacher_steps = 0;  // 0: as in configs/demo/teacher.yaml
  long stage1_steps = 0;   // 0: as in configs/demo/stage1_attn_qat_sft.yaml
  long stage2_steps = 0;   // 0: as in configs/demo/stage2_dmd.yaml (sparse: sparse_stage2_dmd2.yaml)
  long stage0_steps = 0;   // sparse: S0 (layer_recon) step count; 0: as in its recipe
  int64_t ode_trajectories = 0;  // sparse: ODE-cache trajectories; 0: as in its recipe
  int64_t eval_noises = 4;  // initial noises per held-out prompt in the sample comparison
  int64_t batch_size = 0;   // every stage's train_batch_size; 0: as in the recipes
  bool stage2 = true;      // run stage 2 (DMD2)
  // Keep --out and skip every stage whose export is already there (re-run a later stage
  // after editing its recipe: delete that stage's export first).
  bool reuse = false;
  std::vector<std::string> stage1_set;  // "a.b=value" overrides of the stage-1 recipe (sparse: S1 recon_ode)
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
  // Detail ratio: mean |finite difference| (t, h, w) of the samples over the reference's
  // (1 = as sharp as the 48-step teacher; < 1 = blurred, e.g. averaged modes).
  double detail_teacher_3 = 0, detail_stage1_3 = 0, detail_dmd_3 = 0;
  // --recipe sparse: S1's starting point (the S0 export under the student's VSA-QAT
  // attention) with the same 3-step shifted sampler, so the table shows what S1 bought.
  bool stage0_sampled = false;
  double fd_stage0_3 = 0, mse_stage0_3 = 0, detail_stage0_3 = 0;

  // --recipe sparse.
  std::string recipe = "dense";
  struct BlockError {
    std::string model;
    std::vector<double> per_block;  // ||s_l(h_l) - h_{l+1}||^2 / ||h_{l+1} - h_l||^2
    double mean = 0;
  };
  std::vector<BlockError> block_errors;  // PTQ dense, S0, PTQ sparse, S1
  int64_t ode_trajectories = 0;
  double stage0_train_first = 0, stage0_train_last = 0;
  std::vector<std::pair<std::string, double>> stage_seconds;  // stage -> wall seconds
  std::vector<std::pair<std::string, bool>> exports_verified;  // S0, S1, S2 export -> lineage --verify
  std::string stage2_lineage;  // lineage_text of the S2 export
  std::vector<std::string> stage2_chain;  // methods of the S2 chain, newest first
};

// Throws vqad::Error (one line listing kDemoRecipes) unless `recipe` is valid.
void check_demo_recipe(const std::string& recipe);

DemoReport run_demo(const DemoOptions& options);
// The report as a table (what `vqad demo` prints last).
std::string demo_report_text(const DemoReport& r);

}  // namespace vqad::train
