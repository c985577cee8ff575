// Wan2.1 VAE decoder (Diffusers `AutoencoderKLWan`, the `vae/` folder of a Wan Diffusers
// checkpoint) in LibTorch: causal 3D convolutions with the per-frame feature cache,
// residual and attention blocks, spatial and temporal upsampling, RMS norms, latent
// de-normalisation with the config's 16 means / stds.
//
// Decoding runs latent frame by latent frame (the same chunking as Diffusers' _decode):
// each step sees one latent frame plus the cached last two input frames of every causal
// convolution, so memory is bounded by one chunk whatever the clip length. One latent
// frame yields 1 video frame for the first chunk and 4 for every later one
// (frames = 1 + 4 (T - 1)), 8x the latent height and width.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace vqad::media {

struct WanVaeConfig {
  int base_dim = 96;
  int z_dim = 16;
  std::vector<int> dim_mult{1, 2, 4, 4};
  int num_res_blocks = 2;
  std::vector<bool> temperal_downsample{false, true, true};
  std::vector<float> latents_mean, latents_std;  // z_dim each

  // Diffusers vae/config.json; `where` names the file in errors. Keys the decoder does not
  // know (encoder-only or Wan2.2 options such as is_residual) are refused unless they hold
  // the Wan2.1 value, so a different architecture is never decoded silently.
  static WanVaeConfig from_json_file(const std::string& path);
  // The Wan2.1 VAE (base_dim 96, dim_mult 1,2,4,4, 2 res blocks, the published 16 means/stds).
  static WanVaeConfig wan21();
  int upsample_count() const { return int(dim_mult.size()) - 1; }
};

class WanVaeDecoder {
 public:
  // `vae_dir`: a directory holding config.json and diffusion_pytorch_model.safetensors (or a
  // model root with vae/). Every decoder key must be present with the expected shape;
  // encoder.* and quant_conv.* are skipped; anything else is an error naming the key.
  static WanVaeDecoder load(const std::string& vae_dir, torch::Device device = torch::kCPU,
                            torch::ScalarType dtype = torch::kFloat32);
  // From a state dict (tests).
  WanVaeDecoder(WanVaeConfig config, const std::map<std::string, torch::Tensor>& state,
                torch::Device device, torch::ScalarType dtype, const std::string& where);

  const WanVaeConfig& config() const { return config_; }
  torch::ScalarType dtype() const { return dtype_; }
  torch::Device device() const { return device_; }

  // latents [B, z_dim, T, H, W]; `normalized`: the DiT's normalised latents (x * std + mean
  // is applied first), else raw VAE latents. Returns video [B, 3, 1 + 4 (T - 1), 8 H, 8 W]
  // in [-1, 1], float32 on the decoder's device.
  torch::Tensor decode(const torch::Tensor& latents, bool normalized = true) const;

  // The decoder's expected tensor shapes (Diffusers key -> shape), for checks and tests.
  static std::map<std::string, std::vector<int64_t>> expected_shapes(const WanVaeConfig& config);

 private:
  WanVaeConfig config_;
  torch::Device device_;
  torch::ScalarType dtype_;
  std::map<std::string, torch::Tensor> w_;
};

// Frames of a decoded video [3, F, H, W] in [-1, 1] as 8-bit RGB, frame-major
// ([F][H][W][3]), the conversion Diffusers' video processor does ((x + 1) / 2, round).
std::vector<uint8_t> video_to_rgb8(const torch::Tensor& video);

}  // namespace vqad::media
