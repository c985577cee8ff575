// Shared pieces of the export tests: a tiny student checkpoint written the way the
// trainer writes one (role weights, metadata with the quant plan, completion marker),
// and fixed inputs for the tiny model.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vqad/io/tensors.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/metadata.h"

namespace vqad::test_export {

namespace fs = std::filesystem;

// <tmp>/export_<prefix>_<pid>_<test name>, emptied.
inline fs::path fresh_dir(const std::string& prefix) {
  auto dir = fs::temp_directory_path() / ("export_" + prefix + "_" + std::to_string(::getpid()) + "_" +
                                          ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct TinyCheckpoint {
  fs::path dir;
  model::QuantPlan plan;
  std::map<std::string, float> amax;  // static linears (QAD)
  std::string id;
  // The student as training runs it: master weights from the checkpoint, the plan's
  // fake-quant linears attached, built in the current attention scope.
  std::shared_ptr<model::WanModel> student() const {
    auto m = model::wan_from_pretrained((dir / "student").string());
    if (!plan.empty()) {
      model::QuantConfig cfg;
      cfg.method = plan.method;
      model::apply_quant_plan(*m, plan, cfg, amax);
    }
    m->train(false);
    return m;
  }
};

// A tiny random student saved as checkpoint `dir`, with `method`'s plan in its metadata.
// `extras` adds plan entries that are not linears of the model: (name, K) with K > 0
// also adds a tensor <name>.weight [8, K] to the weights; K == 0 adds no tensor.
inline TinyCheckpoint write_tiny_checkpoint(const fs::path& dir, model::QuantMethod method, uint64_t seed,
                                            const std::vector<std::pair<std::string, int64_t>>& extras = {},
                                            bool with_amax = true) {
  TinyCheckpoint ck;
  ck.dir = dir;
  torch::manual_seed(seed);
  model::WanModel m(model::WanConfig::tiny(), {.device = torch::kCPU, .compute_dtype = torch::kBFloat16});
  model::save_diffusers(m, (dir / "student").string());
  std::vector<std::string> names;
  for (const auto& [n, lin] : m.named_linears()) names.push_back(n);
  model::QuantConfig cfg;
  cfg.method = method;
  ck.plan = model::build_quant_plan(names, cfg);
  const fs::path wfile = dir / "student/transformer/diffusion_pytorch_model.safetensors";
  if (!extras.empty()) {
    auto tensors = io::load_safetensors(wfile.string());
    std::vector<std::pair<std::string, torch::Tensor>> list;
    for (auto& [k, v] : tensors) list.emplace_back(k, v.clone());
    for (const auto& [name, k] : extras) {
      ck.plan.entries.push_back({name, nvfp4::ScaleMode::kDynamic, nvfp4::ScaleMode::kDynamic});
      if (k > 0) list.emplace_back(name + ".weight", torch::randn({8, k}));
    }
    tensors.clear();
    io::save_safetensors(wfile.string(), list, {{"format", "pt"}});
  }
  nlohmann::json lq = nullptr;
  if (!ck.plan.empty()) {
    lq = ck.plan.to_json();
    nlohmann::json table = nlohmann::json::object();
    float a = 2.0f;
    for (const auto& e : ck.plan.entries) {
      if (e.activation_mode != nvfp4::ScaleMode::kStatic) continue;
      ck.amax[e.module] = a;
      int block = 0;
      std::string sub;
      model::split_block_name(e.module, &block, &sub);
      table["b" + std::to_string(block) + "." + sub] = a;
      a += 0.375f;
    }
    if (with_amax && !table.empty()) lq["input_amax"] = table;
    if (!with_amax) ck.amax.clear();
  }
  ck.id = train::new_checkpoint_id();
  nlohmann::json meta = {
      {"metadata_schema", train::kMetadataSchema},
      {"metadata_schema_version", train::kMetadataSchemaVersion},
      {"checkpoint", {{"id", ck.id}, {"step", 3}, {"state", "training"}, {"created_at", train::utc_now_iso()}}},
      {"checkpoint_state", "training_dcp"},
      {"training_contract", {{"attention_backend", "TORCH_SDPA"}, {"linear_quantization", lq}}},
      {"lineage", {{"kind", "random_initialization"}, {"init_from", "random:tiny"}, {"checkpoint_id", nullptr},
                   {"parent_metadata", nullptr}}}};
  train::write_metadata(dir.string(), meta);
  st::write_file_atomic((dir / train::kCheckpointMarker).string(), {std::string("ok\n")});
  return ck;
}

struct TinyInputs {
  torch::Tensor x, t, text;
};

inline TinyInputs tiny_inputs(uint64_t seed) {
  torch::manual_seed(seed);
  const model::WanConfig cfg = model::WanConfig::tiny();
  return {torch::randn({1, cfg.in_channels, 2, 4, 4}), torch::tensor({500.0f + static_cast<float>(seed)}),
          torch::randn({1, 6, cfg.text_dim})};
}

}  // namespace vqad::test_export
