// Atomic checkpoint directories: <output_dir>/checkpoint-<step>/ appears only
// complete. Files are written into a hidden temporary directory next to it,
// fsynced, a completion marker is written last, and the directory is renamed
// into place (then the parent is fsynced). A crash at any point leaves either
// the previous checkpoints untouched plus a stray temporary directory (ignored
// and cleaned up later) or the new, complete checkpoint.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace vqad::train {

inline constexpr const char* kCheckpointMarker = "CHECKPOINT_COMPLETE";

struct CheckpointEntry {
  long step = 0;
  std::string path;
};

// Calls fill(tmp_dir) to write the files, then publishes checkpoint-<step>.
// An existing checkpoint-<step> is replaced only after the new one is complete.
std::string write_checkpoint_dir(const std::string& output_dir, long step,
                                 const std::function<void(const std::string& dir)>& fill);

// Complete checkpoints under output_dir, ascending by step. Directories named
// checkpoint-<n> without the marker are skipped with a warning.
std::vector<CheckpointEntry> list_checkpoints(const std::string& output_dir);

// resume spec: "latest" (newest complete under output_dir, nullopt if none),
// a checkpoint-<n> directory, or an output directory (its newest). A named
// directory that is incomplete or missing is an error.
std::optional<CheckpointEntry> resolve_resume(const std::string& spec, const std::string& output_dir);

// Keeps the newest `limit` complete checkpoints (limit <= 0 keeps all) and
// removes stray temporary directories.
void apply_retention(const std::string& output_dir, int limit);

// Removes the temporary checkpoint directories (.tmp-checkpoint-*) under output_dir.
// Called at the start of a run that holds the output directory's RunLock: any such
// directory then belongs to a run that died. Returns how many were removed.
int remove_stale_checkpoint_temps(const std::string& output_dir);

// One run per output directory: <output_dir>/.vqad-run.lock holds an exclusive flock()
// for the lifetime of this object plus "pid host started_at" for messages. A lock file
// left by a dead process (the kernel released its flock) is stale and taken over with a
// log line; a live holder is an error naming its pid and host.
class RunLock {
 public:
  explicit RunLock(const std::string& output_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};
inline constexpr const char* kRunLockName = ".vqad-run.lock";

// What of a previous run output_dir holds (checkpoint-* directories, metrics.jsonl,
// resolved.yaml); empty when none.
std::vector<std::string> previous_run_files(const std::string& output_dir);
// A new (not resuming) run may start in output_dir only when it holds no previous run;
// with overwrite_run the previous run's files (only those vqad writes) are removed first.
void prepare_new_run_dir(const std::string& output_dir, bool overwrite_run);

// Checks that an export may be written to out_dir: it does not exist, is empty, or (with
// overwrite) is an earlier vqad export and neither is, contains nor lies inside `source`,
// a checkpoint or a run directory. Throws naming what was found.
void check_export_target(const std::string& out_dir, const std::string& source, bool overwrite);
// Temporary export directory for out_dir (next to it, named .tmp-export-*), after removing
// the temporary export directories that dead processes on this host left next to it.
std::string export_temp_dir(const std::string& out_dir);

// Creates dir (and parents) or throws one line naming `what`, the path and the reason
// (a file in the way, read-only filesystem, permission denied, ...).
void create_dir_or_fail(const std::string& dir, const std::string& what);

// fsync helpers (also used by exporters).
void fsync_file(const std::string& path);
void fsync_dir(const std::string& path);
void fsync_tree(const std::string& dir);

}  // namespace vqad::train
