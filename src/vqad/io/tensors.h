// safetensors <-> torch tensors, single files and sharded checkpoints
// (`<prefix>-00001-of-0000N.safetensors` + `<prefix>.safetensors.index.json`,
// the layout Diffusers and Hugging Face use).
#pragma once
#include <torch/torch.h>

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "vqad/core/safetensors.h"

namespace vqad::io {

torch::ScalarType to_torch_dtype(st::DType d);
// Throws naming `what` (tensor name) for dtypes safetensors cannot hold.
st::DType to_st_dtype(torch::ScalarType t, const std::string& what);

// CPU tensors aliasing the file mapping (copy-on-write, so in-place edits never
// touch the file); the mapping stays alive until the last tensor is freed.
// Tensors whose bytes are not aligned to their element size are copied.
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);
// Same, plus the file's __metadata__.
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path,
                                                      std::map<std::string, std::string>* metadata);
torch::Tensor tensor_from(const st::File& file, const std::string& name);

// Accepts tensors on any device with any strides; they are copied to
// contiguous CPU memory for writing. Atomic (see st::Writer::write).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// `index_json_or_dir`: a `*.safetensors.index.json`, or a directory holding
// exactly one such index, or (no index) exactly one `*.safetensors` file.
std::map<std::string, torch::Tensor> load_sharded(const std::string& index_json_or_dir);
// Resolves `index_json_or_dir` to the list of files to read (for tools that
// want st::File access without torch tensors): index path ("" when a single
// file) and tensor name -> shard path.
struct ShardedLayout {
  std::string index_path;
  std::map<std::string, std::string> weight_map;  // tensor -> absolute shard path
  std::map<std::string, std::string> metadata;    // index "metadata", values as strings
};
ShardedLayout resolve_sharded(const std::string& index_json_or_dir);

// Writes shards of at most `max_shard_bytes` each (a tensor larger than the
// limit gets a shard of its own) plus `<prefix>.safetensors.index.json` into
// `dir` (created if missing). With one shard the file is
// `<prefix>.safetensors` and no index is written. Returns the index (or single
// file) path. `metadata` goes into every shard's __metadata__.
std::string save_sharded(const std::string& dir,
                         const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                         size_t max_shard_bytes, const std::string& prefix = "model",
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace vqad::io
