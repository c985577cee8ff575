#include "vqad/train/batch_log.h"

#include <unistd.h>

#include "vqad/core/progress.h"

namespace vqad::train {

BatchLog::BatchLog(long start_step, long max_steps, long every_steps, double every_s, std::FILE* out,
                   std::optional<bool> enabled)
    : start_(start_step), max_(max_steps), every_steps_(every_steps), every_s_(every_s), out_(out) {
  enabled_ = enabled.value_or(!::isatty(::fileno(out))) && (every_steps > 0 || every_s > 0);
  last_step_ = start_step;
}

std::string BatchLog::line(long step, long max_steps, double loss, double s_per_step, double tokens_per_s, double eta_s,
                           double mem_gib) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "step %ld/%ld  loss %.6f  %.3f s/step  %.0f tokens/s  ETA %s  mem %.1f GiB", step,
                max_steps, loss, s_per_step, tokens_per_s, format_duration(eta_s).c_str(), mem_gib);
  return buf;
}

void BatchLog::step(long step, double loss, double step_s, int64_t tokens, double mem_gib) {
  total_s_ += step_s;
  since_print_s_ += step_s;
  tokens_since_ += tokens;
  ++steps_since_;
  if (!enabled_) return;
  const bool due = (every_steps_ > 0 && (step - start_) % every_steps_ == 0) ||
                   (every_s_ > 0 && since_print_s_ >= every_s_) || step == max_ || step == start_ + 1;
  if (!due) return;
  const double s_per_step = since_print_s_ / static_cast<double>(steps_since_);
  const double mean_step = total_s_ / static_cast<double>(step - start_);
  std::fprintf(out_, "%s\n",
               line(step, max_, loss, s_per_step, static_cast<double>(tokens_since_) / since_print_s_,
                    mean_step * static_cast<double>(max_ - step), mem_gib)
                   .c_str());
  std::fflush(out_);
  since_print_s_ = 0;
  tokens_since_ = 0;
  steps_since_ = 0;
}

}  // namespace vqad::train
