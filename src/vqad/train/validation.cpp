#include "vqad/train/validation.h"

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/png.h"
#include "vqad/core/safetensors.h"
#include "vqad/data/text_embeddings.h"
#include "vqad/io/tensors.h"
#include "vqad/media/render.h"
#include "vqad/media/video_writer.h"
#include "vqad/train/sampling.h"

namespace fs = std::filesystem;

namespace vqad::train {

namespace {
constexpr const char* kKey = "callbacks.validation.dataset_file";
}  // namespace

png::Image latent_grid(const torch::Tensor& latents) {
  VQAD_CHECK(latents.dim() == 5 && latents.size(1) >= 3, "latent grid: expected [N, C>=3, T, H, W], found ",
             latents.sizes());
  const int64_t N = latents.size(0), T = latents.size(2), H = latents.size(3), W = latents.size(4);
  const int64_t k = std::max<int64_t>(1, 48 / std::max<int64_t>(1, std::min(H, W)));  // cells >= 48 px
  png::Image img(static_cast<int>(T * W * k), static_cast<int>(N * H * k));
  for (int64_t n = 0; n < N; ++n) {
    auto rgb = latents[n].narrow(0, 0, 3).to(torch::kFloat32).contiguous();  // [3, T, H, W]
    const float lo = rgb.min().item<float>(), hi = rgb.max().item<float>();
    const float scale = hi > lo ? 255.0f / (hi - lo) : 0.0f;
    auto a = rgb.accessor<float, 4>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t y = 0; y < H * k; ++y)
        for (int64_t x = 0; x < W * k; ++x) {
          uint8_t* px = img.at(static_cast<int>(t * W * k + x), static_cast<int>(n * H * k + y));
          for (int c = 0; c < 3; ++c)
            px[c] = static_cast<uint8_t>(std::lround((a[c][t][y / k][x / k] - lo) * scale));
        }
  }
  return img;
}

ValidationPrompts load_validation_prompts(const std::string& path, int64_t text_len, int64_t text_dim) {
  VQAD_CHECK(fs::exists(path), kKey, " '", path, "': no such file or directory");
  ValidationPrompts p;
  std::vector<torch::Tensor> texts;
  if (path.ends_with(".json")) {
    std::ifstream f(path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
      fail(kKey, " '", path, "': malformed JSON: ", e.what());
    }
    const nlohmann::json& list = j.is_object() && j.contains("data") ? j["data"] : j;
    VQAD_CHECK(list.is_array() && !list.empty(), kKey, " '", path,
               "': expected a non-empty list of prompts (or {\"data\": [...]})");
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& e = list[i];
      const std::string where = std::string(kKey) + " '" + path + "' entry " + std::to_string(i);
      VQAD_CHECK(e.is_object(), where, ": expected an object");
      VQAD_CHECK(e.contains("embedding"), where,
                 ": no 'embedding' (vqad has no text encoder: give each prompt a .safetensors file with its "
                 "[L, ", text_dim, "] text embedding, or point dataset_file to a preprocessed parquet dataset)");
      fs::path ep = e["embedding"].get<std::string>();
      if (ep.is_relative()) ep = fs::path(path).parent_path() / ep;
      texts.push_back(data::read_text_embedding_file(ep.string(), text_len, text_dim, where));
      p.captions.push_back(e.value("caption", std::string()));
    }
  } else {
    auto rows = data::read_text_embedding_rows(path, text_len, text_dim, std::string(kKey) + " '" + path + "'");
    return {rows.captions, rows.text};
  }
  p.text = torch::stack(texts);
  return p;
}

ValidationRunner::ValidationRunner(const RunConfig& run, std::shared_ptr<Role> student, torch::Device device,
                                   bool writes)
    : run_(run), student_(std::move(student)), device_(device), writes_(writes) {
  const auto& v = run_.callbacks.validation;
  const auto& mc = student_->model->config();
  VQAD_CHECK(v.every_steps > 0 || v.run_at_start, "callbacks.validation: every_steps is 0 and run_at_start false");
  sampler_ = method_registration(run_).validation_sampler(run_);
  prompts_ = load_validation_prompts(v.dataset_file, mc.text_len, mc.text_dim);
  // Latent geometry: the callback's height/width/num_frames, else training.data's.
  const auto& d = run_.training.data;
  const int64_t h = v.height > 0 ? v.height : d.num_height, w = v.width > 0 ? v.width : d.num_width;
  int64_t t = v.num_frames > 0 ? (v.num_frames - 1) / 4 + 1 : d.num_latent_t;
  if (t <= 0 && d.num_frames > 0) t = (d.num_frames - 1) / 4 + 1;
  VQAD_CHECK(h > 0 && w > 0 && t > 0 && h % 16 == 0 && w % 16 == 0,
             "callbacks.validation: the sample geometry is unknown or invalid (height ", h, ", width ", w,
             ", latent frames ", t, "): set callbacks.validation.height/width/num_frames or training.data."
             "num_height/num_width/num_latent_t (height and width multiples of 16)");
  shape_ = {prompts_.text.size(0), mc.in_channels, t, h / 8, w / 8};
  out_dir_ = v.output_dir.empty() ? (fs::path(run_.training.checkpoint.output_dir) / "validation").string()
                                  : v.output_dir;
  // The VAE: named, or found beside the student's weights (a Diffusers root with vae/).
  std::string vae_dir = v.vae;
  const std::string student_init = run_.models.count("student") ? run_.models.at("student").init_from : "";
  if (vae_dir.empty() && !student_init.empty() && fs::exists(fs::path(student_init) / "vae" / "config.json"))
    vae_dir = student_init;
  if (!writes_) return;  // samples only: no VAE, nothing to announce
  if (!vae_dir.empty() && vae_dir != "none") {
    try {
      vae_ = std::make_shared<media::WanVaeDecoder>(media::WanVaeDecoder::load(vae_dir, device_, torch::kFloat32));
    } catch (const Error& e) {
      fail("callbacks.validation.vae: ", e.what());
    }
    if (!media::video_writer_available())
      fail("callbacks.validation.vae: set to ", vae_dir, " but this vqad build has no MP4 writer (ffmpeg "
           "libraries); set callbacks.validation.vae none for latents only");
  }
  log::info("validation: ", shape_[0], " prompts from ", v.dataset_file, ", latents [", shape_[1], ", ", shape_[2],
            ", ", shape_[3], ", ", shape_[4], "], ",
            sampler_.name, ", every ", v.every_steps,
            " steps, to ", out_dir_);
}

int64_t ValidationRunner::v_fps() const { return run_.callbacks.validation.fps; }

std::map<std::string, double> ValidationRunner::run(long step) {
  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard ng;
  auto& m = *student_->model;
  const auto dtype = m.options().compute_dtype;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(run_.training.data.seed) * 1000003ULL +
                                                      static_cast<uint64_t>(step));
  auto noise = at::randn(shape_, gen, torch::TensorOptions(torch::kFloat32)).to(device_);
  auto text = prompts_.text.to(device_, dtype);
  std::string sampler;
  torch::Tensor latents = sampler_.sample(*student_, noise, text, gen, &sampler);
  latents = latents.cpu();
  if (!writes_) return {};
  const fs::path dir = fs::path(out_dir_) / ("step-" + std::to_string(step));
  fs::create_directories(dir);
  nlohmann::json caps = prompts_.captions;
  io::save_safetensors((dir / "samples.safetensors").string(), {{"latents", latents}},
                       {{"captions", caps.dump()}, {"sampler", sampler}, {"step", std::to_string(step)}});
  png::write((dir / "grid.png").string(), latent_grid(latents));
  nlohmann::json decoded = nullptr;
  if (vae_) {
    media::RenderOptions ro;
    ro.fps = static_cast<int>(v_fps());
    auto r = media::render_latents(*vae_, latents, /*normalized=*/true, dir.string(), ro);
    decoded = {{"videos", r.videos.size()}, {"frames", r.frames}, {"height", r.height}, {"width", r.width},
               {"fps", ro.fps}, {"decode_seconds", r.decode_seconds}, {"contact_sheet", "contact_sheet.png"}};
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json summary{{"step", step},
                         {"decoded", decoded},
                         {"sampler", sampler},
                         {"prompts", caps},
                         {"latent_shape", shape_},
                         {"latent_std", latents.std().item<double>()},
                         {"finite", torch::isfinite(latents).all().item<bool>()},
                         {"grid", "grid.png: rows = prompts, columns = latent frames; latent channels 0-2 "
                                  "min-max scaled per sample (a preview, not a VAE decode)"},
                         {"seconds", secs}};
  const std::string text_summary = summary.dump(2) + "\n";
  st::write_file_atomic((dir / "summary.json").string(), {text_summary});
  log::info("validation at step ", step, ": ", shape_[0], " samples (", sampler, ") in ", secs, " s -> ",
            dir.string());
  return {{"validation/seconds", secs}, {"validation/latent_std", summary["latent_std"].get<double>()}};
}

}  // namespace vqad::train
