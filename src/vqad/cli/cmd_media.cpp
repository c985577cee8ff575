// `vqad decode LATENTS.safetensors --vae DIR --out DIR`: latents -> MP4 per sample + a PNG
// contact sheet through the Wan2.1 VAE decoder.
// `vqad report RUN_DIR [--out FILE]`: one self-contained HTML page for judging a run.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "vqad/cli/commands.h"
#include "vqad/core/error.h"
#include "vqad/io/device.h"
#include "vqad/io/tensors.h"
#include "vqad/media/render.h"
#include "vqad/media/report.h"
#include "vqad/media/wan_vae.h"

namespace fs = std::filesystem;

namespace vqad::cli {


void register_media_commands(CLI::App& app) {
  {
    auto* sub = app.add_subcommand("decode", "Decode latents to MP4 videos and a contact sheet with the Wan VAE");
    struct Args {
      std::string latents, vae, out, key = "latents", device = "auto", dtype = "float32";
      int fps = 16;
      bool raw = false, no_video = false, save_tensor = false;
    };
    auto a = std::make_shared<Args>();
    sub->add_option("latents", a->latents, ".safetensors holding [N, 16, T, H, W] (or [16, T, H, W]) latents")
        ->required();
    sub->add_option("--vae", a->vae, "Wan VAE directory (config.json + weights) or a model root with vae/")
        ->required();
    sub->add_option("--out", a->out, "output directory")->required();
    sub->add_option("--key", a->key, "tensor name in the latents file (default: latents, or the only tensor)");
    sub->add_option("--device", a->device, "cpu | cuda | cuda:N | auto (default)");
    sub->add_option("--dtype", a->dtype, "decoder precision: float32 (default) or bfloat16");
    sub->add_option("--fps", a->fps, "frames per second of the MP4s (default 16)");
    sub->add_flag("--raw", a->raw, "latents are raw VAE latents (default: the DiT's normalised latents)");
    sub->add_flag("--no-video", a->no_video, "write the contact sheet only");
    sub->add_flag("--save-tensor", a->save_tensor, "also write decoded.safetensors (F32 [N, 3, F, H, W] in [-1, 1])");
    set_action(sub, [a] {
      auto tensors = io::load_safetensors(a->latents);
      torch::Tensor lat;
      if (tensors.count(a->key)) {
        lat = tensors.at(a->key);
      } else {
        VQAD_CHECK(tensors.size() == 1, "decode: ", a->latents, " has no tensor '", a->key, "' and holds ",
                   tensors.size(), " tensors (name one with --key)");
        lat = tensors.begin()->second;
      }
      if (lat.dim() == 4) lat = lat.unsqueeze(0);
      VQAD_CHECK(a->dtype == "float32" || a->dtype == "bfloat16", "--dtype: expected float32 or bfloat16, found '",
                 a->dtype, "'");
      VQAD_CHECK(a->fps > 0, "--fps: expected a positive value, found ", a->fps);
      const torch::Device device = io::parse_device(a->device);
      auto vae = media::WanVaeDecoder::load(a->vae, device,
                                            a->dtype == "float32" ? torch::kFloat32 : torch::kBFloat16);
      media::RenderOptions ro;
      ro.fps = a->fps;
      ro.write_video = !a->no_video;
      torch::Tensor decoded;
      auto r = media::render_latents(vae, lat, !a->raw, a->out, ro, a->save_tensor ? &decoded : nullptr);
      if (a->save_tensor)
        io::save_safetensors((fs::path(a->out) / "decoded.safetensors").string(), {{"video", decoded}});
      std::printf("decoded %lld samples: %lld frames of %lldx%lld in %.2f s on %s (%s)\n",
                  static_cast<long long>(lat.size(0)), static_cast<long long>(r.frames),
                  static_cast<long long>(r.width), static_cast<long long>(r.height), r.decode_seconds,
                  device.str().c_str(), a->dtype.c_str());
      for (const auto& v : r.videos) std::printf("  %s\n", v.c_str());
      std::printf("  %s\n", r.contact_sheet.c_str());
      return 0;
    });
  }
  {
    auto* sub = app.add_subcommand("report", "Write one self-contained HTML page that shows a training run");
    auto run_dir = std::make_shared<std::string>();
    auto out = std::make_shared<std::string>();
    sub->add_option("run_dir", *run_dir, "training output_dir")->required();
    sub->add_option("--out", *out, "HTML file to write (default RUN_DIR/report.html)");
    set_action(sub, [run_dir, out] {
      const std::string path = out->empty() ? (fs::path(*run_dir) / "report.html").string() : *out;
      const auto summary = media::write_run_report(*run_dir, path);
      std::printf("wrote %s (%s)\n", path.c_str(), summary.c_str());
      return 0;
    });
  }
}

}  // namespace vqad::cli
