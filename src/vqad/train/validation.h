// The validation callback (callbacks.validation): every `every_steps` optimizer steps
// (and before the first step when run_at_start), the student samples the validation
// prompts and the latents are written to
//   <output_dir>/validation/step-<k>/samples.safetensors
// (one F32 tensor "latents" [N, 16, T, H, W], captions in the file's metadata) with a
// summary.json and grid.png (a latent preview, see latent_grid). With a Wan VAE
// (callbacks.validation.vae, or the student's Diffusers root holding vae/) every sample is
// also decoded to sample_<i>.mp4 and the step gets contact_sheet.png (media/render.h).
// vqad has no text encoder, so the prompts come with precomputed text embeddings:
//   - a parquet dataset (t2v or text_only schema; its text embeddings and captions), or
//   - a JSON file: {"data": [{"caption": "...", "embedding": "neg.safetensors"}, ...]}
//     (or a bare list), each embedding a .safetensors file with one [L, D] tensor,
//     relative to the JSON's directory.
// The sampler is the method's (methods/registry.h): sft -> the Euler ODE sampler with
// sampling_steps[0] steps, CFG guidance_scale against the zero text (the unconditional
// the SFT text dropout trains), shift pipeline.flow_shift (else the student's); dmd2 ->
// the few-step DMD sampler on sampling_timesteps (else method.dmd_denoising_steps).
// The initial noise and the DMD re-noising come from a generator seeded by
// training.data.seed and the step, never from the trainer's generator, so validation does
// not change training (resume equality holds with or without it).
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vqad/core/png.h"
#include "vqad/media/wan_vae.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/roles.h"

namespace vqad::train {

struct ValidationPrompts {
  std::vector<std::string> captions;
  torch::Tensor text;  // [N, text_len, D] fp32
};

// A preview grid of latents [N, C, T, H, W]: rows = samples, columns = frames, channels
// 0-2 min-max scaled per sample to RGB, each latent pixel repeated so a cell is >= 48 px.
png::Image latent_grid(const torch::Tensor& latents);

// Reads validation prompts (see above); errors name callbacks.validation.dataset_file.
ValidationPrompts load_validation_prompts(const std::string& path, int64_t text_len, int64_t text_dim);

class ValidationRunner {
 public:
  // Throws (naming the key) when the prompts or the latent geometry cannot be resolved.
  // `writes`: this rank writes the files and decodes them (the VAE is loaded only then). A
  // sharded run builds a runner on every rank of the first shard group: they sample
  // together, the student's units gathered one at a time by its forward (no rank holds the
  // whole student), and only rank 0 writes.
  ValidationRunner(const RunConfig& run, std::shared_ptr<Role> student, torch::Device device, bool writes = true);
  // The schedule of callbacks.validation, the same on every rank (whether or not the rank
  // holds a runner): due after `step`, and before the first step.
  static bool due(const ValidationConfig& v, long step) {
    return v.enabled && v.every_steps > 0 && step % v.every_steps == 0;
  }
  static bool at_start(const ValidationConfig& v) { return v.enabled && v.run_at_start; }
  // Samples, writes the files (when `writes`), returns metrics ("validation/seconds", ...;
  // none on a rank that does not write).
  std::map<std::string, double> run(long step);
  const std::vector<int64_t>& latent_shape() const { return shape_; }
  bool decodes_video() const { return vae_ != nullptr; }

 private:
  RunConfig run_;
  std::shared_ptr<Role> student_;
  torch::Device device_;
  ValidationSampler sampler_;
  ValidationPrompts prompts_;
  std::vector<int64_t> shape_;  // [N, C, T, H, W]
  std::string out_dir_;
  int64_t v_fps() const;
  std::shared_ptr<media::WanVaeDecoder> vae_;  // null: latents and the latent preview only
  bool writes_ = true;
};

}  // namespace vqad::train
