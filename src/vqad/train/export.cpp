#include "vqad/train/export.h"

#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "vqad/core/error.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {

std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& role,
                              bool overwrite) {
  const fs::path src = fs::path(checkpoint_dir) / role / "transformer";
  VQAD_CHECK(fs::is_directory(checkpoint_dir), "export: ", checkpoint_dir, " is not a directory");
  VQAD_CHECK(fs::is_regular_file(fs::path(checkpoint_dir) / kCheckpointMarker), checkpoint_dir,
             ": incomplete checkpoint (no ", kCheckpointMarker, " marker)");
  VQAD_CHECK(fs::is_directory(src), checkpoint_dir, ": no weights for role '", role, "' (expected ", src.string(),
             "; checkpoints hold only trainable roles)");
  require_intact(checkpoint_dir, "export");
  check_export_target(out_dir, checkpoint_dir, overwrite);
  nlohmann::json meta = read_metadata(checkpoint_dir);
  const auto src_files = meta.at("files");
  return build_and_publish_export(out_dir, [&](const fs::path& tmp) {
    create_dir_or_fail((tmp / "transformer").string(), "export");
    for (const auto& e : fs::directory_iterator(src))
      if (e.is_regular_file()) fs::copy_file(e.path(), tmp / "transformer" / e.path().filename());
    for (const char* cfg : {"resolved.yaml", "source.yaml"})  // the run's configs travel with the export
      if (fs::is_regular_file(fs::path(checkpoint_dir) / cfg)) fs::copy_file(fs::path(checkpoint_dir) / cfg, tmp / cfg);
    meta["checkpoint_state"] = "inference_export";
    meta["export"] = {{"role", role}, {"source_checkpoint", fs::absolute(checkpoint_dir).string()},
                      {"created_at", utc_now_iso()}};
    write_metadata(tmp.string(), meta);
    // The copies must be the bytes the checkpoint recorded (a failing disk shows here).
    for (const auto& [rel, sha] : read_metadata(tmp.string()).at("files").items()) {
      const std::string src_rel = (rel == "resolved.yaml" || rel == "source.yaml") ? rel : role + "/" + rel;
      VQAD_CHECK(src_files.contains(src_rel) && src_files[src_rel] == sha, "export: ", (tmp / rel).string(),
                 " differs from ", src_rel, " recorded in ", checkpoint_dir, " (copy corrupted)");
    }
  });
}

}  // namespace vqad::train
