// The training loop: config -> roles -> method -> steps -> checkpoints.
//
// Per optimizer step: for each of gradient_accumulation_steps micro-batches, the
// next batch from the loader, the method's loss (divided by the accumulation count)
// and backward; then per trainable role the global grad norm (clipped when the
// grad_clip callback is on), a NaN/Inf guard that names the role and the offending
// tensors and stops before the weights change, the LR of the schedule, the AdamW
// step. Metrics go to <output_dir>/metrics.jsonl, checkpoints to
// <output_dir>/checkpoint-<step>/ every training_state_checkpointing_steps and at
// the end.
//
// Determinism: one torch CPU generator seeded with training.data.seed draws every
// random number of the method (see the method's draw order); its state, the data
// position and the optimizer are in each checkpoint, so a resumed run reproduces
// the losses of an uninterrupted one.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vqad/train/config.h"
#include "vqad/train/roles.h"

namespace vqad::train {

struct TrainerOptions {
  torch::Device device = torch::kCPU;
  bool progress = true;         // progress bar on stderr
  bool dry_run = false;         // validate + build + print, no steps
  bool overwrite_run = false;   // a new run may replace a previous run in output_dir
  bool async_checkpoints = true;  // checkpoint files written on a background thread
  // GPU runs: bitwise-reproducible algorithms (train/determinism.h); false: torch's defaults.
  bool deterministic = true;
  // Progress lines on stdout when it is not a terminal (batch jobs): every N steps or
  // M seconds, whichever comes first (0 disables that trigger).
  long log_every_steps = 10;
  double log_every_s = 60.0;
};

struct TrainSummary {
  long first_step = 0;          // first step run by this invocation
  long last_step = 0;
  std::vector<double> losses;   // per step run here
  std::vector<std::string> checkpoints;  // written here
  double seconds = 0;
  int stop_signal = 0;          // SIGTERM / SIGINT that stopped the run early (0: ran to the end)
  double checkpoint_stall_s = 0;  // training time spent blocked in checkpoint saves
};

class Trainer {
 public:
  Trainer(RunConfig run, TrainerOptions options);
  ~Trainer();
  TrainSummary run();
  // Writes the resolved config, quant plan and a memory estimate to stdout.
  void print_dry_run() const;
  const std::map<std::string, std::shared_ptr<Role>>& roles() const { return roles_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RunConfig run_;
  TrainerOptions options_;
  std::map<std::string, std::shared_ptr<Role>> roles_;
};

// A trainer checkpoint (or its role directory) -> a Diffusers transformer directory
// with metadata (checkpoint_state inference_export) usable as the next stage's init_from.
std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                              const std::string& role = "student", bool overwrite = false);

}  // namespace vqad::train
