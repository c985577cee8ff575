// Quant plans (model/quant_plan): which Wan linears are quantized, config parsing,
// JSON round trips, activation-amax tables and attaching the plan to a model.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/model/quant_plan.h"

namespace {

using vqad::model::QuantConfig;
using vqad::model::QuantMethod;
using vqad::model::QuantPlan;
using vqad::nvfp4::ScaleMode;

// Targeted per block: self- and cross-attention q/k/v/out (8) and both FFN linears (2),
// so 30 x 10 = 300 for the 1.3B model.
constexpr size_t kWan13BTargets = 300;

// Every nn.Linear of Wan2.1-T2V-1.3B by its Diffusers module name (the patch
// embedding is a Conv3d and not listed). `vsa` adds the VSA gate linear per block.
std::vector<std::string> wan13b_diffusers_linears(bool vsa = false) {
  std::vector<std::string> n = {"condition_embedder.time_embedder.linear_1",
                                "condition_embedder.time_embedder.linear_2", "condition_embedder.time_proj",
                                "condition_embedder.text_embedder.linear_1",
                                "condition_embedder.text_embedder.linear_2"};
  for (int b = 0; b < 30; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* a : {"attn1", "attn2"}) {
      for (const char* s : {".to_q", ".to_k", ".to_v", ".to_out.0"}) n.push_back(p + a + s);
    }
    n.push_back(p + "ffn.net.0.proj");
    n.push_back(p + "ffn.net.2");
    if (vsa) n.push_back(p + "to_gate_compress");
  }
  n.push_back("proj_out");
  return n;
}

// The same model under FastVideo's internal names.
std::vector<std::string> wan13b_fastvideo_linears() {
  std::vector<std::string> n = {"condition_embedder.time_embedder.mlp.fc_in",
                                "condition_embedder.time_embedder.mlp.fc_out",
                                "condition_embedder.time_modulation.linear", "condition_embedder.text_embedder.fc_in",
                                "condition_embedder.text_embedder.fc_out"};
  for (int b = 0; b < 30; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* s : {"to_q", "to_k", "to_v", "to_out", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                          "attn2.to_out", "ffn.fc_in", "ffn.fc_out"}) {
      n.push_back(p + s);
    }
  }
  n.push_back("proj_out");
  return n;
}

std::set<std::string> expected_targets() {
  std::set<std::string> s;
  for (int b = 0; b < 30; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* a : {"attn1", "attn2"}) {
      for (const char* t : {".to_q", ".to_k", ".to_v", ".to_out.0"}) s.insert(p + a + t);
    }
    s.insert(p + "ffn.net.0.proj");
    s.insert(p + "ffn.net.2");
  }
  return s;
}

QuantConfig config_of(QuantMethod m) {
  QuantConfig c;
  c.method = m;
  return c;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/vqad_quant_plan_" + std::to_string(::getpid()) + "_" + name;
}

TEST(QuantPlan, Wan13BDiffusersNamesGive300TargetedLinears) {
  const auto names = wan13b_diffusers_linears();
  const QuantPlan plan = vqad::model::build_quant_plan(names, config_of(QuantMethod::kNvfp4QatTrain));
  ASSERT_EQ(plan.entries.size(), kWan13BTargets);
  std::set<std::string> got;
  for (const auto& e : plan.entries) {
    got.insert(e.module);
    EXPECT_EQ(e.weight_mode, ScaleMode::kDynamic);
    EXPECT_EQ(e.activation_mode, ScaleMode::kDynamic);
  }
  EXPECT_EQ(got, expected_targets());
  // VSA gates stay high precision.
  const QuantPlan vsa = vqad::model::build_quant_plan(wan13b_diffusers_linears(true), config_of(QuantMethod::kNvfp4QatTrain));
  EXPECT_EQ(vsa.entries.size(), kWan13BTargets);
  EXPECT_EQ(vsa.find("blocks.3.to_gate_compress"), nullptr);
  EXPECT_NE(vsa.find("blocks.3.attn2.to_out.0"), nullptr);
}

TEST(QuantPlan, FastVideoInternalNamesGiveTheSameLinears) {
  const QuantPlan plan =
      vqad::model::build_quant_plan(wan13b_fastvideo_linears(), config_of(QuantMethod::kNvfp4QatTrain));
  EXPECT_EQ(plan.entries.size(), kWan13BTargets);
  for (const auto& e : plan.entries) {
    EXPECT_EQ(e.module.rfind("blocks.", 0), 0u) << e.module;
  }
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("blocks.7.attn1.to_out.0"), "blocks.7.to_out");
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("blocks.7.attn2.to_out.0"), "blocks.7.attn2.to_out");
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("blocks.7.ffn.net.0.proj"), "blocks.7.ffn.fc_in");
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("blocks.7.ffn.net.2"), "blocks.7.ffn.fc_out");
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("model.blocks.7.ffn.net.2"), "model.blocks.7.ffn.fc_out");
  EXPECT_EQ(vqad::model::wan_fastvideo_internal_name("proj_out"), "proj_out");
}

TEST(QuantPlan, QadUsesStaticScalesForFfnAndUnitForAttention) {
  const QuantPlan plan =
      vqad::model::build_quant_plan(wan13b_diffusers_linears(), config_of(QuantMethod::kNvfp4Qad));
  ASSERT_EQ(plan.entries.size(), kWan13BTargets);
  int stat = 0, unit = 0;
  for (const auto& e : plan.entries) {
    EXPECT_EQ(e.weight_mode, ScaleMode::kDynamic);
    const bool ffn = e.module.find(".ffn.") != std::string::npos;
    EXPECT_EQ(e.activation_mode, ffn ? ScaleMode::kStatic : ScaleMode::kUnit) << e.module;
    (e.activation_mode == ScaleMode::kStatic ? stat : unit)++;
  }
  EXPECT_EQ(stat, 60);
  EXPECT_EQ(unit, 240);
}

TEST(QuantPlan, NoneAndNonStudentRolesQuantizeNothing) {
  const auto names = wan13b_diffusers_linears();
  EXPECT_TRUE(vqad::model::build_quant_plan(names, QuantConfig{}).empty());
  const QuantConfig student = config_of(QuantMethod::kNvfp4QatTrain);
  for (const char* role : {"teacher", "critic", "fake_score"}) {
    const QuantConfig c = vqad::model::quant_config_for_role(student, role);
    EXPECT_EQ(c.method, QuantMethod::kNone) << role;
    EXPECT_TRUE(vqad::model::build_quant_plan(names, c).empty()) << role;
  }
  EXPECT_EQ(vqad::model::quant_config_for_role(student, "student").method, QuantMethod::kNvfp4QatTrain);
}

TEST(QuantPlan, MatchingNothingOrDuplicateNamesIsAnError) {
  try {
    vqad::model::build_quant_plan({"encoder.dense", "head"}, config_of(QuantMethod::kNvfp4QatTrain));
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("matched none"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("encoder.dense"), std::string::npos) << e.what();
  }
  QuantConfig custom = config_of(QuantMethod::kNvfp4Qad);
  custom.target_prefix_substrings = {"no_such_layer"};
  EXPECT_THROW(vqad::model::build_quant_plan(wan13b_diffusers_linears(), custom), vqad::Error);
  custom.target_prefix_substrings = {"ffn"};
  EXPECT_EQ(vqad::model::build_quant_plan(wan13b_diffusers_linears(), custom).entries.size(), 60u);
  EXPECT_THROW(vqad::model::build_quant_plan({"blocks.0.attn1.to_q", "blocks.0.attn1.to_q"},
                                             config_of(QuantMethod::kNvfp4QatTrain)),
               vqad::Error);
}

TEST(QuantPlan, ConfigFromYaml) {
  using vqad::model::quant_config_from_yaml;
  EXPECT_EQ(quant_config_from_yaml(YAML::Load("{}"), "t").method, QuantMethod::kNone);
  EXPECT_EQ(quant_config_from_yaml(YAML::Node(), "t").method, QuantMethod::kNone);
  EXPECT_EQ(quant_config_from_yaml(YAML::Load("quant_config: none"), "t").method, QuantMethod::kNone);
  EXPECT_EQ(quant_config_from_yaml(YAML::Load("quant_config: ~"), "t").method, QuantMethod::kNone);
  const QuantConfig qat = quant_config_from_yaml(YAML::Load("quant_config: nvfp4_qat_train"), "t");
  EXPECT_EQ(qat.method, QuantMethod::kNvfp4QatTrain);
  EXPECT_EQ(qat.target_prefix_substrings, vqad::model::default_target_prefix_substrings());
  EXPECT_EQ(qat.target_prefix_substrings.size(), 10u);
  const QuantConfig qad = quant_config_from_yaml(
      YAML::Load("quant_config: {method: nvfp4_qad, target_prefix_substrings: [ffn.fc_in, to_q], "
                 "act_amax_json: /tmp/a.json, allow_uncalibrated: true}"),
      "t");
  EXPECT_EQ(qad.method, QuantMethod::kNvfp4Qad);
  EXPECT_EQ(qad.target_prefix_substrings, (std::vector<std::string>{"ffn.fc_in", "to_q"}));
  EXPECT_EQ(qad.act_amax_json, "/tmp/a.json");
  EXPECT_TRUE(qad.allow_uncalibrated);
  auto expect_error = [](const char* yaml, const std::string& needle) {
    try {
      quant_config_from_yaml(YAML::Load(yaml), "run.yaml: pipeline.dit_config");
      ADD_FAILURE() << "expected an error for " << yaml;
    } catch (const vqad::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("pipeline.dit_config.quant_config"), std::string::npos) << e.what();
    }
  };
  expect_error("quant_config: nvfp4_qat", "unknown quant_config 'nvfp4_qat'");
  expect_error("quant_config: {method: nvfp4_qad, bogus: 1}", "unknown key 'bogus'");
  expect_error("quant_config: {target_prefix_substrings: [a]}", "missing 'method'");
  expect_error("quant_config: {method: nvfp4_qad, target_prefix_substrings: []}", "empty list");
  expect_error("quant_config: {method: nvfp4_qad, allow_uncalibrated: maybe}", "allow_uncalibrated");
  expect_error("quant_config: {method: nvfp4_qat_train, act_amax_json: a.json}", "apply only to nvfp4_qad");
  expect_error("quant_config: [a, b]", "expected a method name or a map");
}

TEST(QuantPlan, JsonRoundTripAndText) {
  const QuantPlan plan =
      vqad::model::build_quant_plan(wan13b_diffusers_linears(), config_of(QuantMethod::kNvfp4Qad));
  const nlohmann::json j = plan.to_json();
  EXPECT_EQ(j["method"], "nvfp4_qad");
  EXPECT_EQ(j["count"], kWan13BTargets);
  EXPECT_EQ(j["linears"][0]["module"], "blocks.0.attn1.to_q");
  EXPECT_EQ(j["linears"][0]["activation"], "unit");
  const QuantPlan back = QuantPlan::from_json(nlohmann::json::parse(j.dump()), "meta");
  ASSERT_EQ(back.entries.size(), plan.entries.size());
  for (size_t i = 0; i < back.entries.size(); ++i) {
    EXPECT_EQ(back.entries[i].module, plan.entries[i].module);
    EXPECT_EQ(back.entries[i].activation_mode, plan.entries[i].activation_mode);
  }
  EXPECT_EQ(back.to_json(), j);
  const std::string text = plan.to_text();
  EXPECT_NE(text.find("nvfp4_qad, 300 linear(s)"), std::string::npos);
  EXPECT_NE(text.find("blocks.29.ffn.net.2  W:dynamic A:static"), std::string::npos);
  nlohmann::json bad = j;
  bad["count"] = 3;
  EXPECT_THROW(QuantPlan::from_json(bad, "meta"), vqad::Error);
  bad = j;
  bad["linears"][2]["activation"] = "per_token";
  EXPECT_THROW(QuantPlan::from_json(bad, "meta"), vqad::Error);
  EXPECT_THROW(QuantPlan::from_json(nlohmann::json::array(), "meta"), vqad::Error);
}

TEST(QuantPlan, AmaxTableKeysAndLoading) {
  int block = -1;
  std::string sub;
  ASSERT_TRUE(vqad::model::split_block_name("blocks.12.ffn.net.0.proj", &block, &sub));
  EXPECT_EQ(block, 12);
  EXPECT_EQ(sub, "ffn.net.0.proj");
  ASSERT_TRUE(vqad::model::split_block_name("transformer_blocks.3.ff.fc_in", &block, &sub));
  EXPECT_EQ(block, 3);
  EXPECT_FALSE(vqad::model::split_block_name("proj_out", &block, &sub));

  const auto table = vqad::model::amax_table_from_json(
      nlohmann::json::parse(R"({"b0.ffn.net.0.proj": 3.5, "blocks.1.ffn.net.2": {"all": 7},
                                "b2.ffn.fc_in": 1.25, "proj_out": 2})"),
      "t");
  using vqad::model::lookup_amax;
  ASSERT_NE(lookup_amax(table, "blocks.0.ffn.net.0.proj"), nullptr);
  EXPECT_EQ(*lookup_amax(table, "blocks.0.ffn.net.0.proj"), 3.5f);
  EXPECT_EQ(*lookup_amax(table, "blocks.1.ffn.net.2"), 7.0f);
  EXPECT_EQ(*lookup_amax(table, "blocks.2.ffn.net.0.proj"), 1.25f);  // via the FastVideo internal name
  EXPECT_EQ(*lookup_amax(table, "proj_out"), 2.0f);
  EXPECT_EQ(lookup_amax(table, "blocks.3.ffn.net.2"), nullptr);

  for (const char* bad : {R"({"b0.ffn.net.2": -1})", R"({"b0.ffn.net.2": 0})", R"({"b0.ffn.net.2": "3"})",
                          R"({"b0.ffn.net.2": {"max": 3}})", R"([1, 2])", R"({"b0.ffn.net.2": 1e300})"}) {
    EXPECT_THROW(vqad::model::amax_table_from_json(nlohmann::json::parse(bad), "t"), vqad::Error) << bad;
  }
  EXPECT_THROW(vqad::model::load_amax_table(temp_path("missing.json")), vqad::Error);
  const std::string broken = temp_path("broken.json");
  std::ofstream(broken) << "{\"b0.ffn.net.2\": ";
  EXPECT_THROW(vqad::model::load_amax_table(broken), vqad::Error);
  std::remove(broken.c_str());
}

TEST(QuantPlan, MakeLinearQuantsNeedsAmaxForStaticLinears) {
  const QuantPlan plan =
      vqad::model::build_quant_plan(wan13b_diffusers_linears(), config_of(QuantMethod::kNvfp4Qad));
  try {
    vqad::model::make_linear_quants(plan, config_of(QuantMethod::kNvfp4Qad));
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.ffn.net.0.proj"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("b0.ffn.net.0.proj"), std::string::npos) << e.what();
  }
  std::map<std::string, float> table;
  for (int b = 0; b < 30; ++b) {
    table["b" + std::to_string(b) + ".ffn.net.0.proj"] = 1.0f + b;
    table["b" + std::to_string(b) + ".ffn.net.2"] = 100.0f + b;
  }
  const auto quants = vqad::model::make_linear_quants(plan, config_of(QuantMethod::kNvfp4Qad), table);
  ASSERT_EQ(quants.size(), kWan13BTargets);
  const auto qad = vqad::model::qad_linears(quants);
  ASSERT_EQ(qad.size(), kWan13BTargets);
  for (const auto& l : qad) {
    if (l->name() == "blocks.4.ffn.net.2") {
      EXPECT_EQ(*l->input_amax(), 104.0f);
    }
    if (l->name() == "blocks.4.attn2.to_k") {
      EXPECT_EQ(l->activation_mode(), ScaleMode::kUnit);
    }
  }
  // Export gives the same table back.
  const nlohmann::json exported = vqad::model::export_amax_table(qad);
  EXPECT_EQ(exported.size(), 60u);
  EXPECT_EQ(vqad::model::amax_table_from_json(exported, "export"), table);
  const std::string path = temp_path("amax.json");
  vqad::model::save_amax_table(qad, path);
  EXPECT_EQ(vqad::model::load_amax_table(path), table);
  std::remove(path.c_str());

  QuantConfig allow = config_of(QuantMethod::kNvfp4Qad);
  allow.allow_uncalibrated = true;
  const auto uncal = vqad::model::qad_linears(vqad::model::make_linear_quants(plan, allow));
  EXPECT_THROW(vqad::model::export_amax_table(uncal), vqad::Error);

  const QuantPlan qat =
      vqad::model::build_quant_plan(wan13b_diffusers_linears(), config_of(QuantMethod::kNvfp4QatTrain));
  const auto dyn = vqad::model::make_linear_quants(qat, config_of(QuantMethod::kNvfp4QatTrain));
  ASSERT_EQ(dyn.size(), kWan13BTargets);
  EXPECT_EQ(dyn[0].second->describe(), "nvfp4 W:dynamic A:dynamic");
  EXPECT_TRUE(vqad::model::qad_linears(dyn).empty());
}

// A model with the two calls apply_quant_plan needs.
struct FakeModel {
  std::vector<std::pair<std::string, int>> linears;
  std::map<std::string, std::shared_ptr<vqad::ops::LinearQuant>> attached;
  const std::vector<std::pair<std::string, int>>& named_linears() const { return linears; }
  void attach_linear_quant(const std::string& name, std::shared_ptr<vqad::ops::LinearQuant> q) {
    attached[name] = std::move(q);
  }
};

TEST(QuantPlan, ApplyAttachesEveryPlannedLinear) {
  FakeModel model;
  for (const auto& n : wan13b_diffusers_linears()) model.linears.emplace_back(n, 0);
  const QuantConfig cfg = config_of(QuantMethod::kNvfp4QatTrain);
  const QuantPlan plan = vqad::model::build_quant_plan(wan13b_diffusers_linears(), cfg);
  const auto quants = vqad::model::apply_quant_plan(model, plan, cfg);
  EXPECT_EQ(quants.size(), kWan13BTargets);
  EXPECT_EQ(model.attached.size(), kWan13BTargets);
  EXPECT_EQ(model.attached.count("proj_out"), 0u);
  FakeModel other;
  other.linears = {{"blocks.0.attn1.to_q", 0}};
  EXPECT_THROW(vqad::model::apply_quant_plan(other, plan, cfg), vqad::Error);
  EXPECT_TRUE(other.attached.empty());
}

}  // namespace
