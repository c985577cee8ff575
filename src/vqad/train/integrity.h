// Integrity and ownership of checkpoint / export directories: the metadata's own hash,
// verification before every read, one run per output directory, and what a new run, an
// export or a dead process may and may not delete. (metadata.h and checkpoint_dir.h hold
// the formats; this header the operations on them.)
#pragma once
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/metadata.h"

namespace vqad::train {

// sha256 of every regular file under dir except metadata.json and the completion marker;
// `known` (relative path -> sha256) supplies hashes computed while the files were written,
// so large files are not read back.
nlohmann::json hash_files(const std::string& dir, const std::map<std::string, std::string>& known);

// The metadata's own hash: sha256 of the canonical serialisation (compact JSON, keys
// sorted) of the metadata without its "metadata_sha256" key. Stored under that key, it
// makes any edit of metadata.json that does not recompute it detectable.
inline constexpr const char* kMetadataHashKey = "metadata_sha256";
std::string metadata_sha256(const nlohmann::json& metadata);

// Writes dir/metadata.json (files hashed, `known_hashes` used where given, and the
// metadata hash) atomically. write_metadata(dir, metadata) of metadata.h does the same
// with no known hashes.
void write_metadata(const std::string& dir, nlohmann::json metadata,
                    const std::map<std::string, std::string>& known_hashes);
// verify_lineage (metadata.h) runs verify_directory on the directory and on every parent
// recorded in its lineage, recursively; a parent that is no longer on disk, not intact, or
// whose metadata_sha256 differs from the recorded parent metadata is a problem.
//
// Integrity of one checkpoint or export directory (no parents): metadata present,
// well-formed and matching its metadata_sha256, every recorded file present with its
// recorded sha256, and no file in the directory that the metadata does not list.
// Returns the problems (empty = intact). Hashes files on `threads` threads.
std::vector<std::string> verify_directory(const std::string& dir, int threads = 0);  // 0: up to 8 by the machine
// Throws one vqad::Error naming `what` (e.g. "resume_from_checkpoint"), the directory and
// its problems when verify_directory finds any.
void require_intact(const std::string& dir, const std::string& what);
// The directory holding the metadata.json of a path given as init_from / a checkpoint
// role directory (the path itself or its parent); "" when neither holds one.
std::string metadata_dir_of(const std::string& path);

// Lineage segments of a run that was resumed: lineage.segments lists, per stretch of steps
// trained under one contract (attention backend, linear quantization, precision, learning
// rates, roles), {start_step, contract}. A resume under the same contract continues the
// last segment; a resume under a different one appends a segment starting at the resumed
// step + 1, so no checkpoint claims the new contract for steps trained under the old.
// `resumed` is the metadata of the checkpoint resumed from (null for a fresh run).
void record_resume_segments(nlohmann::json& metadata, const nlohmann::json& resumed);

// Removes the temporary checkpoint directories (.tmp-checkpoint-*, and the .parts-checkpoint-*
// of sharded saves) under output_dir.
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
// Builds an export in a fresh export_temp_dir(out_dir) (`fill` writes into it), fsyncs it
// and puts it in place of out_dir (the caller has checked out_dir with check_export_target).
// On any failure the temporary directory is removed and out_dir is untouched; a filesystem
// error becomes one line naming out_dir. Returns out_dir.
std::string build_and_publish_export(const std::string& out_dir,
                                     const std::function<void(const std::filesystem::path& tmp)>& fill);

// Creates dir (and parents) or throws one line naming `what`, the path and the reason
// (a file in the way, read-only filesystem, permission denied, ...).
void create_dir_or_fail(const std::string& dir, const std::string& what);

}  // namespace vqad::train
