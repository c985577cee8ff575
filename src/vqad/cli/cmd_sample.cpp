// `vqad sample MODEL --prompts FILE (--steps N | --timesteps ...) --out DIR [--vae DIR]`.
// With --vae the sampled latents are also decoded to sample_<i>.mp4 and contact_sheet.png.
#include <iostream>
#include <optional>

#include "vqad/cli/commands.h"
#include "vqad/export/sample_run.h"
#include "vqad/io/device.h"
#include "vqad/media/render.h"
#include "vqad/media/video_writer.h"
#include "vqad/media/wan_vae.h"
#include "vqad/train/trainer.h"

namespace vqad::cli {

void register_sample_commands(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "sample", "Sample latents (and a preview grid) of a model - dense, fake-quant or packed NVFP4 - from "
                "precomputed text embeddings");
  auto o = std::make_shared<deploy::SampleOptions>();
  auto device = std::make_shared<std::string>("cpu");
  auto no_preview = std::make_shared<bool>(false);
  struct Decode {
    std::string vae, dtype = "float32";
    int fps = 16;
  };
  auto dec = std::make_shared<Decode>();
  sub->add_option("model", o->model, "export, Diffusers or checkpoint role directory")->required();
  sub->add_option("--prompts", o->prompts,
                  "safetensors with 'text' [P, Lt, Dt] (and 'negative' [1 or P, Lt, Dt] for --guidance)")
      ->required();
  sub->add_option("--out", o->out, "output directory (latents.safetensors, preview.png, sample.json)")->required();
  sub->add_option("--steps", o->steps, "Euler/CFG sampler with N steps");
  sub->add_option("--timesteps", o->timesteps, "DMD sampler at these timesteps, e.g. 1000,757,522")->delimiter(',');
  sub->add_option("--guidance", o->guidance, "classifier-free guidance scale (Euler; default 1)");
  sub->add_option("--shift", o->shift, "flow shift of the schedule (default 3)");
  sub->add_option("--noise", o->noise, "safetensors with 'noise' [P, 16, T, H, W] (else drawn from --seed)");
  sub->add_option("--latent-shape", o->latent_shape, "T,H,W of the drawn noise")->delimiter(',');
  sub->add_option("--seed", o->seed, "initial noise seed (default 0)");
  sub->add_option("--renoise-seed", o->renoise_seed, "DMD re-noising seed (default 0)");
  sub->add_option("--attention", o->attention, "attention backend (default: the one the model was trained with)");
  sub->add_option("--device", *device, "cpu (default) | cuda | cuda:N | auto");
  sub->add_option("--gemm", o->gemm,
                  "forward GEMM of the NVFP4 linears: auto (default: fp4 where the GPU has FP4 tensor cores) | "
                  "fake_quant | fp4")
      ->check(CLI::IsMember({"auto", "fake_quant", "fp4"}));
  sub->add_flag("--no-preview", *no_preview, "do not write preview.png");
  sub->add_option("--vae", dec->vae,
                  "also decode: Wan VAE directory (config.json + weights) or a Diffusers root with vae/ "
                  "-> sample_<i>.mp4 + contact_sheet.png in --out");
  sub->add_option("--vae-dtype", dec->dtype, "decoder precision: float32 (default) or bfloat16");
  sub->add_option("--fps", dec->fps, "frames per second of the decoded MP4s (default 16)");
  set_action(sub, [=] {
    o->device = io::parse_device(*device);
    o->preview = !*no_preview;
    // Everything about the decode is checked before sampling starts.
    VQAD_CHECK(dec->dtype == "float32" || dec->dtype == "bfloat16",
               "--vae-dtype: expected float32 or bfloat16, found '", dec->dtype, "'");
    VQAD_CHECK(dec->fps > 0, "--fps: expected a positive value, found ", dec->fps);
    std::optional<media::WanVaeDecoder> vae;
    if (!dec->vae.empty()) {
      VQAD_CHECK(media::video_writer_available(), "--vae: this vqad build has no MP4 writer (it was built without "
                 "the ffmpeg libraries); sample without --vae and decode elsewhere with `vqad decode`");
      vae.emplace(media::WanVaeDecoder::load(dec->vae, o->device,
                                             dec->dtype == "float32" ? torch::kFloat32 : torch::kBFloat16));
    }
    const auto r = deploy::run_sample(*o);
    std::cout << "sampled " << r.latents.size(0) << " latents " << r.latents.sizes() << " with a "
              << deploy::model_kind_name(r.kind) << " model (attention " << r.attention << ") into " << o->out
              << "\n";
    if (vae) {
      media::RenderOptions ro;
      ro.fps = dec->fps;
      const auto d = media::render_latents(*vae, r.latents, /*normalized=*/true, o->out, ro);
      std::cout << "decoded " << d.videos.size() << " videos (" << d.frames << " frames " << d.width << "x"
                << d.height << ", " << ro.fps << " fps) in " << d.decode_seconds << " s; contact sheet "
                << d.contact_sheet << "\n";
    }
    return 0;
  });
}

}  // namespace vqad::cli
