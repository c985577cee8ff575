// Leveled logging to stderr with UTC timestamps, torch-free.
//
// The level comes from set_level() or the VQAD_LOG environment variable
// (error | warn | info | debug; default info). Lines look like
//   2026-11-29T07:38:04.123Z I [rank 3] message
// (the rank tag only once set_rank() was called). Thread-safe: one line per call.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "vqad/core/error.h"

namespace vqad::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

const char* level_name(Level l);
std::optional<Level> parse_level(std::string_view name);  // case-insensitive
// Reads VQAD_LOG now; an unknown value is a vqad::Error naming it and the choices.
void init_from_env();
void set_level(Level l);
Level level();
inline bool enabled(Level l) { return static_cast<int>(l) <= static_cast<int>(level()); }
void set_rank(int rank);  // < 0 removes the tag
// Redirects finished lines (without trailing newline) away from stderr; an
// empty function restores stderr. For tests and for tee-ing into a run log.
void set_sink(std::function<void(std::string_view)> sink);

std::string timestamp_utc();  // "2026-11-29T07:38:04.123Z"
void write(Level l, std::string_view message);

template <typename... Args>
void error(Args&&... args) {
  if (enabled(Level::kError)) write(Level::kError, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
void warn(Args&&... args) {
  if (enabled(Level::kWarn)) write(Level::kWarn, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
void info(Args&&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
void debug(Args&&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, detail::concat(std::forward<Args>(args)...));
}

}  // namespace vqad::log
