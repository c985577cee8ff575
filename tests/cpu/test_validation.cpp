// The validation callback: samples written at run start and every N steps (Euler for
// sft, the DMD sampler for dmd2), prompts from a JSON list with embedding files or from
// a parquet dataset, training unaffected (same losses with and without it), errors.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "vqad/core/error.h"
#include "vqad/core/metrics.h"
#include "vqad/core/plot.h"
#include "vqad/core/png.h"
#include "vqad/data/synthetic.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/config.h"
#include "vqad/model/wan/model.h"
#include "vqad/train/config.h"
#include "vqad/train/sampling.h"
#include "vqad/train/trainer.h"
#include "vqad/train/validation.h"
#include "test_train_util.h"
#include "tiny_vae.h"
#include "vqad/media/report.h"
#include "vqad/media/video_writer.h"

namespace fs = std::filesystem;
using namespace vqad;

namespace {

struct ValidationFixture : ::testing::Test {
  fs::path root;
  int64_t dim = model::WanConfig::tiny().text_dim;
  void SetUp() override {
    root = test_train::fresh_test_dir("vqad_validation");
    test_train::write_tiny_dataset(root / "data", 8, 9);
    test_train::write_tiny_dataset(root / "prompts_parquet", 3, 10, data::DataKind::TextOnly);
    fs::create_directories(root / "prompts");
    nlohmann::json list = nlohmann::json::array();
    for (int i = 0; i < 2; ++i) {
      const std::string f = "p" + std::to_string(i) + ".safetensors";
      io::save_safetensors((root / "prompts" / f).string(), {{"emb", torch::randn({3 + i, dim}) * 0.2}});
      list.push_back({{"caption", "prompt " + std::to_string(i)}, {"embedding", f}});
    }
    std::ofstream(root / "prompts" / "validation.json") << nlohmann::json{{"data", list}}.dump(2);
  }
  void TearDown() override { fs::remove_all(root); }

  std::string sft_yaml(const std::string& out, const std::string& validation) const {
    return "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
           "    attention_backend: TORCH_SDPA\n"
           "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
           "training:\n  data:\n    data_path: " + (root / "data").string() + "\n"
           "    train_batch_size: 2\n    seed: 4\n    num_latent_t: 2\n    num_height: 32\n    num_width: 32\n"
           "  optimizer:\n    learning_rate: 1.0e-3\n"
           "  loop:\n    max_train_steps: 4\n"
           "  checkpoint:\n    output_dir: " + out + "\n" + validation;
  }
  static train::TrainerOptions quiet() { return test_train::quiet(); }
};

std::vector<double> losses(const fs::path& out) {
  std::vector<double> v;
  for (const auto& r : read_metrics((out / "metrics.jsonl").string()))
    if (r.contains("loss")) v.push_back(r.at("loss").get<double>());
  return v;
}

}  // namespace

TEST_F(ValidationFixture, SftWritesSamplesAtStartAndEveryNStepsWithoutChangingTraining) {
  const auto with = root / "with", without = root / "without";
  const std::string cb = "callbacks:\n  validation:\n    _target_: fastvideo.train.callbacks.validation.ValidationCallback\n"
                         "    dataset_file: " + (root / "prompts" / "validation.json").string() + "\n"
                         "    every_steps: 2\n    sampling_steps: [4]\n    guidance_scale: 3.0\n";
  train::Trainer(train::parse_run_config(sft_yaml(with.string(), cb)), quiet()).run();
  train::Trainer(train::parse_run_config(sft_yaml(without.string(), "")), quiet()).run();
  EXPECT_EQ(losses(with), losses(without));
  for (int step : {0, 2, 4}) {
    const auto dir = with / "validation" / ("step-" + std::to_string(step));
    ASSERT_TRUE(fs::is_regular_file(dir / "samples.safetensors")) << dir;
    std::map<std::string, std::string> meta;
    auto t = io::load_safetensors((dir / "samples.safetensors").string(), &meta);
    const auto& lat = t.at("latents");
    EXPECT_EQ(lat.sizes().vec(), (std::vector<int64_t>{2, 16, 2, 4, 4}));
    EXPECT_TRUE(torch::isfinite(lat).all().item<bool>());
    EXPECT_GT(lat.std().item<double>(), 0.0);
    EXPECT_NE(meta.at("captions").find("prompt 1"), std::string::npos);
    EXPECT_NE(meta.at("sampler").find("euler, 4 steps"), std::string::npos) << meta.at("sampler");
  }
  EXPECT_FALSE(fs::exists(with / "validation" / "step-1"));
  // The preview grid: 2 prompts x 2 frames of 4 x 4 latent pixels, each repeated 12 times.
  auto grid = png::read((with / "validation" / "step-4" / "grid.png").string());
  EXPECT_EQ(grid.width, 2 * 4 * 12);
  EXPECT_EQ(grid.height, 2 * 4 * 12);
  // The samples change as the model trains.
  auto a = io::load_safetensors((with / "validation" / "step-0" / "samples.safetensors").string()).at("latents");
  auto b = io::load_safetensors((with / "validation" / "step-4" / "samples.safetensors").string()).at("latents");
  EXPECT_FALSE(torch::equal(a, b));
  int records = 0;
  for (const auto& r : read_metrics((with / "metrics.jsonl").string())) records += r.contains("validation/seconds");
  EXPECT_EQ(records, 3);
}

// With a Wan VAE (callbacks.validation.vae) every sample is also decoded to an MP4 and
// the step gets a contact sheet; the latents are the ones written without it and training
// is unchanged. A bad VAE directory fails at load naming the key; `vae: none` decodes nothing.
TEST_F(ValidationFixture, VaeDecodesEverySampleToAnMp4AndAContactSheet) {
  if (!media::video_writer_available()) GTEST_SKIP() << "this build has no H.264 writer (ffmpeg libraries)";
  tiny_vae::write(root / "vae_root");
  const std::string cb = "callbacks:\n  validation:\n    _target_: fastvideo.train.callbacks.validation.ValidationCallback\n"
                         "    dataset_file: " + (root / "prompts" / "validation.json").string() + "\n"
                         "    every_steps: 4\n    sampling_steps: [2]\n    fps: 8\n";
  const auto with = root / "vae_on", without = root / "vae_off";
  train::Trainer(train::parse_run_config(sft_yaml(with.string(), cb),
                                         {"--callbacks.validation.vae", (root / "vae_root").string()}),
                 quiet()).run();
  train::Trainer(train::parse_run_config(sft_yaml(without.string(), cb), {"--callbacks.validation.vae", "none"}),
                 quiet()).run();
  EXPECT_EQ(losses(with), losses(without));
  const auto dir = with / "validation" / "step-4";
  for (int i = 0; i < 2; ++i)
    EXPECT_GT(fs::file_size(dir / ("sample_" + std::to_string(i) + ".mp4")), 0u) << dir;
  const auto sheet = png::read((dir / "contact_sheet.png").string());
  EXPECT_GT(sheet.width, 0);
  EXPECT_GT(sheet.height, 0);
  std::ifstream sf(dir / "summary.json");
  const auto summary = nlohmann::json::parse(sf);
  ASSERT_TRUE(summary.at("decoded").is_object()) << summary.dump();
  EXPECT_EQ(summary["decoded"]["videos"], 2);
  // 2 latent frames -> 5 video frames of 32 x 32 (latent 4 x 4, VAE stride 8).
  EXPECT_EQ(summary["decoded"]["frames"], 5);
  EXPECT_EQ(summary["decoded"]["width"], 32);
  EXPECT_EQ(summary["decoded"]["fps"], 8);
  const auto off = without / "validation" / "step-4";
  EXPECT_FALSE(fs::exists(off / "sample_0.mp4"));
  EXPECT_TRUE(nlohmann::json::parse(std::ifstream(off / "summary.json")).at("decoded").is_null());
  EXPECT_TRUE(torch::equal(io::load_safetensors((dir / "samples.safetensors").string()).at("latents"),
                           io::load_safetensors((off / "samples.safetensors").string()).at("latents")));
  try {
    train::Trainer(train::parse_run_config(sft_yaml((root / "bad").string(), cb),
                                           {"--callbacks.validation.vae", (root / "no_vae_here").string()}),
                   quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("callbacks.validation.vae"), std::string::npos) << e.what();
  }
}

// The run report of a real (tiny) run with decoded validation videos opens in headless
// Chromium: the page renders to a screenshot with the loss curves and the contact sheet
// (scripts/report_screenshot.sh is the same check by hand; it needs the chromium package).
TEST_F(ValidationFixture, RunReportOfARunWithVideosRendersInHeadlessChromium) {
  if (!media::video_writer_available()) GTEST_SKIP() << "this build has no H.264 writer (ffmpeg libraries)";
  if (std::system("command -v chromium > /dev/null 2>&1") != 0) GTEST_SKIP() << "chromium is not installed";
  tiny_vae::write(root / "vae_root");
  const std::string cb = "callbacks:\n  validation:\n    _target_: fastvideo.train.callbacks.validation.ValidationCallback\n"
                         "    dataset_file: " + (root / "prompts" / "validation.json").string() + "\n"
                         "    every_steps: 2\n    sampling_steps: [2]\n    vae: " + (root / "vae_root").string() + "\n";
  const auto run_dir = root / "report_run";
  train::Trainer(train::parse_run_config(sft_yaml(run_dir.string(), cb)), quiet()).run();
  const std::string html = (run_dir / "report.html").string();
  const std::string summary = media::write_run_report(run_dir.string(), html);
  EXPECT_NE(summary.find("videos"), std::string::npos) << summary;
  const fs::path shot = root / "report.png";
  const std::string cmd = "timeout 120 chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars "
                          "--window-size=1200,2400 --screenshot=" + shot.string() + " file://" + html +
                          " > " + (root / "chromium.log").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "chromium failed; see " << (root / "chromium.log");
  ASSERT_TRUE(fs::exists(shot));
  // A blank 1200 x 1600 page compresses to a few KB; curves, text and a contact sheet do not.
  EXPECT_GT(fs::file_size(shot), 40000u);
  // VQAD_REPORT_SCREENSHOT=FILE keeps the screenshot for a person to look at.
  if (const char* keep = std::getenv("VQAD_REPORT_SCREENSHOT"); keep && *keep)
    fs::copy_file(shot, keep, fs::copy_options::overwrite_existing);
}

// FastVideo's `every_steps: 0` and vqad's `--callbacks.validation none` both turn the
// callback off before anything is opened (the dataset file here does not exist).
TEST_F(ValidationFixture, EveryStepsZeroOrNoneTurnsValidationOffWithoutOpeningFiles) {
  const std::string cb = "callbacks:\n  validation:\n    _target_: fastvideo.train.callbacks.validation.ValidationCallback\n"
                         "    dataset_file: " + (root / "no_such_prompts.json").string() + "\n"
                         "    every_steps: 50\n    sampling_steps: [4]\n";
  const auto zero = root / "zero", none = root / "none", plain = root / "plain";
  train::Trainer(train::parse_run_config(sft_yaml(zero.string(), cb), {"--callbacks.validation.every_steps", "0"}),
                 quiet()).run();
  train::Trainer(train::parse_run_config(sft_yaml(none.string(), cb), {"--callbacks.validation", "none"}), quiet())
      .run();
  train::Trainer(train::parse_run_config(sft_yaml(plain.string(), "")), quiet()).run();
  EXPECT_EQ(losses(zero), losses(plain));
  EXPECT_EQ(losses(none), losses(plain));
  EXPECT_FALSE(fs::exists(zero / "validation"));
  EXPECT_FALSE(fs::exists(none / "validation"));
  // With the callback on, the missing file is an error naming the key.
  try {
    train::Trainer(train::parse_run_config(sft_yaml((root / "on").string(), cb)), quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("callbacks.validation.dataset_file"), std::string::npos) << e.what();
  }
}

TEST_F(ValidationFixture, EulerSamplerMatchesAHandWrittenLoop) {
  // Euler on the shifted sigmas with CFG, written out here independently.
  torch::manual_seed(1);
  model::WanModel m(model::WanConfig::tiny());
  auto noise = torch::randn({1, 16, 2, 4, 4});
  auto text = (torch::randn({1, 512, dim}) * 0.2).to(torch::kBFloat16);
  auto uncond = torch::zeros_like(text);
  auto got = train::euler_sample(m, noise, text, uncond, 2.5, 3, 3.0);
  torch::NoGradGuard ng;
  auto x = noise.clone();
  // The shifted schedule in fp32, every operation rounded in the order of spec/sparse_qad.md
  // "Schedules": u from a symmetric fp32 linspace, sigma = S u / (1 + (S - 1) u).
  auto sigma = [](int i) {
    const float step = -1.0f / 3.0f;
    volatile float prod = i < 2 ? step * static_cast<float>(i) : step * static_cast<float>(3 - i);
    const float u = i < 2 ? 1.0f + prod : 0.0f - prod;
    volatile float num = 3.0f * u, den_prod = 2.0f * u;
    volatile float den = 1.0f + den_prod;
    return num / den;
  };
  for (int i = 0; i < 3; ++i) {
    const float si = sigma(i), sn = sigma(i + 1);
    auto t = torch::full({1}, 1000.0f * si);
    auto vc = m.forward(x.to(torch::kBFloat16), t, text).to(torch::kFloat32);
    auto vu = m.forward(x.to(torch::kBFloat16), t, uncond).to(torch::kFloat32);
    x = x + (sn - si) * (vu + 2.5 * (vc - vu));
  }
  EXPECT_TRUE(torch::allclose(got, x, 1e-5, 1e-5));
}

TEST_F(ValidationFixture, ParquetPromptsAndErrors) {
  auto p = train::load_validation_prompts((root / "prompts_parquet").string(), 512, dim);
  EXPECT_EQ(p.text.sizes().vec(), (std::vector<int64_t>{3, 512, dim}));
  EXPECT_EQ(p.captions.size(), 3u);
  EXPECT_FALSE(p.captions[0].empty());
  // FastVideo's caption-only validation.json: vqad cannot encode text -> a clear error.
  std::ofstream(root / "captions_only.json") << R"({"data": [{"caption": "a cat"}]})";
  try {
    train::load_validation_prompts((root / "captions_only.json").string(), 512, dim);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("callbacks.validation.dataset_file"), std::string::npos) << msg;
    EXPECT_NE(msg.find("embedding"), std::string::npos) << msg;
  }
  try {
    train::load_validation_prompts((root / "missing.json").string(), 512, dim);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.json"), std::string::npos) << e.what();
  }
}

TEST(Png, WriteReadRoundTripAndGridPixels) {
  png::Image img(300, 260);  // > 65535 bytes of scanlines: several stored blocks
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) {
      uint8_t* p = img.at(x, y);
      p[0] = uint8_t(x), p[1] = uint8_t(y), p[2] = uint8_t(x ^ y);
    }
  const auto path = (fs::temp_directory_path() / ("vqad_png_" + std::to_string(::getpid()) + ".png")).string();
  png::write(path, img);
  auto back = png::read(path);
  EXPECT_EQ(back.width, 300);
  EXPECT_EQ(back.height, 260);
  EXPECT_EQ(back.rgb, img.rgb);
  // The standard CRC-32 check value.
  const std::string check = "123456789";
  EXPECT_EQ(png::crc32(reinterpret_cast<const uint8_t*>(check.data()), check.size()), 0xCBF43926u);
  // A flipped byte fails the CRC.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x55');
  }
  EXPECT_THROW(png::read(path), Error);
  fs::remove(path);
  // Grid: min-max per sample over channels 0-2; sample 0's smallest value maps to 0, largest to 255.
  auto lat = torch::zeros({1, 16, 1, 2, 2});
  lat[0][0][0][0][0] = -1.0;
  lat[0][1][0][1][1] = 3.0;
  auto g = train::latent_grid(lat);
  EXPECT_EQ(g.width, 48);
  EXPECT_EQ(g.height, 48);
  EXPECT_EQ(g.at(0, 0)[0], 0);       // -1 -> 0
  EXPECT_EQ(g.at(47, 47)[1], 255);   // 3 -> 255
  EXPECT_EQ(g.at(47, 0)[2], 64);     // 0 -> 255 / 4 = 63.75 -> 64
}

// `vqad plot`: the run's loss metrics as a PNG with one panel per metric.
TEST_F(ValidationFixture, PlotCommandRendersTheLossPanels) {
  const auto out = root / "run";
  train::Trainer(train::parse_run_config(sft_yaml(out.string(), "")), quiet()).run();
  const std::string cmd = std::string(VQAD_BINARY) + " plot " + out.string() + " > " + (root / "plot.log").string() +
                          " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  auto img = png::read((out / "loss.png").string());
  EXPECT_EQ(img.width, 900);
  EXPECT_EQ(img.height, 220);  // one metric with "loss" in its name in an sft run
  // Not blank: some pixels carry the series colour.
  int coloured = 0;
  for (size_t i = 0; i + 2 < img.rgb.size(); i += 3) coloured += img.rgb[i] != img.rgb[i + 2];
  EXPECT_GT(coloured, 50);
  EXPECT_NE(std::system((std::string(VQAD_BINARY) + " plot " + out.string() + " --keys nope > /dev/null 2>&1").c_str()),
            0);
  EXPECT_EQ(vqad::plot::tick_text(0.000123), "0.000123");
  EXPECT_EQ(vqad::plot::tick_text(1.5e-7), "1.5e-7");
  EXPECT_EQ(vqad::plot::tick_text(2500), "2.5e3");
}
