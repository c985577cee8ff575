#include "vqad/train/trainer_state.h"

#include <algorithm>
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

std::string save_trainer_checkpoint(const RunConfig& run, const RoleMap& roles, const std::string& output_dir,
                                    long step, const RoleOptimizers& optimizers, const data::PrefetchLoader& loader,
                                    torch::Generator& gen, const std::string& started_at,
                                    const nlohmann::json& mesh) {
  auto path = write_checkpoint_dir(output_dir, step, [&](const std::string& dir) {
    nlohmann::json updates = nlohmann::json::object();
    for (const auto& name : checkpointed_roles(run)) {
      const fs::path rd = fs::path(dir) / name;
      model::save_diffusers(*roles.at(name)->model, rd.string());
      torch::save(*optimizers.at(name).adamw, (rd / "optimizer.pt").string());
    }
    for (const auto& [name, o] : optimizers) updates[name] = o.updates;
    nlohmann::json state;
    state["step"] = step;
    state["data"] = loader.state();
    state["generator_state"] = hex_encode(gen.get_state());
    state["optimizer_updates"] = updates;
    state["distributed"] = mesh;
    st::write_file_atomic((fs::path(dir) / "trainer_state.json").string(), {state.dump(2) + "\n"});
    st::write_file_atomic((fs::path(dir) / "resolved.yaml").string(), {run.resolved_yaml});
    write_source_yaml(run, dir);
    auto meta = build_metadata(run, roles, step, started_at);
    meta["distributed"] = mesh;
    write_metadata(dir, meta);
  });
  apply_retention(output_dir, static_cast<int>(run.training.checkpoint.checkpoints_total_limit));
  log::info("checkpoint ", path);
  return path;
}

long load_trainer_checkpoint(const CheckpointEntry& checkpoint, const RunConfig& run, RoleMap& roles,
                             RoleOptimizers& optimizers, data::PrefetchLoader& loader, torch::Generator& gen) {
  for (const auto& name : checkpointed_roles(run)) {
    const fs::path rd = fs::path(checkpoint.path) / name;
    VQAD_CHECK(fs::is_directory(rd), checkpoint.path, ": no weights for role '", name, "'");
    model::load_weights(*roles.at(name)->model, model::read_weights(rd.string()));
    torch::load(*optimizers.at(name).adamw, (rd / "optimizer.pt").string());
  }
  std::ifstream f(fs::path(checkpoint.path) / "trainer_state.json");
  VQAD_CHECK(f.good(), checkpoint.path, ": trainer_state.json missing");
  nlohmann::json state = nlohmann::json::parse(f);
  loader.load_state(state.at("data"));
  gen.set_state(hex_decode(state.at("generator_state").get<std::string>(), checkpoint.path));
  for (auto& [name, o] : optimizers) {
    if (state.contains("optimizer_updates") && state["optimizer_updates"].contains(name))
      o.updates = state["optimizer_updates"][name].get<long>();
    else
      o.updates = checkpoint.step;  // checkpoints written before per-role counts: every step updated
  }
  return checkpoint.step;
}

}  // namespace vqad::train
