#include "vqad/core/plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>

#include "vqad/core/error.h"

namespace vqad::plot {

namespace {
// 3x5 glyphs, one row per entry, bit 2 = left column.
const std::map<char, std::array<uint8_t, 5>>& font() {
  static const std::map<char, std::array<uint8_t, 5>> f = {
      {'0', {7, 5, 5, 5, 7}}, {'1', {2, 6, 2, 2, 7}}, {'2', {7, 1, 7, 4, 7}}, {'3', {7, 1, 7, 1, 7}},
      {'4', {5, 5, 7, 1, 1}}, {'5', {7, 4, 7, 1, 7}}, {'6', {7, 4, 7, 5, 7}}, {'7', {7, 1, 1, 1, 1}},
      {'8', {7, 5, 7, 5, 7}}, {'9', {7, 5, 7, 1, 7}}, {'.', {0, 0, 0, 0, 2}}, {'-', {0, 0, 7, 0, 0}},
      {'+', {0, 2, 7, 2, 0}}, {'e', {0, 7, 7, 4, 7}}};
  return f;
}

struct Rgb {
  uint8_t r, g, b;
};

void put(png::Image& img, int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= img.width || y >= img.height) return;
  uint8_t* p = img.at(x, y);
  p[0] = c.r, p[1] = c.g, p[2] = c.b;
}

void line(png::Image& img, double x0, double y0, double x1, double y1, Rgb c, int thick) {
  const int n = static_cast<int>(std::ceil(std::max(std::fabs(x1 - x0), std::fabs(y1 - y0)))) + 1;
  for (int i = 0; i <= n; ++i) {
    const double t = static_cast<double>(i) / n;
    const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))), y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
    for (int dx = 0; dx < thick; ++dx)
      for (int dy = 0; dy < thick; ++dy) put(img, x + dx, y + dy, c);
  }
}

// Text with 3x5 glyphs scaled by `s`, left-top at (x, y); returns the width drawn.
int text(png::Image& img, int x, int y, const std::string& s, Rgb c, int scale = 2) {
  int cx = x;
  for (char ch : s) {
    auto it = font().find(ch);
    if (it != font().end())
      for (int r = 0; r < 5; ++r)
        for (int col = 0; col < 3; ++col)
          if (it->second[r] & (4 >> col))
            for (int a = 0; a < scale; ++a)
              for (int b = 0; b < scale; ++b) put(img, cx + col * scale + a, y + r * scale + b, c);
    cx += 4 * scale;
  }
  return cx - x;
}

const Rgb kPalette[] = {{31, 119, 180}, {214, 39, 40}, {44, 160, 44}, {148, 103, 189}, {255, 127, 14}, {23, 190, 207}};
}  // namespace

std::string tick_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  std::string s = buf;
  // "1e+03" -> "1e3", "1e-05" -> "1e-5"
  auto e = s.find('e');
  if (e != std::string::npos) {
    std::string mant = s.substr(0, e), ex = s.substr(e + 1);
    if (!ex.empty() && ex[0] == '+') ex = ex.substr(1);
    const bool neg = !ex.empty() && ex[0] == '-';
    if (neg) ex = ex.substr(1);
    while (ex.size() > 1 && ex[0] == '0') ex = ex.substr(1);
    s = mant + "e" + (neg ? "-" : "") + ex;
  }
  return s;
}

png::Image panels(const std::vector<Series>& series, const Options& o) {
  VQAD_CHECK(!series.empty(), "plot: no series");
  const int left = 70, right = 20, top = 14, bottom = 26;
  png::Image img(o.width, o.panel_height * static_cast<int>(series.size()), 255);
  const Rgb axis{60, 60, 60}, grid{225, 225, 225};
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    VQAD_CHECK(s.x.size() == s.y.size(), "plot: series '", s.name, "' has ", s.x.size(), " x and ", s.y.size(), " y");
    const int y_off = static_cast<int>(k) * o.panel_height;
    const int x0 = left, x1 = o.width - right, y0 = y_off + top, y1 = y_off + o.panel_height - bottom;
    double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      xmin = std::min(xmin, s.x[i]), xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
    }
    // Frame and grid.
    line(img, x0, y0, x1, y0, axis, 1), line(img, x0, y1, x1, y1, axis, 1);
    line(img, x0, y0, x0, y1, axis, 1), line(img, x1, y0, x1, y1, axis, 1);
    if (xmin > xmax) continue;  // nothing finite to draw
    if (xmax == xmin) xmax = xmin + 1;
    if (ymax == ymin) ymax = ymin + (ymin == 0 ? 1 : std::fabs(ymin) * 0.1), ymin -= (ymax - ymin) * 0.5;
    const double pad = (ymax - ymin) * 0.05;
    ymin -= pad, ymax += pad;
    auto px = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0); };
    auto py = [&](double y) { return y1 - (y - ymin) / (ymax - ymin) * (y1 - y0); };
    for (int t = 0; t <= 4; ++t) {
      const double yv = ymin + (ymax - ymin) * t / 4.0, xv = xmin + (xmax - xmin) * t / 4.0;
      const int yy = static_cast<int>(std::lround(py(yv))), xx = static_cast<int>(std::lround(px(xv)));
      if (t > 0 && t < 4) line(img, x0 + 1, yy, x1 - 1, yy, grid, 1), line(img, xx, y0 + 1, xx, y1 - 1, grid, 1);
      // Steps are integers: round the x labels unless the span is so short that rounding
      // would print one step twice (1, 1.75, 2.5, ... must not read 1, 2, 3, 3).
      const bool round_x = (xmax - xmin) >= 8.0;
      const std::string ys = tick_text(yv), xs = tick_text(round_x ? std::round(xv) : xv);
      text(img, x0 - 6 - static_cast<int>(ys.size()) * 8, yy - 5, ys, axis);
      text(img, xx - static_cast<int>(xs.size()) * 4, y1 + 8, xs, axis);
    }
    const Rgb c = kPalette[k % (sizeof(kPalette) / sizeof(kPalette[0]))];
    const Rgb light{static_cast<uint8_t>(255 - (255 - c.r) / 3), static_cast<uint8_t>(255 - (255 - c.g) / 3),
                    static_cast<uint8_t>(255 - (255 - c.b) / 3)};
    double px_prev = 0, py_prev = 0, ema = 0, ex_prev = 0, ey_prev = 0;
    bool first = true;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      const double X = px(s.x[i]), Y = py(s.y[i]);
      ema = first ? s.y[i] : o.ema * ema + (1.0 - o.ema) * s.y[i];
      const double EY = py(ema);
      if (!first) {
        line(img, px_prev, py_prev, X, Y, light, 1);
        if (o.ema > 0) line(img, ex_prev, ey_prev, X, EY, c, 2);
      }
      px_prev = X, py_prev = Y, ex_prev = X, ey_prev = EY;
      first = false;
    }
    if (o.ema <= 0)  // no overlay: draw the raw line in full colour
      for (size_t i = 1; i < s.x.size(); ++i)
        if (std::isfinite(s.y[i]) && std::isfinite(s.y[i - 1]))
          line(img, px(s.x[i - 1]), py(s.y[i - 1]), px(s.x[i]), py(s.y[i]), c, 1);
  }
  return img;
}

}  // namespace vqad::plot
