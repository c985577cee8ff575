#include "vqad/export/sample_run.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "vqad/core/attention_backend.h"
#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/png.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/tensor_text.h"
#include "vqad/train/flow_matching.h"
#include "vqad/train/sampling.h"

namespace vqad::deploy {
namespace fs = std::filesystem;
namespace {

torch::Tensor tensor_of(const std::map<std::string, torch::Tensor>& file, const std::string& key,
                        const std::string& path) {
  auto it = file.find(key);
  VQAD_CHECK(it != file.end(), path, ": no tensor '", key, "'");
  VQAD_CHECK(it->second.is_floating_point(), path, ": tensor '", key, "' must be floating point, found ",
             c10::toString(it->second.scalar_type()));
  return it->second;
}

// Middle frame, latent channels 0..2 as RGB, each tile min-max scaled, nearest upscaling.
png::Image preview_grid(const torch::Tensor& latents) {
  const int64_t n = latents.size(0), t = latents.size(2), h = latents.size(3), w = latents.size(4);
  const int64_t c = std::min<int64_t>(3, latents.size(1));
  const int scale = static_cast<int>(std::max<int64_t>(1, 64 / std::max(h, w)));
  const int cols = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int rows = static_cast<int>((n + cols - 1) / cols);
  const int tw = static_cast<int>(w) * scale, th = static_cast<int>(h) * scale, gap = 2;
  png::Image img(cols * (tw + gap) + gap, rows * (th + gap) + gap, 255);
  for (int64_t i = 0; i < n; ++i) {
    const torch::Tensor f = latents[i].narrow(0, 0, c).select(1, t / 2).contiguous();  // [c, h, w]
    const float lo = f.min().item<float>(), hi = f.max().item<float>();
    const float span = hi > lo ? hi - lo : 1.0f;
    const float* p = f.data_ptr<float>();
    const int x0 = gap + static_cast<int>(i % cols) * (tw + gap), y0 = gap + static_cast<int>(i / cols) * (th + gap);
    for (int y = 0; y < th; ++y) {
      for (int x = 0; x < tw; ++x) {
        uint8_t* px = img.at(x0 + x, y0 + y);
        for (int ch = 0; ch < 3; ++ch) {
          const float v = ch < c ? p[(ch * h + y / scale) * w + x / scale] : lo;
          px[ch] = static_cast<uint8_t>(std::lround(std::clamp((v - lo) / span, 0.0f, 1.0f) * 255.0f));
        }
      }
    }
  }
  return img;
}

}  // namespace

SampleResult run_sample(const SampleOptions& o) {
  VQAD_CHECK((o.steps > 0) != !o.timesteps.empty(), "sample: give exactly one of --steps N (Euler/CFG) and "
             "--timesteps t1,t2,... (DMD sampler)");
  VQAD_CHECK(o.timesteps.empty() || o.guidance == 1.0, "sample: --guidance ", o.guidance,
             " applies to the Euler/CFG sampler only; the DMD sampler (--timesteps) takes no guidance");
  for (double t : o.timesteps)
    VQAD_CHECK(t > 0.0 && t <= 1000.0, "sample: --timesteps value ", t, " is outside (0, 1000]");
  VQAD_CHECK(o.shift > 0.0, "sample: --shift must be positive, got ", o.shift);
  VQAD_CHECK(!o.out.empty(), "sample: --out is required");

  // Text embeddings.
  const auto prompts = io::load_safetensors(o.prompts);
  const torch::Tensor text = tensor_of(prompts, "text", o.prompts);
  VQAD_CHECK(text.dim() == 3 && text.size(0) > 0, o.prompts, ": 'text' must be [P, Lt, Dt], found ",
             ops::shape_str(text.sizes()));
  const int64_t p = text.size(0);
  torch::Tensor uncond;
  const bool cfg = o.steps > 0 && o.guidance != 1.0;
  if (cfg) {
    VQAD_CHECK(prompts.count("negative"), o.prompts, ": no 'negative' tensor, the unconditional text that --guidance ",
               o.guidance, " needs (store zeros of 'text''s shape for an empty prompt)");
    uncond = tensor_of(prompts, "negative", o.prompts);
    VQAD_CHECK(uncond.dim() == 3 && (uncond.size(0) == 1 || uncond.size(0) == p) && uncond.size(1) == text.size(1) &&
                   uncond.size(2) == text.size(2),
               o.prompts, ": 'negative' ", ops::shape_str(uncond.sizes()), " does not match 'text' ",
               ops::shape_str(text.sizes()), " (expected [1 or ", p, ", ", text.size(1), ", ", text.size(2), "])");
    uncond = uncond.expand_as(text).contiguous();
  }

  // Model, in the attention backend it was trained with unless told otherwise.
  SampleResult r;
  std::string backend_name = o.attention;
  if (backend_name.empty()) {
    const nlohmann::json meta = model_metadata(o.model);
    backend_name = meta.is_object() ? meta.value("training_contract", nlohmann::json::object())
                                          .value("attention_backend", std::string("TORCH_SDPA"))
                                    : std::string("TORCH_SDPA");
  }
  const auto backend = parse_attention_backend(backend_name);
  VQAD_CHECK(backend.has_value(), "sample: unknown attention backend '", backend_name, "' (valid: ",
             attention_backend_choices(), ")");
  r.attention = attention_backend_name(*backend);
  InferenceModel im;
  {
    ops::AttentionBackendScope scope(*backend);
    model::WanModelOptions mo;
    mo.compute_dtype = torch::kBFloat16;
    im = load_inference_model(o.model, mo);
  }
  r.kind = im.kind;
  auto& m = *im.model;
  m.to(o.device);
  {
    const ops::Nvfp4GemmRoute requested = ops::parse_nvfp4_gemm_route(o.gemm, "sample --gemm");
    const ops::Nvfp4GemmRoute route = ops::resolve_nvfp4_gemm_route(requested, o.device, "sample --gemm");
    if (ops::set_nvfp4_gemm_route(im.quants, route) > 0) {
      r.gemm_route = ops::nvfp4_gemm_route_name(route);
      log::info("sample: ", model_kind_name(im.kind), " model, NVFP4 linear forward GEMM route ", r.gemm_route,
                " (--gemm ", o.gemm, ", device ", o.device.str(), ")");
    }
  }
  const auto& cfgm = m.config();
  VQAD_CHECK(text.size(2) == cfgm.text_dim, o.prompts, ": 'text' has width ", text.size(2), ", the model's text_dim is ",
             cfgm.text_dim);

  // Initial noise.
  torch::Tensor noise;
  if (!o.noise.empty()) {
    const auto nf = io::load_safetensors(o.noise);
    noise = tensor_of(nf, "noise", o.noise).to(torch::kFloat32);
    VQAD_CHECK(noise.dim() == 5 && noise.size(0) == p && noise.size(1) == cfgm.in_channels, o.noise, ": 'noise' must be [",
               p, ", ", cfgm.in_channels, ", T, H, W], found ", ops::shape_str(noise.sizes()));
  } else {
    VQAD_CHECK(o.latent_shape.size() == 3, "sample: --latent-shape T,H,W is required without --noise");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    noise = at::randn({p, cfgm.in_channels, o.latent_shape[0], o.latent_shape[1], o.latent_shape[2]}, gen,
                      torch::TensorOptions(torch::kFloat32));
  }
  r.noise = noise.contiguous();
  const torch::Tensor text_d = text.to(o.device, torch::kBFloat16);
  const torch::Tensor noise_d = r.noise.to(o.device);
  torch::Tensor lat;
  if (o.steps > 0) {
    lat = train::euler_sample(m, noise_d, text_d, cfg ? uncond.to(o.device, torch::kBFloat16) : torch::Tensor(),
                              o.guidance, o.steps, o.shift);
  } else {
    train::FlowMatchGrid grid(o.shift);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.renoise_seed);
    lat = train::dmd_sample(m, grid, noise_d, text_d, o.timesteps, gen);
  }
  r.latents = lat.to(torch::kCPU, torch::kFloat32).contiguous();

  // Outputs.
  fs::create_directories(o.out);
  io::save_safetensors((fs::path(o.out) / "latents.safetensors").string(),
                       {{"latents", r.latents}, {"noise", r.noise}}, {{"format", "pt"}});
  r.files.push_back("latents.safetensors");
  if (o.preview) {
    png::write((fs::path(o.out) / "preview.png").string(), preview_grid(r.latents));
    r.files.push_back("preview.png");
  }
  nlohmann::json info = {
      {"model", fs::absolute(o.model).string()},
      {"model_kind", model_kind_name(r.kind)},
      {"attention_backend", r.attention},
      {"quant_method", im.plan.empty() ? std::string("none") : model::quant_method_name(im.plan.method)},
      {"prompts", fs::absolute(o.prompts).string()},
      {"count", p},
      {"sampler", o.steps > 0 ? "euler_cfg" : "dmd"},
      {"steps", o.steps},
      {"timesteps", o.timesteps},
      {"guidance", o.guidance},
      {"shift", o.shift},
      {"noise", o.noise.empty() ? nlohmann::json({{"seed", o.seed}, {"latent_shape", o.latent_shape}})
                                : nlohmann::json(fs::absolute(o.noise).string())},
      {"renoise_seed", o.renoise_seed},
      {"device", o.device.str()},
      {"gemm_route", r.gemm_route.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.gemm_route)}};
  if (im.metadata.is_object() && im.metadata.contains("checkpoint"))
    info["checkpoint_id"] = im.metadata["checkpoint"].value("id", "");
  st::write_file_atomic((fs::path(o.out) / "sample.json").string(), {info.dump(2) + "\n"});
  r.files.push_back("sample.json");
  return r;
}

}  // namespace vqad::deploy
