#include "vqad/train/metadata.h"

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/core/sha256.h"
#include "vqad/ops/attention.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/methods/registry.h"
#include "vqad/version.h"
#include "vqad/build_info.h"

namespace fs = std::filesystem;

namespace vqad::train {

std::string new_checkpoint_id() {
  std::random_device rd;
  std::mt19937_64 g((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                    static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::ostringstream os;
  os << "ckpt_" << std::hex;
  for (int i = 0; i < 2; ++i) {
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(g()));
    os << buf;
  }
  return os.str();
}

std::string utc_now_iso() {
  using namespace std::chrono;
  const auto now = system_clock::now();
  const auto us = duration_cast<microseconds>(now.time_since_epoch()).count() % 1000000;
  std::time_t t = system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  char out[96];
  std::snprintf(out, sizeof(out), "%s.%06lld+00:00", buf, static_cast<long long>(us));
  return out;
}

static nlohmann::json attention_json(const Role& r) {
  const AttentionBackend b = r.config.attention_backend;
  nlohmann::json a;
  a["backend"] = attention_backend_name(b);
  const bool vsa = model::is_vsa_backend(b);
  a["kind"] = vsa ? "vsa" : "dense";
  a["cube_shape"] = nullptr;
  if (vsa) {
    const auto cube = ops::vsa_cube_of(b);
    const auto& vc = r.model->attention_spec().vsa;
    a["cube_shape"] = {cube.t, cube.h, cube.w};
    a["physical_block_tokens"] = vsa_ref::kPhysicalBlockTokens;
    a["selection"] = {{"mode", ops::vsa_selection_name(vc.selection)}, {"top_p", vc.top_p},
                      {"sparsity", vc.sparsity}};
    a["compression_gates"] = {{"module", "to_gate_compress"},
                              {"initialization", r.compression_gate_initialization}};
  }
  const bool qat = b == AttentionBackend::kAttnQatTrain || b == AttentionBackend::kVsaQatTrainC64 ||
                   b == AttentionBackend::kVsaQatTrainC128;
  const auto& q = r.model->attention_spec().qat;
  nlohmann::json p;
  p["quantization_aware"] = qat;
  p["compute"] = "BF16";
  p["master_weights"] = "FP32";
  if (qat) {
    p["qk_format"] = "NVFP4 E2M1, unit scale, 16-channel blocks";
    p["p_format"] = "NVFP4 E2M1 per 16 keys against the running max";
    p["scale_dtype"] = "FP8 E4M3FN";
    p["quant_p"] = q.quant_p;
    p["quant_v"] = q.quant_v;
    p["block_n"] = q.block_n;
    p["backward"] = q.bwd_mode == ops::AttnQatBwdMode::kConsistent ? "consistent" : "fastvideo";
    p["use_global_sf_qkv"] = false;
    p["use_global_sf_p"] = false;
    p["two_level_p"] = false;
    p["pv_fp8"] = false;
  }
  a["precision"] = p;
  return a;
}

static nlohmann::json linear_quant_json(const Role& r) {
  if (r.plan.empty()) return nullptr;
  nlohmann::json j = r.plan.to_json();
  j["format"] = "NVFP4 W4A4: E2M1 values, 16-element blocks, FP8 E4M3 block scales, FP32 global scale";
  j["backward"] = "whole-linear straight-through on the saved unquantized X and master W";
  j["scope"] = "student transformer only";
  return j;
}

nlohmann::json build_metadata(const RunConfig& run, const std::map<std::string, std::shared_ptr<Role>>& roles,
                              long step, const std::string& run_started_at) {
  nlohmann::json m;
  m["metadata_schema"] = kMetadataSchema;
  m["metadata_schema_version"] = kMetadataSchemaVersion;
  m["checkpoint"] = {{"id", new_checkpoint_id()}, {"step", step}, {"state", "training"}, {"created_at", utc_now_iso()}};
  m["checkpoint_state"] = "training_dcp";
  m["config"] = nlohmann::json::parse(run.resolved.dump());
  m["config_sha256"] = {{"resolved", run.resolved_sha256}, {"source", run.source_sha256}};
  const auto& student = roles.count("student") ? *roles.at("student") : *roles.begin()->second;
  const auto& wc = student.model->config();
  m["model"] = {{"kind", wan_model_kind(wc)}, {"architecture", wc.to_json()}};
  m["attention"] = attention_json(student);

  nlohmann::json contract;
  contract["attention_backend"] = attention_backend_name(student.config.attention_backend);
  contract["linear_quantization"] = linear_quant_json(student);
  contract["precision"] = {{"master_weights", "FP32"},
                           {"compute", c10::toString(student.model->options().compute_dtype)},
                           {"layernorm_modulation_rope", "FP32"}};
  // The method's own account of what it optimizes (methods/registry.h).
  nlohmann::json sup = method_registration(run).supervision(run, student);
  sup["method"] = method_name(run.method.kind);
  contract["supervision"] = sup;
  nlohmann::json roles_j = nlohmann::json::object(), frozen = nlohmann::json::array(), ckpt = nlohmann::json::array();
  for (const auto& [name, r] : roles) {
    roles_j[name] = {{"init_from", r->config.init_from},
                     {"attention_backend", attention_backend_name(r->config.attention_backend)},
                     {"trainable", r->config.trainable},
                     {"flow_shift", r->config.flow_shift},
                     {"linear_quantization", r->plan.empty() ? "none" : model::quant_method_name(r->plan.method)}};
    (r->config.trainable ? ckpt : frozen).push_back(name);
  }
  contract["distillation"] = {{"roles", roles_j}, {"frozen_roles", frozen}, {"checkpoint_roles", ckpt},
                              {"method", m["config"].value("method", nlohmann::json::object())}};
  nlohmann::json kernels = nlohmann::json::object();
  for (const auto& [path, sha] : build_info::kernel_source_hashes()) kernels[path] = sha;
  contract["kernel_source_files"] = kernels;
  m["training_contract"] = contract;

  m["provenance"] = {
      {"code", {{"repo", "vqad"}, {"version", VQAD_VERSION}, {"commit", build_info::kGitCommit},
                {"dirty", build_info::kGitDirty}, {"policy", "commit-and-dirty-flag-at-configure-time"}}},
      {"configs", {{"source", {{"path", "source.yaml"}, {"sha256", run.source_sha256}}},
                   {"resolved", {{"path", "resolved.yaml"}, {"sha256", run.resolved_sha256}}}}}};

  nlohmann::json lineage;
  lineage["init_from"] = student.config.init_from;
  lineage["kind"] = student.init_kind == "random" ? "random_initialization"
                    : student.init_kind == "vqad_export" ? "vqad_export_initialization"
                                                         : "pretrained_initialization";
  lineage["optimizer_state"] = "fresh";
  if (!student.compression_gate_initialization.empty())
    lineage["compression_gate_initialization"] = student.compression_gate_initialization;
  if (!student.parent_metadata.is_null()) {
    lineage["checkpoint_id"] = student.parent_metadata["checkpoint"].value("id", "");
    lineage["checkpoint_step"] = student.parent_metadata["checkpoint"].value("step", 0);
    lineage["parent_metadata"] = student.parent_metadata;
  } else {
    lineage["checkpoint_id"] = nullptr;
    lineage["parent_metadata"] = nullptr;
  }
  m["lineage"] = lineage;
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  m["run_identity"] = {{"run_name", run.training.tracker.run_name},
                       {"output_dir", run.training.checkpoint.output_dir},
                       {"started_at", run_started_at},
                       {"hostname", host},
                       {"world_size", run.training.distributed.num_gpus}};
  return m;
}

nlohmann::json hash_files(const std::string& dir) {
  nlohmann::json files = nlohmann::json::object();
  std::vector<fs::path> paths;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (const auto& p : paths) {
    const std::string rel = fs::relative(p, dir).string();
    if (rel == "metadata.json" || rel == kCheckpointMarker) continue;
    files[rel] = sha256_file(p.string());
  }
  return files;
}

void write_metadata(const std::string& dir, nlohmann::json metadata) {
  metadata["files"] = hash_files(dir);
  st::write_file_atomic((fs::path(dir) / "metadata.json").string(), {metadata.dump(2) + "\n"});
}

nlohmann::json read_metadata(const std::string& dir) {
  const fs::path p = fs::path(dir) / "metadata.json";
  VQAD_CHECK(fs::is_regular_file(p), dir, ": no metadata.json (not a vqad checkpoint or export)");
  std::ifstream f(p);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail(p.string(), ": malformed JSON: ", e.what());
  }
}

std::string lineage_text(const nlohmann::json& metadata) {
  std::ostringstream os;
  const nlohmann::json* m = &metadata;
  int depth = 0;
  while (m && m->is_object()) {
    static const nlohmann::json kEmpty = nlohmann::json::object();
    const auto& c = m->contains("checkpoint") ? (*m)["checkpoint"] : kEmpty;
    // A reference into *m (not a copy): the next iteration points into it.
    const auto& lin = m->contains("lineage") ? (*m)["lineage"] : kEmpty;
    os << std::string(depth * 2, ' ') << (depth ? "<- " : "") << c.value("id", "?") << "  step "
       << c.value("step", 0) << "  " << m->value("checkpoint_state", "?") << "  method "
       << (*m)["training_contract"]["supervision"].value("method", "?") << "  attention "
       << (*m)["training_contract"].value("attention_backend", "?") << "  linears "
       << ((*m)["training_contract"]["linear_quantization"].is_null()
               ? std::string("dense")
               : (*m)["training_contract"]["linear_quantization"].value("method", "?"))
       << "\n"
       << std::string(depth * 2 + (depth ? 3 : 0), ' ') << "init_from " << lin.value("init_from", "?") << " ("
       << lin.value("kind", "?") << ")\n";
    if (!lin.contains("parent_metadata") || lin["parent_metadata"].is_null()) break;
    m = &lin["parent_metadata"];
    ++depth;
  }
  return os.str();
}

std::vector<std::string> verify_lineage(const std::string& dir) {
  std::vector<std::string> problems;
  nlohmann::json m;
  try {
    m = read_metadata(dir);
  } catch (const Error& e) {
    return {e.what()};
  }
  static const std::regex id_re("ckpt_[0-9a-f]{32}");
  const std::string id = m["checkpoint"].value("id", "");
  if (!std::regex_match(id, id_re)) problems.push_back(dir + ": checkpoint.id '" + id + "' is malformed");
  if (m.value("metadata_schema", "") != kMetadataSchema)
    problems.push_back(dir + ": metadata_schema is '" + m.value("metadata_schema", "") + "', expected " + kMetadataSchema);
  const auto files = m.value("files", nlohmann::json::object());
  if (files.empty()) problems.push_back(dir + ": metadata lists no files");
  for (const auto& [rel, sha] : files.items()) {
    const fs::path p = fs::path(dir) / rel;
    if (!fs::is_regular_file(p)) {
      problems.push_back(p.string() + ": missing (recorded in metadata)");
    } else if (sha256_file(p.string()) != sha.get<std::string>()) {
      problems.push_back(p.string() + ": sha256 differs from metadata (file modified)");
    }
  }
  const auto& lin = m.value("lineage", nlohmann::json::object());
  if (lin.contains("parent_metadata") && lin["parent_metadata"].is_object()) {
    const auto& parent = lin["parent_metadata"];
    const std::string pid = parent["checkpoint"].value("id", "");
    if (lin.value("checkpoint_id", "") != pid)
      problems.push_back(dir + ": lineage.checkpoint_id does not match the parent metadata's id");
    const std::string init = lin.value("init_from", "");
    fs::path parent_dir = init;
    if (!fs::is_regular_file(parent_dir / "metadata.json") && fs::is_regular_file(parent_dir.parent_path() / "metadata.json"))
      parent_dir = parent_dir.parent_path();
    if (fs::is_regular_file(parent_dir / "metadata.json")) {
      auto on_disk = read_metadata(parent_dir.string());
      if (on_disk["checkpoint"].value("id", "") != pid)
        problems.push_back(parent_dir.string() + ": parent on disk has id " + on_disk["checkpoint"].value("id", "") +
                           ", lineage records " + pid);
      auto sub = verify_lineage(parent_dir.string());
      problems.insert(problems.end(), sub.begin(), sub.end());
    }
  }
  return problems;
}

}  // namespace vqad::train
