// `vqad sample` (export/sample_run.h): the samplers of train/sampling.h on dense,
// fake-quant and packed exports; the packed export samples the same latents as the
// fake-quant student; on the demo's stage-2 export it reproduces the demo report's path.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "tests/support/errors.h"
#include "vqad/core/error.h"
#include "vqad/core/png.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/export/packed.h"
#include "vqad/export/sample_run.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/attention.h"
#include "vqad/train/flow_matching.h"
#include "vqad/train/roles.h"
#include "vqad/train/sampling.h"
#include "test_export_util.h"
#include "tiny_vae.h"
#include "vqad/media/video_writer.h"

namespace {

namespace fs = std::filesystem;
using namespace vqad::test_export;
using vqad::model::QuantMethod;

void write_prompts(const fs::path& path, int64_t p, uint64_t seed, bool negative) {
  torch::manual_seed(seed);
  const auto cfg = vqad::model::WanConfig::tiny();
  std::vector<std::pair<std::string, torch::Tensor>> t = {{"text", torch::randn({p, 6, cfg.text_dim})}};
  if (negative) t.emplace_back("negative", torch::zeros({1, 6, cfg.text_dim}));
  vqad::io::save_safetensors(path.string(), t);
}

using vqad::test::error_of;

TEST(ExportSample, PackedFakeQuantAndDirectSamplerAgree) {
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  const fs::path dir = fresh_dir("sample");
  const TinyCheckpoint ck = write_tiny_checkpoint(dir / "checkpoint-1", QuantMethod::kNvfp4QatTrain, 31);
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "dense").string(), {});
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "packed").string(), {.format = "nvfp4"});
  write_prompts(dir / "prompts.safetensors", 3, 5, true);

  vqad::deploy::SampleOptions o;
  o.prompts = (dir / "prompts.safetensors").string();
  o.timesteps = {1000, 757, 522};
  o.latent_shape = {2, 4, 4};
  o.seed = 3;
  o.renoise_seed = 77;
  o.model = (dir / "dense").string();
  o.out = (dir / "s_dense").string();
  const auto a = vqad::deploy::run_sample(o);
  EXPECT_EQ(a.kind, vqad::deploy::ModelKind::kFakeQuant);
  EXPECT_EQ(a.attention, "TORCH_SDPA");
  o.model = (dir / "packed").string();
  o.out = (dir / "s_packed").string();
  const auto b = vqad::deploy::run_sample(o);
  EXPECT_EQ(b.kind, vqad::deploy::ModelKind::kPackedNvfp4);
  EXPECT_EQ(a.latents.sizes(), (std::vector<int64_t>{3, 16, 2, 4, 4}));
  EXPECT_TRUE(torch::equal(a.latents, b.latents));
  // The same sampler called directly on the fake-quant student.
  {
    auto student = ck.student();
    auto prompts = vqad::io::load_safetensors(o.prompts);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
    vqad::train::FlowMatchGrid grid(3.0);
    const auto direct = vqad::train::dmd_sample(*student, grid, a.noise, prompts.at("text").to(torch::kBFloat16),
                                                o.timesteps, gen);
    EXPECT_TRUE(torch::equal(direct, a.latents));
  }
  // Files: latents round trip, preview grid, settings.
  auto back = vqad::io::load_safetensors((dir / "s_packed/latents.safetensors").string());
  EXPECT_TRUE(torch::equal(back.at("latents"), b.latents));
  const auto img = vqad::png::read((dir / "s_packed/preview.png").string());
  EXPECT_GT(img.width, 64);
  std::ifstream jf(dir / "s_packed/sample.json");
  const auto info = nlohmann::json::parse(jf);
  EXPECT_EQ(info.at("model_kind"), "packed-nvfp4");
  EXPECT_EQ(info.at("sampler"), "dmd");
  EXPECT_EQ(info.at("checkpoint_id"), ck.id);

  // Euler with CFG from the packed and the fake-quant export, and errors.
  o.timesteps.clear();
  o.steps = 3;
  o.guidance = 2.5;
  const auto c = vqad::deploy::run_sample(o);
  o.model = (dir / "dense").string();
  const auto d = vqad::deploy::run_sample(o);
  EXPECT_TRUE(torch::equal(c.latents, d.latents));
  EXPECT_FALSE(torch::equal(c.latents, a.latents));
  write_prompts(dir / "nonneg.safetensors", 3, 5, false);
  auto bad = o;
  bad.prompts = (dir / "nonneg.safetensors").string();
  EXPECT_NE(error_of([&] { vqad::deploy::run_sample(bad); }).find("no 'negative' tensor"), std::string::npos);
  bad = o;
  bad.timesteps = {1000};
  EXPECT_NE(error_of([&] { vqad::deploy::run_sample(bad); }).find("exactly one of --steps"), std::string::npos);
  fs::remove_all(dir);
}

// The demo's stage-2 report samples the DMD student (train/demo.cpp): held-out prompts x 4
// noises from seed 2024, ATTN_QAT_TRAIN + nvfp4_qat_train linears, dmd_sample on the
// shift-3 grid at the recipe's timesteps with re-noising seed 77. `vqad sample` on the
// stage-2 export - dense, and packed - gives the same latents bit for bit.
TEST(ExportSample, DemoStage2ExportSamplesTheReportLatents) {
  // Runs `vqad demo` (a few training steps of each stage and the report's evaluation):
  // minutes on a loaded CPU, so opt-in.
  if (!std::getenv("VQAD_RUN_DEMO_TESTS")) GTEST_SKIP() << "runs vqad demo; set VQAD_RUN_DEMO_TESTS=1 to run it";
  const fs::path dir = fresh_dir("demo");
  const fs::path out = dir / "demo";
  auto run = [&](const std::string& args, const fs::path& log) {
    const int rc = std::system((std::string(VQAD_BINARY) + " " + args + " > " + log.string() + " 2>&1").c_str());
    std::ifstream f(log);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return std::make_pair(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text);
  };
  auto [rc, demo_log] = run("demo --out " + out.string() +
                                " --teacher-steps 4 --stage1-steps 2 --stage2-steps 2 --train-rows 8",
                            dir / "demo.log");
  ASSERT_EQ(rc, 0) << demo_log;
  const fs::path stage2 = out / "stage2_export";

  // The report's inputs and sampler, as train/demo.cpp forms them.
  const auto tiny = vqad::model::WanConfig::tiny();
  vqad::data::DatasetOptions dopt;
  dopt.text_len = tiny.text_len;
  dopt.text_dim = tiny.text_dim;
  auto held = vqad::data::ParquetDataset::open((out / "data" / "heldout").string(), dopt);
  std::vector<torch::Tensor> texts, noises;
  auto sgen = at::make_generator<at::CPUGeneratorImpl>(2024);
  for (int64_t i = 0; i < held->size(); ++i) {
    auto b = held->get_batch({i});
    for (int k = 0; k < 4; ++k) {
      texts.push_back(b.text);
      noises.push_back(at::randn(b.latent.sizes(), sgen, torch::TensorOptions(torch::kFloat32)));
    }
  }
  const torch::Tensor text = torch::cat(texts, 0).to(torch::kBFloat16);
  const torch::Tensor noise = torch::cat(noises, 0);
  const std::vector<double> steps = {1000, 757, 522};
  torch::Tensor report;
  {
    std::shared_ptr<vqad::model::WanModel> m;
    {
      vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kAttnQatTrain);
      m = vqad::model::wan_from_pretrained(stage2.string(), {.compute_dtype = torch::kBFloat16});
    }
    vqad::model::QuantConfig qc;
    qc.method = QuantMethod::kNvfp4QatTrain;
    vqad::train::attach_quant_plan(*m, qc);
    m->eval();
    vqad::train::FlowMatchGrid grid(3.0);
    auto g2 = at::make_generator<at::CPUGeneratorImpl>(77);
    report = vqad::train::dmd_sample(*m, grid, noise, text, steps, g2);
  }
  vqad::io::save_safetensors((dir / "prompts.safetensors").string(), {{"text", text}});
  vqad::io::save_safetensors((dir / "noise.safetensors").string(), {{"noise", noise}});
  auto [rc2, text2] = run("export " + stage2.string() + " " + (dir / "packed").string() + " --format nvfp4",
                          dir / "export.log");
  ASSERT_EQ(rc2, 0) << text2;
  for (const char* model : {"stage2", "packed"}) {
    const fs::path mdir = std::string(model) == "stage2" ? stage2 : dir / "packed";
    const fs::path sdir = dir / (std::string("s_") + model);
    auto [rc3, text3] = run("sample " + mdir.string() + " --prompts " + (dir / "prompts.safetensors").string() +
                                " --noise " + (dir / "noise.safetensors").string() +
                                " --timesteps 1000,757,522 --renoise-seed 77 --out " + sdir.string(),
                            dir / (std::string("sample_") + model + ".log"));
    ASSERT_EQ(rc3, 0) << text3;
    EXPECT_NE(text3.find("attention ATTN_QAT_TRAIN"), std::string::npos) << text3;
    auto lat = vqad::io::load_safetensors((sdir / "latents.safetensors").string());
    EXPECT_TRUE(torch::equal(lat.at("latents"), report)) << model;
  }
  fs::remove_all(dir);
}

// `vqad sample --vae` decodes what it sampled: sample_<i>.mp4 per prompt and a contact sheet
// next to the latents; a VAE that does not load fails before any sampling, naming it.
TEST(ExportSample, SampleCommandDecodesWithAVae) {
  if (!vqad::media::video_writer_available()) GTEST_SKIP() << "this build has no H.264 writer (ffmpeg libraries)";
  const fs::path dir = fresh_dir("sample_vae");
  write_tiny_checkpoint(dir / "checkpoint-1", QuantMethod::kNvfp4QatTrain, 31);
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "dense").string(), {});
  write_prompts(dir / "prompts.safetensors", 2, 5, false);
  tiny_vae::write(dir / "vae_root");
  auto run = [&](const std::string& args, const fs::path& log) {
    const int rc = std::system((std::string(VQAD_BINARY) + " " + args + " > " + log.string() + " 2>&1").c_str());
    std::ifstream f(log);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return std::make_pair(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, text);
  };
  const std::string base = "sample " + (dir / "dense").string() + " --prompts " + (dir / "prompts.safetensors").string() +
                           " --timesteps 1000,757,522 --latent-shape 2,4,4 --attention TORCH_SDPA";
  auto [rc, text] = run(base + " --vae " + (dir / "vae_root").string() + " --fps 10 --out " + (dir / "s").string(),
                        dir / "s.log");
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("decoded 2 videos (5 frames 32x32, 10 fps)"), std::string::npos) << text;
  EXPECT_GT(fs::file_size(dir / "s" / "sample_0.mp4"), 0u);
  EXPECT_GT(fs::file_size(dir / "s" / "sample_1.mp4"), 0u);
  EXPECT_GT(vqad::png::read((dir / "s" / "contact_sheet.png").string()).width, 0);
  EXPECT_TRUE(fs::exists(dir / "s" / "latents.safetensors"));
  auto [rc2, text2] = run(base + " --vae " + (dir / "missing").string() + " --out " + (dir / "s2").string(),
                          dir / "s2.log");
  EXPECT_EQ(rc2, 1) << text2;
  EXPECT_NE(text2.find((dir / "missing").string()), std::string::npos) << text2;
  EXPECT_FALSE(fs::exists(dir / "s2" / "latents.safetensors")) << "sampled before the VAE was checked";
  auto [rc3, text3] = run(base + " --vae " + (dir / "vae_root").string() + " --vae-dtype fp8 --out " +
                              (dir / "s3").string(), dir / "s3.log");
  EXPECT_EQ(rc3, 1) << text3;
  EXPECT_NE(text3.find("--vae-dtype"), std::string::npos) << text3;
  fs::remove_all(dir);
}

}  // namespace
