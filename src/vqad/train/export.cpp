#include "vqad/train/export.h"

#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "vqad/core/error.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {

std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& role,
                              bool overwrite) {
  const fs::path src = fs::path(checkpoint_dir) / role / "transformer";
  VQAD_CHECK(fs::is_directory(src), checkpoint_dir, ": no weights for role '", role, "' (expected ", src.string(),
             "; checkpoints hold only trainable roles)");
  VQAD_CHECK(fs::is_regular_file(fs::path(checkpoint_dir) / kCheckpointMarker), checkpoint_dir,
             ": incomplete checkpoint (no ", kCheckpointMarker, " marker)");
  nlohmann::json meta = read_metadata(checkpoint_dir);
  if (fs::exists(out_dir)) {
    VQAD_CHECK(overwrite, "export: ", out_dir, " already exists (pass --overwrite to replace it)");
  }
  const fs::path tmp = fs::path(out_dir).string() + ".tmp-export-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp / "transformer");
  for (const auto& e : fs::directory_iterator(src))
    if (e.is_regular_file()) fs::copy_file(e.path(), tmp / "transformer" / e.path().filename());
  for (const char* cfg : {"resolved.yaml", "source.yaml"})  // the run's configs travel with the export
    if (fs::is_regular_file(fs::path(checkpoint_dir) / cfg)) fs::copy_file(fs::path(checkpoint_dir) / cfg, tmp / cfg);
  meta["checkpoint_state"] = "inference_export";
  meta["export"] = {{"role", role}, {"source_checkpoint", fs::absolute(checkpoint_dir).string()},
                    {"created_at", utc_now_iso()}};
  write_metadata(tmp.string(), meta);
  fsync_tree(tmp.string());
  if (fs::exists(out_dir)) fs::remove_all(out_dir);
  fs::rename(tmp, out_dir);
  fsync_dir(fs::absolute(out_dir).parent_path().string());
  return out_dir;
}

}  // namespace vqad::train
