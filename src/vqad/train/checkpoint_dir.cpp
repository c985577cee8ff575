#include "vqad/train/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include "vqad/core/error.h"
#include "vqad/core/log.h"

namespace fs = std::filesystem;

namespace vqad::train {
namespace {
const std::regex kCkptName(R"(checkpoint-(\d+))");
constexpr const char* kTmpPrefix = ".tmp-checkpoint-";

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  VQAD_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' for fsync");
  int rc = ::fsync(fd);
  ::close(fd);
  VQAD_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed");
}

bool complete(const fs::path& dir) { return fs::is_regular_file(dir / kCheckpointMarker); }

std::optional<long> step_of(const fs::path& dir) {
  std::smatch m;
  const std::string name = dir.filename().string();
  if (!std::regex_match(name, m, kCkptName)) return std::nullopt;
  return std::stol(m[1]);
}
}  // namespace

void fsync_file(const std::string& path) { fsync_path(path, O_RDONLY); }
void fsync_dir(const std::string& path) { fsync_path(path, O_RDONLY | O_DIRECTORY); }
void fsync_tree(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) fsync_file(e.path().string());
    else if (e.is_directory()) fsync_dir(e.path().string());
  }
  fsync_dir(dir);
}

std::string write_checkpoint_dir(const std::string& output_dir, long step,
                                 const std::function<void(const std::string&)>& fill) {
  fs::create_directories(output_dir);
  const fs::path final_dir = fs::path(output_dir) / ("checkpoint-" + std::to_string(step));
  const fs::path tmp = fs::path(output_dir) / (kTmpPrefix + std::to_string(step) + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  fill(tmp.string());
  {
    std::ofstream marker(tmp / kCheckpointMarker);
    marker << "step " << step << "\n";
    VQAD_CHECK(marker.good(), "checkpoint: cannot write marker in '", tmp.string(), "'");
  }
  fsync_tree(tmp.string());
  if (fs::exists(final_dir)) {
    // Replace an older checkpoint of the same step only once the new one is complete.
    const fs::path old = fs::path(output_dir) / (std::string(kTmpPrefix) + "old-" + std::to_string(step));
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_dir(output_dir);
  return final_dir.string();
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& output_dir) {
  std::vector<CheckpointEntry> out;
  if (!fs::is_directory(output_dir)) return out;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    if (!e.is_directory()) continue;
    auto step = step_of(e.path());
    if (!step) continue;
    if (!complete(e.path())) {
      log::warn("checkpoint ", e.path().string(), " has no ", kCheckpointMarker,
                " marker (interrupted write?); skipping it");
      continue;
    }
    out.push_back({*step, e.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointEntry> resolve_resume(const std::string& spec, const std::string& output_dir) {
  if (spec.empty()) return std::nullopt;
  if (spec == "latest") {
    auto all = list_checkpoints(output_dir);
    if (all.empty()) return std::nullopt;
    return all.back();
  }
  const fs::path p(spec);
  VQAD_CHECK(fs::is_directory(p), "resume_from_checkpoint: '", spec, "' is not a directory");
  if (auto step = step_of(p)) {
    VQAD_CHECK(complete(p), "resume_from_checkpoint: '", spec, "' is incomplete (no ",
               kCheckpointMarker, " marker)");
    return CheckpointEntry{*step, p.string()};
  }
  auto all = list_checkpoints(spec);
  VQAD_CHECK(!all.empty(), "resume_from_checkpoint: '", spec,
             "' is neither a checkpoint-<step> directory nor an output directory with complete checkpoints");
  return all.back();
}

void apply_retention(const std::string& output_dir, int limit) {
  if (!fs::is_directory(output_dir)) return;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind(kTmpPrefix, 0) == 0) fs::remove_all(e.path());
  }
  if (limit <= 0) return;
  auto all = list_checkpoints(output_dir);
  for (size_t i = 0; i + static_cast<size_t>(limit) < all.size(); ++i) {
    log::info("checkpoint retention: removing ", all[i].path);
    fs::remove_all(all[i].path);
  }
}

}  // namespace vqad::train
