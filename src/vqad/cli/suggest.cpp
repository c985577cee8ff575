#include "vqad/cli/suggest.h"

#include <algorithm>

namespace vqad::cli {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    // A prefix of a long name is a likely abbreviation.
    if (c.size() > word.size() && word.size() >= 3 && c.compare(0, word.size(), word) == 0) d = std::min<size_t>(d, 1);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  return best_d <= limit && best_d > 0 ? best : "";
}

namespace {
std::string path_of(const CLI::App* app) {
  std::string p;
  for (const CLI::App* a = app; a; a = a->get_parent()) p = a->get_name() + (p.empty() ? "" : " " + p);
  return p.empty() ? "vqad" : p;
}

std::vector<std::string> long_flags(const CLI::App* app) {
  std::vector<std::string> out;
  for (const CLI::App* a = app; a; a = a->get_parent())
    for (const CLI::Option* o : a->get_options())
      for (const auto& n : o->get_lnames()) out.push_back("--" + n);
  return out;
}

bool has_flag(const CLI::App* app, const std::string& flag) {
  auto all = long_flags(app);
  return std::find(all.begin(), all.end(), flag) != all.end();
}
}  // namespace

std::string suggestion_for(CLI::App& app, int argc, char** argv) {
  CLI::App* cur = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string tok = argv[i];
    if (tok == "--") break;
    if (tok.rfind("--", 0) == 0) {
      const std::string flag = tok.substr(0, tok.find('='));
      if (flag.find('.') != std::string::npos || has_flag(cur, flag)) continue;
      const std::string best = closest(flag, long_flags(cur));
      if (!best.empty())
        return "unknown flag '" + flag + "' of '" + path_of(cur) + "'; did you mean '" + best + "'?";
      return "";
    }
    if (tok[0] == '-') continue;
    auto subs = cur->get_subcommands([](CLI::App*) { return true; });
    if (subs.empty()) continue;  // a positional argument or an option value
    CLI::App* next = nullptr;
    std::vector<std::string> names;
    for (CLI::App* s : subs) {
      names.push_back(s->get_name());
      if (s->get_name() == tok) next = s;
    }
    if (next) {
      cur = next;
      continue;
    }
    const std::string best = closest(tok, names);
    if (!best.empty())
      return "unknown subcommand '" + tok + "' of '" + path_of(cur) + "'; did you mean '" + best + "'?";
    return "";
  }
  return "";
}

}  // namespace vqad::cli
