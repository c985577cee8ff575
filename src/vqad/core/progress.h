// Progress reporting for long work (training steps, cache generation, export).
//
// On a terminal: one bar redrawn in place (carriage return), at most every
// 0.1 s. Otherwise (a log file, a pipe, a batch system): a plain line every
// `plain_interval_s` seconds and one at the end, so logs stay readable.
// Both show done/total, percent, rate and ETA; the rate is measured over the
// whole run so far (steady-state training is what matters).
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

namespace vqad {

std::string format_duration(double seconds);  // "45s", "3m07s", "2h05m", "3d04h"
std::string format_rate(double per_second, const std::string& unit);  // "2.50 it/s", "8.0 s/it"

class Progress {
 public:
  struct Options {
    std::FILE* out = stderr;
    std::optional<bool> tty;          // default: isatty(fileno(out))
    double plain_interval_s = 30.0;   // non-TTY line period
    double tty_interval_s = 0.1;      // TTY redraw period
    int bar_width = 30;
    std::function<double()> clock;    // seconds; default steady_clock (tests inject one)
  };

  Progress(std::string label, int64_t total, std::string unit = "it");
  Progress(std::string label, int64_t total, std::string unit, Options options);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void update(int64_t n = 1) { set(done_ + n); }
  void set(int64_t done);
  // Short text after the numbers, e.g. "loss 0.0312".
  void set_postfix(std::string text) { postfix_ = std::move(text); }
  // Prints the final state (idempotent; the destructor calls it).
  void finish();
  // The line that would be printed now (no bar, no control characters).
  std::string status_line() const;

 private:
  void render(bool final_line);
  std::string label_, unit_, postfix_;
  int64_t total_, done_ = 0, start_done_ = 0;
  Options opt_;
  bool tty_ = false, finished_ = false;
  double start_ = 0, last_print_ = 0;
};

}  // namespace vqad
