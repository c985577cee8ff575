// Wan VAE decoder, MP4 writer, contact sheets and the run report. Numerical parity with
// Diffusers' AutoencoderKLWan is checked by scripts/vae_parity.sh (it installs diffusers);
// these tests check the decoder's structure (frame counts, causality of the frame cache,
// strict loading) and the files a person opens.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/png.h"
#include "vqad/io/tensors.h"
#include "vqad/media/render.h"
#include "vqad/media/report.h"
#include "vqad/media/video_writer.h"
#include "vqad/media/wan_vae.h"
#include "tiny_vae.h"

namespace fs = std::filesystem;
using vqad::media::WanVaeConfig;
using vqad::media::WanVaeDecoder;

namespace {

WanVaeConfig tiny_config() { return tiny_vae::config(); }
std::map<std::string, torch::Tensor> random_state(const WanVaeConfig& c, uint64_t seed) {
  return tiny_vae::random_state(c, seed);
}

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("vqad_media_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string run(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  while (p && fgets(buf, sizeof buf, p)) out += buf;
  int status = p ? pclose(p) : -1;
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

}  // namespace

TEST(WanVae, FrameCountAndRange) {
  const auto c = tiny_config();
  WanVaeDecoder vae(c, random_state(c, 1), torch::kCPU, torch::kFloat32, "test");
  torch::Tensor z = torch::randn({2, 16, 3, 4, 6});
  torch::Tensor v = vae.decode(z);
  EXPECT_EQ(v.sizes().vec(), (std::vector<int64_t>{2, 3, 1 + 4 * 2, 32, 48}));
  EXPECT_LE(v.max().item<float>(), 1.0f);
  EXPECT_GE(v.min().item<float>(), -1.0f);
  EXPECT_TRUE(torch::isfinite(v).all().item<bool>());
  EXPECT_GT(v.std().item<float>(), 0.0f);
}

// The frame cache makes decoding causal: decoding the first k latent frames gives exactly
// the first 1 + 4 (k - 1) frames of decoding all of them, and later latent frames change
// later video frames only.
TEST(WanVae, FrameCacheIsCausal) {
  const auto c = tiny_config();
  WanVaeDecoder vae(c, random_state(c, 2), torch::kCPU, torch::kFloat32, "test");
  torch::Tensor z = torch::randn({1, 16, 4, 3, 5});
  torch::Tensor full = vae.decode(z);
  for (int k = 1; k <= 3; ++k) {
    torch::Tensor part = vae.decode(z.narrow(2, 0, k));
    ASSERT_EQ(part.size(2), 1 + 4 * (k - 1));
    EXPECT_TRUE(torch::equal(part, full.narrow(2, 0, part.size(2)))) << "prefix of " << k << " latent frames";
  }
  torch::Tensor z2 = z.clone();
  z2.narrow(2, 3, 1).add_(1.0);
  torch::Tensor changed = vae.decode(z2);
  EXPECT_TRUE(torch::equal(changed.narrow(2, 0, 9), full.narrow(2, 0, 9)));
  EXPECT_FALSE(torch::equal(changed.narrow(2, 9, 4), full.narrow(2, 9, 4)));
}

// Normalised DiT latents are de-normalised with the config's means / stds (x * std + mean)
// before the decoder; raw latents are decoded as they are.
TEST(WanVae, DenormalisationUsesConfigStatistics) {
  const auto c = tiny_config();
  auto state = random_state(c, 3);
  WanVaeDecoder vae(c, state, torch::kCPU, torch::kFloat32, "test");
  torch::Tensor z = torch::randn({1, 16, 1, 2, 2});
  torch::Tensor a = vae.decode(z, /*normalized=*/true);
  auto cfg = c;
  torch::Tensor mean = torch::tensor(cfg.latents_mean).view({1, -1, 1, 1, 1});
  torch::Tensor stdv = torch::tensor(cfg.latents_std).view({1, -1, 1, 1, 1});
  torch::Tensor b = vae.decode(z * stdv + mean, /*normalized=*/false);
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5));
}

TEST(WanVae, StrictLoading) {
  const auto c = tiny_config();
  auto state = random_state(c, 4);
  auto missing = state;
  missing.erase("decoder.conv_out.bias");
  try {
    WanVaeDecoder vae(c, missing, torch::kCPU, torch::kFloat32, "vae-dir");
    FAIL() << "missing key accepted";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("decoder.conv_out.bias"), std::string::npos) << e.what();
  }
  auto shaped = state;
  shaped["decoder.conv_in.weight"] = torch::zeros({1, 16, 3, 3, 3});
  try {
    WanVaeDecoder vae(c, shaped, torch::kCPU, torch::kFloat32, "vae-dir");
    FAIL() << "wrong shape accepted";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("wrong shape"), std::string::npos) << e.what();
  }
  auto extra = state;
  extra["encoder.conv_in.weight"] = torch::zeros({4});  // the encoder half is skipped
  EXPECT_NO_THROW(WanVaeDecoder(c, extra, torch::kCPU, torch::kFloat32, "vae-dir"));
  extra["decoder.surprise"] = torch::zeros({4});
  EXPECT_THROW(WanVaeDecoder(c, extra, torch::kCPU, torch::kFloat32, "vae-dir"), vqad::Error);
}

TEST(WanVae, ConfigRefusesOtherArchitectures) {
  auto dir = temp_dir("cfg");
  std::ofstream(dir / "config.json") << R"({"base_dim": 96, "z_dim": 16, "is_residual": true})";
  try {
    WanVaeConfig::from_json_file((dir / "config.json").string());
    FAIL();
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is_residual"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "config.json") << R"({"base_dim": 96, "z_dim": 16, "latents_mean": [0.0]})";
  EXPECT_THROW(WanVaeConfig::from_json_file((dir / "config.json").string()), vqad::Error);
  fs::remove_all(dir);
}

TEST(WanVae, DecodeCommandWritesVideosAndSheet) {
  if (!vqad::media::video_writer_available()) GTEST_SKIP() << "this build has no H.264 writer (ffmpeg libraries)";
  auto dir = temp_dir("cli");
  tiny_vae::write(dir);  // a VAE directory as Diffusers writes it
  vqad::io::save_safetensors((dir / "lat.safetensors").string(), {{"latents", torch::randn({2, 16, 3, 4, 5})}});
  int rc = 0;
  const std::string out = run(std::string(VQAD_BINARY) + " decode " + (dir / "lat.safetensors").string() + " --vae " +
                                  dir.string() + " --out " + (dir / "out").string() + " --fps 12 --device cpu",
                              &rc);
  ASSERT_EQ(rc, 0) << out;
  ASSERT_TRUE(fs::exists(dir / "out" / "sample_0.mp4")) << out;
  ASSERT_TRUE(fs::exists(dir / "out" / "sample_1.mp4")) << out;
  auto sheet = vqad::png::read((dir / "out" / "contact_sheet.png").string());
  EXPECT_GT(sheet.width, 0);
  // ffprobe (from the ffmpeg package) reads the stream back: frames, size, fps.
  int prc = 0;
  const std::string probe = run("ffprobe -v error -count_frames -select_streams v:0 -show_entries "
                                "stream=nb_read_frames,width,height,r_frame_rate -of csv=p=0 " +
                                    (dir / "out" / "sample_0.mp4").string(),
                                &prc);
  if (prc == 127 || probe.find("not found") != std::string::npos) GTEST_SKIP() << "ffprobe not installed";
  ASSERT_EQ(prc, 0) << probe;
  // 3 latent frames -> 9 video frames of 40x32 at 12 fps.
  EXPECT_NE(probe.find("40,32,12/1,9"), std::string::npos) << probe;
  fs::remove_all(dir);
}

TEST(RunReport, EmbedsCurvesSheetsVideosLineageAndConfig) {
  auto dir = temp_dir("report");
  {
    std::ofstream m(dir / "metrics.jsonl");
    for (int s = 1; s <= 5; ++s)
      m << nlohmann::json{{"step", s}, {"loss", 1.0 / s}, {"grad_norm/student", 0.5 * s}, {"lr/student", 1e-5},
                          {"step_time_s", 0.5}, {"tokens_per_s", 1000.0}, {"mem_peak_gib", 1.5}}
               .dump()
        << "\n";
  }
  std::ofstream(dir / "resolved.yaml") << "training:\n  max_train_steps: 5\n";
  fs::create_directories(dir / "validation" / "step-5");
  vqad::png::write((dir / "validation" / "step-5" / "contact_sheet.png").string(), vqad::png::Image(8, 4, 200));
  std::ofstream(dir / "validation" / "step-5" / "sample_0.mp4") << "not really a video";
  fs::create_directories(dir / "checkpoint-5");
  nlohmann::json parent = {{"checkpoint", {{"id", "parent-id"}, {"step", 500}}},
                           {"provenance", {{"lineage", {{"kind", "base_model_initialization"}}}}}};
  nlohmann::json meta = {{"checkpoint", {{"id", "child-id"}, {"step", 5}}},
                         {"provenance", {{"lineage", {{"kind", "dense_qat_weight_initialization"},
                                                      {"parent_metadata", parent}}}}}};
  std::ofstream(dir / "checkpoint-5" / "metadata.json") << meta.dump();
  const std::string html_path = (dir / "report.html").string();
  const std::string summary = vqad::media::write_run_report(dir.string(), html_path);
  std::ifstream in(html_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string html = ss.str();
  EXPECT_NE(html.find("data:image/png;base64,"), std::string::npos);
  EXPECT_NE(html.find("data:video/mp4;base64,"), std::string::npos);
  EXPECT_NE(html.find("child-id"), std::string::npos);
  EXPECT_NE(html.find("parent-id"), std::string::npos);
  EXPECT_NE(html.find("max_train_steps"), std::string::npos);
  EXPECT_NE(summary.find("lineage of 2"), std::string::npos) << summary;
  EXPECT_NE(summary.find("1 videos"), std::string::npos) << summary;
  fs::remove_all(dir);
  EXPECT_THROW(vqad::media::write_run_report("/nonexistent-run-dir", html_path), vqad::Error);
}

TEST(Base64, Rfc4648Vectors) {
  EXPECT_EQ(vqad::media::base64(""), "");
  EXPECT_EQ(vqad::media::base64("f"), "Zg==");
  EXPECT_EQ(vqad::media::base64("fo"), "Zm8=");
  EXPECT_EQ(vqad::media::base64("foo"), "Zm9v");
  EXPECT_EQ(vqad::media::base64("foobar"), "Zm9vYmFy");
}
