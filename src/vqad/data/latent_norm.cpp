#include "vqad/data/latent_norm.h"

#include "vqad/core/error.h"

namespace vqad::data {

const std::array<float, kWanLatentChannels> kWanLatentMean = {
    -0.7571f, -0.7089f, -0.9113f, 0.1075f, -0.1745f, 0.9653f, -0.1517f, 1.5508f,
    0.4134f,  -0.0715f, 0.5517f,  -0.3632f, -0.1922f, -0.9497f, 0.2503f, -0.2921f};
const std::array<float, kWanLatentChannels> kWanLatentStd = {
    2.8184f, 1.4541f, 2.3275f, 2.6558f, 1.2196f, 1.7708f, 2.6052f, 2.0743f,
    3.2687f, 2.1526f, 2.8652f, 1.5579f, 1.6382f, 1.1253f, 2.8251f, 1.9160f};

namespace {
std::pair<torch::Tensor, torch::Tensor> stats_for(const torch::Tensor& x) {
  VQAD_CHECK(x.dim() >= 4 && x.size(-4) == kWanLatentChannels,
             "Wan latent normalization: expected a tensor [..., 16, T, H, W], found shape ",
             x.sizes());
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(x.device());
  auto mean = torch::tensor(torch::ArrayRef<float>(kWanLatentMean.data(), kWanLatentChannels), opts)
                  .view({kWanLatentChannels, 1, 1, 1});
  auto std = torch::tensor(torch::ArrayRef<float>(kWanLatentStd.data(), kWanLatentChannels), opts)
                 .view({kWanLatentChannels, 1, 1, 1});
  return {mean, std};
}
}  // namespace

torch::Tensor normalize_wan_latents(const torch::Tensor& x) {
  auto [mean, std] = stats_for(x);
  return (x.to(torch::kFloat32) - mean) / std;
}

torch::Tensor denormalize_wan_latents(const torch::Tensor& x) {
  auto [mean, std] = stats_for(x);
  return x.to(torch::kFloat32) * std + mean;
}

}  // namespace vqad::data
