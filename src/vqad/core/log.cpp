#include "vqad/core/log.h"

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace vqad::log {

namespace {

struct State {
  std::mutex mu;
  std::function<void(std::string_view)> sink;
  std::atomic<int> level{-1};  // -1: not yet read from the environment
  std::atomic<int> rank{-1};
};

State& state() {
  static State s;
  return s;
}

constexpr const char* kChoices = "error, warn, info, debug";

// Lazy path: an unknown VQAD_LOG must not throw out of a log call, so it is
// reported once and info is used; init_from_env() is the strict entry.
int lazy_level() {
  State& s = state();
  int l = s.level.load(std::memory_order_relaxed);
  if (l >= 0) return l;
  Level chosen = Level::kInfo;
  const char* env = std::getenv("VQAD_LOG");
  if (env && *env) {
    if (auto p = parse_level(env)) chosen = *p;
    else
      std::fprintf(stderr, "vqad: warning: VQAD_LOG='%s' is not one of %s; using info\n", env,
                   kChoices);
  }
  int expected = -1;
  s.level.compare_exchange_strong(expected, static_cast<int>(chosen));
  return s.level.load();
}

}  // namespace

const char* level_name(Level l) {
  switch (l) {
    case Level::kError: return "error";
    case Level::kWarn: return "warn";
    case Level::kInfo: return "info";
    case Level::kDebug: return "debug";
  }
  return "?";
}

std::optional<Level> parse_level(std::string_view name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "error") return Level::kError;
  if (s == "warn" || s == "warning") return Level::kWarn;
  if (s == "info") return Level::kInfo;
  if (s == "debug") return Level::kDebug;
  return std::nullopt;
}

void init_from_env() {
  const char* env = std::getenv("VQAD_LOG");
  if (!env || !*env) {
    set_level(Level::kInfo);
    return;
  }
  auto p = parse_level(env);
  VQAD_CHECK(p.has_value(), "environment variable VQAD_LOG: unknown level '", env,
             "' (valid: ", kChoices, ")");
  set_level(*p);
}

void set_level(Level l) { state().level.store(static_cast<int>(l)); }
Level level() { return static_cast<Level>(lazy_level()); }
void set_rank(int rank) { state().rank.store(rank); }

void set_sink(std::function<void(std::string_view)> sink) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().sink = std::move(sink);
}

std::string timestamp_utc() {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  int ms = static_cast<int>(duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

void write(Level l, std::string_view message) {
  static const char kTag[] = {'E', 'W', 'I', 'D'};
  std::string line = timestamp_utc();
  line += ' ';
  line += kTag[static_cast<int>(l)];
  int rank = state().rank.load();
  if (rank >= 0) line += " [rank " + std::to_string(rank) + "]";
  line += ' ';
  line.append(message.data(), message.size());
  std::lock_guard<std::mutex> lock(state().mu);
  if (state().sink) {
    state().sink(line);
  } else {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
}

}  // namespace vqad::log
