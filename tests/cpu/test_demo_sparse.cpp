// `vqad demo`: the multi-modal synthetic data it trains on (data::SynthOptions::modes),
// the --recipe check, and `--recipe sparse` end to end at minimal step counts: three
// exports (S0 layer_recon, S1 recon_ode, S2 dmd2) whose lineage verifies with the chain
// S2 -> S1 -> S0 -> teacher, and a report with every row filled.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "vqad/core/error.h"
#include "vqad/data/synthetic.h"
#include "vqad/train/demo.h"
#include "vqad/train/metadata.h"
#include "test_train_util.h"

namespace fs = std::filesystem;
using namespace vqad;

TEST(DemoData, MultiModalRowsOfACaptionClusterIntoTheRequestedModes) {
  data::SynthOptions so;
  so.latent_t = 4;
  so.latent_h = 8;
  so.latent_w = 8;
  so.text_dim = 32;
  so.seed = 3;
  so.modes = 3;
  so.captions = 2;
  so.detail = 0.05;
  std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>> by_caption;  // caption -> (mode, latent)
  std::map<int64_t, std::string> caption_text;
  for (int64_t g = 0; g < 48; ++g) {
    auto r = data::synth_record(so, g);
    const auto m = data::synth_mode_of(so, g);
    ASSERT_GE(m.caption, 0);
    ASSERT_LT(m.caption, 2);
    ASSERT_GE(m.mode, 0);
    ASSERT_LT(m.mode, 3);
    if (caption_text.count(m.caption)) EXPECT_EQ(caption_text[m.caption], r.caption);  // one caption per index
    caption_text[m.caption] = r.caption;
    by_caption[m.caption].push_back({m.mode, r.latent.to(torch::kFloat32).flatten()});
  }
  ASSERT_EQ(caption_text.size(), 2u);
  EXPECT_NE(caption_text[0], caption_text[1]);
  for (const auto& [c, rows] : by_caption) {
    // Without the generator's labels: single-linkage clusters at half the largest gap
    // between within-label and across-label distances give exactly 3 groups, equal to
    // the labels (every within-mode distance is far below every across-mode one).
    double within = 0, across = 1e30;
    for (size_t i = 0; i < rows.size(); ++i)
      for (size_t j = i + 1; j < rows.size(); ++j) {
        const double d = (rows[i].second - rows[j].second).norm().item<double>();
        if (rows[i].first == rows[j].first) within = std::max(within, d);
        else across = std::min(across, d);
      }
    EXPECT_LT(within * 2.0, across) << "caption " << c;
    const double thr = 0.5 * (within + across);
    std::vector<int> cluster(rows.size(), -1);
    int clusters = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (cluster[i] >= 0) continue;
      std::vector<size_t> stack = {i};
      cluster[i] = clusters;
      while (!stack.empty()) {
        size_t a = stack.back();
        stack.pop_back();
        for (size_t b = 0; b < rows.size(); ++b)
          if (cluster[b] < 0 && (rows[a].second - rows[b].second).norm().item<double>() < thr) {
            cluster[b] = clusters;
            stack.push_back(b);
          }
      }
      ++clusters;
    }
    EXPECT_EQ(clusters, 3) << "caption " << c;
    std::map<int, std::set<int64_t>> labels;
    for (size_t i = 0; i < rows.size(); ++i) labels[cluster[i]].insert(rows[i].first);
    for (const auto& [k, l] : labels) EXPECT_EQ(l.size(), 1u) << "cluster " << k << " mixes modes";
  }
  // The default options (modes 0) keep the old data: rows differ in layout, not by a shared mode.
  data::SynthOptions d = so;
  d.modes = 0;
  EXPECT_THROW(data::synth_mode_of(d, 0), Error);
  EXPECT_FALSE(torch::equal(data::synth_record(d, 0).latent, data::synth_record(so, 0).latent));
}

TEST(DemoRecipe, UnknownRecipeIsAOneLineErrorListingTheValidOnes) {
  const fs::path out = test_train::fresh_test_dir("vqad_demo_recipe");
  train::DemoOptions o;
  o.out = out.string();
  o.recipe = "sparce";
  try {
    train::run_demo(o);
    FAIL() << "an unknown recipe ran";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--recipe 'sparce'"), std::string::npos) << m;
    EXPECT_NE(m.find("dense, sparse"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(out)) << "the refusal must come before the output directory is made";
  EXPECT_NO_THROW(train::check_demo_recipe("dense"));
  EXPECT_NO_THROW(train::check_demo_recipe("sparse"));
}

TEST(DemoSparse, RunsEndToEndAndTheThreeExportsVerifyAsOneChain) {
  // One step or two of every stage, but the VSA / ATTN_QAT_TRAIN CPU references on 256
  // tokens and the 48-step reference sampler: about a minute of one core (2.5 minutes on a
  // loaded 2-core machine), so opt-in like the dense demo's end-to-end test.
  if (!std::getenv("VQAD_RUN_DEMO_TESTS")) GTEST_SKIP() << "runs vqad demo --recipe sparse; set VQAD_RUN_DEMO_TESTS=1";
  const fs::path out = test_train::fresh_test_dir("vqad_demo_sparse");
  train::DemoOptions o;
  o.out = out.string();
  o.recipe = "sparse";
  o.progress = false;
  o.train_rows = 4;
  o.heldout_rows = 1;
  o.eval_noises = 1;
  o.batch_size = 1;
  o.teacher_steps = 2;
  o.ode_trajectories = 2;
  o.stage0_steps = 1;
  o.stage1_steps = 1;
  o.stage2_steps = 2;  // the student updates every 2nd step
  const auto r = train::run_demo(o);
  EXPECT_EQ(r.recipe, "sparse");
  ASSERT_EQ(r.exports_verified.size(), 3u);
  const char* names[] = {"stage0_export", "stage1_export", "stage2_export"};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r.exports_verified[i].first, names[i]);
    EXPECT_TRUE(r.exports_verified[i].second) << names[i];
    EXPECT_TRUE(train::verify_lineage((out / names[i]).string()).empty()) << names[i];
  }
  EXPECT_TRUE(r.lineage_verified);
  EXPECT_EQ(r.stage2_chain, (std::vector<std::string>{"dmd2", "recon_ode", "layer_recon", "sft"}));
  // S2's metadata holds the whole chain: S1 -> S0 -> the teacher export, each the parent's export.
  auto m = train::read_metadata((out / "stage2_export").string());
  const auto& l2 = m["provenance"]["lineage"];
  EXPECT_EQ(l2["kind"], "sparse_qat_weight_initialization");
  const auto& l1 = l2["parent_metadata"]["provenance"]["lineage"];
  EXPECT_EQ(l1["kind"], "dense_qat_weight_initialization");
  EXPECT_EQ(l1["parent_metadata"]["provenance"]["lineage"]["init_from"], (out / "teacher_export").string());
  // The ODE cache holds the anchors S1 trains on, and every report row is filled.
  EXPECT_EQ(r.ode_trajectories, 2);
  EXPECT_TRUE(fs::is_regular_file(out / "ode_cache" / "COMPLETE"));
  ASSERT_EQ(r.block_errors.size(), 4u);
  for (const auto& b : r.block_errors) {
    ASSERT_EQ(b.per_block.size(), 2u) << b.model;
    EXPECT_GT(b.mean, 0.0) << b.model;
  }
  EXPECT_EQ(r.samples, 1);
  EXPECT_TRUE(r.stage2_ran);
  EXPECT_GT(r.mse_teacher_3, 0.0);
  EXPECT_GT(r.mse_stage1_3, 0.0);
  EXPECT_TRUE(r.stage0_sampled);
  EXPECT_GT(r.mse_stage0_3, 0.0);
  EXPECT_GT(r.mse_dmd_3, 0.0);
  const auto text = train::demo_report_text(r);
  EXPECT_NE(text.find("stage2_export verified"), std::string::npos) << text;
  EXPECT_NE(text.find("S1 vs its start"), std::string::npos) << text;
  EXPECT_NE(text.find("S2 lineage chain: dmd2 recon_ode layer_recon sft"), std::string::npos) << text;
  fs::remove_all(out);
}
