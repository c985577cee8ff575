#include "vqad/train/trainer_state.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/safetensors.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {

std::string hex_encode(const torch::Tensor& bytes) {
  auto t = bytes.contiguous();
  const uint8_t* p = t.data_ptr<uint8_t>();
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(t.numel() * 2);
  for (int64_t i = 0; i < t.numel(); ++i) {
    s.push_back(d[p[i] >> 4]);
    s.push_back(d[p[i] & 15]);
  }
  return s;
}

torch::Tensor hex_decode(const std::string& s, const std::string& where) {
  VQAD_CHECK(s.size() % 2 == 0, where, ": malformed generator state");
  auto t = torch::empty({static_cast<int64_t>(s.size() / 2)}, torch::kUInt8);
  uint8_t* p = t.data_ptr<uint8_t>();
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(where, ": malformed generator state");
  };
  for (size_t i = 0; i < s.size() / 2; ++i) p[i] = static_cast<uint8_t>(nib(s[2 * i]) << 4 | nib(s[2 * i + 1]));
  return t;
}

namespace {
std::vector<std::string> checkpointed_roles(const RunConfig& run) {
  std::vector<std::string> v;
  for (const auto& r : method_role_specs(run))
    if (r.checkpointed) v.push_back(r.name);
  std::sort(v.begin(), v.end());
  return v;
}
}  // namespace

void prepare_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles,
                                const RoleOptimizers& optimizers) {
  writer.prepare(roles, checkpointed_roles(run), optimizers);
}

namespace {
// trainer_state.json and metadata.json of checkpoint-<step>.
std::pair<nlohmann::json, nlohmann::json> checkpoint_documents(const RunConfig& run, const RoleMap& roles, long step,
                                                               const RoleOptimizers& optimizers,
                                                               const data::PrefetchLoader& loader,
                                                               torch::Generator& gen, const std::string& started_at,
                                                               const nlohmann::json& mesh,
                                                               const nlohmann::json& resumed_metadata) {
  nlohmann::json updates = nlohmann::json::object();
  for (const auto& [name, o] : optimizers) updates[name] = o.updates;
  nlohmann::json state;
  state["step"] = step;
  state["data"] = loader.state();
  state["generator_state"] = hex_encode(gen.get_state());
  state["optimizer_updates"] = updates;
  state["distributed"] = mesh;
  auto meta = build_metadata(run, roles, step, started_at);
  meta["distributed"] = mesh;
  record_resume_segments(meta, resumed_metadata);
  const char* cublas_ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  meta["determinism"] = {{"deterministic_algorithms", at::globalContext().deterministicAlgorithms()},
                         {"cudnn_deterministic", at::globalContext().deterministicCuDNN()},
                         {"cublas_workspace_config", cublas_ws ? nlohmann::json(cublas_ws) : nlohmann::json(nullptr)}};
  return {std::move(state), std::move(meta)};
}
}  // namespace

double save_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles, long step,
                               const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                               torch::Generator& gen, const std::string& started_at, const nlohmann::json& mesh,
                               const nlohmann::json& resumed_metadata) {
  auto [state, meta] =
      checkpoint_documents(run, roles, step, optimizers, loader, gen, started_at, mesh, resumed_metadata);
  return writer.save(step, roles, checkpointed_roles(run), optimizers, std::move(state), run.resolved_yaml,
                     std::move(meta), source_yaml_text(run).value_or(""));
}

void prepare_sharded_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run,
                                        const std::map<std::string, dist::FullyShardedModel*>& models,
                                        const RoleOptimizers& optimizers) {
  writer.prepare_sharded(checkpointed_roles(run), models, optimizers);
}

double save_sharded_trainer_checkpoint(CheckpointWriter& writer, const RunConfig& run, const RoleMap& roles,
                                       long step, const std::map<std::string, dist::FullyShardedModel*>& models,
                                       const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                                       torch::Generator& gen, const std::string& started_at,
                                       const nlohmann::json& mesh, const nlohmann::json& resumed_metadata) {
  auto [state, meta] =
      checkpoint_documents(run, roles, step, optimizers, loader, gen, started_at, mesh, resumed_metadata);
  return writer.save_sharded(step, roles, checkpointed_roles(run), models, optimizers, std::move(state),
                             run.resolved_yaml, std::move(meta), source_yaml_text(run).value_or(""));
}

long load_trainer_checkpoint(const CheckpointEntry& checkpoint, const RunConfig& run, RoleMap& roles,
                             RoleOptimizers& optimizers, data::PrefetchLoader& loader, torch::Generator& gen,
                             bool optimizer_state_on_host) {
  const nlohmann::json state = load_checkpoint_state(checkpoint.path, roles, checkpointed_roles(run), optimizers,
                                                     nullptr, optimizer_state_on_host);
  const std::string sp = (fs::path(checkpoint.path) / "trainer_state.json").string();
  try {
    loader.load_state(state.at("data"));
  } catch (const nlohmann::json::exception& e) {
    fail(sp, ": malformed data position: ", e.what());
  }
  gen.set_state(hex_decode(state.at("generator_state").get<std::string>(), sp));
  for (auto& [name, o] : optimizers) {
    const bool has = state.contains("optimizer_updates") && state["optimizer_updates"].contains(name);
    VQAD_CHECK(!has || state["optimizer_updates"][name].is_number_integer(), sp, ": optimizer_updates.", name,
               " must be an integer, found ", has ? state["optimizer_updates"][name].dump() : "");
    o.updates = has ? state["optimizer_updates"][name].get<long>()
                    : checkpoint.step;  // checkpoints written before per-role counts: every step updated
  }
  return checkpoint.step;
}

}  // namespace vqad::train
