// Decoded videos as files a person opens: one MP4 per sample and a PNG contact sheet
// (rows = samples, columns = evenly spaced frames), from latents through the Wan VAE.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "vqad/core/png.h"
#include "vqad/media/wan_vae.h"

namespace vqad::media {

struct RenderOptions {
  int fps = 16;
  bool write_video = true;   // false: contact sheet only
  int sheet_columns = 8;     // frames per sample in the contact sheet
  int sheet_cell_height = 120;  // pixels per cell (frames are scaled down to it)
};

struct RenderResult {
  std::vector<std::string> videos;  // sample_<i>.mp4
  std::string contact_sheet;        // contact_sheet.png
  int64_t frames = 0, height = 0, width = 0;
  double decode_seconds = 0.0;
};

// videos: decoded [N, 3, F, H, W] in [-1, 1].
png::Image contact_sheet(const torch::Tensor& videos, int columns, int cell_height);

// latents [N, 16, T, H, W] (normalised DiT latents unless `normalized` is false) ->
// out_dir/sample_<i>.mp4 + out_dir/contact_sheet.png. Decodes one sample at a time.
RenderResult render_latents(const WanVaeDecoder& vae, const torch::Tensor& latents, bool normalized,
                            const std::string& out_dir, const RenderOptions& options,
                            torch::Tensor* decoded = nullptr);

}  // namespace vqad::media
