#include "vqad/train/checkpoint_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <regex>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {
namespace {
const std::regex kCkptName(R"(checkpoint-(\d+))");
constexpr const char* kTmpPrefix = ".tmp-checkpoint-";
constexpr const char* kPartsPrefix = ".parts-checkpoint-";  // a sharded save's parts (checkpoint_writer.h)

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  VQAD_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' for fsync: ", std::strerror(errno));
  int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  VQAD_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed: ", std::strerror(err));
}

std::string hostname() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

// A zombie (killed, not yet reaped: e.g. a rank of a launched job whose launcher was killed
// too, under an init that does not reap) holds nothing and counts as gone.
bool pid_alive(long pid) {
  if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  const auto close = text.rfind(')');  // "pid (comm) S ...": the state follows the command name
  return close == std::string::npos || close + 2 >= text.size() ||
         (text[close + 2] != 'Z' && text[close + 2] != 'X');
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
  create_dir_or_fail(output_dir, "checkpoint");
  const fs::path final_dir = fs::path(output_dir) / ("checkpoint-" + std::to_string(step));
  const fs::path tmp = fs::path(output_dir) / (kTmpPrefix + std::to_string(step) + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  create_dir_or_fail(tmp.string(), "checkpoint");
  try {
    fill(tmp.string());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // a failed write leaves nothing behind (e.g. on a full disk)
    throw;
  }
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

std::string checkpoint_parts_dir(const std::string& output_dir, long step, int part) {
  return (fs::path(output_dir) / (kPartsPrefix + std::to_string(step) + "-r" + std::to_string(part))).string();
}

int remove_checkpoint_parts(const std::string& output_dir, long max_step) {
  int n = 0;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return 0;
  for (const auto& e : fs::directory_iterator(output_dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto r = name.rfind("-r");
    if (!e.is_directory() || name.rfind(kPartsPrefix, 0) != 0 || r == std::string::npos ||
        r <= std::strlen(kPartsPrefix))
      continue;
    long step = 0;
    try {
      step = std::stol(name.substr(std::strlen(kPartsPrefix), r - std::strlen(kPartsPrefix)));
    } catch (const std::exception&) {
      continue;  // not a name vqad writes
    }
    if (step > max_step) continue;
    log::info("removing ", e.path().string(), " (part of a sharded checkpoint that was not published)");
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (rm)
      log::warn("could not remove ", e.path().string(), ": ", rm.message(), " (a later save of step ", step,
                " replaces its files)");
    else
      ++n;
  }
  return n;
}

int remove_stale_checkpoint_temps(const std::string& output_dir) {
  int n = remove_checkpoint_parts(output_dir, std::numeric_limits<long>::max());
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return 0;
  for (const auto& e : fs::directory_iterator(output_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind(kTmpPrefix, 0) != 0) continue;
    // A complete checkpoint moved aside to be replaced by a newer copy of the same step,
    // when the process died before the copy took its place: put it back.
    const std::string old_prefix = std::string(kTmpPrefix) + "old-";
    if (name.rfind(old_prefix, 0) == 0 && complete(e.path())) {
      const fs::path back = fs::path(output_dir) / ("checkpoint-" + name.substr(old_prefix.size()));
      if (!fs::exists(back, ec)) {
        log::info("restoring ", back.string(), " from ", e.path().string(), " (its replacement was interrupted)");
        fs::rename(e.path(), back);
        continue;
      }
    }
    log::info("removing ", e.path().string(), " (temporary checkpoint directory of a run that did not finish it)");
    fs::remove_all(e.path());
    ++n;
  }
  return n;
}

void create_dir_or_fail(const std::string& dir, const std::string& what) {
  std::error_code ec;
  fs::path p(dir);
  // The first existing ancestor that is not a directory is the usual culprit.
  for (fs::path a = p; !a.empty(); a = a.parent_path()) {
    if (fs::exists(a, ec)) {
      VQAD_CHECK(fs::is_directory(a, ec), what, ": cannot create directory ", dir, ": ", a.string(),
                 " exists and is not a directory");
      break;
    }
    if (a == a.parent_path()) break;
  }
  fs::create_directories(p, ec);
  VQAD_CHECK(!ec, what, ": cannot create directory ", dir, ": ", ec.message());
  VQAD_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, what, ": directory ", dir, " is not writable: ",
             std::strerror(errno));
}

RunLock::RunLock(const std::string& output_dir) {
  create_dir_or_fail(output_dir, "training.checkpoint.output_dir");
  path_ = (fs::path(output_dir) / kRunLockName).string();
  auto read_holder = [&] {
    std::string text(256, '\0');
    ssize_t n = ::pread(fd_, text.data(), text.size(), 0);
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
    return text;
  };
  const std::string me = hostname();
  for (int attempt = 0;; ++attempt) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    VQAD_CHECK(fd_ >= 0, "training.checkpoint.output_dir: cannot create the run lock ", path_, ": ",
               std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const std::string holder = read_holder();
      ::close(fd_);
      fd_ = -1;
      fail("training.checkpoint.output_dir ", output_dir, " is in use by another vqad run (",
           holder.empty() ? "?" : holder, ", lock ", path_,
           "); one run per output directory: wait for it, stop it, or choose another output_dir");
    }
    // The holder we raced with may have unlinked the file between our open and flock.
    struct stat a{}, b{};
    if (::fstat(fd_, &a) == 0 && ::stat(path_.c_str(), &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev) break;
    ::close(fd_);
    fd_ = -1;
    VQAD_CHECK(attempt < 5, "training.checkpoint.output_dir: the run lock ", path_, " keeps changing; another run?");
  }
  const std::string holder = read_holder();
  if (!holder.empty()) {
    // "pid <n> host <h> started <t>": a holder on this host that is still alive (a
    // filesystem without working flock) is in use; anything else is stale.
    long pid = 0;
    char host[256] = {0};
    if (std::sscanf(holder.c_str(), "pid %ld host %255s", &pid, host) == 2 && me == host && pid != ::getpid() &&
        pid_alive(pid)) {
      ::close(fd_);
      fd_ = -1;
      fail("training.checkpoint.output_dir ", output_dir, " is in use by another vqad run (", holder, ", lock ", path_,
           "); one run per output directory");
    }
    log::info("taking over the stale run lock ", path_, " (", holder, ": that process is gone)");
  }
  const std::string text = "pid " + std::to_string(::getpid()) + " host " + me + " started " + utc_now_iso() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    const std::string why = std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    fail("training.checkpoint.output_dir: cannot write the run lock ", path_, ": ", why);
  }
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());
  ::close(fd_);  // releases the flock
}

std::vector<std::string> previous_run_files(const std::string& output_dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return found;
  for (const auto& e : fs::directory_iterator(output_dir, ec)) {
    const std::string name = e.path().filename().string();
    if ((e.is_directory() && step_of(e.path())) || name == "metrics.jsonl" || name == "resolved.yaml")
      found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

void prepare_new_run_dir(const std::string& output_dir, bool overwrite_run) {
  auto found = previous_run_files(output_dir);
  if (found.empty()) return;
  std::string list;
  for (size_t i = 0; i < found.size() && i < 5; ++i) list += (i ? ", " : "") + found[i];
  if (found.size() > 5) list += ", ...";
  VQAD_CHECK(overwrite_run, "training.checkpoint.output_dir ", output_dir, " holds another run (", list,
             "); resume it with --training.checkpoint.resume_from_checkpoint latest, choose another output_dir, or "
             "pass --overwrite-run to delete that run's checkpoints and metrics");
  for (const auto& name : found) {
    log::info("--overwrite-run: removing ", (fs::path(output_dir) / name).string());
    fs::remove_all(fs::path(output_dir) / name);
  }
}

void check_export_target(const std::string& out_dir, const std::string& source, bool overwrite) {
  std::error_code ec;
  const fs::path out = fs::weakly_canonical(fs::absolute(out_dir), ec);
  const fs::path src = fs::weakly_canonical(fs::absolute(source), ec);
  auto inside = [](const fs::path& a, const fs::path& b) {  // a == b or a under b
    auto ai = a.begin(), bi = b.begin();
    for (; bi != b.end(); ++ai, ++bi)
      if (ai == a.end() || *ai != *bi) return false;
    return true;
  };
  VQAD_CHECK(!inside(out, src), "export: the output ", out_dir, " is or lies inside the source checkpoint ", source);
  VQAD_CHECK(!inside(src, out), "export: the output ", out_dir, " contains the source checkpoint ", source,
             " (refusing to replace it)");
  if (!fs::exists(out, ec)) return;
  VQAD_CHECK(fs::is_directory(out, ec), "export: ", out_dir, " exists and is not a directory");
  if (fs::is_empty(out, ec)) return;
  VQAD_CHECK(overwrite, "export: ", out_dir, " already exists (pass --overwrite to replace an earlier export)");
  // --overwrite replaces only an earlier export: never a checkpoint, a run directory or anything else.
  VQAD_CHECK(!fs::exists(out / kCheckpointMarker, ec), "export --overwrite: ", out_dir,
             " is a training checkpoint, not an export; refusing to delete it");
  for (auto it = fs::recursive_directory_iterator(out, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    VQAD_CHECK(!(it->is_directory() && step_of(it->path())) && name != kCheckpointMarker && name != kRunLockName &&
                   name != "metrics.jsonl",
               "export --overwrite: ", out_dir, " contains ", it->path().string(),
               " (a checkpoint or run directory); refusing to delete it");
  }
  nlohmann::json m;
  try {
    m = read_metadata(out.string());
  } catch (const Error&) {
    fail("export --overwrite: ", out_dir, " is not a vqad export (no readable metadata.json); refusing to delete it");
  }
  VQAD_CHECK(m.value("checkpoint_state", std::string()) == "inference_export", "export --overwrite: ", out_dir,
             " is not a vqad export (checkpoint_state ", m.value("checkpoint_state", std::string("?")),
             "); refusing to delete it");
}

std::string export_temp_dir(const std::string& out_dir) {
  const fs::path out = fs::absolute(out_dir).lexically_normal();
  const fs::path parent = out.has_filename() ? out.parent_path() : out.parent_path().parent_path();
  const std::string base = out.has_filename() ? out.filename().string() : out.parent_path().filename().string();
  const std::string me = hostname();
  std::error_code ec;
  // .tmp-export-<name>.<host>.<pid>: left behind by a killed export on this host when the pid is gone.
  const std::string prefix = ".tmp-export-" + base + ".";
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const auto dot = rest.rfind('.');
    if (dot == std::string::npos || rest.substr(0, dot) != me) continue;
    const long pid = std::atol(rest.substr(dot + 1).c_str());
    if (pid_alive(pid)) continue;
    log::info("removing ", e.path().string(), " (temporary export directory of a process that is gone)");
    fs::remove_all(e.path(), ec);
  }
  return (parent / (prefix + me + "." + std::to_string(::getpid()))).string();
}

std::string build_and_publish_export(const std::string& out_dir, const std::function<void(const fs::path& tmp)>& fill) {
  const fs::path tmp = export_temp_dir(out_dir);
  fs::remove_all(tmp);
  try {
    fill(tmp);
    fsync_tree(tmp.string());
  } catch (const fs::filesystem_error& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fail("export to ", out_dir, ": ", e.code().message(), " (", e.path1().string(), "); nothing was replaced");
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  if (fs::exists(out_dir)) fs::remove_all(out_dir);
  fs::rename(tmp, out_dir);
  fsync_dir(fs::absolute(out_dir).parent_path().string());
  return out_dir;
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
    // Renamed first (atomic), so that an interrupted deletion never leaves a
    // checkpoint-<n> that looks complete but is not; the next start removes the rest.
    const fs::path doomed = fs::path(output_dir) / (std::string(kTmpPrefix) + "del-" + std::to_string(all[i].step));
    fs::rename(all[i].path, doomed);
    fs::remove_all(doomed);
  }
}

}  // namespace vqad::train
