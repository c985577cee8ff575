// Wan2.1 T2V DiT configuration (spec/wan_model.md "Configs"). Read from / written to a
// Diffusers `transformer/config.json` (class WanTransformer3DModel).
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace vqad::model {

struct WanConfig {
  int64_t num_attention_heads = 12;
  int64_t attention_head_dim = 128;
  int64_t num_layers = 30;
  int64_t ffn_dim = 8960;
  int64_t in_channels = 16;
  int64_t out_channels = 16;
  std::array<int64_t, 3> patch_size{1, 2, 2};  // (t, h, w)
  int64_t text_dim = 4096;
  int64_t text_len = 512;  // not in config.json: the text encoder's length (data property)
  int64_t freq_dim = 256;
  double eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t rope_max_seq_len = 1024;
  // Per-block `to_gate_compress` (dim x dim), used by the VSA backends. Not a Diffusers
  // field: set by the role's backend when the model is built.
  bool gate_compress = false;

  int64_t dim() const { return num_attention_heads * attention_head_dim; }
  int64_t patch_volume() const { return patch_size[0] * patch_size[1] * patch_size[2]; }
  // head_dim split for (t, h, w): [d - 4*(d//6), 2*(d//6), 2*(d//6)].
  std::array<int64_t, 3> rope_axes_dims() const;

  // Throws vqad::Error naming `where` when the numbers cannot describe a Wan model.
  void validate(const std::string& where = "WanConfig") const;

  static WanConfig wan_1_3b();
  static WanConfig wan_14b();
  // 2 heads x 32 (dim 64), 2 layers, ffn 128, text_dim 32: for tests and demos.
  static WanConfig tiny();
  // "1.3B" | "14B" | "tiny"
  static WanConfig preset(const std::string& name);
  // The name metadata and logs give the architecture: "wan-t2v-1.3b", "wan-t2v-14b",
  // "wan-t2v-tiny" (heads, head dim, layers, FFN and text dims of a preset), else
  // "wan-t2v-custom".
  std::string kind() const;

  // Strict: every architecture field must be present with the right type; fields that
  // Diffusers defaults (eps, rope_max_seq_len, qk_norm, cross_attn_norm, ...) may be absent;
  // unknown fields and values vqad does not implement (image conditioning, another qk_norm)
  // are errors. Keys starting with '_' (e.g. _class_name) are metadata and ignored, except
  // a _class_name other than WanTransformer3DModel.
  static WanConfig from_json(const nlohmann::json& j, const std::string& where);
  static WanConfig from_file(const std::string& config_json_path);
  nlohmann::json to_json() const;

  bool operator==(const WanConfig&) const = default;
};

}  // namespace vqad::model
