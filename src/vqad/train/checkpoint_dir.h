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

// A sharded save's parts (checkpoint_writer.h): where rank `part` of the writing shard group
// writes its files for checkpoint-<step> before rank 0 adopts them.
std::string checkpoint_parts_dir(const std::string& output_dir, long step, int part);
// Removes the parts directories of steps <= max_step (those of a save that was not published,
// or of every step at the start of a run); returns how many.
int remove_checkpoint_parts(const std::string& output_dir, long max_step);

// fsync helpers (also used by exporters).
void fsync_file(const std::string& path);
void fsync_dir(const std::string& path);
void fsync_tree(const std::string& dir);

}  // namespace vqad::train
