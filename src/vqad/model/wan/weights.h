// Wan transformer weights in the Diffusers layout: locate, read, strictly load, save.
//
// Accepted sources (spec/wan_model.md "Weights"): a model root with transformer/, the
// transformer directory itself, or a file. Inside a transformer directory, exactly one of
//   diffusion_pytorch_model.safetensors                      (single file)
//   diffusion_pytorch_model.safetensors.index.json + shards  (sharded)
//   model.safetensors                                        (FastVideo export; a stale
//                                                             index left beside it is ignored)
// must be present; anything else is an error naming what was found.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vqad/model/wan/config.h"
#include "vqad/model/wan/model.h"

namespace vqad::model {

struct WeightSource {
  enum class Kind { kSingleFile, kSharded, kFastVideoExport };
  Kind kind = Kind::kSingleFile;
  std::string path;             // the .safetensors file or the index JSON
  std::string transformer_dir;  // directory holding it
  std::string config_path;      // transformer_dir/config.json, "" when absent
};

WeightSource locate_weights(const std::string& path);

struct WeightState {
  std::map<std::string, torch::Tensor> tensors;  // Diffusers key -> CPU tensor
  std::map<std::string, std::string> origin;     // Diffusers key -> file it came from
  std::string source;                            // for messages
};

// Reads every tensor of the source. A sharded set is checked against its index: tensors
// a shard holds but the index does not list, and listed tensors a shard lacks, are errors.
WeightState read_weights(const WeightSource& source);
WeightState read_weights(const std::string& path);

// What a load did beyond copying tensors.
struct LoadReport {
  // blocks.N.to_gate_compress.{weight,bias} the state lacked and that were set to zero
  // (a dense checkpoint loaded into a VSA model: compression_gate_initialization zero).
  std::vector<std::string> zeroed_gate_keys;
  bool gates_zeroed() const { return !zeroed_gate_keys.empty(); }
};

// Strict: the state must hold exactly the model's keys with the model's shapes and a
// floating dtype. Only blocks.N.to_gate_compress.{weight,bias} may be absent; they are
// zeroed and listed in the report. One vqad::Error lists every missing, unexpected and
// mis-shaped key (with files).
LoadReport load_weights(WanModel& model, const WeightState& state);

// Config from <transformer dir>/config.json, model built in the current attention scope,
// weights loaded strictly. `report` (optional) receives what load_weights reports.
std::shared_ptr<WanModel> wan_from_pretrained(const std::string& path,
                                              const WanModelOptions& options = {},
                                              LoadReport* report = nullptr);

// Diffusers layout: <out_dir>/transformer/config.json and
// <out_dir>/transformer/diffusion_pytorch_model.safetensors (fp32 by default), both atomic.
void save_diffusers(WanModel& model, const std::string& out_dir,
                    torch::ScalarType dtype = torch::kFloat32);

// (key, shape) of every parameter, in registration order.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(WanModel& model);

}  // namespace vqad::model
