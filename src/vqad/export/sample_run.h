// `vqad sample`: latents (and a preview grid) of any exported model - dense, fake-quant
// or packed NVFP4 (load_inference_model) - from precomputed text embeddings, with the
// samplers of train/sampling.h: multi-step Euler with classifier-free guidance, or the
// few-step DMD sampler on the shifted flow-matching grid.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vqad/export/packed.h"

namespace vqad::deploy {

struct SampleOptions {
  std::string model;       // export / Diffusers / checkpoint role directory
  std::string prompts;     // safetensors: "text" [P, Lt, Dt], optional "negative" [1 or P, Lt, Dt]
  std::string out;         // output directory
  int steps = 0;           // Euler/CFG sampler with this many steps, or
  std::vector<double> timesteps;  // the DMD sampler at these timesteps (exactly one of the two)
  double guidance = 1.0;   // CFG scale (Euler only; needs "negative" when != 1)
  double shift = 3.0;      // flow shift of the schedule / grid
  std::string noise;       // safetensors with "noise" [P, 16, T, H, W]; else drawn from `seed`
  std::vector<int64_t> latent_shape;  // T, H, W of the drawn noise
  uint64_t seed = 0;           // initial noise generator
  uint64_t renoise_seed = 0;   // DMD re-noising generator
  std::string attention;   // attention backend; "" = the one the model was trained with (metadata), else TORCH_SDPA
  torch::Device device = torch::kCPU;
  // Forward GEMM of the NVFP4 linears (fake-quant and packed models): auto | fake_quant | fp4,
  // as training.linear_quantization.gemm; fp4 on a device without FP4 tensor cores is an error.
  std::string gemm = "auto";
  bool preview = true;     // write preview.png
};

struct SampleResult {
  torch::Tensor latents;   // fp32 [P, 16, T, H, W] on the CPU
  torch::Tensor noise;     // the initial noise used
  ModelKind kind = ModelKind::kDense;
  std::string attention;
  std::string gemm_route;  // the NVFP4 linears' resolved route ("" for a dense model)
  std::vector<std::string> files;  // written, relative to out
};

// Samples and writes <out>/latents.safetensors ("latents", "noise"), preview.png (the
// middle frame's first three latent channels per sample, each tile min-max scaled) and
// sample.json (settings, model kind, the model's checkpoint id).
SampleResult run_sample(const SampleOptions& options);

}  // namespace vqad::deploy
