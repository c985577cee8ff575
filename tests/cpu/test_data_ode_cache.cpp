// ODE-trajectory cache: write/read round trip, metadata, pairs, resume of an unfinished
// cache, and the error cases.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "test_data_util.h"
#include "vqad/core/error.h"
#include "vqad/data/ode_cache.h"

namespace fs = std::filesystem;
using namespace vqad::data;
using namespace vqad::test_data;

namespace {

OdeCacheMeta small_meta() {
  OdeCacheMeta m;
  m.geometry = {9, 32, 48, 3, {16, 3, 4, 6}};
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
  m.schedule = OdeSchedule::shifted(8.0, 48, anchors);
  m.teacher.model_kind = "wan-t2v-1.3b";
  m.teacher.init_from = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers";
  m.teacher.negative_prompt = "blurry";
  m.teacher.file_sha256 = {{"transformer/config.json", std::string(64, 'a')}};
  m.teacher.architecture = {{"num_layers", 30}};
  m.text_len = 16;
  m.text_dim = 8;
  m.source_kind = "test";
  m.runtime = {{"device_type", "cpu"}};
  return m;
}

OdeTrajectory make_traj(int64_t i, int64_t anchors = 12) {
  OdeTrajectory t;
  t.id = "p" + std::to_string(i);
  t.caption = "prompt " + std::to_string(i);
  t.seed = 100 + i;
  t.start_latents = torch::randn({anchors, 16, 3, 4, 6}).to(torch::kBFloat16);
  t.final_latent = torch::randn({16, 3, 4, 6}).to(torch::kBFloat16);
  t.prompt_embedding = torch::randn({3 + i, 8});
  return t;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const vqad::Error& e) {
    return e.what();
  }
  return "(no vqad::Error thrown)";
}

}  // namespace

TEST(DataOdeCache, ShiftedScheduleMatchesTheRecipe) {
  auto s = OdeSchedule::shifted(8.0, 48, {0, 16, 32});
  ASSERT_EQ(s.sigmas.size(), 49u);
  EXPECT_DOUBLE_EQ(s.sigmas[0], 1.0);
  EXPECT_NEAR(s.sigmas[16], 0.9411764144897461, 1e-7);  // seeds/004 student schedule
  EXPECT_NEAR(s.sigmas[32], 0.800000011920929, 1e-7);
  EXPECT_NEAR(s.sigmas[47], 0.145454540848732, 1e-7);
  EXPECT_DOUBLE_EQ(s.sigmas[48], 0.0);
  EXPECT_NEAR(s.timesteps()[16], 941.1764, 1e-3);
}

TEST(DataOdeCache, RoundTripWithMetadataAndPairs) {
  auto dir = fresh_dir("ode");
  std::vector<OdeTrajectory> written;
  {
    OdeCacheWriter w(dir.string(), small_meta());
    for (int64_t i = 0; i < 3; ++i) {
      written.push_back(make_traj(i));
      w.add(written.back());
    }
    w.finalize(12.5);
  }
  auto c = OdeCache::open(dir.string());
  EXPECT_EQ(c.num_trajectories(), 3);
  EXPECT_EQ(c.num_anchors(), 12);
  EXPECT_EQ(c.num_pairs(), 36);
  const auto& j = c.metadata_json();
  EXPECT_EQ(j["metadata_schema"], "vqad.ode_cache");
  EXPECT_EQ(j["pairs"], 36);
  EXPECT_EQ(j["teacher"]["files"]["transformer/config.json"], std::string(64, 'a'));
  EXPECT_EQ(j["schedule"]["student_indices"].size(), 12u);
  EXPECT_DOUBLE_EQ(j["generation_seconds"].get<double>(), 12.5);
  EXPECT_EQ(j["runtime"]["device_type"], "cpu");
  EXPECT_EQ(c.meta().teacher.guidance_scale, 6.0);
  for (int64_t i = 0; i < 3; ++i) {
    auto t = c.trajectory(i);
    EXPECT_EQ(t.caption, written[size_t(i)].caption);
    EXPECT_EQ(t.seed, 100 + i);
    EXPECT_TRUE(torch::equal(t.start_latents, written[size_t(i)].start_latents));
    EXPECT_TRUE(torch::equal(t.final_latent, written[size_t(i)].final_latent));
    EXPECT_TRUE(torch::equal(t.prompt_embedding, written[size_t(i)].prompt_embedding));
  }
  // Pair 17 = trajectory 1, anchor 5 = teacher step 20.
  auto p = c.pair(17);
  EXPECT_EQ(p.trajectory, 1);
  EXPECT_EQ(p.anchor, 5);
  EXPECT_EQ(p.teacher_step, 20);
  EXPECT_DOUBLE_EQ(p.sigma, c.meta().schedule.sigmas[20]);
  EXPECT_DOUBLE_EQ(p.timestep, 1000.0 * p.sigma);
  EXPECT_TRUE(torch::equal(p.start_latent, written[1].start_latents[5]));
  EXPECT_TRUE(torch::equal(p.target_latent, written[1].final_latent));
  ASSERT_EQ(p.text.sizes(), (std::vector<int64_t>{16, 8}));
  EXPECT_TRUE(torch::equal(p.text.narrow(0, 0, 4), written[1].prompt_embedding));
  EXPECT_EQ(p.text.narrow(0, 4, 12).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(p.text_mask.sum().item<float>(), 4.0f);
  EXPECT_THROW(c.pair(36), vqad::Error);
  fs::remove_all(dir);
}

TEST(DataOdeCache, UnfinishedCacheIsRefusedAndResumable) {
  auto dir = fresh_dir("ode_resume");
  {
    OdeCacheWriter w(dir.string(), small_meta());
    w.add(make_traj(0));
    w.add(make_traj(1));
  }  // stopped before finalize
  auto msg = error_of([&] { OdeCache::open(dir.string()); });
  EXPECT_NE(msg.find("incomplete"), std::string::npos) << msg;
  // A different identity cannot continue it.
  OdeCacheMeta other = small_meta();
  other.schedule = OdeSchedule::shifted(5.0, 48, other.schedule.student_indices);
  msg = error_of([&] { OdeCacheWriter(dir.string(), other); });
  EXPECT_NE(msg.find("different identity"), std::string::npos) << msg;
  // The same identity continues after the last complete file.
  OdeCacheMeta again = small_meta();
  again.runtime = {{"device_type", "cuda"}};  // runtime may differ between sessions
  OdeCacheWriter w(dir.string(), again);
  EXPECT_EQ(w.num_written(), 2);
  w.add(make_traj(2));
  w.finalize(1.0);
  auto c = OdeCache::open(dir.string());
  EXPECT_EQ(c.num_trajectories(), 3);
  EXPECT_EQ(c.trajectory(2).caption, "prompt 2");
  msg = error_of([&] { OdeCacheWriter(dir.string(), small_meta()); });
  EXPECT_NE(msg.find("already complete"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataOdeCache, BadTrajectoriesAndFilesAreErrors) {
  auto dir = fresh_dir("ode_err");
  OdeCacheWriter w(dir.string(), small_meta());
  auto msg = error_of([&] { w.add(make_traj(0, 11)); });
  EXPECT_NE(msg.find("start_latents must have shape"), std::string::npos) << msg;
  auto t = make_traj(0);
  t.final_latent = t.final_latent.to(torch::kFloat32);
  msg = error_of([&] { w.add(t); });
  EXPECT_NE(msg.find("bfloat16"), std::string::npos) << msg;
  t = make_traj(0);
  t.prompt_embedding = torch::randn({17, 8});
  msg = error_of([&] { w.add(t); });
  EXPECT_NE(msg.find("prompt_embedding"), std::string::npos) << msg;
  w.add(make_traj(0));
  w.add(make_traj(1));
  w.finalize(0.0);
  // A trajectory file that vanished.
  fs::remove(dir / "trajectories" / "00000001.safetensors");
  msg = error_of([&] { OdeCache::open(dir.string()); });
  EXPECT_NE(msg.find("00000001.safetensors"), std::string::npos) << msg;
  // Bad metadata.
  std::ofstream(dir / "cache.json", std::ios::trunc) << "{\"metadata_schema\": \"other\"}";
  msg = error_of([&] { OdeCache::open(dir.string()); });
  EXPECT_NE(msg.find("metadata_schema"), std::string::npos) << msg;
  // Invalid schedules are rejected when a cache is created.
  OdeCacheMeta bad = small_meta();
  bad.schedule.student_indices = {0, 48};
  msg = error_of([&] { OdeCacheWriter((dir / "x").string(), bad); });
  EXPECT_NE(msg.find("student index 48"), std::string::npos) << msg;
  fs::remove_all(dir);
}
