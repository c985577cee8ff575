// `vqad plot RUN_DIR [--out FILE] [--keys k1,k2]`: the run's metrics.jsonl as loss curves
// in a PNG, one panel per metric (raw values light, moving average dark, step on x).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/core/plot.h"

namespace fs = std::filesystem;

namespace vqad::cli {

void register_plot_commands(CLI::App& app) {
  auto* sub = app.add_subcommand("plot", "Render a run's loss curves (metrics.jsonl) to a PNG");
  auto run_dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto keys = std::make_shared<std::string>();
  sub->add_option("run_dir", *run_dir, "training output_dir (holds metrics.jsonl), or the metrics file")->required();
  sub->add_option("--out", *out, "PNG to write (default RUN_DIR/loss.png)");
  sub->add_option("--keys", *keys, "comma-separated metrics (default: every metric whose name contains 'loss')");
  set_action(sub, [run_dir, out, keys] {
    const fs::path metrics_path =
        fs::is_directory(*run_dir) ? fs::path(*run_dir) / "metrics.jsonl" : fs::path(*run_dir);
    VQAD_CHECK(fs::is_regular_file(metrics_path), "plot: ", metrics_path.string(), " not found");
    const auto records = read_metrics(metrics_path.string());
    std::vector<std::string> names;
    if (!keys->empty()) {
      std::stringstream ss(*keys);
      for (std::string k; std::getline(ss, k, ',');)
        if (!k.empty()) names.push_back(k);
    } else {
      std::set<std::string> found;
      for (const auto& r : records)
        for (auto it = r.begin(); it != r.end(); ++it)
          if (it.key().find("loss") != std::string::npos && it.value().is_number()) found.insert(it.key());
      if (found.count("loss")) names.push_back("loss");
      for (const auto& k : found)
        if (k != "loss") names.push_back(k);
    }
    VQAD_CHECK(!names.empty(), "plot: ", metrics_path.string(), " has no metric to plot",
               keys->empty() ? " (no key containing 'loss')" : "");
    std::vector<plot::Series> series;
    for (const auto& k : names) {
      plot::Series s;
      s.name = k;
      for (const auto& r : records)
        if (r.contains(k) && r[k].is_number() && r.contains("step")) {
          // dmd2 logs generator_loss 0 on the critic-only iterations (as FastVideo does):
          // not a value of the generator's loss, so not plotted.
          if (k == "generator_loss" && r.contains("update_student") && r["update_student"].get<double>() == 0.0)
            continue;
          s.x.push_back(r["step"].get<double>());
          s.y.push_back(r[k].get<double>());
        }
      VQAD_CHECK(!s.x.empty(), "plot: metric '", k, "' does not occur in ", metrics_path.string());
      series.push_back(std::move(s));
    }
    const std::string png_path = out->empty() ? (metrics_path.parent_path() / "loss.png").string() : *out;
    png::write(png_path, plot::panels(series));
    std::printf("wrote %s (%zu records)\n", png_path.c_str(), records.size());
    for (size_t i = 0; i < series.size(); ++i) {
      const auto& s = series[i];
      const auto [mn, mx] = std::minmax_element(s.y.begin(), s.y.end());
      std::printf("  panel %zu: %-24s %zu points, steps %g..%g, min %.5g, max %.5g, last %.5g\n", i + 1,
                  s.name.c_str(), s.y.size(), s.x.front(), s.x.back(), *mn, *mx, s.y.back());
    }
    return 0;
  });
}

}  // namespace vqad::cli
