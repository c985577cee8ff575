#include "vqad/train/metadata.h"
#include "vqad/train/integrity.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/safetensors.h"
#include "vqad/core/sha256.h"
#include "vqad/data/ode_cache.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/vsa_attention.h"
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

namespace {

bool is_qat_backend(AttentionBackend b) {
  return b == AttentionBackend::kAttnQatTrain || b == AttentionBackend::kVsaQatTrainC64 ||
         b == AttentionBackend::kVsaQatTrainC128;
}

nlohmann::json cube_shape_json(AttentionBackend b) {
  if (!model::is_vsa_backend(b)) return nullptr;
  const auto cube = ops::vsa_cube_of(b);
  return {cube.t, cube.h, cube.w};
}

std::string kernel_family(AttentionBackend b) {
  if (model::is_vsa_backend(b)) return is_qat_backend(b) ? "vqad_vsa_nvfp4_fake" : "vqad_vsa_bf16";
  if (b == AttentionBackend::kAttnQatTrain) return "vqad_sm90_dense_nvfp4_fake";
  return "dense_sdpa";
}

nlohmann::json precision_json(const Role& r) {
  const AttentionBackend b = r.config.attention_backend;
  const bool qat = is_qat_backend(b);
  const auto& q = r.model->attention_spec().qat;
  nlohmann::json p;
  p["quantization_aware"] = qat;
  p["compute"] = "BF16";
  p["master_weights"] = "FP32";
  if (model::is_vsa_backend(b)) {
    p["coarse"] = "BF16";
    p["quantize_coarse"] = false;
    p["fine"] = qat ? "NVFP4 fake-quant with BF16 matmul" : "BF16";
    p["quantize_fine"] = qat;
  }
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
  return p;
}

nlohmann::json selection_json(const Role& r) {
  if (!model::is_vsa_backend(r.config.attention_backend)) return nullptr;
  const auto& vc = r.model->attention_spec().vsa;
  return {{"mode", ops::vsa_selection_name(vc.selection)},
          {"top_p", vc.top_p},
          {"sparsity", vc.sparsity},
          {"effective_topk", "max(1, min(ceil((1-sparsity)*num_blocks), num_blocks))"}};
}

// compression_gates of a VSA student: the module, its initialisation (the role's loader
// record) and whether it trains: "trained" when the gates are in the trainable scope (or
// the whole model trains), "frozen" otherwise; null for dense attention.
nlohmann::json gates_json(const Role& r) {
  if (!model::is_vsa_backend(r.config.attention_backend)) return nullptr;
  std::string training = "frozen";
  if (r.config.trainable) {
    if (r.trainable_names.empty()) training = "trained";
    for (const auto& n : r.trainable_names)
      if (n.find("to_gate_compress") != std::string::npos) training = "trained";
  }
  return {{"module", "to_gate_compress"}, {"initialization", r.compression_gate_initialization},
          {"training", training}};
}

nlohmann::json attention_json(const RunConfig& run, const Role& r) {
  const AttentionBackend b = r.config.attention_backend;
  nlohmann::json a;
  a["backend"] = attention_backend_name(b);
  a["kind"] = model::is_vsa_backend(b) ? "vsa" : "dense";
  a["cube_shape"] = cube_shape_json(b);
  a["physical_block_tokens"] = model::is_vsa_backend(b) ? nlohmann::json(vsa_ref::kPhysicalBlockTokens) : nlohmann::json(nullptr);
  a["precision"] = precision_json(r);
  a["selection"] = selection_json(r);
  a["compression_gates"] = gates_json(r);
  a["training_kernel_family"] = kernel_family(b);
  // What actually runs for this backend on this device (FLASH_ATTN and TORCH_SDPA are the
  // same dense math; on a CPU both are the fp32 reference).
  auto params = r.model->parameters();
  const bool cuda = !params.empty() && params.front().is_cuda();
  a["device"] = cuda ? "cuda" : "cpu";
  if (b == AttentionBackend::kAttnQatTrain)
    a["implementation"] = cuda ? "vqad ATTN_QAT_TRAIN CUDA kernels" : "vqad ATTN_QAT_TRAIN CPU reference";
  else if (model::is_vsa_backend(b))
    a["implementation"] = cuda ? "vqad VSA CUDA kernels (kernels/vsa)" : "vqad VSA CPU reference (numerics/vsa_ref)";
  else
    a["implementation"] = cuda ? "LibTorch scaled_dot_product_attention (torch selects the kernel)"
                               : "dense CPU reference (fp32 scores and softmax)";
  return a;
}

nlohmann::json linear_quant_json(const Role& r) {
  if (r.plan.empty()) return nullptr;
  nlohmann::json j = r.plan.to_json();
  j["kind"] = model::quant_method_name(r.plan.method);
  j["format"] = "NVFP4 W4A4: E2M1 values, 16-element blocks, FP8 E4M3 block scales, FP32 global scale";
  j["forward"] = "dequantized NVFP4 operands, BF16 GEMM with the global-scale alpha, BF16 output";
  j["backward"] = "whole-linear STE on the saved unquantized X and master W in the gradient dtype";
  j["master_weights"] = "FP32";
  j["scope"] = "student transformer only; teacher and critic load with quant_config dropped";
  const bool qad = r.plan.method == model::QuantMethod::kNvfp4Qad;
  j["weight_global_scale"] = "dynamic, 448*6/max|W| recomputed every forward from the master weight";
  j["activation_global_scale"] = qad ? "static (calibrated amax) for FFN linears, unit elsewhere"
                                     : "dynamic, 448*6/max|X| recomputed every forward";
  if (qad) {
    j["forward"] = "dequantized NVFP4 operands, BF16 GEMM with alpha = (1/w_sf)/input_sf, BF16 output, then + bias "
                   "in BF16 (seeds/003's order); static input_sf = fp32(2688/amax) computed in double";
    // The calibrated amax table of the static linears: what the packed export and a
    // fake-quant load of this checkpoint use.
    const auto layers = model::qad_linears(r.quants);
    bool calibrated = true;
    for (const auto& l : layers)
      calibrated = calibrated && (l->activation_mode() != nvfp4::ScaleMode::kStatic || l->input_amax().has_value());
    if (calibrated) j["input_amax"] = model::export_amax_table(layers);
  }
  // The forward GEMM route the role was built with (training.linear_quantization.gemm resolved
  // for its device).
  j["gemm_route"] = ops::nvfp4_gemm_route_name(r.quant_config.gemm_route);
  if (r.quant_config.gemm_route == ops::Nvfp4GemmRoute::kFp4)
    j["forward"] = std::string("E2M1 codes and E4M3 block scales (cvt.rn.satfinite.e2m1x2.f32) through cuBLASLt's "
                               "block-scaled FP4 GEMM with the global-scale alpha, fp32 output, then the bias in the "
                               "fake-quant route's order; ") +
                   (qad ? "alpha = (1/w_sf)/input_sf, BF16 output + bias in BF16 (seeds/003's order)"
                        : "one BF16 rounding of alpha * acc + bias");
  if (r.plan.shared_qkv_scale) {
    nlohmann::json groups = nlohmann::json::object();
    for (const auto& [g, members] : model::shared_scale_groups(r.plan)) groups[g] = members;
    j["shared_scale_groups"] = groups;
  }
  return j;
}

// The parent's attention facts, from vqad's or FastVideo's metadata (same keys).
struct ParentFacts {
  bool present = false;
  std::string backend, kind;
  nlohmann::json cube_shape = nullptr;
  bool quantization_aware = false;
};

ParentFacts parent_facts(const nlohmann::json& pm) {
  ParentFacts f;
  if (!pm.is_object()) return f;
  f.present = true;
  const auto& a = pm.contains("attention") && pm["attention"].is_object() ? pm["attention"] : nlohmann::json::object();
  const auto& tc = pm.contains("training_contract") && pm["training_contract"].is_object() ? pm["training_contract"]
                                                                                           : nlohmann::json::object();
  f.backend = a.value("backend", tc.value("attention_backend", std::string()));
  f.kind = a.value("kind", std::string());
  if (f.kind.empty()) f.kind = f.backend.rfind("VSA", 0) == 0 ? "vsa" : "dense";
  f.cube_shape = a.contains("cube_shape") ? a["cube_shape"] : nlohmann::json(nullptr);
  const auto& prec = a.contains("precision") && a["precision"].is_object() ? a["precision"] : nlohmann::json::object();
  f.quantization_aware = prec.value("quantization_aware", f.backend.find("QAT") != std::string::npos);
  return f;
}

std::string read_parent_architecture_text(const std::string& init_from, nlohmann::json* out) {
  try {
    const auto src = model::locate_weights(init_from);
    if (src.config_path.empty()) return "";
    std::ifstream f(src.config_path);
    *out = nlohmann::json::parse(f);
    return src.config_path;
  } catch (const std::exception&) {
    return "";
  }
}

nlohmann::json lineage_json(const Role& student) {
  nlohmann::json lin;
  const auto pf = parent_facts(student.parent_metadata);
  const bool vsa = model::is_vsa_backend(student.config.attention_backend);
  if (student.init_kind == "random")
    lin["kind"] = "random_initialization";
  else if (!pf.present)
    lin["kind"] = "base_model_initialization";
  else if (pf.kind == "vsa")
    lin["kind"] = pf.quantization_aware ? "sparse_qat_weight_initialization" : "sparse_weight_initialization";
  else
    lin["kind"] = pf.quantization_aware ? "dense_qat_weight_initialization" : "dense_weight_initialization";
  lin["init_from"] = student.config.init_from;
  lin["optimizer_state"] = "fresh";
  // The loader's record: gates zero-filled (a dense parent, random weights) or read from the
  // parent's weights (seeds/004: "inherited").
  lin["compression_gate_initialization"] =
      !vsa ? nlohmann::json(nullptr)
           : nlohmann::json(student.compression_gate_initialization == "zero" || !pf.present || pf.kind != "vsa"
                                ? "zero"
                                : "inherited");
  if (pf.present) {
    const auto& c = student.parent_metadata.value("checkpoint", nlohmann::json::object());
    lin["checkpoint_id"] = c.value("id", "");
    lin["checkpoint_step"] = c.value("step", student.parent_metadata.value("step", 0));
    nlohmann::json arch;
    if (!read_parent_architecture_text(student.config.init_from, &arch).empty()) lin["parent_architecture"] = arch;
    lin["parent_attention_backend"] = pf.backend;
    lin["parent_cube_shape"] = pf.cube_shape;
    lin["parent_quantization_aware"] = pf.quantization_aware;
    lin["parent_metadata"] = student.parent_metadata;
  }
  return lin;
}

// sha256 of a role's weights: the single safetensors file, or (sharded) the sha256 of
// the lines "<sha256>  <shard file name>\n" in index order. null for random weights.
nlohmann::json weights_sha256(const RoleConfig& rc) {
  if (rc.init_from.rfind("random:", 0) == 0) return nullptr;
  static std::mutex mu;
  static std::map<std::string, std::string> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(rc.init_from);
  if (it != cache.end()) return it->second;
  const auto src = model::locate_weights(rc.init_from);
  std::string sha;
  if (src.kind == model::WeightSource::Kind::kSharded) {
    std::ifstream f(src.path);
    auto idx = nlohmann::json::parse(f);
    std::set<std::string> shards;
    for (const auto& [k, v] : idx.at("weight_map").items()) shards.insert(v.get<std::string>());
    std::string lines;
    for (const auto& s : shards)
      lines += sha256_file((fs::path(src.transformer_dir) / s).string()) + "  " + s + "\n";
    sha = sha256_hex(lines);
  } else {
    sha = sha256_file(src.path);
  }
  cache[rc.init_from] = sha;
  return sha;
}

nlohmann::json reference_json(const RoleConfig& teacher) {
  const AttentionBackend b = teacher.attention_backend;
  return {{"attention_backend", attention_backend_name(b)},
          {"attention_kind", model::is_vsa_backend(b) ? "vsa" : "dense"},
          {"frozen", !teacher.trainable},
          {"init_from", teacher.init_from},
          {"linear_quantization", teacher.quant_config == "none" ? nlohmann::json(nullptr)
                                                                 : nlohmann::json(teacher.quant_config)},
          {"weights_sha256", weights_sha256(teacher)}};
}

nlohmann::json cache_json(const RunConfig& run) {
  const auto& d = run.training.data;
  if (d.data_path.size() != 1) return nullptr;
  auto c = data::OdeCache::open(d.data_path[0].path);
  nlohmann::json j = c.metadata_json();
  j["path"] = d.data_path[0].path;
  return j;
}

nlohmann::json student_init_json(const Role& student, const RoleConfig& teacher, const nlohmann::json& lineage) {
  nlohmann::json j;
  j["kind"] = lineage.value("kind", "");
  j["init_from"] = student.config.init_from;
  j["checkpoint_step"] = lineage.contains("checkpoint_step") ? lineage["checkpoint_step"] : nlohmann::json(nullptr);
  j["compression_gate_initialization"] = lineage["compression_gate_initialization"];
  // The student starts from the reference's own weights (same source, no override).
  j["initial_weight_equality_with_reference"] = student.config.init_from == teacher.init_from &&
                                                student.config.transformer_override_safetensor.empty() &&
                                                student.init_kind != "random";
  return j;
}

nlohmann::json recon_supervision(const RunConfig& run, const Role& student, const nlohmann::json& training_schedule) {
  const RoleConfig& teacher = run.role("teacher");
  const nlohmann::json lineage = lineage_json(student);
  nlohmann::json s;
  s["protocol_version"] = 2;
  s["method"] = method_name(run.method.kind);
  s["attention_backend"] = attention_backend_name(student.config.attention_backend);
  s["attention_kind"] = model::is_vsa_backend(student.config.attention_backend) ? "vsa" : "dense";
  s["input_source"] = "ode_start";
  s["input_description"] = "cached_ode_start_latent_and_corresponding_timestep_sigma_without_renoising";
  s["reference"] = reference_json(teacher);
  s["cache"] = cache_json(run);
  s["student_initialization"] = student_init_json(student, teacher, lineage);
  s["trainable_scope"] = "quantized_path";
  s["trainable_modules"] = student.trainable_modules;
  s["trainable_parameters"] = student.trainable_names;
  s["loss"] = "mse";
  if (run.method.kind == MethodKind::kLayerRecon) {
    const auto& l = run.method.layer_recon;
    s["objective"] = "fixed_teacher_layer_reconstruction";
    s["propagation"] = "teacher";
    s["group_size"] = l.group_size;
    s["energy_floor"] = l.energy_floor;
    s["checkpoint_blocks"] = l.checkpoint_blocks;
    s["endpoint_loss"] = false;
    s["forward_path"] = "teacher_trajectory_input_at_every_group_start_with_in_group_student_propagation_and_"
                        "identical_frozen_embedding_and_conditioning";
    s["gradient_scope"] = "group_local_student_quantized_path_groups_of_" + std::to_string(l.group_size);
    s["normalized_mse_denominator"] =
        "detached_per_sample_reference_block_update_mean_square_clamped_to_energy_floor";
    s["reduction"] = "float32_per_sample_token_channel_mean_then_batch_and_layer_mean";
    s["target"] = "teacher_trajectory_hidden_state_after_each_group_of_blocks";
  } else {
    const auto& r = run.method.recon_ode;
    s["objective"] = "attention_mlp_reconstruction_and_ode_endpoint";
    s["attention_weight"] = r.attention_weight;
    s["mlp_weight"] = r.mlp_weight;
    s["ode_weight"] = r.ode_weight;
    s["student_steps"] = r.student_steps;
    s["checkpoint_blocks"] = r.checkpoint_blocks;
    s["endpoint_loss"] = true;
    s["endpoint_formula"] = "mean((start_latent - start_sigma * student_velocity - target_latent)^2)";
    s["reconstruction_normalization"] = "none";
    s["reduction"] = "attention_and_mlp_each_layer_mean_plus_ode_mean_mse_weighted_sum";
    s["forward_path"] = "teacher_driven_local_reconstruction_plus_separate_full_student_velocity_forward_both_"
                        "under_student_sparse_block_selection";
    s["attention_metadata"] = "student_vsa_metadata_at_recipe_sparsity_for_both_forwards";
    s["gradient_scope"] = "local_reconstruction_plus_end_to_end_ode_within_student_quantized_path";
    s["target"] = {"self_attention_post_output_projection_pre_gate_residual", "ffn_pre_gate_residual",
                   "cached_teacher_final_clean_latent"};
    s["training_schedule"] = training_schedule;
    s["cube_shape"] = cube_shape_json(student.config.attention_backend);
  }
  return s;
}

nlohmann::json code_json() {
  return {{"repo", "vqad"},
          {"version", VQAD_VERSION},
          {"commit", build_info::kGitCommit},
          {"dirty", build_info::kGitDirty},
          {"policy", "commit-and-dirty-flag-at-configure-time"}};
}

}  // namespace

nlohmann::json recon_supervision_json(const RunConfig& run, const Role& student,
                                      const nlohmann::json& training_schedule) {
  return recon_supervision(run, student, training_schedule);
}

nlohmann::json build_metadata(const RunConfig& run, const std::map<std::string, std::shared_ptr<Role>>& roles,
                              long step, const std::string& run_started_at) {
  nlohmann::json m;
  m["metadata_schema"] = kMetadataSchema;
  m["metadata_schema_version"] = kMetadataSchemaVersion;
  m["step"] = step;
  m["checkpoint"] = {{"id", new_checkpoint_id()}, {"step", step}, {"state", "training"}, {"created_at", utc_now_iso()}};
  m["checkpoint_state"] = "training_dcp";
  m["code_provenance"] = code_json();
  m["config"] = nlohmann::json::parse(run.resolved.dump());
  m["config_sha256"] = {{"resolved", run.resolved_sha256}, {"source", run.source_sha256}};
  const auto& student = roles.count("student") ? *roles.at("student") : *roles.begin()->second;
  const auto& wc = student.model->config();
  m["model"] = {{"kind", wc.kind()}, {"architecture", wc.to_json()}};
  m["attention"] = attention_json(run, student);

  const nlohmann::json lineage = lineage_json(student);
  nlohmann::json contract;
  const AttentionBackend sb = student.config.attention_backend;
  contract["attention_backend"] = attention_backend_name(sb);
  contract["attention_kind"] = model::is_vsa_backend(sb) ? "VSA" : "dense";
  contract["cube_shape"] = cube_shape_json(sb);
  contract["physical_block_tokens"] = model::is_vsa_backend(sb) ? nlohmann::json(vsa_ref::kPhysicalBlockTokens) : nlohmann::json(nullptr);
  contract["model_kind"] = wc.kind();
  contract["model_architecture"] = wc.to_json();
  contract["precision"] = precision_json(student);
  contract["selection"] = selection_json(student);
  contract["training_kernel_family"] = kernel_family(sb);
  contract["kernel_source_commit"] = build_info::kGitCommit;
  nlohmann::json kernels = nlohmann::json::object();
  for (const auto& [path, sha] : build_info::kernel_source_hashes()) kernels[path] = sha;
  contract["kernel_source_files"] = kernels;
  contract["linear_quantization"] = linear_quant_json(student);

  // The method's own account of what it optimizes (methods/registry.h).
  const MethodRegistration& reg = method_registration(run);
  nlohmann::json sup = reg.supervision(run, student);
  if (!reg.records_distillation) {
    sup["method"] = method_name(run.method.kind);
    contract["supervision"] = sup;
  } else {
    nlohmann::json roles_j = nlohmann::json::object(), frozen = nlohmann::json::array(),
                   ckpt = nlohmann::json::array();
    for (const auto& [name, r] : roles) {
      roles_j[name] = m["config"]["models"].value(name, nlohmann::json::object());
      roles_j[name]["linear_quantization"] = r->plan.empty() ? "none" : model::quant_method_name(r->plan.method);
      (r->config.trainable ? ckpt : frozen).push_back(name);
    }
    contract["distillation"] = {{"method_name", method_name(run.method.kind)},
                                {"roles", roles_j},
                                {"frozen_roles", frozen},
                                {"checkpoint_roles", ckpt},
                                {"method", m["config"].value("method", nlohmann::json::object())},
                                {"objective", sup}};
  }
  contract["direct_lineage"] = lineage;
  m["training_contract"] = contract;

  nlohmann::json configs = {{"resolved", {{"path", "resolved.yaml"}, {"sha256", run.resolved_sha256}}}};
  configs["source"] = {{"path", run.source_path.empty() ? nlohmann::json(nullptr) : nlohmann::json("source.yaml")},
                       {"sha256", run.source_sha256}};
  m["provenance"] = {{"code", code_json()}, {"configs", configs}, {"lineage", lineage}};
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const auto& tr = run.training.tracker;
  m["run_identity"] = {{"output_dir", run.training.checkpoint.output_dir},
                       {"tracker", {{"entity", tr.entity}, {"project_name", tr.project_name},
                                    {"run_name", tr.run_name}, {"trackers", tr.trackers}}},
                       {"run_name", tr.run_name},
                       {"started_at", run_started_at},
                       {"hostname", host},
                       {"world_size", run.training.distributed.num_gpus}};
  return m;
}

std::optional<std::string> source_yaml_text(const RunConfig& run) {
  if (run.source_path.empty()) return std::nullopt;
  std::ifstream in(run.source_path, std::ios::binary);
  if (!in.good()) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (sha256_hex(text) != run.source_sha256) {
    log::warn(run.source_path, " changed since the run started: source.yaml not written");
    return std::nullopt;
  }
  return text;
}

void write_source_yaml(const RunConfig& run, const std::string& dir) {
  if (auto text = source_yaml_text(run)) st::write_file_atomic((fs::path(dir) / "source.yaml").string(), {*text});
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
  if (threads <= 0) threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 8);
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
  c["lr_warmup_steps"] = at("/training/optimizer/lr_warmup_steps");
  // A decaying schedule is computed over max_train_steps: a resume with another total
  // follows another LR curve from then on (a new segment), a constant one does not.
  const auto sched = c["lr_scheduler"];
  const bool decays = sched.is_string() && sched != "constant" && sched != "constant_with_warmup";
  c["lr_schedule_total_steps"] = decays ? at("/training/loop/max_train_steps") : nlohmann::json(nullptr);
  c["fake_score_learning_rate"] = at("/method/fake_score_learning_rate");
  return c;
}

void record_resume_segments(nlohmann::json& metadata, const nlohmann::json& resumed) {
  const bool v2 = metadata.contains("provenance") && metadata["provenance"].is_object() &&
                  metadata["provenance"].contains("lineage");
  nlohmann::json& mlin = v2 ? metadata["provenance"]["lineage"] : metadata["lineage"];
  nlohmann::json segments = nlohmann::json::array();
  const nlohmann::json current = segment_contract(metadata);
  if (resumed.is_object()) {
    // Schema 2 keeps the lineage under provenance; schema 1 at the top level.
    const auto& rprov = resumed.value("provenance", nlohmann::json::object());
    const auto lin = rprov.contains("lineage") ? rprov["lineage"] : resumed.value("lineage", nlohmann::json::object());
    if (lin.contains("segments") && lin["segments"].is_array() && !lin["segments"].empty())
      segments = lin["segments"];
    else
      segments.push_back({{"start_step", 1}, {"contract", segment_contract(resumed)}});
    const auto ck = resumed.value("checkpoint", nlohmann::json::object());
    const long rstep = ck.value("step", 0L);
    if (segments.back().value("contract", nlohmann::json()) != current) {
      segments.push_back({{"start_step", rstep + 1}, {"contract", current}, {"resumed_from", ck.value("id", "")}});
      log::warn("resuming under a different training contract than checkpoint step ", rstep,
                " (attention, quantization, precision or learning-rate schedule changed): metadata records a new lineage "
                "segment from step ", rstep + 1);
    }
    mlin["resumed_from"] = {{"checkpoint_id", ck.value("id", "")}, {"step", rstep}};
    mlin["optimizer_state"] = "resumed";
  } else {
    segments.push_back({{"start_step", 1}, {"contract", current}});
  }
  mlin["segments"] = segments;
  // training_contract.direct_lineage repeats provenance.lineage (seeds/004's structure).
  if (v2 && metadata.contains("training_contract") && metadata["training_contract"].is_object() &&
      metadata["training_contract"].contains("direct_lineage"))
    metadata["training_contract"]["direct_lineage"] = mlin;
}

namespace {

const nlohmann::json& empty_object() {
  static const nlohmann::json e = nlohmann::json::object();
  return e;
}
const nlohmann::json& obj(const nlohmann::json& j, const char* key) {
  return j.is_object() && j.contains(key) && j[key].is_object() ? j[key] : empty_object();
}

std::string short_method(const nlohmann::json& m) {
  const auto& tc = obj(m, "training_contract");
  const auto& sup = obj(tc, "supervision");
  if (sup.contains("method") && sup["method"].is_string()) return sup["method"].get<std::string>();
  if (sup.contains("objective") && sup["objective"].is_string()) return sup["objective"].get<std::string>();
  const auto& dist = obj(tc, "distillation");
  if (dist.contains("method_name") && dist["method_name"].is_string()) return dist["method_name"].get<std::string>();
  const auto& cm = obj(obj(m, "config"), "method");
  if (cm.contains("_target_") && cm["_target_"].is_string()) {
    const std::string t = cm["_target_"].get<std::string>();
    return t.substr(t.rfind('.') + 1);
  }
  return "?";
}

std::string linears_of(const nlohmann::json& m) {
  const auto& tc = obj(m, "training_contract");
  if (!tc.contains("linear_quantization") || tc["linear_quantization"].is_null()) return "dense";
  const auto& lq = tc["linear_quantization"];
  if (lq.is_string()) return lq.get<std::string>();
  if (lq.contains("kind")) return lq["kind"].get<std::string>();
  return lq.value("method", "?");
}

std::string attention_of(const nlohmann::json& m) {
  const auto& a = obj(m, "attention");
  if (a.contains("backend") && a["backend"].is_string()) return a["backend"].get<std::string>();
  return obj(m, "training_contract").value("attention_backend", "?");
}

std::string str_or(const nlohmann::json& j, const char* key, const std::string& dflt) {
  return j.is_object() && j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : dflt;
}

bool known_schema(const std::string& s) {
  return s == kMetadataSchema || s == kFastVideoMetadataSchema || s == kFastVideoDenseMetadataSchema;
}

// Structural checks of one level and, recursively, of its embedded parents.
void verify_structure(const nlohmann::json& m, const std::string& where, std::vector<std::string>& problems) {
  static const std::regex id_re("ckpt_[0-9a-f]{32}");
  const std::string schema = str_or(m, "metadata_schema", "");
  if (!known_schema(schema))
    problems.push_back(where + ": metadata_schema '" + schema + "' is not one of " + kMetadataSchema + ", " +
                       kFastVideoMetadataSchema + ", " + kFastVideoDenseMetadataSchema);
  const auto& c = obj(m, "checkpoint");
  const std::string id = str_or(c, "id", "");
  if (!std::regex_match(id, id_re)) problems.push_back(where + ": checkpoint.id '" + id + "' is malformed");
  if (m.contains("step") && c.contains("step") && m["step"] != c["step"])
    problems.push_back(where + ": step " + m["step"].dump() + " differs from checkpoint.step " + c["step"].dump());
  const auto& lin = lineage_of(m);
  const auto& tc = obj(m, "training_contract");
  if (tc.contains("direct_lineage") && m.contains("provenance") && obj(m, "provenance").contains("lineage") &&
      tc["direct_lineage"] != obj(m, "provenance")["lineage"])
    problems.push_back(where + ": training_contract.direct_lineage differs from provenance.lineage");
  const auto& student_cfg = obj(obj(obj(m, "config"), "models"), "student");
  if (student_cfg.contains("init_from") && lin.contains("init_from") && student_cfg["init_from"] != lin["init_from"])
    problems.push_back(where + ": lineage.init_from " + lin["init_from"].dump() +
                       " differs from config.models.student.init_from " + student_cfg["init_from"].dump());
  if (!lin.contains("parent_metadata") || !lin["parent_metadata"].is_object()) return;
  const auto& parent = lin["parent_metadata"];
  const auto& pc = obj(parent, "checkpoint");
  const std::string pwhere = where + " <- parent " + str_or(pc, "id", "?");
  if (lin.value("checkpoint_id", nlohmann::json()) != pc.value("id", nlohmann::json()))
    problems.push_back(where + ": lineage.checkpoint_id does not match the parent metadata's checkpoint.id");
  if (lin.contains("checkpoint_step") && lin["checkpoint_step"] != pc.value("step", nlohmann::json()))
    problems.push_back(where + ": lineage.checkpoint_step " + lin["checkpoint_step"].dump() +
                       " does not match the parent's checkpoint.step " + pc.value("step", nlohmann::json()).dump());
  if (lin.contains("parent_attention_backend") && lin["parent_attention_backend"].is_string() &&
      lin["parent_attention_backend"].get<std::string>() != attention_of(parent))
    problems.push_back(where + ": lineage.parent_attention_backend " + lin["parent_attention_backend"].dump() +
                       " differs from the parent's attention backend " + attention_of(parent));
  const auto& pprec = obj(obj(parent, "attention"), "precision");
  if (lin.contains("parent_quantization_aware") && pprec.contains("quantization_aware") &&
      lin["parent_quantization_aware"] != pprec["quantization_aware"])
    problems.push_back(where + ": lineage.parent_quantization_aware differs from the parent's attention precision");
  const auto& parch = obj(obj(parent, "model"), "architecture");
  const auto& larch = obj(lin, "parent_architecture");
  for (const auto& [k, v] : parch.items())
    if (larch.contains(k) && larch[k] != v)
      problems.push_back(where + ": lineage.parent_architecture." + k + " " + larch[k].dump() +
                         " differs from the parent's model.architecture " + v.dump());
  verify_structure(parent, pwhere, problems);
}

}  // namespace

const nlohmann::json& lineage_of(const nlohmann::json& m) {
  const auto& prov = obj(m, "provenance");
  if (prov.contains("lineage") && prov["lineage"].is_object()) return prov["lineage"];
  return obj(m, "lineage");  // schema version 1
}

nlohmann::json read_metadata_path(const std::string& path) {
  if (fs::is_directory(path)) return read_metadata(path);
  VQAD_CHECK(fs::is_regular_file(path), path, ": no such checkpoint, export or metadata file");
  std::ifstream f(path);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail(path, ": malformed JSON: ", e.what());
  }
}

std::string lineage_text(const nlohmann::json& metadata) {
  std::ostringstream os;
  const nlohmann::json* m = &metadata;
  int depth = 0;
  while (m && m->is_object()) {
    const auto& c = obj(*m, "checkpoint");
    const auto& lin = lineage_of(*m);
    const auto& init = lin.contains("init_from") && lin["init_from"].is_string() ? lin["init_from"].get<std::string>()
                                                                                 : std::string("?");
    os << std::string(depth * 2, ' ') << (depth ? "<- " : "") << str_or(c, "id", "?") << "  step "
       << c.value("step", nlohmann::json(0)).dump() << "  " << str_or(*m, "checkpoint_state", "?") << "  method "
       << short_method(*m) << "  attention " << attention_of(*m) << "  linears " << linears_of(*m) << "  schema "
       << str_or(*m, "metadata_schema", "?") << "\n"
       << std::string(depth * 2 + (depth ? 3 : 0), ' ') << "init_from " << init << " ("
       << str_or(lin, "kind", "?") << ")\n";
    if (!lin.contains("parent_metadata") || !lin["parent_metadata"].is_object()) break;
    m = &lin["parent_metadata"];
    ++depth;
  }
  return os.str();
}

std::vector<std::string> verify_lineage(const std::string& path) {
  std::vector<std::string> problems;
  nlohmann::json m;
  try {
    m = read_metadata_path(path);
  } catch (const Error& e) {
    return {e.what()};
  }
  verify_structure(m, path, problems);
  if (!fs::is_directory(path)) return problems;  // a metadata file alone: structure only
  const std::string dir = path;
  // Integrity of the directory: the metadata's own signature, every recorded file's
  // sha256, and no files that the metadata does not list.
  {
    auto v = verify_directory(dir);
    problems.insert(problems.end(), v.begin(), v.end());
  }
  // The parent on disk (the export this stage started from) must be the recorded one.
  const auto& lin = lineage_of(m);
  if (lin.contains("parent_metadata") && lin["parent_metadata"].is_object()) {
    const std::string pid = str_or(obj(lin["parent_metadata"], "checkpoint"), "id", "");
    const std::string init = str_or(lin, "init_from", "");
    const std::string parent_dir = metadata_dir_of(init);
    if (parent_dir.empty()) {
      problems.push_back(dir + ": parent " + (init.empty() ? std::string("(no init_from recorded)") : init) +
                         " (id " + pid + ") is not on disk; the lineage cannot be verified");
    } else {
      nlohmann::json on_disk;
      try {
        on_disk = read_metadata(parent_dir);
      } catch (const Error& e) {
        problems.push_back(e.what());
        return problems;
      }
      const std::string did = str_or(obj(on_disk, "checkpoint"), "id", "");
      if (did != pid)
        problems.push_back(parent_dir + ": parent on disk has id " + did + ", lineage records " + pid);
      auto strip = [](nlohmann::json j) {
        if (j.is_object()) {
          j.erase("files");
          j.erase(kMetadataHashKey);
        }
        return j;
      };
      if (did == pid && strip(on_disk) != strip(lin["parent_metadata"]))
        problems.push_back(parent_dir + ": the parent's metadata on disk differs from the embedded "
                           "parent_metadata (the stage did not start from this export)");
      auto sub = verify_lineage(parent_dir);
      problems.insert(problems.end(), sub.begin(), sub.end());
    }
  }
  return problems;
}

nlohmann::json hash_files(const std::string& dir) { return hash_files(dir, {}); }
void write_metadata(const std::string& dir, nlohmann::json metadata) { write_metadata(dir, std::move(metadata), {}); }

}  // namespace vqad::train
