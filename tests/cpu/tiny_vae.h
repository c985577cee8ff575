// A small Wan VAE with the Wan2.1 structure (two temporal and three spatial upsamplers) and
// random weights, written as Diffusers writes it (<root>/vae/config.json + safetensors), for
// the tests of decoding (test_media, test_validation, the sample command).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "vqad/io/tensors.h"
#include "vqad/media/wan_vae.h"

namespace tiny_vae {

inline vqad::media::WanVaeConfig config() {
  vqad::media::WanVaeConfig c = vqad::media::WanVaeConfig::wan21();
  c.base_dim = 8;
  c.dim_mult = {1, 2, 2, 2};
  c.num_res_blocks = 1;
  return c;
}

inline std::map<std::string, torch::Tensor> random_state(const vqad::media::WanVaeConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  std::map<std::string, torch::Tensor> s;
  for (const auto& [k, shape] : vqad::media::WanVaeDecoder::expected_shapes(c)) {
    if (k.find("gamma") != std::string::npos)
      s[k] = 1.0 + 0.1 * torch::randn(shape);
    else
      s[k] = 0.2 * torch::randn(shape) / std::sqrt(double(shape.size() > 1 ? shape[1] : 1));
  }
  return s;
}

// Writes <root>/vae/{config.json, diffusion_pytorch_model.safetensors}; returns <root>/vae.
inline std::filesystem::path write(const std::filesystem::path& root, uint64_t seed = 5) {
  const auto c = config();
  const auto dir = root / "vae";
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = {{"_class_name", "AutoencoderKLWan"}, {"base_dim", c.base_dim}, {"z_dim", 16},
                        {"dim_mult", c.dim_mult},       {"num_res_blocks", c.num_res_blocks},
                        {"attn_scales", nlohmann::json::array()}, {"temperal_downsample", c.temperal_downsample},
                        {"latents_mean", c.latents_mean}, {"latents_std", c.latents_std}, {"dropout", 0.0}};
  std::ofstream(dir / "config.json") << cfg.dump(2);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (auto& [k, t] : random_state(c, seed)) tensors.emplace_back(k, t);
  vqad::io::save_safetensors((dir / "diffusion_pytorch_model.safetensors").string(), tensors);
  return dir;
}

}  // namespace tiny_vae
