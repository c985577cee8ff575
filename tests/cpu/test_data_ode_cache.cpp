// ODE-trajectory cache format: write/read round trip, metadata, pairs, resume of an
// unfinished cache, rank-owned indices, `vqad data inspect` and the error cases (a missing
// or truncated trajectory file, a shape that disagrees with the geometry, a schedule
// that disagrees with its formula or with the recipe).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include "tests/support/errors.h"
#include "test_data_util.h"
#include "test_ode_util.h"
#include "vqad/core/error.h"
#include "vqad/data/ode_cache.h"
#include "vqad/sample/ode_generate.h"
#include "vqad/cli/cmd_ode_cache.h"

namespace fs = std::filesystem;
using namespace vqad::data;
using namespace vqad::test_data;

namespace {

OdeCacheMeta small_meta() {
  OdeCacheMeta m;
  m.geometry = OdeGeometry::wan(9, 32, 48);  // [16, 3, 4, 6]
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
  m.schedule = OdeSchedule::shifted(8.0f, 48, anchors);
  m.teacher.model_kind = "wan-t2v-1.3b";
  m.teacher.init_from = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers";
  m.teacher.negative_prompt = "blurry";
  m.teacher.file_sha256 = {{"transformer/config.json", std::string(64, 'a')}};
  m.teacher.architecture = {{"num_layers", 30}};
  m.text_len = 16;
  m.text_dim = 8;
  m.source_kind = "test";
  m.seed = 7;
  m.runtime = {{"device_type", "cpu"}};
  return m;
}

OdeTrajectory make_traj(int64_t i, int64_t anchors = 12) {
  OdeTrajectory t;
  t.id = "p" + std::to_string(i);
  t.caption = "prompt " + std::to_string(i);
  t.seed = 100 + i;
  t.source_row = i;
  t.start_latents = torch::randn({anchors, 16, 3, 4, 6}).to(torch::kBFloat16);
  t.final_latent = torch::randn({16, 3, 4, 6}).to(torch::kBFloat16);
  t.prompt_embedding = torch::randn({3 + i, 8});
  return t;
}

using vqad::test::error_of;

}  // namespace

TEST(DataOdeCache, ScheduleIsTheSharedFp32Schedule) {
  auto s = OdeSchedule::shifted(8.0f, 48, {0, 16, 32});
  ASSERT_EQ(s.sigmas.size(), 49u);
  ASSERT_EQ(s.timesteps.size(), 48u);
  EXPECT_EQ(s.sigmas[0], 1.0f);
  EXPECT_EQ(double(s.sigmas[16]), 0.9411764144897461);  // seeds/004 student schedule
  EXPECT_EQ(double(s.sigmas[32]), 0.800000011920929);
  EXPECT_EQ(s.sigmas[48], 0.0f);
  EXPECT_EQ(double(s.timesteps[16]), 941.1763916015625);
  auto g = OdeGeometry::wan(61, 448, 896);  // the seeds/004 geometry
  EXPECT_EQ(g.latent_shape, (std::vector<int64_t>{16, 16, 56, 112}));
  EXPECT_EQ(g.num_latent_t, 16);
}

TEST(DataOdeCache, RoundTripWithMetadataAndPairs) {
  auto dir = fresh_dir("ode");
  std::vector<OdeTrajectory> written;
  {
    OdeCacheWriter w(dir.string(), small_meta(), 3);
    for (int64_t i = 0; i < 3; ++i) {
      written.push_back(make_traj(i));
      EXPECT_FALSE(w.finalize_if_complete());
      w.write(i, written.back());
    }
    EXPECT_TRUE(w.finalize_if_complete());
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
  EXPECT_EQ(j["schedule"]["sigmas"][16].get<double>(), 0.9411764144897461);
  EXPECT_EQ(j["runtime"]["device_type"], "cpu");
  EXPECT_EQ(c.meta().teacher.guidance_scale, 6.0);
  EXPECT_EQ(c.meta().seed, 7);
  for (int64_t i = 0; i < 3; ++i) {
    auto t = c.trajectory(i);
    EXPECT_EQ(t.caption, written[size_t(i)].caption);
    EXPECT_EQ(t.seed, 100 + i);
    EXPECT_EQ(t.source_row, i);
    EXPECT_TRUE(torch::equal(t.start_latents, written[size_t(i)].start_latents));
    EXPECT_TRUE(torch::equal(t.final_latent, written[size_t(i)].final_latent));
    EXPECT_TRUE(torch::equal(t.prompt_embedding, written[size_t(i)].prompt_embedding));
  }
  // Pair 17 = trajectory 1, anchor 5 = teacher step 20.
  auto p = c.pair(17);
  EXPECT_EQ(p.trajectory, 1);
  EXPECT_EQ(p.anchor, 5);
  EXPECT_EQ(p.teacher_step, 20);
  EXPECT_EQ(p.sigma, c.meta().schedule.sigmas[20]);
  EXPECT_EQ(p.timestep, c.meta().schedule.timesteps[20]);
  EXPECT_TRUE(torch::equal(p.start_latent, written[1].start_latents[5]));
  EXPECT_TRUE(torch::equal(p.target_latent, written[1].final_latent));
  EXPECT_EQ(c.anchor_of_teacher_step(20), 5);
  EXPECT_EQ(c.anchor_of_teacher_step(21), -1);
  EXPECT_THROW(c.pair(36), vqad::Error);
  auto rep = c.verify();
  EXPECT_TRUE(rep.complete);
  EXPECT_EQ(rep.trajectories, 3);
  EXPECT_GT(rep.min_bytes, 13 * 16 * 3 * 4 * 6 * 2);
  fs::remove_all(dir);
}

TEST(DataOdeCache, UnfinishedCacheIsRefusedAndResumable) {
  auto dir = fresh_dir("ode_resume");
  {
    OdeCacheWriter w(dir.string(), small_meta(), 4);
    w.write(0, make_traj(0));
    w.write(2, make_traj(2));
  }  // stopped
  auto msg = error_of([&] { OdeCache::open(dir.string()); });
  EXPECT_NE(msg.find("incomplete"), std::string::npos) << msg;
  // A different identity cannot continue it; the message names the field.
  OdeCacheMeta other = small_meta();
  other.schedule = OdeSchedule::shifted(5.0f, 48, other.schedule.student_indices);
  msg = error_of([&] { OdeCacheWriter(dir.string(), other, 4); });
  EXPECT_NE(msg.find("different identity"), std::string::npos) << msg;
  EXPECT_NE(msg.find("schedule"), std::string::npos) << msg;
  msg = error_of([&] { OdeCacheWriter(dir.string(), small_meta(), 5); });
  EXPECT_NE(msg.find("trajectories"), std::string::npos) << msg;
  // The same identity continues; the runtime may differ between sessions (the creator's stays).
  OdeCacheMeta again = small_meta();
  again.runtime = {{"device_type", "cuda"}};
  OdeCacheWriter w(dir.string(), again, 4);
  EXPECT_EQ(w.missing(), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(w.missing(1, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(w.missing(0, 2), (std::vector<int64_t>{}));
  msg = error_of([&] { w.write(2, make_traj(2)); });
  EXPECT_NE(msg.find("already exists"), std::string::npos) << msg;
  w.write(1, make_traj(1));
  EXPECT_FALSE(w.finalize_if_complete());
  w.write(3, make_traj(3));
  EXPECT_TRUE(w.finalize_if_complete());
  auto c = OdeCache::open(dir.string());
  EXPECT_EQ(c.num_trajectories(), 4);
  EXPECT_EQ(c.trajectory(3).caption, "prompt 3");
  EXPECT_EQ(c.metadata_json()["runtime"]["device_type"], "cpu");
  msg = error_of([&] { OdeCacheWriter(dir.string(), small_meta(), 4); });
  EXPECT_NE(msg.find("already complete"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataOdeCache, StaleTemporariesOfDeadProcessesAreRemoved) {
  auto dir = fresh_dir("ode_tmp");
  { OdeCacheWriter w(dir.string(), small_meta(), 2); }
  // A temporary named like st::write_file_atomic's, of a process id that cannot exist.
  const auto stale = dir / "trajectories" / ".00000000.safetensors.tmp.2147483646.12345";
  const auto live = dir / "trajectories" / (".00000001.safetensors.tmp." + std::to_string(::getpid()) + ".1");
  std::ofstream(stale) << "partial";
  std::ofstream(live) << "in flight";
  OdeCacheWriter w(dir.string(), small_meta(), 2);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  fs::remove_all(dir);
}

TEST(DataOdeCache, BadTrajectoriesAndFilesAreErrors) {
  auto dir = fresh_dir("ode_err");
  OdeCacheWriter w(dir.string(), small_meta(), 2);
  auto msg = error_of([&] { w.write(0, make_traj(0, 11)); });
  EXPECT_NE(msg.find("start_latents must have shape"), std::string::npos) << msg;
  auto t = make_traj(0);
  t.final_latent = t.final_latent.to(torch::kFloat32);
  msg = error_of([&] { w.write(0, t); });
  EXPECT_NE(msg.find("bfloat16"), std::string::npos) << msg;
  t = make_traj(0);
  t.prompt_embedding = torch::randn({17, 8});
  msg = error_of([&] { w.write(0, t); });
  EXPECT_NE(msg.find("prompt_embedding"), std::string::npos) << msg;
  msg = error_of([&] { w.write(2, make_traj(2)); });
  EXPECT_NE(msg.find("outside"), std::string::npos) << msg;
  w.write(0, make_traj(0));
  w.write(1, make_traj(1));
  ASSERT_TRUE(w.finalize_if_complete());
  // Invalid schedules and geometries are rejected when a cache is created.
  OdeCacheMeta bad = small_meta();
  bad.schedule.student_indices = {0, 48};
  msg = error_of([&] { OdeCacheWriter((dir / "x").string(), bad, 1); });
  EXPECT_NE(msg.find("student index 48"), std::string::npos) << msg;
  bad = small_meta();
  bad.schedule.sigmas[9] = 0.5f;
  msg = error_of([&] { OdeCacheWriter((dir / "x").string(), bad, 1); });
  EXPECT_NE(msg.find("schedule.sigmas[9]"), std::string::npos) << msg;
  bad = small_meta();
  bad.geometry.latent_shape = {16, 3, 4, 8};
  msg = error_of([&] { OdeCacheWriter((dir / "x").string(), bad, 1); });
  EXPECT_NE(msg.find("geometry.latent_shape"), std::string::npos) << msg;
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------
// `vqad data inspect CACHE` on a generated cache, then on broken copies of it.

namespace {

struct InspectFixture {
  vqad::test_ode::OdeFixture f;
  fs::path cache;
};

InspectFixture generated_cache() {
  InspectFixture x{vqad::test_ode::make_ode_fixture("ode_inspect", 2, 3, 8), {}};
  vqad::sample::OdeGenerateOptions o;
  o.progress = false;
  vqad::sample::generate_ode_cache(vqad::cli::load_ode_recipe(x.f.recipe, {}), o);
  x.cache = x.f.dir / "cache";
  return x;
}

fs::path broken_copy(const InspectFixture& x, const std::string& name) {
  const fs::path c = x.f.dir / name;
  fs::copy(x.cache, c, fs::copy_options::recursive);
  return c;
}

void rewrite_json(const fs::path& path, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  {
    std::ifstream in(path);
    j = nlohmann::json::parse(in);
  }
  edit(j);
  std::ofstream(path, std::ios::trunc) << j.dump(2);
}

}  // namespace

TEST(DataOdeCache, InspectSummarisesAndNamesTheBrokenFileAndField) {
  auto x = generated_cache();
  const std::string bin = VQAD_BINARY;
  auto r = run_command(bin + " data inspect " + x.cache.string() + " --recipe " + x.f.recipe);
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* want : {"complete", "trajectories 3, anchors 2, pairs 6", "latent [16,2,4,4] bfloat16",
                           "8 teacher steps, shift 8", "anchors (teacher steps) [0,4]", "wan-t2v-tiny (random:tiny)",
                           "guidance 6", "bytes per trajectory", "agrees with the recipe"})
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;

  // Missing trajectory file.
  auto c = broken_copy(x, "missing");
  fs::remove(c / "trajectories" / "00000001.safetensors");
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("00000001.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("missing"), std::string::npos) << r.output;

  // Truncated trajectory file.
  c = broken_copy(x, "truncated");
  fs::resize_file(c / "trajectories" / "00000002.safetensors",
                  fs::file_size(c / "trajectories" / "00000002.safetensors") - 100);
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("00000002.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("truncated"), std::string::npos) << r.output;

  // A geometry that disagrees with the stored shapes: cache.json says 9 frames (3 latent frames).
  c = broken_copy(x, "geometry");
  rewrite_json(c / "cache.json", [](nlohmann::json& j) {
    j["geometry"]["num_frames"] = 9;
    j["geometry"]["num_latent_t"] = 3;
    j["geometry"]["latent_shape"] = {16, 3, 4, 4};
  });
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("00000000.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("start_latents"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("geometry.latent_shape"), std::string::npos) << r.output;

  // A latent_shape inconsistent with the pixel geometry.
  c = broken_copy(x, "shape");
  rewrite_json(c / "cache.json", [](nlohmann::json& j) { j["geometry"]["latent_shape"] = {16, 2, 4, 6}; });
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("cache.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("geometry.latent_shape"), std::string::npos) << r.output;

  // A schedule that is not the shifted schedule of its shift (one sigma changed).
  c = broken_copy(x, "schedule");
  rewrite_json(c / "cache.json", [](nlohmann::json& j) { j["schedule"]["sigmas"][3] = 0.5; });
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("cache.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("schedule.sigmas[3]"), std::string::npos) << r.output;

  // A schedule that disagrees with the recipe (shift 5 in the recipe).
  const std::string other = (x.f.dir / "other.yaml").string();
  {
    std::ifstream in(x.f.recipe);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    text.replace(text.find("flow_shift: 8.0"), 15, "flow_shift: 5.0");
    std::ofstream(other) << text;
  }
  r = run_command(bin + " data inspect " + x.cache.string() + " --recipe " + other);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("schedule.flow_shift"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cache.json"), std::string::npos) << r.output;

  // An unfinished cache: how far it got.
  c = broken_copy(x, "unfinished");
  fs::remove(c / "COMPLETE");
  fs::remove(c / "trajectories" / "00000002.safetensors");
  r = run_command(bin + " data inspect " + c.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("incomplete: 2 of 3 trajectory files"), std::string::npos) << r.output;
  fs::remove_all(x.f.dir);
}
