// Line charts as PNG for `vqad plot`: one panel per series (each with its own y range),
// the raw values in a light colour and an exponential moving average on top, axis ticks
// labelled with a built-in 3x5 digit font. No text beyond numbers: the caller prints the
// panel legend.
#pragma once
#include <string>
#include <vector>

#include "vqad/core/png.h"

namespace vqad::plot {

struct Series {
  std::string name;
  std::vector<double> x, y;  // same length; non-finite y values are skipped
};

struct Options {
  int width = 900;
  int panel_height = 220;
  double ema = 0.9;  // smoothing of the overlay (0 = none)
};

png::Image panels(const std::vector<Series>& series, const Options& options = {});
// Tick label text of v (shortest of %g with 3 significant digits).
std::string tick_text(double v);

}  // namespace vqad::plot
