#include "vqad/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "vqad/core/error.h"

namespace vqad::train {
namespace {
constexpr double kPi = 3.14159265358979323846;
}  // namespace

LrScheduleConfig lr_schedule_from(const OptimizerConfig& opt, LrSchedule kind, long total_steps) {
  VQAD_CHECK(kind != LrSchedule::kPiecewiseConstant,
             "training.optimizer.lr_scheduler: piecewise_constant needs step rules, which vqad "
             "does not read; use constant, constant_with_warmup, linear, cosine, "
             "cosine_with_restarts, cosine_with_min_lr or polynomial");
  LrScheduleConfig c;
  c.kind = kind;
  c.warmup_steps = opt.lr_warmup_steps;
  c.total_steps = total_steps;
  if (kind == LrSchedule::kCosineWithRestarts) c.num_cycles = std::max<double>(1.0, opt.lr_num_cycles);
  else if (opt.lr_num_cycles > 0) c.num_cycles = static_cast<double>(opt.lr_num_cycles);
  c.power = opt.lr_power > 0 ? opt.lr_power : 1.0;
  c.min_lr_ratio = opt.min_lr_ratio;
  return c;
}

double lr_multiplier(const LrScheduleConfig& c, long step) {
  const double s = static_cast<double>(std::max(0L, step));
  const double w = static_cast<double>(std::max(0L, c.warmup_steps));
  if (c.kind == LrSchedule::kConstant) return 1.0;
  if (s < w) return s / std::max(1.0, w);  // linear warmup for every other schedule
  if (c.kind == LrSchedule::kConstantWithWarmup) return 1.0;
  const double span = std::max(1.0, static_cast<double>(c.total_steps) - w);
  const double progress = std::min(1.0, (s - w) / span);
  switch (c.kind) {
    case LrSchedule::kLinear:
      return std::max(0.0, 1.0 - progress);
    case LrSchedule::kCosine:
      return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * c.num_cycles * 2.0 * progress)));
    case LrSchedule::kCosineWithRestarts: {
      if (progress >= 1.0) return 0.0;
      const double cycles = std::max(1.0, c.num_cycles);
      return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * std::fmod(cycles * progress, 1.0))));
    }
    case LrSchedule::kPolynomial: {
      const double end = c.lr_end_ratio;
      return (1.0 - end) * std::pow(1.0 - progress, c.power) + end;
    }
    case LrSchedule::kCosineWithMinLr: {
      const double cosv = 0.5 * (1.0 + std::cos(kPi * c.num_cycles * 2.0 * progress));
      return c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosv;
    }
    default:
      fail("lr schedule ", lr_schedule_name(c.kind), " is not supported by vqad");
  }
}

}  // namespace vqad::train
