// Progress lines for batch jobs: when stdout is not a terminal (a log file, a batch
// system), one line every `every_steps` steps or `every_s` seconds, whichever comes first,
// plus the last step:
//   step 120/1000  loss 0.123456  1.52 s/step  3401 tokens/s  ETA 22m17s  mem 45.2 GiB
// On a terminal the progress bar does this job and BatchLog prints nothing.
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace vqad::train {

class BatchLog {
 public:
  BatchLog(long start_step, long max_steps, long every_steps, double every_s, std::FILE* out = stdout,
           std::optional<bool> enabled = std::nullopt);
  // After each step: its loss, duration, tokens and the peak memory so far.
  void step(long step, double loss, double step_s, int64_t tokens, double mem_gib);
  static std::string line(long step, long max_steps, double loss, double s_per_step, double tokens_per_s,
                          double eta_s, double mem_gib);

 private:
  long start_, max_, every_steps_;
  double every_s_;
  std::FILE* out_;
  bool enabled_;
  long last_step_ = 0;
  double since_print_s_ = 0, total_s_ = 0;
  int64_t tokens_since_ = 0;
  long steps_since_ = 0;
};

}  // namespace vqad::train
