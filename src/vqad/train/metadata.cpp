#include "vqad/train/metadata.h"
#include "vqad/train/integrity.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
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
  // What actually runs for this backend on this device (FLASH_ATTN and TORCH_SDPA are the
  // same dense math; on a CPU both are the fp32 reference).
  auto params = r.model->parameters();
  const bool cuda = !params.empty() && params.front().is_cuda();
  a["device"] = cuda ? "cuda" : "cpu";
  if (qat)
    a["implementation"] = cuda ? "vqad ATTN_QAT_TRAIN CUDA kernels" : "vqad ATTN_QAT_TRAIN CPU reference";
  else if (!vsa)
    a["implementation"] = cuda ? "LibTorch scaled_dot_product_attention (torch selects the kernel)"
                               : "dense CPU reference (fp32 scores and softmax)";
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

nlohmann::json hash_files(const std::string& dir, const std::map<std::string, std::string>& known) {
  nlohmann::json files = nlohmann::json::object();
  std::vector<fs::path> paths;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (const auto& p : paths) {
    const std::string rel = fs::relative(p, dir).string();
    if (rel == "metadata.json" || rel == kCheckpointMarker) continue;
    auto it = known.find(rel);
    files[rel] = it != known.end() ? it->second : sha256_file(p.string());
  }
  return files;
}

std::string metadata_sha256(const nlohmann::json& metadata) {
  if (!metadata.is_object()) return sha256_hex(metadata.dump());
  nlohmann::json copy = metadata;
  copy.erase(kMetadataHashKey);
  return sha256_hex(copy.dump());
}

void write_metadata(const std::string& dir, nlohmann::json metadata, const std::map<std::string, std::string>& known) {
  metadata["files"] = hash_files(dir, known);
  metadata[kMetadataHashKey] = metadata_sha256(metadata);
  st::write_file_atomic((fs::path(dir) / "metadata.json").string(), {metadata.dump(2) + "\n"});
}

nlohmann::json read_metadata(const std::string& dir) {
  const fs::path p = fs::path(dir) / "metadata.json";
  VQAD_CHECK(fs::is_regular_file(p), dir, ": no metadata.json (not a vqad checkpoint or export)");
  std::ifstream f(p);
  VQAD_CHECK(f.good(), p.string(), ": cannot be read");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail(p.string(), ": malformed JSON: ", e.what());
  }
  VQAD_CHECK(m.is_object(), p.string(), ": expected a JSON object, found ", m.type_name());
  return m;
}

std::string metadata_dir_of(const std::string& path) {
  if (path.empty()) return "";
  const fs::path p(path);
  if (fs::is_regular_file(p / "metadata.json")) return p.string();
  if (fs::is_regular_file(p.parent_path() / "metadata.json")) return p.parent_path().string();
  return "";
}

std::vector<std::string> verify_directory(const std::string& dir, int threads) {
  std::vector<std::string> problems;
  nlohmann::json m;
  try {
    m = read_metadata(dir);
  } catch (const Error& e) {
    return {e.what()};
  }
  const std::string mpath = (fs::path(dir) / "metadata.json").string();
  if (!m.contains(kMetadataHashKey) || !m[kMetadataHashKey].is_string())
    problems.push_back(mpath + ": no " + kMetadataHashKey + " (unsigned metadata: edits cannot be detected)");
  else if (const std::string want = m[kMetadataHashKey].get<std::string>(), got = metadata_sha256(m); want != got)
    problems.push_back(mpath + ": " + kMetadataHashKey + " records " + want + ", the metadata hashes to " + got +
                       " (metadata.json was edited after it was written)");
  if (!m.contains("files") || !m["files"].is_object()) {
    problems.push_back(mpath + ": expected 'files' {path: sha256}, found " +
                       (m.contains("files") ? std::string(m["files"].type_name()) : std::string("no 'files' key")));
    return problems;
  }
  const auto& files = m["files"];
  if (files.empty()) problems.push_back(dir + ": metadata lists no files");
  std::vector<std::pair<std::string, std::string>> todo;  // rel, recorded sha
  for (const auto& [rel, sha] : files.items()) {
    const fs::path p = fs::path(dir) / rel;
    if (!sha.is_string()) {
      problems.push_back(mpath + ": files['" + rel + "']: expected a sha256 string, found " + sha.dump());
    } else if (rel.find("..") != std::string::npos || fs::path(rel).is_absolute()) {
      problems.push_back(mpath + ": files['" + rel + "'] points outside the directory");
    } else if (!fs::is_regular_file(p)) {
      problems.push_back(p.string() + ": missing (recorded in metadata)");
    } else {
      todo.emplace_back(rel, sha.get<std::string>());
    }
  }
  // Files the metadata does not list: nothing may be added to a checkpoint after it was sealed.
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file() && !it->is_symlink()) continue;
    const std::string rel = fs::relative(it->path(), dir).string();
    if (rel == "metadata.json" || rel == kCheckpointMarker) continue;
    if (!files.contains(rel))
      problems.push_back(it->path().string() + ": not listed in metadata (added after the directory was written)");
  }
  // Hash the listed files, largest first, on a few threads (files are independent).
  std::sort(todo.begin(), todo.end(), [&](const auto& a, const auto& b) {
    return fs::file_size(fs::path(dir) / a.first) > fs::file_size(fs::path(dir) / b.first);
  });
  std::vector<std::string> got(todo.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
      try {
        got[i] = sha256_file((fs::path(dir) / todo[i].first).string());
      } catch (const Error& e) {
        got[i] = std::string("!") + e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(todo.size())));
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  for (size_t i = 0; i < todo.size(); ++i) {
    const std::string p = (fs::path(dir) / todo[i].first).string();
    if (!got[i].empty() && got[i][0] == '!')
      problems.push_back(got[i].substr(1));
    else if (got[i] != todo[i].second)
      problems.push_back(p + ": sha256 " + got[i] + ", metadata records " + todo[i].second +
                         " (file modified, truncated or corrupted)");
  }
  return problems;
}

void require_intact(const std::string& dir, const std::string& what) {
  auto problems = verify_directory(dir);
  if (problems.empty()) return;
  std::string msg = what + ": " + dir + " failed its integrity check (" + std::to_string(problems.size()) +
                    " problem(s)): " + problems[0];
  for (size_t i = 1; i < problems.size() && i < 4; ++i) msg += "; " + problems[i];
  if (problems.size() > 4) msg += "; ...";
  fail(msg);
}

static nlohmann::json segment_contract(const nlohmann::json& m) {
  nlohmann::json c = nlohmann::json::object();
  if (!m.is_object()) return c;
  const auto tc = m.value("training_contract", nlohmann::json::object());
  c["attention_backend"] = tc.value("attention_backend", nlohmann::json(nullptr));
  const auto lq = tc.value("linear_quantization", nlohmann::json(nullptr));
  c["linear_quantization"] = lq.is_object() ? lq.value("method", nlohmann::json("?")) : nlohmann::json("none");
  c["precision"] = tc.value("precision", nlohmann::json(nullptr));
  const auto att = m.value("attention", nlohmann::json::object());
  c["attention_implementation"] = att.value("implementation", nlohmann::json(nullptr));
  nlohmann::json roles = nlohmann::json::object();
  if (tc.contains("distillation") && tc["distillation"].is_object() && tc["distillation"].contains("roles"))
    for (const auto& [name, r] : tc["distillation"]["roles"].items())
      if (r.is_object())
        roles[name] = {{"attention_backend", r.value("attention_backend", nlohmann::json(nullptr))},
                       {"linear_quantization", r.value("linear_quantization", nlohmann::json(nullptr))},
                       {"trainable", r.value("trainable", nlohmann::json(nullptr))}};
  c["roles"] = roles;
  const auto cfg = m.value("config", nlohmann::json::object());
  auto at = [&](const char* ptr) {
    const nlohmann::json::json_pointer jp(ptr);
    return cfg.contains(jp) ? cfg[jp] : nlohmann::json(nullptr);
  };
  c["learning_rate"] = at("/training/optimizer/learning_rate");
  c["lr_scheduler"] = at("/training/optimizer/lr_scheduler");
  c["fake_score_learning_rate"] = at("/method/fake_score_learning_rate");
  return c;
}

void record_resume_segments(nlohmann::json& metadata, const nlohmann::json& resumed) {
  nlohmann::json segments = nlohmann::json::array();
  const nlohmann::json current = segment_contract(metadata);
  if (resumed.is_object()) {
    const auto lin = resumed.value("lineage", nlohmann::json::object());
    if (lin.contains("segments") && lin["segments"].is_array() && !lin["segments"].empty())
      segments = lin["segments"];
    else
      segments.push_back({{"start_step", 1}, {"contract", segment_contract(resumed)}});
    const auto ck = resumed.value("checkpoint", nlohmann::json::object());
    const long rstep = ck.value("step", 0L);
    if (segments.back().value("contract", nlohmann::json()) != current) {
      segments.push_back({{"start_step", rstep + 1}, {"contract", current}, {"resumed_from", ck.value("id", "")}});
      log::warn("resuming under a different training contract than checkpoint step ", rstep,
                " (attention, quantization, precision or learning rate changed): metadata records a new lineage "
                "segment from step ", rstep + 1);
    }
    metadata["lineage"]["resumed_from"] = {{"checkpoint_id", ck.value("id", "")}, {"step", rstep}};
    metadata["lineage"]["optimizer_state"] = "resumed";
  } else {
    segments.push_back({{"start_step", 1}, {"contract", current}});
  }
  metadata["lineage"]["segments"] = segments;
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
  std::vector<std::string> problems = verify_directory(dir);
  nlohmann::json m;
  try {
    m = read_metadata(dir);
  } catch (const Error&) {
    return problems;  // already reported
  }
  static const std::regex id_re("ckpt_[0-9a-f]{32}");
  const auto& ck = m.contains("checkpoint") && m["checkpoint"].is_object() ? m["checkpoint"] : nlohmann::json::object();
  const std::string id = ck.contains("id") && ck["id"].is_string() ? ck["id"].get<std::string>() : "";
  if (!std::regex_match(id, id_re)) problems.push_back(dir + ": checkpoint.id '" + id + "' is malformed");
  if (!m.contains("metadata_schema") || m["metadata_schema"] != kMetadataSchema)
    problems.push_back(dir + ": metadata_schema is " + (m.contains("metadata_schema") ? m["metadata_schema"].dump() : "missing") +
                       ", expected " + kMetadataSchema);
  if (!m.contains("lineage") || !m["lineage"].is_object()) {
    problems.push_back(dir + ": metadata has no lineage object");
    return problems;
  }
  const auto& lin = m["lineage"];
  if (lin.contains("parent_metadata") && lin["parent_metadata"].is_object()) {
    const auto& parent = lin["parent_metadata"];
    const std::string pid = parent.contains("checkpoint") && parent["checkpoint"].is_object()
                                ? parent["checkpoint"].value("id", "")
                                : "";
    if (!lin.contains("checkpoint_id") || lin["checkpoint_id"] != pid)
      problems.push_back(dir + ": lineage.checkpoint_id does not match the parent metadata's id");
    const std::string init = lin.contains("init_from") && lin["init_from"].is_string() ? lin["init_from"].get<std::string>() : "";
    const std::string parent_dir = metadata_dir_of(init);
    if (parent_dir.empty()) {
      problems.push_back(dir + ": parent " + (init.empty() ? std::string("(no init_from recorded)") : init) + " (id " +
                         pid + ") is not on disk; the lineage cannot be verified");
    } else {
      nlohmann::json on_disk;
      try {
        on_disk = read_metadata(parent_dir);
      } catch (const Error& e) {
        problems.push_back(e.what());
        return problems;
      }
      const std::string disk_id = on_disk.contains("checkpoint") && on_disk["checkpoint"].is_object()
                                      ? on_disk["checkpoint"].value("id", "")
                                      : "";
      if (disk_id != pid)
        problems.push_back(parent_dir + ": parent on disk has id " + disk_id + ", lineage records " + pid);
      else if (metadata_sha256(on_disk) != metadata_sha256(parent))
        problems.push_back(parent_dir + ": parent metadata on disk hashes to " + metadata_sha256(on_disk) +
                           ", the lineage records metadata hashing to " + metadata_sha256(parent));
      auto sub = verify_lineage(parent_dir);
      problems.insert(problems.end(), sub.begin(), sub.end());
    }
  }
  return problems;
}

nlohmann::json hash_files(const std::string& dir) { return hash_files(dir, {}); }
void write_metadata(const std::string& dir, nlohmann::json metadata) { write_metadata(dir, std::move(metadata), {}); }

}  // namespace vqad::train
