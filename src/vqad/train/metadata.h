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
// `known` (relative path -> sha256) supplies hashes computed while the files were written,
// so large files are not read back.
nlohmann::json hash_files(const std::string& dir, const std::map<std::string, std::string>& known = {});

// The metadata's own hash: sha256 of the canonical serialisation (compact JSON, keys
// sorted) of the metadata without its "metadata_sha256" key. Stored under that key, it
// makes any edit of metadata.json that does not recompute it detectable.
inline constexpr const char* kMetadataHashKey = "metadata_sha256";
std::string metadata_sha256(const nlohmann::json& metadata);

// Writes dir/metadata.json (with files hashed and the metadata hash) atomically.
void write_metadata(const std::string& dir, nlohmann::json metadata,
                    const std::map<std::string, std::string>& known_hashes = {});
nlohmann::json read_metadata(const std::string& dir);

// Integrity of one checkpoint or export directory (no parents): metadata present,
// well-formed and matching its metadata_sha256, every recorded file present with its
// recorded sha256, and no file in the directory that the metadata does not list.
// Returns the problems (empty = intact). Hashes files on `threads` threads.
std::vector<std::string> verify_directory(const std::string& dir, int threads = 4);
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

// The lineage chain of a checkpoint or export directory, newest first, one line each.
std::string lineage_text(const nlohmann::json& metadata);
// Verifies dir: verify_directory, ids well-formed, and every parent recorded in the
// lineage is on disk, intact, and identical to the metadata recorded for it (its
// metadata_sha256), recursively. A parent that is no longer on disk is a problem.
// Returns the list of problems (empty = verified).
std::vector<std::string> verify_lineage(const std::string& dir);

}  // namespace vqad::train
