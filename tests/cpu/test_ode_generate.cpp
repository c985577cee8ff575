// ODE-cache generation with the tiny Wan teacher on CPU: the cache equals a loop over the
// teacher written out here; resume after SIGKILL at random points and a rank split give
// a byte-identical cache; recipe errors; `vqad bench ode-cache` runs tiny.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "tests/support/errors.h"
#include "test_ode_util.h"
#include "vqad/cli/cmd_ode_cache.h"
#include "vqad/core/error.h"
#include "vqad/data/ode_cache.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/text_embeddings.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/sample/ode_generate.h"
#include "vqad/sample/schedule.h"

namespace fs = std::filesystem;
using namespace vqad;
using namespace vqad::test_ode;

namespace {

using vqad::test::error_of;

sample::OdeGenerateSummary generate(const std::string& recipe, int64_t rank = 0, int64_t world = 1,
                                    const std::vector<std::string>& overrides = {}) {
  sample::OdeGenerateOptions o;
  o.rank = rank;
  o.world = world;
  o.progress = false;
  return sample::generate_ode_cache(cli::load_ode_recipe(recipe, overrides), o);
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

TEST(OdeGenerate, CacheEqualsAnIndependentTeacherLoop) {
  auto f = make_ode_fixture("gen", 3, 4, 12);
  auto s = generate(f.recipe);
  EXPECT_TRUE(s.complete);
  EXPECT_EQ(s.generated, 4);
  auto cache = data::OdeCache::open((f.dir / "cache").string());
  ASSERT_EQ(cache.num_trajectories(), 4);
  EXPECT_EQ(cache.meta().schedule.student_indices, (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(cache.meta().geometry.latent_shape, (std::vector<int64_t>{16, 2, 4, 4}));
  const auto& j = cache.metadata_json();
  EXPECT_EQ(j["teacher"]["model_kind"], "wan-t2v-tiny");
  EXPECT_EQ(j["teacher"]["backend"], "TORCH_SDPA");
  EXPECT_EQ(j["teacher"]["negative_prompt"], "blurry, static");
  EXPECT_EQ(j["teacher"]["guidance_scale"], 6.0);
  EXPECT_EQ(j["runtime"]["device_type"], "cpu");
  EXPECT_FALSE(j["runtime"]["vqad_commit"].get<std::string>().empty());
  EXPECT_EQ(j["pairs"], 12);

  // The teacher, built as a random:tiny role is: manual_seed(seed), then the model.
  torch::manual_seed(1000);
  std::shared_ptr<model::WanModel> m;
  {
    ops::AttentionBackendScope scope(AttentionBackend::kTorchSdpa);
    model::WanModelOptions mo;
    mo.compute_dtype = torch::kBFloat16;
    m = std::make_shared<model::WanModel>(model::WanConfig::tiny(), mo);
  }
  m->train(false);
  torch::NoGradGuard ng;
  const auto sched = sample::shifted_schedule(8.0f, 12);
  auto uncond = data::read_text_embedding_file(f.negative, 512, 32, "negative").unsqueeze(0).to(torch::kBFloat16);
  data::DatasetOptions dopt;
  dopt.kind = data::DataKind::TextOnly;
  dopt.text_len = 512;
  dopt.text_dim = 32;
  auto prompts = data::ParquetDataset::open(f.prompts, dopt);
  for (int64_t i = 0; i < 4; ++i) {
    auto row = prompts->get(i % 3);
    auto text = row.text.unsqueeze(0).to(torch::kBFloat16);
    const uint64_t seed = splitmix(splitmix(1000) + uint64_t(i)) >> 1;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto x = at::randn({1, 16, 2, 4, 4}, gen, torch::TensorOptions(torch::kFloat32)).to(torch::kBFloat16);
    std::vector<torch::Tensor> anchors;
    for (int k = 0; k < 12; ++k) {
      if (k % 4 == 0) anchors.push_back(x[0].clone());
      auto t = torch::full({1}, sched.timesteps[size_t(k)]);
      auto vc = m->forward(x, t, text).to(torch::kFloat32);
      auto vu = m->forward(x, t, uncond).to(torch::kFloat32);
      auto v = vu + 6.0 * (vc - vu);
      const float ds = sched.sigmas[size_t(k) + 1] - sched.sigmas[size_t(k)];
      x = (x.to(torch::kFloat32) + ds * v).to(torch::kBFloat16);
    }
    auto traj = cache.trajectory(i);
    EXPECT_EQ(traj.seed, int64_t(seed));
    EXPECT_EQ(traj.source_row, i % 3);
    EXPECT_EQ(traj.id, row.id);
    EXPECT_EQ(traj.caption, row.caption);
    EXPECT_TRUE(torch::equal(traj.start_latents, torch::stack(anchors))) << "trajectory " << i;
    EXPECT_TRUE(torch::equal(traj.final_latent, x[0])) << "trajectory " << i;
    EXPECT_TRUE(torch::equal(traj.prompt_embedding, row.text.narrow(0, 0, row.text_tokens)));
    // The state moved away from the noise (the teacher did something).
    EXPECT_GT((traj.final_latent.to(torch::kFloat32) - traj.start_latents[0].to(torch::kFloat32)).abs().max().item<float>(),
              1e-3f);
  }
  // A rerun of a complete cache is a no-op.
  auto again = generate(f.recipe);
  EXPECT_TRUE(again.complete);
  EXPECT_EQ(again.generated, 0);
  fs::remove_all(f.dir);
}

TEST(OdeGenerate, BatchedCfgAndRankSplit) {
  auto f = make_ode_fixture("gen_rank", 3, 5, 8);
  generate(f.recipe);
  const auto whole = tree_bytes(f.dir / "cache");
  // Two ranks, in either order, write the same cache; only the last one completes it.
  const std::string split = (f.dir / "split").string();
  auto s1 = generate(f.recipe, 1, 2, {"--ode_cache.output_dir", split});
  EXPECT_EQ(s1.generated, 2);  // trajectories 1, 3
  EXPECT_FALSE(s1.complete);
  EXPECT_FALSE(fs::exists(fs::path(split) / "COMPLETE"));
  auto s0 = generate(f.recipe, 0, 2, {"--ode_cache.output_dir", split});
  EXPECT_EQ(s0.generated, 3);  // trajectories 0, 2, 4
  EXPECT_TRUE(s0.complete);
  EXPECT_EQ(tree_bytes(split), whole);
  // cfg_forward batched: one forward of batch 2; close to, and recorded apart from, two forwards.
  const std::string batched = (f.dir / "batched").string();
  generate(f.recipe, 0, 1, {"--ode_cache.output_dir", batched, "--ode_cache.cfg_forward", "batched"});
  auto a = data::OdeCache::open((f.dir / "cache").string());
  auto b = data::OdeCache::open(batched);
  EXPECT_EQ(b.meta().teacher.cfg_forward, "batched");
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_TRUE(torch::allclose(a.trajectory(i).final_latent.to(torch::kFloat32),
                                b.trajectory(i).final_latent.to(torch::kFloat32), 0.05, 0.05));
  // Continuing a cache with another identity is refused, naming the field.
  auto msg = error_of([&] {
    fs::remove(fs::path(split) / "COMPLETE");
    generate(f.recipe, 0, 1, {"--ode_cache.output_dir", split, "--ode_cache.guidance_scale", "5.0"});
  });
  EXPECT_NE(msg.find("different identity"), std::string::npos) << msg;
  EXPECT_NE(msg.find("teacher"), std::string::npos) << msg;
  fs::remove_all(f.dir);
}

TEST(OdeGenerate, KilledAtRandomPointsAndResumedIsByteIdentical) {
  auto f = make_ode_fixture("gen_kill", 3, 5, 32);
  const std::string ref_dir = (f.dir / "ref").string();
  generate(f.recipe, 0, 1, {"--ode_cache.output_dir", ref_dir});
  const auto ref = tree_bytes(ref_dir);
  ASSERT_EQ(ref.size(), 7u);  // cache.json, COMPLETE, 5 trajectories

  const std::string out = (f.dir / "cache").string();
  const std::string log = (f.dir / "gen.log").string();
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> delay_ms(150, 1500);
  int kills = 0, runs = 0;
  bool finished = false;
  while (!finished && runs < 40) {
    ++runs;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl(VQAD_BINARY, VQAD_BINARY, "ode-cache", "generate", f.recipe.c_str(), "--no-progress",
              "--ode_cache.output_dir", out.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Random kill delays, growing with the run count so that a slow machine still finishes.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms(rng) + 150 * runs);
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (done == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ++kills;
      continue;
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << test_data::run_command("cat " + log).output;
    finished = true;
  }
  ASSERT_TRUE(finished) << "generation never finished in " << runs << " runs";
  EXPECT_GE(kills, 1) << "no run was interrupted (the generation is too fast for the kill delays)";
  EXPECT_EQ(tree_bytes(out), ref) << "after " << kills << " kills";
  EXPECT_TRUE(fs::exists(fs::path(out) / "sessions"));
  fs::remove_all(f.dir);
}

TEST(OdeGenerate, RecipeErrorsNameTheKey) {
  auto f = make_ode_fixture("gen_err", 2, 2, 8);
  auto msg = error_of([&] { cli::load_ode_recipe(f.recipe, {"--ode_cache.guidence_scale", "3"}); });
  EXPECT_NE(msg.find("unknown key 'ode_cache.guidence_scale'"), std::string::npos) << msg;
  msg = error_of([&] { cli::load_ode_recipe(f.recipe, {"--models.teacher.attention_backend", "ATTN_QAT_TRAIN"}); });
  EXPECT_NE(msg.find("models.teacher.attention_backend"), std::string::npos) << msg;
  msg = error_of([&] { cli::load_ode_recipe(f.recipe, {"--ode_cache.anchors", "[0, 8]"}); });
  EXPECT_NE(msg.find("ode_cache.anchors"), std::string::npos) << msg;
  msg = error_of([&] { cli::load_ode_recipe(f.recipe, {"--ode_cache.num_frames", "6"}); });
  EXPECT_NE(msg.find("ode_cache.num_frames"), std::string::npos) << msg;
  msg = error_of([&] { cli::load_ode_recipe(f.recipe, {"--models.teacher.quant_config", "nvfp4_qat_train"}); });
  EXPECT_NE(msg.find("models.teacher.quant_config"), std::string::npos) << msg;
  msg = error_of([&] { generate(f.recipe, 0, 1, {"--ode_cache.negative_prompt_embedding", "/nonexistent.safetensors"}); });
  EXPECT_NE(msg.find("ode_cache.negative_prompt_embedding"), std::string::npos) << msg;
  // RANK / WORLD_SIZE from the environment.
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "3", 1);
  EXPECT_EQ(sample::rank_and_world_from_env(), (std::pair<int64_t, int64_t>{3, 4}));
  ::setenv("RANK", "4", 1);
  msg = error_of([&] { sample::rank_and_world_from_env(); });
  EXPECT_NE(msg.find("RANK"), std::string::npos) << msg;
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  EXPECT_EQ(sample::rank_and_world_from_env(), (std::pair<int64_t, int64_t>{0, 1}));
  fs::remove_all(f.dir);
}

TEST(OdeGenerate, BenchRunsTinyOnCpu) {
  auto dir = test_data::fresh_dir("bench_ode");
  auto r = test_data::run_command(std::string(VQAD_BINARY) +
                                  " bench ode-cache --preset tiny --device cpu --frames 2 --height 4 --width 4 "
                                  "--steps 8 --trajectories 2 --repeats 2 --text-tokens 8 --out " +
                                  dir.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("seconds per trajectory"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("floor: 8 x 2 forwards (separate)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("disk bytes per trajectory"), std::string::npos) << r.output;
  std::ifstream jf(dir / "ode_cache.json");
  auto j = nlohmann::json::parse(jf);
  EXPECT_EQ(j["trajectories"], 2);
  EXPECT_GT(j["bytes_per_trajectory"].get<double>(), 2.0 * 3 * 16 * 2 * 4 * 4);  // 2 anchors + x_8 in bf16
  EXPECT_GT(j["floor_separate_s"].get<double>(), 0.0);
  fs::remove_all(dir);
}

TEST(OdeGenerate, ShippedSparseQadRecipeHasTheSeedValues) {
  auto r = cli::load_ode_recipe(std::string(VQAD_SOURCE_DIR) + "/configs/sparse_qad/ode_cache.yaml", {});
  EXPECT_EQ(r.teacher.init_from, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers");
  EXPECT_EQ(r.teacher.attention_backend, AttentionBackend::kTorchSdpa);
  EXPECT_EQ(data::OdeGeometry::wan(r.num_frames, r.num_height, r.num_width).latent_shape,
            (std::vector<int64_t>{16, 16, 56, 112}));
  EXPECT_EQ(r.teacher_steps, 48);
  EXPECT_EQ(r.flow_shift, 8.0f);
  EXPECT_EQ(r.guidance_scale, 6.0);
  EXPECT_EQ(r.anchors, (std::vector<int64_t>{0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44}));
  EXPECT_EQ(r.trajectories, 1000);
  EXPECT_EQ(r.seed, 1000);
  EXPECT_EQ(r.negative_prompt.rfind("色调艳丽", 0), 0u);
}
