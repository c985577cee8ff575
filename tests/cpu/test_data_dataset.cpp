// The Dataset interface: the factory's choice of kind, synthetic rows equal to written and
// re-read parquet rows, and the ODE-pair dataset (pairs, anchor subsets, batch fields,
// text dropout, seeded order and resume through the loader).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "tests/support/errors.h"
#include "test_data_util.h"
#include "test_ode_util.h"
#include "vqad/cli/cmd_ode_cache.h"
#include "vqad/core/error.h"
#include "vqad/data/dataset.h"
#include "vqad/data/loader.h"
#include "vqad/data/ode_dataset.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/py_random.h"
#include "vqad/data/synthetic.h"
#include "vqad/sample/ode_generate.h"

namespace fs = std::filesystem;
using namespace vqad;
using namespace vqad::data;

namespace {

using vqad::test::error_of;

// One generated ODE cache shared by the tests below: 3 prompts, 3 trajectories, 12 steps
// (anchors 0, 4, 8).
struct OdeCacheEnv {
  test_ode::OdeFixture f;
  std::string cache;
  OdeCacheEnv() : f(test_ode::make_ode_fixture("ode_ds", 3, 3, 12)) {
    sample::OdeGenerateOptions o;
    o.progress = false;
    sample::generate_ode_cache(cli::load_ode_recipe(f.recipe, {}), o);
    cache = (f.dir / "cache").string();
  }
  ~OdeCacheEnv() { fs::remove_all(f.dir); }
};

OdeCacheEnv& env() {
  static OdeCacheEnv e;
  return e;
}

DatasetSpec ode_spec(const std::string& path) {
  DatasetSpec s;
  s.sources = {{path, 1}};
  s.text_len = 512;
  s.text_dim = 32;
  s.seed = 1000;
  return s;
}

}  // namespace

TEST(DataDataset, SyntheticRowsEqualWrittenAndReadParquetRows) {
  auto dir = test_data::fresh_dir("synth_ds");
  SynthOptions so;
  so.latent_t = 3;
  so.latent_h = 4;
  so.latent_w = 6;
  so.text_dim = 16;
  so.seed = 1000;
  WriterOptions wo;
  write_synthetic_dataset(dir.string(), 7, so, wo);
  DatasetOptions o;
  o.text_len = 24;
  o.text_dim = 16;
  o.num_latent_t = 2;
  o.cfg_rate = 0.5;
  o.seed = 1000;
  auto pq = ParquetDataset::open(dir.string(), o);
  SyntheticDataset mem(7, so, o);
  ASSERT_EQ(mem.size(), pq->size());
  const std::vector<int64_t> idx = {6, 0, 3, 5};
  auto a = mem.get_batch(idx), b = pq->get_batch(idx);
  EXPECT_EQ(a.indices, b.indices);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.captions, b.captions);
  EXPECT_EQ(a.text_dropped, b.text_dropped);
  EXPECT_TRUE(torch::equal(a.latent, b.latent));
  EXPECT_TRUE(torch::equal(a.text, b.text));
  EXPECT_TRUE(torch::equal(a.text_mask, b.text_mask));
  EXPECT_EQ(a.latent.sizes(), (std::vector<int64_t>{4, 16, 2, 4, 6}));
  EXPECT_FALSE(a.has_ode_pairs());
  fs::remove_all(dir);
}

TEST(DataDataset, FactoryChoosesTheKindFromThePath) {
  auto dir = test_data::fresh_dir("factory");
  SynthOptions so;
  so.latent_t = 2;
  so.latent_h = 2;
  so.latent_w = 2;
  so.text_dim = 32;
  write_synthetic_dataset((dir / "pq").string(), 5, so, WriterOptions{});
  DatasetSpec spec = ode_spec((dir / "pq").string());
  auto pq = make_dataset(spec);
  EXPECT_EQ(pq->size(), 5);
  EXPECT_EQ(pq->identity()["kind"], "parquet");
  EXPECT_NE(pq->description().find("parquet t2v"), std::string::npos) << pq->description();
  // Two parquet sources with a repeat.
  spec.sources = {{(dir / "pq").string(), 2}, {(dir / "pq").string(), 1}};
  EXPECT_EQ(make_dataset(spec)->size(), 15);

  spec = ode_spec("synthetic://6");
  spec.num_latent_t = 2;
  spec.num_height = 32;
  spec.num_width = 48;
  auto syn = make_dataset(spec);
  EXPECT_EQ(syn->size(), 6);
  EXPECT_EQ(syn->identity()["kind"], "synthetic");
  EXPECT_EQ(syn->get_batch({1}).latent.sizes(), (std::vector<int64_t>{1, 16, 2, 4, 6}));
  spec.num_height = 0;
  auto msg = error_of([&] { make_dataset(spec); });
  EXPECT_NE(msg.find("num_height"), std::string::npos) << msg;
  msg = error_of([&] { make_dataset(ode_spec("synthetic://x")); });
  EXPECT_NE(msg.find("synthetic://ROWS"), std::string::npos) << msg;

  auto ode = make_dataset(ode_spec(env().cache));
  EXPECT_EQ(ode->identity()["kind"], "ode_cache");
  EXPECT_EQ(ode->size(), 9);
  EXPECT_TRUE(ode->get_batch({0}).has_ode_pairs());
  // Anchors only select pairs of a cache.
  spec = ode_spec((dir / "pq").string());
  spec.ode_anchor_indices = {0};
  msg = error_of([&] { make_dataset(spec); });
  EXPECT_NE(msg.find("training.data.ode_anchor_indices"), std::string::npos) << msg;
  // A cache cannot be mixed with other sources.
  spec = ode_spec(env().cache);
  spec.sources.push_back({(dir / "pq").string(), 1});
  msg = error_of([&] { make_dataset(spec); });
  EXPECT_NE(msg.find("ODE-trajectory cache"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataDataset, OdePairsAnchorSubsetsAndBatchFields) {
  auto cache = OdeCache::open(env().cache);
  auto spec = ode_spec(env().cache);
  spec.ode_anchor_indices = {8, 0};  // any order; pairs follow teacher-step order
  auto ds = std::dynamic_pointer_cast<const OdeDataset>(make_dataset(spec));
  ASSERT_TRUE(ds);
  EXPECT_EQ(ds->size(), 6);
  EXPECT_EQ(ds->anchor_teacher_steps(), (std::vector<int64_t>{0, 8}));
  EXPECT_NE(ds->description().find("3 trajectories x 2 anchors"), std::string::npos) << ds->description();
  const auto& sched = cache.meta().schedule;
  auto b = ds->get_batch({5, 0, 3});
  ASSERT_EQ(b.ode_start.sizes(), (std::vector<int64_t>{3, 16, 2, 4, 4}));
  EXPECT_EQ(b.ode_start.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(b.ode_sigma.scalar_type(), torch::kFloat32);
  EXPECT_EQ(b.ode_teacher_step, (std::vector<int64_t>{8, 0, 8}));
  EXPECT_FALSE(b.latent.defined());
  const std::vector<std::pair<int64_t, int64_t>> expect = {{2, 2}, {0, 0}, {1, 2}};  // (trajectory, cache anchor)
  for (size_t k = 0; k < 3; ++k) {
    auto t = cache.trajectory(expect[k].first);
    const int64_t step = sched.student_indices[size_t(expect[k].second)];
    EXPECT_TRUE(torch::equal(b.ode_start[int64_t(k)], t.start_latents[expect[k].second])) << k;
    EXPECT_TRUE(torch::equal(b.ode_target[int64_t(k)], t.final_latent)) << k;
    EXPECT_EQ(b.ode_sigma[int64_t(k)].item<float>(), sched.sigmas[size_t(step)]);
    EXPECT_EQ(b.ode_timestep[int64_t(k)].item<float>(), sched.timesteps[size_t(step)]);
    const int64_t L = t.prompt_embedding.size(0);
    EXPECT_TRUE(torch::equal(b.text[int64_t(k)].narrow(0, 0, L), t.prompt_embedding));
    EXPECT_EQ(b.text[int64_t(k)].narrow(0, L, 512 - L).abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(b.text_mask[int64_t(k)].sum().item<float>(), float(L));
    EXPECT_EQ(b.captions[k], t.caption);
  }
  // The seed's S1 subset {0, 16, 32} on this 12-step cache: 16 is not an anchor, named with the key.
  spec.ode_anchor_indices = {0, 16};
  auto msg = error_of([&] { make_dataset(spec); });
  EXPECT_NE(msg.find("training.data.ode_anchor_indices"), std::string::npos) << msg;
  EXPECT_NE(msg.find("teacher step 16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[0,4,8]"), std::string::npos) << msg;
  // Text dropout as the parquet dataset does it: cfg_drop(seed, index, rate), mask kept.
  spec.ode_anchor_indices = {};
  spec.cfg_rate = 0.5;
  auto dropped = make_dataset(spec);
  std::vector<int64_t> all(9);
  for (int64_t i = 0; i < 9; ++i) all[size_t(i)] = i;
  auto d = dropped->get_batch(all);
  int n = 0;
  for (int64_t i = 0; i < 9; ++i) {
    EXPECT_EQ(bool(d.text_dropped[size_t(i)]), cfg_drop(1000, i, 0.5)) << i;
    if (d.text_dropped[size_t(i)]) {
      ++n;
      EXPECT_EQ(d.text[i].abs().sum().item<float>(), 0.0f);
      EXPECT_GT(d.text_mask[i].sum().item<float>(), 0.0f);
    }
  }
  EXPECT_GT(n, 0);
  EXPECT_LT(n, 9);
}

TEST(DataDataset, OdePairsSeededOrderAndResumeThroughTheLoader) {
  auto ds = make_dataset(ode_spec(env().cache));
  SamplerOptions so{ds->size(), 2, 1, 0, 1000};
  std::vector<Batch> expect;
  {
    PrefetchLoader sync(ds, DpSpBatchSampler(so), 0);
    for (int i = 0; i < 7; ++i) expect.push_back(sync.next());
  }
  // The order is the sampler's permutation of all 9 pairs (drop_last: 4 batches per epoch).
  std::set<int64_t> seen;
  for (int i = 0; i < 4; ++i)
    for (auto p : expect[size_t(i)].indices) seen.insert(p);
  EXPECT_EQ(seen.size(), 8u);
  nlohmann::json saved;
  {
    PrefetchLoader loader(ds, DpSpBatchSampler(so), 2);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(loader.next().indices, expect[size_t(i)].indices);
    saved = loader.state();
    EXPECT_EQ(saved["dataset_root"], env().cache);
  }
  auto ds2 = make_dataset(ode_spec(env().cache));
  PrefetchLoader resumed(ds2, DpSpBatchSampler(so), 2);
  resumed.load_state(nlohmann::json::parse(saved.dump()));
  for (int i = 3; i < 7; ++i) {
    Batch b = resumed.next();
    ASSERT_EQ(b.indices, expect[size_t(i)].indices) << "batch " << i;
    EXPECT_TRUE(torch::equal(b.ode_start, expect[size_t(i)].ode_start));
    EXPECT_TRUE(torch::equal(b.ode_target, expect[size_t(i)].ode_target));
    EXPECT_TRUE(torch::equal(b.ode_sigma, expect[size_t(i)].ode_sigma));
    EXPECT_TRUE(torch::equal(b.text, expect[size_t(i)].text));
  }
}
