#include "vqad/media/report.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/core/plot.h"
#include "vqad/core/png.h"
#include "vqad/core/safetensors.h"

namespace vqad::media {
namespace fs = std::filesystem;

std::string base64(const std::string& in) {
  static const char* tbl = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += tbl[(v >> 18) & 63];
    out += tbl[(v >> 12) & 63];
    out += tbl[(v >> 6) & 63];
    out += tbl[v & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += tbl[(v >> 18) & 63];
    out += tbl[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += tbl[(v >> 18) & 63];
    out += tbl[(v >> 12) & 63];
    out += tbl[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  VQAD_CHECK(in.good(), "report: cannot read ", p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string html_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string png_uri(const png::Image& img) {
  const fs::path tmp = fs::temp_directory_path() / ("vqad-report-" + std::to_string(::getpid()) + ".png");
  png::write(tmp.string(), img);
  std::string bytes = read_file(tmp);
  fs::remove(tmp);
  return "data:image/png;base64," + base64(bytes);
}

// Panels of every numeric metric whose key starts with one of `prefixes` (or equals one).
std::string curves(const std::vector<nlohmann::json>& records, const std::vector<std::string>& prefixes,
                   const std::set<std::string>& exclude, int* panels_out) {
  std::set<std::string> keys;
  for (const auto& r : records)
    for (auto it = r.begin(); it != r.end(); ++it) {
      if (!it.value().is_number() || exclude.count(it.key())) continue;
      for (const auto& p : prefixes)
        if (it.key() == p || it.key().rfind(p, 0) == 0 || it.key().find(p) != std::string::npos) keys.insert(it.key());
    }
  std::vector<plot::Series> series;
  for (const auto& k : keys) {
    plot::Series s;
    s.name = k;
    for (const auto& r : records)
      if (r.contains(k) && r[k].is_number() && r.contains("step")) {
        if (k == "generator_loss" && r.contains("update_student") && r["update_student"].is_number() &&
            r["update_student"].get<double>() == 0.0)
          continue;
        s.x.push_back(r["step"].get<double>());
        s.y.push_back(r[k].get<double>());
      }
    if (!s.x.empty()) series.push_back(std::move(s));
  }
  *panels_out = int(series.size());
  if (series.empty()) return "<p class=dim>no such metrics logged</p>";
  return "<img alt=\"curves\" src=\"" + png_uri(plot::panels(series)) + "\">";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Newest checkpoint-<step> directory with a metadata.json, or "".
fs::path newest_checkpoint(const fs::path& run) {
  long best = -1;
  fs::path found;
  for (const auto& e : fs::directory_iterator(run)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("checkpoint-", 0) != 0) continue;
    char* end = nullptr;
    const long step = std::strtol(n.c_str() + 11, &end, 10);
    if (!end || *end != '\0' || !fs::exists(e.path() / "metadata.json")) continue;
    if (step > best) {
      best = step;
      found = e.path();
    }
  }
  return found;
}

// The chain of a metadata document: itself, then parent_metadata wherever the schema keeps
// it (vqad: provenance.lineage / lineage; FastVideo's seeds schema: provenance.lineage).
std::vector<nlohmann::json> lineage_chain(const nlohmann::json& meta) {
  std::vector<nlohmann::json> chain;
  const nlohmann::json* cur = &meta;
  for (int depth = 0; cur && cur->is_object() && depth < 16; ++depth) {
    chain.push_back(*cur);
    const nlohmann::json* next = nullptr;
    for (const char* base : {"provenance", ""}) {
      const nlohmann::json* holder = *base ? (cur->contains(base) ? &(*cur)[base] : nullptr) : cur;
      if (holder && holder->is_object() && holder->contains("lineage") && (*holder)["lineage"].is_object() &&
          (*holder)["lineage"].contains("parent_metadata") && (*holder)["lineage"]["parent_metadata"].is_object()) {
        next = &(*holder)["lineage"]["parent_metadata"];
        break;
      }
    }
    cur = next;
  }
  return chain;
}

std::string get_str(const nlohmann::json& j, std::initializer_list<const char*> path) {
  const nlohmann::json* cur = &j;
  for (const char* k : path) {
    if (!cur->is_object() || !cur->contains(k)) return "";
    cur = &(*cur)[k];
  }
  if (cur->is_string()) return cur->get<std::string>();
  if (cur->is_null()) return "";
  return cur->dump();
}

}  // namespace

std::string write_run_report(const std::string& run_dir, const std::string& out_html) {
  const fs::path run(run_dir);
  VQAD_CHECK(fs::is_directory(run), "report: ", run_dir, " is not a directory");
  const fs::path metrics_path = run / "metrics.jsonl";
  VQAD_CHECK(fs::exists(metrics_path), "report: ", run_dir, " has no metrics.jsonl (not a training output_dir)");
  const auto records = read_metrics(metrics_path.string());

  std::ostringstream h;
  h << "<!doctype html><html><head><meta charset=\"utf-8\"><title>vqad run " << html_escape(run.filename().string())
    << "</title><style>body{font-family:sans-serif;margin:24px;max-width:1400px;color:#222}"
       "h2{border-bottom:1px solid #ccc;padding-bottom:4px}table{border-collapse:collapse}"
       "td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}img{max-width:100%}"
       "pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:480px}.dim{color:#888}"
       "video{max-width:45%;margin:4px}</style></head><body>";
  h << "<h1>vqad run: " << html_escape(fs::absolute(run).string()) << "</h1>";
  std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  h << "<p class=dim>report written " << when << "; " << records.size() << " metric records</p>";

  // Throughput and memory.
  std::vector<double> step_t, tok, mem, mfu;
  double last_step = 0;
  for (const auto& r : records) {
    if (r.contains("step") && r["step"].is_number()) last_step = std::max(last_step, r["step"].get<double>());
    auto take = [&](const char* k, std::vector<double>& v) {
      if (r.contains(k) && r[k].is_number()) v.push_back(r[k].get<double>());
    };
    take("step_time_s", step_t);
    take("tokens_per_s", tok);
    take("mem_peak_gib", mem);
    take("mfu", mfu);
  }
  h << "<h2>Throughput and memory</h2><table><tr><th>steps logged</th><td>" << last_step << "</td></tr>";
  h << "<tr><th>step time (median)</th><td>" << median(step_t) << " s</td></tr>";
  h << "<tr><th>tokens/s (median)</th><td>" << median(tok) << "</td></tr>";
  if (!mfu.empty()) h << "<tr><th>MFU (median)</th><td>" << median(mfu) << "</td></tr>";
  h << "<tr><th>peak memory (max)</th><td>" << (mem.empty() ? 0.0 : *std::max_element(mem.begin(), mem.end()))
    << " GiB</td></tr></table>";

  // Curves.
  int loss_panels = 0, norm_panels = 0, lr_panels = 0;
  h << "<h2>Losses</h2>" << curves(records, {"loss"}, {}, &loss_panels);
  h << "<h2>Gradient norms</h2>" << curves(records, {"grad_norm"}, {}, &norm_panels);
  h << "<h2>Learning rates</h2>" << curves(records, {"lr/", "lr"}, {}, &lr_panels);

  // Validation.
  int sheets = 0, videos = 0;
  h << "<h2>Validation</h2>";
  const fs::path vdir = run / "validation";
  std::vector<std::pair<long, fs::path>> steps;
  if (fs::is_directory(vdir))
    for (const auto& e : fs::directory_iterator(vdir)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step-", 0) == 0) steps.emplace_back(std::strtol(n.c_str() + 5, nullptr, 10), e.path());
    }
  std::sort(steps.begin(), steps.end());
  if (steps.empty()) h << "<p class=dim>no validation outputs under " << html_escape(vdir.string()) << "</p>";
  for (const auto& [step, dir] : steps) {
    h << "<h3>step " << step << "</h3>";
    for (const char* img : {"contact_sheet.png", "grid.png"}) {
      if (!fs::exists(dir / img)) continue;
      h << "<p>" << img << "</p><img alt=\"" << img << "\" src=\"data:image/png;base64," << base64(read_file(dir / img))
        << "\">";
      ++sheets;
      break;  // the decoded contact sheet when there is one, else the latent preview
    }
    std::vector<fs::path> mp4s;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".mp4") mp4s.push_back(e.path());
    std::sort(mp4s.begin(), mp4s.end());
    for (const auto& m : mp4s) {
      h << "<video controls loop muted title=\"" << html_escape(m.filename().string())
        << "\" src=\"data:video/mp4;base64," << base64(read_file(m)) << "\"></video>";
      ++videos;
    }
    // What a person looks at first (sheet, videos); the sampler settings folded below.
    if (fs::exists(dir / "summary.json"))
      h << "<details><summary>summary.json</summary><pre>" << html_escape(read_file(dir / "summary.json"))
        << "</pre></details>";
  }

  // Lineage of the newest checkpoint.
  h << "<h2>Lineage</h2>";
  const fs::path ckpt = newest_checkpoint(run);
  int chain_len = 0;
  if (ckpt.empty()) {
    h << "<p class=dim>no checkpoint with metadata.json</p>";
  } else {
    nlohmann::json meta;
    try {
      meta = nlohmann::json::parse(read_file(ckpt / "metadata.json"));
    } catch (const std::exception& e) {
      fail("report: ", (ckpt / "metadata.json").string(), " is not valid JSON (", e.what(), ")");
    }
    const auto chain = lineage_chain(meta);
    chain_len = int(chain.size());
    h << "<p>newest checkpoint: " << html_escape(ckpt.string()) << "</p><table><tr><th>#</th><th>checkpoint</th>"
      << "<th>step</th><th>state</th><th>lineage kind</th><th>init_from</th><th>attention</th></tr>";
    for (size_t i = 0; i < chain.size(); ++i) {
      const auto& m = chain[i];
      std::string kind = get_str(m, {"provenance", "lineage", "kind"});
      if (kind.empty()) kind = get_str(m, {"lineage", "kind"});
      std::string init = get_str(m, {"provenance", "lineage", "init_from"});
      if (init.empty()) init = get_str(m, {"lineage", "init_from"});
      std::string state = get_str(m, {"checkpoint_state"});
      if (state.empty()) state = get_str(m, {"checkpoint", "state"});
      h << "<tr><td>" << i << "</td><td>" << html_escape(get_str(m, {"checkpoint", "id"})) << "</td><td>"
        << html_escape(get_str(m, {"checkpoint", "step"})) << "</td><td>" << html_escape(state) << "</td><td>"
        << html_escape(kind) << "</td><td>" << html_escape(init) << "</td><td>"
        << html_escape(get_str(m, {"attention", "backend"})) << "</td></tr>";
    }
    h << "</table><details><summary>metadata.json</summary><pre>" << html_escape(meta.dump(2)) << "</pre></details>";
  }

  // Config.
  h << "<h2>Config</h2>";
  if (fs::exists(run / "resolved.yaml"))
    h << "<details open><summary>resolved.yaml</summary><pre>" << html_escape(read_file(run / "resolved.yaml"))
      << "</pre></details>";
  else
    h << "<p class=dim>no resolved.yaml in the run directory</p>";
  h << "</body></html>\n";
  st::write_file_atomic(out_html, {h.str()});
  std::ostringstream s;
  s << loss_panels << " loss, " << norm_panels << " grad-norm, " << lr_panels << " lr panels; " << steps.size()
    << " validation steps, " << sheets << " sheets, " << videos << " videos; lineage of " << chain_len;
  return s.str();
}

}  // namespace vqad::media
