// Large-file writing for checkpoints: big sequential writes, one fsync per file, and the
// file's sha256 computed from memory on a second thread while it is written (so a
// checkpoint is never read back to be hashed).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace vqad {

// Creates `path` (it must not exist), writes the parts in order, fsyncs and closes it.
// Returns the sha256 (hex) of the bytes. On any failure the partial file is removed and a
// vqad::Error names the path and the reason ("No space left on device", "File too large").
std::string write_file_hashed(const std::string& path, const std::vector<std::string_view>& parts);

// The errno text of a write failure, with a hint for the common environment faults.
std::string write_error_text(int err);

}  // namespace vqad
