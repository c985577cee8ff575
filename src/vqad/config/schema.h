// One descriptor per config key (type, default, help, status) and the typed reader
// of one mapping of the config against its section's descriptors.
//
// Status:
//   implemented        parsed, validated and acted on.
//   not_supported_yet  refused when the config loads (naming the key) unless its value
//                      asks for nothing (`inert`, e.g. `fused: false`); never ignored.
//   planned            parsed and validated as FastVideo does while the feature that
//                      acts on it is written (`planned_by`); that feature flips it to
//                      implemented. Until then the code that would act refuses what it
//                      cannot do (e.g. num_gpus > 1 in the trainer).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vqad/config/value.h"
#include "vqad/core/error.h"

namespace vqad::config {

enum class KeyType { kBool, kInt, kFloat, kString, kChoice, kIntList, kFloatList, kStringList, kPair, kMapping, kAny };
const char* key_type_name(KeyType t);

enum class KeyStatus { kImplemented, kNotSupportedYet, kPlanned };
const char* key_status_name(KeyStatus s);  // implemented | not_supported_yet | planned

struct KeyDesc {
  std::string key;
  KeyType type = KeyType::kAny;
  Json default_value;  // null: none (required, derived from another key, or absent)
  std::string help;
  KeyStatus status = KeyStatus::kImplemented;
  bool or_default = false;           // FastVideo's `x or default`: a falsy value reads as the default
  std::vector<std::string> choices;  // kChoice
  Json inert;                        // not_supported_yet: the one value that is accepted (asks for nothing)
  std::string planned_by;            // planned: the feature that will act on the key
};

struct SectionSchema {
  std::string path;  // e.g. "training.optimizer", "models.<role>", "method (dmd2)"
  std::vector<KeyDesc> keys;
  const KeyDesc* find(const std::string& key) const;
  std::vector<std::string> key_names() const;
};

struct Ctx {
  std::string source;  // the file name (or "<string>") every error starts with
};

template <typename... Args>
[[noreturn]] void key_fail(const Ctx& ctx, const std::string& path, Args&&... args) {
  fail("config ", ctx.source, ": key '", path, "': ", std::forward<Args>(args)...);
}
inline void check(bool ok, const Ctx& ctx, const std::string& path, const std::string& what) {
  if (!ok) key_fail(ctx, path, what);
}

int64_t as_int(const Ctx& ctx, const std::string& path, const Json& v);
double as_double(const Ctx& ctx, const std::string& path, const Json& v);
bool as_bool(const Ctx& ctx, const std::string& path, const Json& v);
std::string as_string(const Ctx& ctx, const std::string& path, const Json& v);

// One mapping of the config, read against its schema. Defaults come from the key's
// descriptor (the overloads taking `def` are for defaults derived from other keys).
// Construction refuses not_supported_yet keys that are set; finish() refuses keys the
// schema does not know, listing the valid ones.
class Section {
 public:
  Section(const Ctx& ctx, const Json* node, const SectionSchema& schema, std::string path);

  std::string key_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const Ctx& ctx() const { return ctx_; }
  const std::string& path() const { return path_; }

  // The raw value, or nullptr when absent or null.
  const Json* get(const std::string& key) const;
  bool has(const std::string& key) const { return get(key) != nullptr; }

  int64_t i64(const std::string& key) const;
  int64_t i64(const std::string& key, int64_t def) const;
  double f64(const std::string& key) const;
  double f64(const std::string& key, double def) const;
  bool boolean(const std::string& key) const;
  std::string str(const std::string& key) const;
  std::string str(const std::string& key, const std::string& def) const;
  std::string required_str(const std::string& key) const;
  // One of the descriptor's choices (exact match).
  std::string choice(const std::string& key) const;
  std::string choice(const std::string& key, const std::string& def) const;
  std::vector<std::string> str_list(const std::string& key) const;
  std::vector<double> f64_list(const std::string& key) const;
  std::vector<int64_t> i64_list(const std::string& key) const;
  // [b1, b2] or "b1,b2", each in [0, 1).
  std::array<double, 2> betas(const std::string& key, bool required = false) const;
  Section sub(const std::string& key, const SectionSchema& schema) const;

  void finish() const;

 private:
  const KeyDesc& desc(const std::string& key) const;
  bool use_default(const KeyDesc& d, const Json* v) const { return !v || (d.or_default && falsy(*v)); }

  const Ctx& ctx_;
  const Json* node_;
  const SectionSchema& schema_;
  std::string path_;
};

}  // namespace vqad::config
