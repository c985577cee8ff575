#include "vqad/model/wan/weights.h"

#include "vqad/model/wan/packed_weights.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/tensor_text.h"

namespace vqad::model {
namespace fs = std::filesystem;
namespace {

constexpr const char* kSingle = "diffusion_pytorch_model.safetensors";
constexpr const char* kIndex = "diffusion_pytorch_model.safetensors.index.json";
constexpr const char* kFastVideo = "model.safetensors";

bool is_shard_name(const std::string& n) {
  static const std::regex re(R"(diffusion_pytorch_model-\d+-of-\d+\.safetensors)");
  return std::regex_match(n, re);
}

bool is_gate_compress_key(const std::string& k) {
  static const std::regex re(R"(blocks\.\d+\.to_gate_compress\.(weight|bias))");
  return std::regex_match(k, re);
}

// At most `limit` lines, then a count of the rest.
void list_lines(std::ostringstream& os, const std::vector<std::string>& lines, size_t limit = 40) {
  for (size_t i = 0; i < lines.size() && i < limit; ++i) os << "\n    " << lines[i];
  if (lines.size() > limit) os << "\n    ... and " << lines.size() - limit << " more";
}

float scalar_f32(const torch::Tensor& t, const std::string& key, const std::string& source) {
  VQAD_CHECK(t.scalar_type() == torch::kFloat32 && t.numel() == 1, "packed NVFP4 weights ", source, ": ", key,
             " must be an F32 scalar, found ", c10::toString(t.scalar_type()), " ", ops::shape_str(t.sizes()));
  return t.reshape({1}).item<float>();
}

}  // namespace

WeightSource locate_weights(const std::string& path) {
  fs::path p(path);
  VQAD_CHECK(fs::exists(p), "Wan weights: path ", path, " does not exist");
  WeightSource src;
  if (fs::is_regular_file(p)) {
    const std::string name = p.filename().string();
    const bool index = name.size() > 11 && name.ends_with(".index.json");
    VQAD_CHECK(index || name.ends_with(".safetensors"), "Wan weights: file ", path,
               " is neither a .safetensors file nor a *.index.json");
    src.path = fs::absolute(p).string();
    src.transformer_dir = fs::absolute(p).parent_path().string();
    src.kind = index ? WeightSource::Kind::kSharded
               : name == kFastVideo ? WeightSource::Kind::kFastVideoExport
                                    : WeightSource::Kind::kSingleFile;
  } else {
    fs::path dir = fs::is_directory(p / "transformer") ? p / "transformer" : p;
    dir = fs::absolute(dir);
    src.transformer_dir = dir.string();
    bool single = fs::is_regular_file(dir / kSingle), index = fs::is_regular_file(dir / kIndex),
         fastvideo = fs::is_regular_file(dir / kFastVideo);
    std::vector<std::string> shards;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && is_shard_name(e.path().filename().string()))
        shards.push_back(e.path().filename().string());
    if (fastvideo) {
      VQAD_CHECK(!single && shards.empty(), "Wan weights: directory ", dir.string(),
                 " holds both a FastVideo export (", kFastVideo, ") and Diffusers weights (",
                 single ? kSingle : "diffusion_pytorch_model-*-of-*.safetensors",
                 "); remove one or pass the file to use");
      src.kind = WeightSource::Kind::kFastVideoExport;
      src.path = (dir / kFastVideo).string();
    } else if (single) {
      VQAD_CHECK(shards.empty(), "Wan weights: directory ", dir.string(), " holds both ", kSingle,
                 " and shards (", shards.front(), ", ...); remove one or pass the file to use");
      src.kind = WeightSource::Kind::kSingleFile;
      src.path = (dir / kSingle).string();
    } else if (index) {
      src.kind = WeightSource::Kind::kSharded;
      src.path = (dir / kIndex).string();
    } else {
      fail("Wan weights: directory ", dir.string(), " holds none of ", kSingle, ", ", kIndex,
           ", ", kFastVideo, " (looked in ", path, " and its transformer/ subdirectory)");
    }
  }
  const fs::path cfg = fs::path(src.transformer_dir) / "config.json";
  if (fs::is_regular_file(cfg)) src.config_path = cfg.string();
  return src;
}

namespace {
WeightState read_weights_raw(const WeightSource& source) {
  WeightState state;
  state.source = source.path;
  if (source.kind != WeightSource::Kind::kSharded) {
    state.tensors = io::load_safetensors(source.path);
    for (const auto& [k, _] : state.tensors) state.origin[k] = source.path;
    return state;
  }
  io::ShardedLayout layout = io::resolve_sharded(source.path);
  std::map<std::string, std::set<std::string>> listed;  // shard -> names the index puts there
  for (const auto& [name, shard] : layout.weight_map) listed[shard].insert(name);
  std::vector<std::string> problems;
  for (const auto& [shard, names] : listed) {
    st::File f = st::File::open(shard);
    for (const auto& name : f.names()) {
      if (!names.count(name)) {
        auto it = layout.weight_map.find(name);
        problems.push_back("'" + name + "' is in " + shard + " but the index " +
                           (it == layout.weight_map.end() ? std::string("does not list it")
                                                          : "maps it to " + it->second));
        continue;
      }
      state.tensors.emplace(name, io::tensor_from(f, name));
      state.origin[name] = shard;
    }
    for (const auto& name : names)
      if (!f.contains(name))
        problems.push_back("'" + name + "' is mapped to " + shard + " by the index but that shard lacks it");
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << "Wan weights: sharded set " << source.path << " is inconsistent with its shards ("
       << problems.size() << " problem(s)):";
    list_lines(os, problems);
    fail(os.str());
  }
  return state;
}
}  // namespace

std::map<std::string, PackedNvfp4Linear> unpack_nvfp4_linears(WeightState& state) {
  std::map<std::string, PackedNvfp4Linear> out;
  const std::string scale_suffix = ".weight_scale";
  std::vector<std::string> modules;
  for (const auto& [k, t] : state.tensors)
    if (k.ends_with(scale_suffix)) modules.push_back(k.substr(0, k.size() - scale_suffix.size()));
  for (const std::string& m : modules) {
    auto where = [&](const std::string& key) {
      auto it = state.origin.find(key);
      return key + " (" + (it == state.origin.end() ? state.source : it->second) + ")";
    };
    const std::string wkey = m + ".weight", skey = m + ".weight_scale", s2key = m + ".weight_scale_2",
                      ikey = m + ".input_scale", swkey = m + ".weight_scale_swizzled";
    const torch::Tensor scales = state.tensors.at(skey);
    VQAD_CHECK(scales.scalar_type() == torch::kFloat8_e4m3fn && scales.dim() == 2, "packed NVFP4 weights: ",
               where(skey), " must be F8_E4M3 [N, K/16], found ", c10::toString(scales.scalar_type()), " ",
               ops::shape_str(scales.sizes()));
    auto wit = state.tensors.find(wkey);
    VQAD_CHECK(wit != state.tensors.end(), "packed NVFP4 weights: ", where(skey), " has no ", wkey);
    const torch::Tensor packed = wit->second;
    const int64_t n = scales.size(0), k = scales.size(1) * nvfp4::kBlock;
    VQAD_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.size(0) == n &&
                   packed.size(1) * 2 == k,
               "packed NVFP4 weights: ", where(wkey), " must be U8 [", n, ", ", k / 2, "] to match ", skey, " ",
               ops::shape_str(scales.sizes()), ", found ", c10::toString(packed.scalar_type()), " ",
               ops::shape_str(packed.sizes()));
    VQAD_CHECK(state.tensors.count(s2key), "packed NVFP4 weights: ", where(skey), " has no ", s2key);
    PackedNvfp4Linear lin;
    lin.module = m;
    lin.weight_scale_2 = scalar_f32(state.tensors.at(s2key), s2key, state.source);
    VQAD_CHECK(std::isfinite(lin.weight_scale_2) && lin.weight_scale_2 > 0.0f, "packed NVFP4 weights: ",
               where(s2key), " must be positive and finite, found ", lin.weight_scale_2);
    if (state.tensors.count(ikey)) {
      lin.input_scale = scalar_f32(state.tensors.at(ikey), ikey, state.source);
      VQAD_CHECK(std::isfinite(*lin.input_scale) && *lin.input_scale > 0.0f, "packed NVFP4 weights: ", where(ikey),
                 " must be positive and finite, found ", *lin.input_scale);
    }
    const torch::Tensor sc = scales.contiguous().view(torch::kUInt8);
    const torch::Tensor pc = packed.contiguous();
    const uint8_t* sb = sc.data_ptr<uint8_t>();
    const uint8_t* pb = pc.data_ptr<uint8_t>();
    for (int64_t i = 0; i < sc.numel(); ++i) {
      VQAD_CHECK((sb[i] & 0x7F) != nvfp4::kE4M3NaN && !(sb[i] & 0x80), "packed NVFP4 weights: ", where(skey),
                 " holds a negative or NaN block scale (byte ", static_cast<int>(sb[i]), " at block ", i, ")");
    }
    if (state.tensors.count(swkey)) {
      const torch::Tensor sw = state.tensors.at(swkey).contiguous().view(torch::kUInt8);
      const int64_t cols = k / nvfp4::kBlock;
      VQAD_CHECK(sw.numel() == nvfp4::swizzled_scales_size(n, cols), "packed NVFP4 weights: ", where(swkey),
                 " has ", sw.numel(), " bytes, the 128x4 layout of [", n, ", ", cols, "] needs ",
                 nvfp4::swizzled_scales_size(n, cols));
      std::vector<uint8_t> lin_from_sw(static_cast<size_t>(n * cols));
      nvfp4::unswizzle_scales(sw.data_ptr<uint8_t>(), n, cols, lin_from_sw.data());
      VQAD_CHECK(std::memcmp(lin_from_sw.data(), sb, lin_from_sw.size()) == 0, "packed NVFP4 weights: ",
                 where(swkey), " does not hold the same scales as ", skey);
      state.tensors.erase(swkey);
      state.origin.erase(swkey);
    }
    torch::Tensor unit = torch::empty({n, k}, torch::kFloat32);
    torch::Tensor weight = torch::empty({n, k}, torch::kFloat32);
    float* u = unit.data_ptr<float>();
    float* w = weight.data_ptr<float>();
    const float s_dec = lin.weight_scale_2;
    for (int64_t i = 0; i < n * k; ++i) {
      const uint8_t byte = pb[i / 2];
      const uint8_t code = (i % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      const float S = nvfp4::e4m3_decode(sb[i / nvfp4::kBlock]);
      u[i] = nvfp4::e2m1_decode(code) * S;
      w[i] = u[i] * s_dec;  // (e2m1 * S) * s_dec: the rounding order of FQ(W)
    }
    lin.unit_weight = unit;
    state.tensors[wkey] = weight;
    for (const std::string& key : {skey, s2key, ikey}) {
      state.tensors.erase(key);
      state.origin.erase(key);
    }
    out.emplace(m, std::move(lin));
  }
  return out;
}

WeightState read_weights(const WeightSource& source) {
  WeightState state = read_weights_raw(source);
  unpack_nvfp4_linears(state);
  return state;
}

std::map<std::string, PackedNvfp4Linear> read_packed_nvfp4_linears(const std::string& path) {
  WeightState state = read_weights_raw(locate_weights(path));
  return unpack_nvfp4_linears(state);
}

WeightState read_weights(const std::string& path) { return read_weights(locate_weights(path)); }

LoadReport load_weights(WanModel& model, const WeightState& state) {
  auto params = model.named_parameters(/*recurse=*/true);
  std::vector<std::string> missing, unexpected, misshaped, bad_dtype;
  std::vector<std::string> zeroed;
  auto origin = [&](const std::string& k) {
    auto it = state.origin.find(k);
    return it == state.origin.end() ? state.source : it->second;
  };
  for (const auto& item : params) {
    const auto& key = item.key();
    auto it = state.tensors.find(key);
    if (it == state.tensors.end()) {
      if (is_gate_compress_key(key)) {
        zeroed.push_back(key);
      } else {
        missing.push_back(key + " (expected " + ops::shape_str(item.value().sizes()) + ")");
      }
      continue;
    }
    if (it->second.sizes() != item.value().sizes())
      misshaped.push_back(key + ": expected " + ops::shape_str(item.value().sizes()) + ", found " +
                          ops::shape_str(it->second.sizes()) + " in " + origin(key));
    else if (!it->second.is_floating_point())
      bad_dtype.push_back(key + ": expected a floating dtype, found " +
                          std::string(c10::toString(it->second.scalar_type())) + " in " + origin(key));
  }
  for (const auto& [key, _] : state.tensors)
    if (!params.contains(key)) unexpected.push_back(key + " (in " + origin(key) + ")");

  if (!missing.empty() || !unexpected.empty() || !misshaped.empty() || !bad_dtype.empty()) {
    std::ostringstream os;
    os << "Wan weights " << state.source << " do not match the model (" << model.config().num_layers
       << " layers, dim " << model.config().dim() << "): " << missing.size() << " missing, "
       << unexpected.size() << " unexpected, " << misshaped.size() << " mis-shaped, "
       << bad_dtype.size() << " non-float key(s)";
    if (!missing.empty()) {
      os << "\n  missing:";
      list_lines(os, missing);
    }
    if (!unexpected.empty()) {
      os << "\n  unexpected:";
      list_lines(os, unexpected);
    }
    if (!misshaped.empty()) {
      os << "\n  mis-shaped:";
      list_lines(os, misshaped);
    }
    if (!bad_dtype.empty()) {
      os << "\n  wrong dtype:";
      list_lines(os, bad_dtype);
    }
    fail(os.str());
  }

  torch::NoGradGuard no_grad;
  for (auto& item : params) {
    auto& p = item.value();
    VQAD_CHECK(!p.is_meta(), "Wan weights: cannot load into a model built on the meta device");
    auto it = state.tensors.find(item.key());
    if (it == state.tensors.end()) {
      p.zero_();
    } else {
      p.copy_(it->second);
    }
  }
  LoadReport report;
  report.zeroed_gate_keys = std::move(zeroed);
  return report;
}

std::shared_ptr<WanModel> wan_from_pretrained(const std::string& path, const WanModelOptions& options,
                                              LoadReport* report) {
  WeightSource src = locate_weights(path);
  VQAD_CHECK(!src.config_path.empty(), "Wan model ", path, ": no config.json in ",
             src.transformer_dir, " (a Diffusers transformer/config.json is required)");
  WanConfig config = WanConfig::from_file(src.config_path);
  auto state = read_weights(src);
  // Checkpoints trained with a VSA backend carry the gate; keep it even for dense roles
  // so that a save writes it back.
  for (const auto& [k, _] : state.tensors)
    if (is_gate_compress_key(k)) config.gate_compress = true;
  auto model = std::make_shared<WanModel>(config, options);
  LoadReport r = load_weights(*model, state);
  if (report != nullptr) *report = std::move(r);
  return model;
}

void save_diffusers(WanModel& model, const std::string& out_dir, torch::ScalarType dtype) {
  VQAD_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
             "save_diffusers ", out_dir, ": dtype must be float32, bfloat16 or float16, found ",
             c10::toString(dtype));
  const fs::path dir = fs::path(out_dir) / "transformer";
  std::error_code ec;
  fs::create_directories(dir, ec);
  VQAD_CHECK(!ec, "save_diffusers: cannot create ", dir.string(), ": ", ec.message());
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters(true)) {
      VQAD_CHECK(!item.value().is_meta(), "save_diffusers: parameter ", item.key(),
                 " is on the meta device (no data to save)");
      tensors.emplace_back(item.key(), item.value().detach().to(torch::kCPU, dtype).contiguous());
    }
  }
  io::save_safetensors((dir / kSingle).string(), tensors, {{"format", "pt"}});
  const std::string cfg = model.config().to_json().dump(2) + "\n";
  st::write_file_atomic((dir / "config.json").string(), {cfg});
}

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(WanModel& model) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& item : model.named_parameters(true))
    out.emplace_back(item.key(), item.value().sizes().vec());
  return out;
}

}  // namespace vqad::model
