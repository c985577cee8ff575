// Per-channel normalization of Wan2.1 VAE latents. Preprocessed datasets store the
// raw VAE posterior mean; the DiT trains on (x - mean_c) / std_c with the 16
// channel statistics of the Wan2.1 VAE config (latents_mean / latents_std).
#pragma once
#include <torch/torch.h>

#include <array>

namespace vqad::data {

inline constexpr int kWanLatentChannels = 16;
extern const std::array<float, kWanLatentChannels> kWanLatentMean;
extern const std::array<float, kWanLatentChannels> kWanLatentStd;

// x: [..., 16, T, H, W] float32 (channel axis at dim -4) -> normalized float32.
torch::Tensor normalize_wan_latents(const torch::Tensor& x);
// Inverse, for decoding generated latents back to VAE space.
torch::Tensor denormalize_wan_latents(const torch::Tensor& x);

}  // namespace vqad::data
