#include "vqad/core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace vqad {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  long long t = static_cast<long long>(std::llround(s));
  if (t < 60) std::snprintf(buf, sizeof buf, "%llds", t);
  else if (t < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else if (t < 86400) std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, (t % 3600) / 60);
  else std::snprintf(buf, sizeof buf, "%lldd%02lldh", t / 86400, (t % 86400) / 3600);
  return buf;
}

std::string format_rate(double per_second, const std::string& unit) {
  char buf[64];
  if (!std::isfinite(per_second) || per_second <= 0) return "? " + unit + "/s";
  if (per_second >= 1.0) std::snprintf(buf, sizeof buf, "%.2f %s/s", per_second, unit.c_str());
  else std::snprintf(buf, sizeof buf, "%.1f s/%s", 1.0 / per_second, unit.c_str());
  return buf;
}

Progress::Progress(std::string label, int64_t total, std::string unit)
    : Progress(std::move(label), total, std::move(unit), Options{}) {}

Progress::Progress(std::string label, int64_t total, std::string unit, Options options)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), opt_(std::move(options)) {
  if (!opt_.clock) {
    opt_.clock = [] {
      using namespace std::chrono;
      return duration<double>(steady_clock::now().time_since_epoch()).count();
    };
  }
  tty_ = opt_.tty.has_value() ? *opt_.tty : (opt_.out && ::isatty(::fileno(opt_.out)));
  start_ = last_print_ = opt_.clock();
}

Progress::~Progress() { finish(); }

std::string Progress::status_line() const {
  double elapsed = opt_.clock() - start_;
  double rate = elapsed > 0 ? static_cast<double>(done_ - start_done_) / elapsed : 0.0;
  char buf[96];
  std::string s = label_ + " ";
  if (total_ > 0) {
    std::snprintf(buf, sizeof buf, "%lld/%lld (%.1f%%)", static_cast<long long>(done_),
                  static_cast<long long>(total_), 100.0 * done_ / total_);
  } else {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(done_));
  }
  s += buf;
  s += " | " + format_rate(rate, unit_);
  s += " | elapsed " + format_duration(elapsed);
  if (total_ > 0) {
    double eta = rate > 0 ? static_cast<double>(std::max<int64_t>(total_ - done_, 0)) / rate
                          : -1.0;
    s += " | ETA " + (done_ >= total_ ? std::string("0s") : format_duration(eta));
  }
  if (!postfix_.empty()) s += " | " + postfix_;
  return s;
}

void Progress::set(int64_t done) {
  if (finished_) return;
  done_ = done;
  double now = opt_.clock();
  double interval = tty_ ? opt_.tty_interval_s : opt_.plain_interval_s;
  if (now - last_print_ >= interval) {
    last_print_ = now;
    render(false);
  }
}

void Progress::render(bool final_line) {
  if (!opt_.out) return;
  std::string line = status_line();
  if (tty_) {
    std::string bar;
    if (total_ > 0) {
      int filled = static_cast<int>(opt_.bar_width * std::min<double>(1.0, double(done_) / total_));
      bar = "[" + std::string(filled, '#') + std::string(opt_.bar_width - filled, '.') + "] ";
    }
    // \033[K clears what a longer previous line left behind.
    std::fprintf(opt_.out, "\r%s%s\033[K%s", bar.c_str(), line.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(opt_.out, "%s\n", line.c_str());
  }
  std::fflush(opt_.out);
}

void Progress::finish() {
  if (finished_) return;
  render(true);
  finished_ = true;
}

}  // namespace vqad
