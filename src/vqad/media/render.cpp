#include "vqad/media/render.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "vqad/core/error.h"
#include "vqad/media/video_writer.h"

namespace vqad::media {
namespace fs = std::filesystem;

png::Image contact_sheet(const torch::Tensor& videos, int columns, int cell_height) {
  VQAD_CHECK(videos.dim() == 5 && videos.size(1) == 3, "contact sheet: videos expected [N, 3, F, H, W], found ",
             c10::str(videos.sizes()));
  VQAD_CHECK(columns > 0 && cell_height > 0, "contact sheet: columns and cell height must be positive");
  const int64_t n = videos.size(0), f = videos.size(2), h = videos.size(3), w = videos.size(4);
  const int cols = int(std::min<int64_t>(columns, f));
  const int ch = int(std::min<int64_t>(cell_height, h));
  const int cw = std::max(1, int(std::lround(double(w) * ch / double(h))));
  const int gap = 2;
  png::Image img(cols * cw + (cols + 1) * gap, int(n) * ch + int(n + 1) * gap, 32);
  torch::Tensor v = ((videos.to(torch::kCPU, torch::kFloat32) / 2 + 0.5).clamp(0, 1) * 255).round();
  for (int64_t s = 0; s < n; ++s) {
    for (int c = 0; c < cols; ++c) {
      const int64_t frame = cols == 1 ? 0 : (int64_t(c) * (f - 1)) / (cols - 1);
      // Area-averaged downscale to the cell size.
      torch::Tensor fr = v[s].select(1, frame).unsqueeze(0);  // [1, 3, H, W]
      torch::Tensor cell = torch::nn::functional::interpolate(
          fr, torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{ch, cw}).mode(torch::kArea));
      cell = cell.squeeze(0).round().clamp(0, 255).to(torch::kUInt8).permute({1, 2, 0}).contiguous();
      const uint8_t* p = cell.data_ptr<uint8_t>();
      const int x0 = gap + c * (cw + gap), y0 = gap + int(s) * (ch + gap);
      for (int y = 0; y < ch; ++y)
        std::copy(p + size_t(y) * cw * 3, p + size_t(y + 1) * cw * 3, img.at(x0, y0 + y));
    }
  }
  return img;
}

RenderResult render_latents(const WanVaeDecoder& vae, const torch::Tensor& latents, bool normalized,
                            const std::string& out_dir, const RenderOptions& options, torch::Tensor* decoded) {
  VQAD_CHECK(latents.dim() == 5, "render: latents expected [N, C, T, H, W], found ", c10::str(latents.sizes()));
  if (options.write_video)
    VQAD_CHECK(video_writer_available(), "render: MP4 output requested but this vqad build has no H.264 writer "
               "(build with the ffmpeg libraries, or ask for the contact sheet only)");
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  VQAD_CHECK(!ec, "render: cannot create ", out_dir, " (", ec.message(), ")");
  RenderResult r;
  std::vector<torch::Tensor> all;
  double decode_s = 0.0;
  for (int64_t i = 0; i < latents.size(0); ++i) {
    const auto d0 = std::chrono::steady_clock::now();
    torch::Tensor video = vae.decode(latents.narrow(0, i, 1), normalized).cpu();  // [1, 3, F, H, W]
    decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - d0).count();
    r.frames = video.size(2);
    r.height = video.size(3);
    r.width = video.size(4);
    if (options.write_video) {
      const std::string path = (fs::path(out_dir) / ("sample_" + std::to_string(i) + ".mp4")).string();
      VideoSpec spec;
      spec.width = int(r.width);
      spec.height = int(r.height);
      spec.fps = options.fps;
      write_mp4(path, video_to_rgb8(video[0]), int(r.frames), spec);
      r.videos.push_back(path);
    }
    all.push_back(video);
  }
  torch::Tensor videos = torch::cat(all, 0);
  r.contact_sheet = (fs::path(out_dir) / "contact_sheet.png").string();
  png::write(r.contact_sheet, contact_sheet(videos, options.sheet_columns, options.sheet_cell_height));
  r.decode_seconds = decode_s;
  if (decoded) *decoded = videos;
  return r;
}

}  // namespace vqad::media
