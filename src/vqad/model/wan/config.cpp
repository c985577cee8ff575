#include "vqad/model/wan/config.h"

#include <fstream>
#include <set>
#include <sstream>

#include "vqad/core/error.h"

namespace vqad::model {
namespace {

using nlohmann::json;

int64_t get_int(const json& j, const char* key, const std::string& where) {
  const auto& v = j.at(key);
  VQAD_CHECK(v.is_number_integer(), where, ": field '", key, "' must be an integer, found ",
             v.dump());
  return v.get<int64_t>();
}

}  // namespace

std::array<int64_t, 3> WanConfig::rope_axes_dims() const {
  const int64_t d = attention_head_dim;
  return {d - 4 * (d / 6), 2 * (d / 6), 2 * (d / 6)};
}

void WanConfig::validate(const std::string& where) const {
  auto positive = [&](int64_t v, const char* name) {
    VQAD_CHECK(v > 0, where, ": ", name, " must be positive, found ", v);
  };
  positive(num_attention_heads, "num_attention_heads");
  positive(attention_head_dim, "attention_head_dim");
  positive(num_layers, "num_layers");
  positive(ffn_dim, "ffn_dim");
  positive(in_channels, "in_channels");
  positive(out_channels, "out_channels");
  positive(text_dim, "text_dim");
  positive(text_len, "text_len");
  positive(rope_max_seq_len, "rope_max_seq_len");
  for (auto p : patch_size) positive(p, "patch_size entries");
  VQAD_CHECK(freq_dim > 0 && freq_dim % 2 == 0, where, ": freq_dim must be positive and even, found ",
             freq_dim);
  auto axes = rope_axes_dims();
  VQAD_CHECK(attention_head_dim >= 6 && axes[0] % 2 == 0 && axes[1] % 2 == 0, where,
             ": attention_head_dim ", attention_head_dim,
             " gives a RoPE split [", axes[0], ", ", axes[1], ", ", axes[2],
             "] with odd or empty parts; it must be even and at least 6 (e.g. 128 -> [44, 42, 42])");
  VQAD_CHECK(eps > 0, where, ": eps must be positive, found ", eps);
  VQAD_CHECK(rope_theta > 0, where, ": rope theta must be positive, found ", rope_theta);
}

WanConfig WanConfig::wan_1_3b() { return WanConfig{}; }

WanConfig WanConfig::wan_14b() {
  WanConfig c;
  c.num_attention_heads = 40;
  c.num_layers = 40;
  c.ffn_dim = 13824;
  return c;
}

WanConfig WanConfig::tiny() {
  WanConfig c;
  c.num_attention_heads = 2;
  c.attention_head_dim = 32;
  c.num_layers = 2;
  c.ffn_dim = 128;
  c.text_dim = 32;
  return c;
}

std::string WanConfig::kind() const {
  auto same = [&](const WanConfig& ref) {
    return num_attention_heads == ref.num_attention_heads && attention_head_dim == ref.attention_head_dim &&
           num_layers == ref.num_layers && ffn_dim == ref.ffn_dim && text_dim == ref.text_dim;
  };
  if (same(wan_1_3b())) return "wan-t2v-1.3b";
  if (same(wan_14b())) return "wan-t2v-14b";
  if (same(tiny())) return "wan-t2v-tiny";
  return "wan-t2v-custom";
}

WanConfig WanConfig::preset(const std::string& name) {
  if (name == "1.3B") return wan_1_3b();
  if (name == "14B") return wan_14b();
  if (name == "tiny") return tiny();
  if (name == "tiny-hd128") {
    // The tiny model with the head dimension of the CUDA attention kernels (128): one
    // head of 128 channels, so tiny runs (the demo, tests) can use ATTN_QAT_TRAIN on a GPU.
    WanConfig c = tiny();
    c.num_attention_heads = 1;
    c.attention_head_dim = 128;
    c.ffn_dim = 256;
    return c;
  }
  if (name == "tiny-4head") {
    // The tiny model with its 64 channels split into 4 heads of 16: runs with Ulysses
    // sequence parallelism of up to 4 ranks (the recipes' sp_size 4) on the CPU.
    WanConfig c = tiny();
    c.num_attention_heads = 4;
    c.attention_head_dim = 16;
    return c;
  }
  fail("Wan model preset '", name, "' is unknown; valid presets: 1.3B, 14B, tiny, tiny-hd128, tiny-4head");
}

WanConfig WanConfig::from_json(const json& j, const std::string& where) {
  VQAD_CHECK(j.is_object(), where, ": expected a JSON object, found ", j.type_name());
  static const std::set<std::string> required = {
      "num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim", "in_channels",
      "out_channels",        "patch_size",         "text_dim",   "freq_dim"};
  static const std::set<std::string> optional = {
      "eps",       "rope_max_seq_len", "qk_norm", "cross_attn_norm", "added_kv_proj_dim",
      "image_dim", "pos_embed_seq_len",
      // Written by packed NVFP4 exports (ModelOpt's form); the weight loader reads the packing.
      "quantization_config"};
  std::vector<std::string> missing, unknown;
  for (const auto& k : required)
    if (!j.contains(k)) missing.push_back(k);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& k = it.key();
    if (k.empty() || k[0] == '_') continue;
    if (!required.count(k) && !optional.count(k)) unknown.push_back(k);
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  };
  VQAD_CHECK(missing.empty(), where, ": missing required field(s): ", join(missing));
  VQAD_CHECK(unknown.empty(), where, ": unknown field(s) for a Wan2.1 T2V transformer: ",
             join(unknown));
  if (j.contains("_class_name")) {
    const auto& cls = j["_class_name"];
    VQAD_CHECK(cls.is_string() && cls.get<std::string>() == "WanTransformer3DModel", where,
               ": _class_name must be \"WanTransformer3DModel\", found ", cls.dump());
  }

  WanConfig c;
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.attention_head_dim = get_int(j, "attention_head_dim", where);
  c.num_layers = get_int(j, "num_layers", where);
  c.ffn_dim = get_int(j, "ffn_dim", where);
  c.in_channels = get_int(j, "in_channels", where);
  c.out_channels = get_int(j, "out_channels", where);
  c.text_dim = get_int(j, "text_dim", where);
  c.freq_dim = get_int(j, "freq_dim", where);
  const auto& ps = j["patch_size"];
  VQAD_CHECK(ps.is_array() && ps.size() == 3, where,
             ": field 'patch_size' must be an array of 3 integers (t, h, w), found ", ps.dump());
  for (size_t i = 0; i < 3; ++i) {
    VQAD_CHECK(ps[i].is_number_integer(), where,
               ": field 'patch_size' must hold integers, found ", ps.dump());
    c.patch_size[i] = ps[i].get<int64_t>();
  }
  if (j.contains("eps")) {
    VQAD_CHECK(j["eps"].is_number(), where, ": field 'eps' must be a number, found ",
               j["eps"].dump());
    c.eps = j["eps"].get<double>();
  }
  if (j.contains("rope_max_seq_len")) c.rope_max_seq_len = get_int(j, "rope_max_seq_len", where);
  if (j.contains("qk_norm")) {
    const auto& v = j["qk_norm"];
    VQAD_CHECK(v.is_string() && v.get<std::string>() == "rms_norm_across_heads", where,
               ": field 'qk_norm' must be \"rms_norm_across_heads\" (the only norm vqad "
               "implements), found ", v.dump());
  }
  if (j.contains("cross_attn_norm")) {
    const auto& v = j["cross_attn_norm"];
    VQAD_CHECK(v.is_boolean() && v.get<bool>(), where,
               ": field 'cross_attn_norm' must be true (the Wan2.1 layout), found ", v.dump());
  }
  for (const char* k : {"added_kv_proj_dim", "image_dim", "pos_embed_seq_len"}) {
    if (j.contains(k))
      VQAD_CHECK(j[k].is_null(), where, ": field '", k,
                 "' must be null (image-to-video conditioning is not implemented), found ",
                 j[k].dump());
  }
  c.validate(where);
  return c;
}

WanConfig WanConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  VQAD_CHECK(in.good(), "Wan config ", path, ": cannot open the file");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("Wan config ", path, ": invalid JSON: ", e.what());
  }
  return from_json(j, "Wan config " + path);
}

json WanConfig::to_json() const {
  json j;
  j["_class_name"] = "WanTransformer3DModel";
  j["_diffusers_version"] = "0.33.1";
  j["added_kv_proj_dim"] = nullptr;
  j["attention_head_dim"] = attention_head_dim;
  j["cross_attn_norm"] = true;
  j["eps"] = eps;
  j["ffn_dim"] = ffn_dim;
  j["freq_dim"] = freq_dim;
  j["image_dim"] = nullptr;
  j["in_channels"] = in_channels;
  j["num_attention_heads"] = num_attention_heads;
  j["num_layers"] = num_layers;
  j["out_channels"] = out_channels;
  j["patch_size"] = json::array({patch_size[0], patch_size[1], patch_size[2]});
  j["qk_norm"] = "rms_norm_across_heads";
  j["rope_max_seq_len"] = rope_max_seq_len;
  j["text_dim"] = text_dim;
  return j;
}

}  // namespace vqad::model
