#include "vqad/io/tensors.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "vqad/core/error.h"

namespace vqad::io {

namespace fs = std::filesystem;

torch::ScalarType to_torch_dtype(st::DType d) {
  switch (d) {
    case st::DType::F32: return torch::kFloat32;
    case st::DType::F16: return torch::kFloat16;
    case st::DType::BF16: return torch::kBFloat16;
    case st::DType::F8_E4M3: return torch::kFloat8_e4m3fn;
    case st::DType::I64: return torch::kInt64;
    case st::DType::I32: return torch::kInt32;
    case st::DType::U8: return torch::kUInt8;
    case st::DType::BOOL: return torch::kBool;
    case st::DType::F64: return torch::kFloat64;
    case st::DType::I16: return torch::kInt16;
    case st::DType::I8: return torch::kInt8;
  }
  fail("safetensors: invalid dtype enum value ", static_cast<int>(d));
}

st::DType to_st_dtype(torch::ScalarType t, const std::string& what) {
  switch (t) {
    case torch::kFloat32: return st::DType::F32;
    case torch::kFloat16: return st::DType::F16;
    case torch::kBFloat16: return st::DType::BF16;
    case torch::kFloat8_e4m3fn: return st::DType::F8_E4M3;
    case torch::kInt64: return st::DType::I64;
    case torch::kInt32: return st::DType::I32;
    case torch::kUInt8: return st::DType::U8;
    case torch::kBool: return st::DType::BOOL;
    case torch::kFloat64: return st::DType::F64;
    case torch::kInt16: return st::DType::I16;
    case torch::kInt8: return st::DType::I8;
    default: break;
  }
  fail("tensor '", what, "': dtype ", c10::toString(t), " cannot be stored in safetensors (supported: ",
       st::dtype_choices(), ")");
}

torch::Tensor tensor_from(const st::File& file, const std::string& name) {
  const st::TensorInfo& info = file.info(name);
  auto dtype = to_torch_dtype(info.dtype);
  auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCPU);
  // The mapping is MAP_PRIVATE and writable, so handing out a mutable pointer
  // is safe: writes land in private copy-on-write pages.
  void* ptr = const_cast<uint8_t*>(file.data(name));
  size_t align = st::dtype_size(info.dtype);
  if (info.nbytes == 0) return torch::empty(info.shape, opts);
  if (reinterpret_cast<uintptr_t>(ptr) % align != 0) {
    auto t = torch::empty(info.shape, opts);
    std::memcpy(t.data_ptr(), ptr, info.nbytes);
    return t;
  }
  std::shared_ptr<st::Mapping> keep = file.mapping();
  return torch::from_blob(
      ptr, info.shape, [keep](void*) mutable { keep.reset(); }, opts);
}

std::map<std::string, torch::Tensor> load_safetensors(
    const std::string& path, std::map<std::string, std::string>* metadata) {
  st::File f = st::File::open(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : f.names()) out.emplace(name, tensor_from(f, name));
  if (metadata) *metadata = f.metadata();
  return out;
}

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  return load_safetensors(path, nullptr);
}

namespace {

// Contiguous CPU copies kept alive while the writer references their bytes.
void add_tensors(st::Writer& w, std::vector<torch::Tensor>& keep,
                 const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  for (const auto& [name, t] : tensors) {
    VQAD_CHECK(t.defined(), "tensor '", name, "': undefined tensor cannot be saved");
    st::DType dt = to_st_dtype(t.scalar_type(), name);
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    keep.push_back(c);
    std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
    w.add_view(name, dt, std::move(shape), c.data_ptr(), c.numel() * c.element_size());
  }
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  st::Writer w;
  std::vector<torch::Tensor> keep;
  add_tensors(w, keep, tensors);
  w.set_metadata(metadata);
  w.write(path);
}

ShardedLayout resolve_sharded(const std::string& index_json_or_dir) {
  using nlohmann::json;
  ShardedLayout layout;
  fs::path p(index_json_or_dir);
  VQAD_CHECK(fs::exists(p), "checkpoint path ", index_json_or_dir, " does not exist");
  if (fs::is_directory(p)) {
    std::vector<fs::path> indexes, singles;
    for (const auto& e : fs::directory_iterator(p)) {
      std::string fname = e.path().filename().string();
      if (fname.ends_with(".safetensors.index.json")) indexes.push_back(e.path());
      else if (fname.ends_with(".safetensors")) singles.push_back(e.path());
    }
    if (indexes.size() == 1) {
      p = indexes[0];
    } else if (indexes.empty() && singles.size() == 1) {
      p = singles[0];
    } else {
      std::string found;
      for (const auto& x : indexes.empty() ? singles : indexes)
        found += (found.empty() ? "" : ", ") + x.filename().string();
      fail("checkpoint directory ", index_json_or_dir,
           ": expected exactly one *.safetensors.index.json or (without an index) exactly one "
           "*.safetensors file, found ",
           found.empty() ? std::string("none") : found);
    }
  }
  std::string ps = p.string();
  if (ps.size() < 5 || ps.compare(ps.size() - 5, 5, ".json") != 0) {
    // A single safetensors file: every tensor lives in it.
    st::File f = st::File::open(ps);
    for (const auto& n : f.names()) layout.weight_map[n] = ps;
    return layout;
  }
  layout.index_path = ps;
  std::ifstream in(ps);
  VQAD_CHECK(in.good(), "checkpoint index ", ps, ": cannot open");
  json idx;
  try {
    idx = json::parse(in);
  } catch (const json::exception& e) {
    fail("checkpoint index ", ps, ": malformed JSON: ", e.what());
  }
  VQAD_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
             "checkpoint index ", ps, ": expected an object with a 'weight_map' object");
  if (idx.contains("metadata") && idx["metadata"].is_object())
    for (auto it = idx["metadata"].begin(); it != idx["metadata"].end(); ++it)
      layout.metadata[it.key()] =
          it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
  fs::path dir = fs::path(ps).parent_path();
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    VQAD_CHECK(it.value().is_string(), "checkpoint index ", ps, ": weight_map['", it.key(),
               "'] must be a shard file name, found ", it.value().dump());
    fs::path shard = dir / it.value().get<std::string>();
    VQAD_CHECK(fs::is_regular_file(shard), "checkpoint index ", ps, ": shard file ",
               shard.string(), " (holding tensor '", it.key(), "') does not exist");
    layout.weight_map[it.key()] = shard.string();
  }
  return layout;
}

std::map<std::string, torch::Tensor> load_sharded(const std::string& index_json_or_dir) {
  ShardedLayout layout = resolve_sharded(index_json_or_dir);
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard] : layout.weight_map) by_shard[shard].push_back(name);
  std::map<std::string, torch::Tensor> out;
  for (const auto& [shard, names] : by_shard) {
    st::File f = st::File::open(shard);
    for (const auto& name : names) {
      VQAD_CHECK(f.contains(name), "checkpoint index ", layout.index_path, " maps tensor '", name,
                 "' to shard ", shard, ", but that shard has no such tensor");
      out.emplace(name, tensor_from(f, name));
    }
  }
  return out;
}

std::string save_sharded(const std::string& dir,
                         const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                         size_t max_shard_bytes, const std::string& prefix,
                         const std::map<std::string, std::string>& metadata) {
  using nlohmann::json;
  VQAD_CHECK(max_shard_bytes > 0, "save_sharded ", dir, ": max shard size must be positive");
  fs::create_directories(dir);
  std::set<std::string> names;
  std::vector<std::vector<size_t>> shards;
  size_t current = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    VQAD_CHECK(names.insert(name).second, "save_sharded ", dir, ": duplicate tensor name '", name,
               "'");
    VQAD_CHECK(t.defined(), "tensor '", name, "': undefined tensor cannot be saved");
    size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    if (shards.empty() || (current + bytes > max_shard_bytes && !shards.back().empty())) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += bytes;
    total += bytes;
  }
  if (shards.size() <= 1) {
    std::string path = (fs::path(dir) / (prefix + ".safetensors")).string();
    save_safetensors(path, tensors, metadata);
    return path;
  }
  json weight_map = json::object();
  const size_t n = shards.size();
  for (size_t s = 0; s < n; ++s) {
    char fname[64];
    std::snprintf(fname, sizeof fname, "-%05zu-of-%05zu.safetensors", s + 1, n);
    std::string shard_name = prefix + fname;
    std::vector<std::pair<std::string, torch::Tensor>> part;
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = shard_name;
    }
    save_safetensors((fs::path(dir) / shard_name).string(), part, metadata);
  }
  json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::string text = idx.dump(2) + "\n";
  std::string index_path = (fs::path(dir) / (prefix + ".safetensors.index.json")).string();
  st::write_file_atomic(index_path, {std::string_view(text)});
  return index_path;
}

}  // namespace vqad::io
