// Checkpoint and export metadata (metadata.json) and lineage.
//
// Schema vqad.qad_training v2 follows seeds/004's structure (spec/sparse_qad.md
// "Checkpoint metadata"): step, checkpoint {id, step, state, created_at},
// checkpoint_state (training_dcp | inference_export), code_provenance, config +
// config_sha256 {resolved, source}, model {kind, architecture}, attention {backend, kind,
// cube_shape, physical_block_tokens, precision, selection, compression_gates,
// training_kernel_family}, training_contract {attention_backend, attention_kind,
// cube_shape, physical_block_tokens, model_kind, model_architecture, precision,
// selection, training_kernel_family, kernel_source_commit, kernel_source_files,
// linear_quantization, supervision (sft / layer_recon / recon_ode) or distillation (dmd2),
// direct_lineage}, provenance {code, configs, lineage {kind, init_from, checkpoint_id,
// checkpoint_step, optimizer_state, compression_gate_initialization, parent_architecture,
// parent_attention_backend, parent_cube_shape, parent_quantization_aware,
// parent_metadata (the parent's whole metadata, recursively)}}, run_identity, and files
// {relative path: sha256} of what the directory holds.
#pragma once
#include <nlohmann/json.hpp>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "vqad/train/config.h"
#include "vqad/train/roles.h"

namespace vqad::train {

inline constexpr const char* kMetadataSchema = "vqad.qad_training";
inline constexpr int kMetadataSchemaVersion = 2;
// FastVideo's schemas (seeds/004: sparse stages and the dense S0), read by lineage_text /
// verify_lineage.
inline constexpr const char* kFastVideoMetadataSchema = "fastvideo.nanovideo_vsa_training";
inline constexpr const char* kFastVideoDenseMetadataSchema = "fastvideo.dense_nvfp4_training";

std::string new_checkpoint_id();        // "ckpt_" + 32 hex digits
std::string utc_now_iso();              // 2026-11-29T08:00:00.000000+00:00

// Metadata of a training checkpoint (state training_dcp) for the given roles. The
// method's registration supplies training_contract.supervision (or, for a distillation
// method, the objective inside training_contract.distillation).
nlohmann::json build_metadata(const RunConfig& run, const std::map<std::string, std::shared_ptr<Role>>& roles,
                              long step, const std::string& run_started_at);

// training_contract.supervision of the reconstruction methods (layer_recon, recon_ode):
// protocol_version 2, the frozen reference (models.teacher, weights_sha256), the ODE cache,
// the student's initialisation, the trainable scope and the objective's description.
// `training_schedule`: recon_ode's few-step schedule (null for layer_recon).
nlohmann::json recon_supervision_json(const RunConfig& run, const Role& student,
                                      const nlohmann::json& training_schedule);

// dir/source.yaml: the config file as given (run.source_path), when it still has the
// bytes whose sha256 the run recorded (else a warning and no file).
void write_source_yaml(const RunConfig& run, const std::string& dir);
// The same bytes, or nullopt (no source file, or it changed: a warning).
std::optional<std::string> source_yaml_text(const RunConfig& run);

// sha256 of every regular file under dir except metadata.json and the completion marker.
nlohmann::json hash_files(const std::string& dir);

// Writes dir/metadata.json (with files hashed) atomically.
void write_metadata(const std::string& dir, nlohmann::json metadata);
nlohmann::json read_metadata(const std::string& dir);
// A checkpoint / export directory, or a metadata JSON file (e.g. FastVideo's).
nlohmann::json read_metadata_path(const std::string& path);

// The lineage record of a metadata object: provenance.lineage (schema v2 and FastVideo),
// else the top-level lineage of schema v1; an empty object when there is none.
const nlohmann::json& lineage_of(const nlohmann::json& metadata);

// The lineage chain of a checkpoint or export, newest first, two lines per stage (vqad's
// and FastVideo's schema).
std::string lineage_text(const nlohmann::json& metadata);
// Verifies `path` (a directory or a metadata file). At every level of the chain: a known
// schema, well-formed ids, step == checkpoint.step, direct_lineage == provenance.lineage,
// lineage.init_from == config.models.student.init_from, and the recorded parent facts
// (checkpoint_id, checkpoint_step, parent_attention_backend, parent_quantization_aware,
// parent_architecture) equal the embedded parent's. For a directory also: every recorded
// file hash matches, and a parent export still on disk at init_from is the embedded one
// (same metadata) and verifies in turn. Returns the problems (empty = verified).
std::vector<std::string> verify_lineage(const std::string& path);

}  // namespace vqad::train
