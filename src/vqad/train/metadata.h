// Checkpoint and export metadata (metadata.json) and lineage.
//
// Every checkpoint and export carries: schema name/version, checkpoint {id, step,
// state, created_at}, checkpoint_state (training_dcp | inference_export), the
// resolved config and its sha256 (and the source file's), model kind and
// architecture, attention {backend, kind, precision}, training_contract
// {attention_backend, linear_quantization (the quant plan), precision, supervision,
// distillation {roles, frozen_roles, checkpoint_roles, method}, kernel source
// hashes}, provenance {code commit/dirty, configs}, lineage {kind, init_from,
// checkpoint_id, parent_metadata (the parent's whole metadata, recursively)},
// run_identity, and files {relative path: sha256} of what the directory holds.
#pragma once
#include <nlohmann/json.hpp>
#include <map>
#include <memory>
#include <string>

#include "vqad/train/config.h"
#include "vqad/train/roles.h"

namespace vqad::train {

inline constexpr const char* kMetadataSchema = "vqad.qad_training";
inline constexpr int kMetadataSchemaVersion = 1;

std::string new_checkpoint_id();        // "ckpt_" + 32 hex digits
std::string utc_now_iso();              // 2026-11-29T08:00:00.000000+00:00

// Metadata of a training checkpoint (state training_dcp) for the given roles.
nlohmann::json build_metadata(const RunConfig& run, const std::map<std::string, std::shared_ptr<Role>>& roles,
                              long step, const std::string& run_started_at);

// sha256 of every regular file under dir except metadata.json and the completion marker.
nlohmann::json hash_files(const std::string& dir);

// Writes dir/metadata.json (with files hashed) atomically.
void write_metadata(const std::string& dir, nlohmann::json metadata);
nlohmann::json read_metadata(const std::string& dir);

// The lineage chain of a checkpoint or export directory, newest first, one line each.
std::string lineage_text(const nlohmann::json& metadata);
// Verifies dir: metadata present and well-formed, ids well-formed, every recorded file
// hash matches, and every parent that is still on disk matches its recorded metadata
// (id and files). Returns the list of problems (empty = verified).
std::vector<std::string> verify_lineage(const std::string& dir);

}  // namespace vqad::train
