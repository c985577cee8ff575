// Wan weights: Diffusers save -> load round trip, the three source layouts, strict-load
// errors (single file and sharded) and config.json parsing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "vqad/core/error.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"

namespace {

namespace fs = std::filesystem;
using vqad::model::WanConfig;
using vqad::model::WanModel;
using vqad::model::WanModelOptions;
using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

class WanWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("vqad_wan_weights_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    torch::manual_seed(17);
    model_ = std::make_shared<WanModel>(WanConfig::tiny(), opts());
    torch::NoGradGuard g;
    for (auto& p : model_->parameters()) p.add_(0.01 * torch::randn_like(p));  // no default values
  }
  void TearDown() override { fs::remove_all(dir_); }
  static WanModelOptions opts() { return WanModelOptions{torch::kCPU, torch::kFloat32, false}; }

  Tensors state() const {
    Tensors t;
    for (const auto& item : model_->named_parameters()) t.emplace_back(item.key(), item.value().detach().clone());
    return t;
  }
  // A transformer dir holding `tensors` as one Diffusers file plus the tiny config.
  std::string write_single(const std::string& name, const Tensors& tensors,
                           const std::string& file = "diffusion_pytorch_model.safetensors") {
    fs::path d = dir_ / name / "transformer";
    fs::create_directories(d);
    vqad::io::save_safetensors((d / file).string(), tensors);
    std::ofstream(d / "config.json") << WanConfig::tiny().to_json().dump(2);
    return (dir_ / name).string();
  }
  std::string write_sharded(const std::string& name, const Tensors& tensors) {
    fs::path d = dir_ / name / "transformer";
    vqad::io::save_sharded(d.string(), tensors, 64 * 1024, "diffusion_pytorch_model");
    std::ofstream(d / "config.json") << WanConfig::tiny().to_json().dump(2);
    return (dir_ / name).string();
  }
  std::string load_error(const std::string& path) {
    try {
      vqad::model::wan_from_pretrained(path, opts());
    } catch (const vqad::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "loading " << path << " must fail";
    return "";
  }
  void expect_same_params(WanModel& a, WanModel& b) {
    auto pa = a.named_parameters(), pb = b.named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (const auto& item : pa) {
      ASSERT_TRUE(pb.contains(item.key())) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
    }
  }

  fs::path dir_;
  std::shared_ptr<WanModel> model_;
};

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST_F(WanWeights, SaveLoadRoundTripIsBitExact) {
  const std::string out = (dir_ / "export").string();
  vqad::model::save_diffusers(*model_, out);
  ASSERT_TRUE(fs::is_regular_file(dir_ / "export/transformer/config.json"));
  ASSERT_TRUE(fs::is_regular_file(dir_ / "export/transformer/diffusion_pytorch_model.safetensors"));
  auto raw = vqad::io::load_safetensors((dir_ / "export/transformer/diffusion_pytorch_model.safetensors").string());
  EXPECT_EQ(raw.size(), 15u + 27u * 2u);
  for (const auto& [k, t] : raw) EXPECT_EQ(t.scalar_type(), torch::kFloat32) << k;

  for (const std::string& path : {out, out + "/transformer",
                                  out + "/transformer/diffusion_pytorch_model.safetensors"}) {
    auto loaded = vqad::model::wan_from_pretrained(path, opts());
    EXPECT_EQ(loaded->config(), model_->config());
    expect_same_params(*model_, *loaded);
  }
  auto loaded = vqad::model::wan_from_pretrained(out, opts());
  auto x = torch::randn({1, 16, 2, 4, 4});
  auto text = torch::randn({1, 5, WanConfig::tiny().text_dim});
  torch::NoGradGuard g;
  EXPECT_TRUE(torch::equal(model_->forward(x, torch::tensor({250.0f}), text),
                           loaded->forward(x, torch::tensor({250.0f}), text)));
}

TEST_F(WanWeights, ShardedAndFastVideoExportLoad) {
  auto sharded = write_sharded("sharded", state());
  int shards = 0;
  for (const auto& e : fs::directory_iterator(fs::path(sharded) / "transformer"))
    shards += e.path().extension() == ".safetensors";
  ASSERT_GT(shards, 2);
  EXPECT_EQ(vqad::model::locate_weights(sharded).kind, vqad::model::WeightSource::Kind::kSharded);
  expect_same_params(*model_, *vqad::model::wan_from_pretrained(sharded, opts()));

  // FastVideo export: transformer/model.safetensors, a stale index from the base model beside it.
  auto fv = write_single("fastvideo", state(), "model.safetensors");
  std::ofstream(fs::path(fv) / "transformer/diffusion_pytorch_model.safetensors.index.json")
      << R"({"weight_map": {"x": "diffusion_pytorch_model-00001-of-00002.safetensors"}})";
  EXPECT_EQ(vqad::model::locate_weights(fv).kind, vqad::model::WeightSource::Kind::kFastVideoExport);
  expect_same_params(*model_, *vqad::model::wan_from_pretrained(fv, opts()));

  // bf16 weights are accepted and widened into the fp32 masters.
  Tensors half;
  for (auto& [k, t] : state()) half.emplace_back(k, t.to(torch::kBFloat16));
  auto loaded = vqad::model::wan_from_pretrained(write_single("bf16", half), opts());
  auto w = loaded->named_parameters()["proj_out.weight"];
  EXPECT_EQ(w.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(w, model_->named_parameters()["proj_out.weight"].to(torch::kBFloat16).to(torch::kFloat32)));
}

TEST_F(WanWeights, AmbiguousOrEmptyDirectoriesAreErrors) {
  auto both = write_single("both", state());
  vqad::io::save_safetensors((fs::path(both) / "transformer/model.safetensors").string(), state());
  EXPECT_TRUE(has(load_error(both), "both a FastVideo export"));
  fs::create_directories(dir_ / "empty/transformer");
  EXPECT_TRUE(has(load_error((dir_ / "empty").string()), "holds none of"));
  EXPECT_TRUE(has(load_error((dir_ / "nowhere").string()), "does not exist"));
  auto nocfg = write_single("nocfg", state());
  fs::remove(fs::path(nocfg) / "transformer/config.json");
  EXPECT_TRUE(has(load_error(nocfg), "no config.json"));
}

TEST_F(WanWeights, StrictMissingUnexpectedMisshaped) {
  Tensors missing, unexpected = state(), misshaped;
  for (auto& [k, t] : state())
    if (k != "blocks.1.attn2.norm_k.weight") missing.emplace_back(k, t);
  auto e = load_error(write_single("missing", missing));
  EXPECT_TRUE(has(e, "1 missing, 0 unexpected, 0 mis-shaped")) << e;
  EXPECT_TRUE(has(e, "blocks.1.attn2.norm_k.weight (expected [64])")) << e;

  unexpected.emplace_back("blocks.2.attn1.to_q.weight", torch::zeros({64, 64}));
  unexpected.emplace_back("pos_embed", torch::zeros({3}));
  e = load_error(write_single("unexpected", unexpected));
  EXPECT_TRUE(has(e, "0 missing, 2 unexpected")) << e;
  EXPECT_TRUE(has(e, "blocks.2.attn1.to_q.weight (in ")) << e;
  EXPECT_TRUE(has(e, "pos_embed")) << e;
  EXPECT_TRUE(has(e, "diffusion_pytorch_model.safetensors")) << e;

  for (auto& [k, t] : state())
    misshaped.emplace_back(k, k == "blocks.0.ffn.net.2.weight" ? torch::zeros({64, 127}) : t);
  e = load_error(write_single("misshaped", misshaped));
  EXPECT_TRUE(has(e, "1 mis-shaped")) << e;
  EXPECT_TRUE(has(e, "blocks.0.ffn.net.2.weight: expected [64, 128], found [64, 127]")) << e;

  Tensors ints;
  for (auto& [k, t] : state()) ints.emplace_back(k, k == "proj_out.bias" ? torch::zeros({64}, torch::kInt32) : t);
  e = load_error(write_single("ints", ints));
  EXPECT_TRUE(has(e, "proj_out.bias: expected a floating dtype")) << e;

  // All three at once: one error listing each.
  Tensors all;
  for (auto& [k, t] : misshaped)
    if (k != "scale_shift_table") all.emplace_back(k, t);
  all.emplace_back("extra.weight", torch::zeros({2}));
  e = load_error(write_single("all", all));
  EXPECT_TRUE(has(e, "1 missing, 1 unexpected, 1 mis-shaped")) << e;
  EXPECT_TRUE(has(e, "scale_shift_table (expected [1, 2, 64])")) << e;
}

TEST_F(WanWeights, StrictErrorsInShardedSetNameTheShard) {
  Tensors missing, unexpected = state(), misshaped;
  for (auto& [k, t] : state())
    if (k != "blocks.0.attn1.to_v.bias") missing.emplace_back(k, t);
  auto e = load_error(write_sharded("missing", missing));
  EXPECT_TRUE(has(e, "1 missing")) << e;
  EXPECT_TRUE(has(e, "blocks.0.attn1.to_v.bias")) << e;

  unexpected.emplace_back("blocks.0.to_gate_compress.weight_typo", torch::zeros({4}));
  e = load_error(write_sharded("unexpected", unexpected));
  EXPECT_TRUE(has(e, "1 unexpected")) << e;
  EXPECT_TRUE(has(e, "diffusion_pytorch_model-000")) << e;  // the shard holding it

  for (auto& [k, t] : state())
    misshaped.emplace_back(k, k == "condition_embedder.time_proj.weight" ? torch::zeros({384, 63}) : t);
  e = load_error(write_sharded("misshaped", misshaped));
  EXPECT_TRUE(has(e, "condition_embedder.time_proj.weight: expected [384, 64], found [384, 63] in ")) << e;
  EXPECT_TRUE(has(e, "-of-000")) << e;

  // A shard holding a tensor that its index does not list.
  auto root = write_sharded("unlisted", state());
  fs::path index = fs::path(root) / "transformer/diffusion_pytorch_model.safetensors.index.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
  j["weight_map"].erase("proj_out.bias");
  std::ofstream(index) << j.dump();
  e = load_error(root);
  EXPECT_TRUE(has(e, "'proj_out.bias' is in ")) << e;
  EXPECT_TRUE(has(e, "does not list it")) << e;
}

TEST_F(WanWeights, GateCompressAbsentIsZeroPresentIsKept) {
  WanConfig g = WanConfig::tiny();
  g.gate_compress = true;
  WanModel gated(g, opts());
  {
    torch::NoGradGuard ng;
    gated.named_parameters()["blocks.0.to_gate_compress.weight"].fill_(3.0);
  }
  auto state = vqad::model::read_weights(write_single("dense", this->state()));
  vqad::model::load_weights(gated, state);  // checkpoint without the gate
  EXPECT_EQ(gated.named_parameters()["blocks.0.to_gate_compress.weight"].abs().sum().item<float>(), 0.0f);

  {
    torch::NoGradGuard ng;
    gated.named_parameters()["blocks.1.to_gate_compress.bias"].fill_(0.5);
  }
  vqad::model::save_diffusers(gated, (dir_ / "vsa").string());
  auto back = vqad::model::wan_from_pretrained((dir_ / "vsa").string(), opts());
  EXPECT_TRUE(back->config().gate_compress);
  expect_same_params(gated, *back);
  // ... and a dense model refuses them (unexpected keys).
  auto vsa_state = vqad::model::read_weights((dir_ / "vsa").string());
  WanModel dense(WanConfig::tiny(), opts());
  EXPECT_THROW(vqad::model::load_weights(dense, vsa_state), vqad::Error);
}

// ---------------------------------------------------------------------------------------
TEST(WanConfigJson, DiffusersConfigParsesStrictly) {
  // Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json.
  const char* text = R"({
    "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
    "added_kv_proj_dim": null, "attention_head_dim": 128, "cross_attn_norm": true,
    "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": null, "in_channels": 16,
    "num_attention_heads": 12, "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096})";
  auto j = nlohmann::json::parse(text);
  EXPECT_EQ(WanConfig::from_json(j, "t"), WanConfig::wan_1_3b());
  for (const auto& c : {WanConfig::wan_1_3b(), WanConfig::wan_14b()})
    EXPECT_EQ(WanConfig::from_json(c.to_json(), "t"), c);
  auto tiny = WanConfig::tiny();
  auto back = WanConfig::from_json(tiny.to_json(), "t");
  back.text_len = tiny.text_len;  // a data property, not part of config.json
  EXPECT_EQ(back, tiny);

  auto err = [](nlohmann::json bad) {
    try {
      WanConfig::from_json(bad, "cfg.json");
    } catch (const vqad::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto m = j;
  m.erase("ffn_dim");
  EXPECT_TRUE(has(err(m), "cfg.json: missing required field(s): ffn_dim")) << err(m);
  m = j;
  m["num_frames"] = 3;
  EXPECT_TRUE(has(err(m), "unknown field(s) for a Wan2.1 T2V transformer: num_frames")) << err(m);
  m = j;
  m["qk_norm"] = "rms_norm";
  EXPECT_TRUE(has(err(m), "'qk_norm'")) << err(m);
  m = j;
  m["image_dim"] = 1280;
  EXPECT_TRUE(has(err(m), "'image_dim' must be null")) << err(m);
  m = j;
  m["num_layers"] = 30.5;
  EXPECT_TRUE(has(err(m), "'num_layers' must be an integer")) << err(m);
  m = j;
  m["patch_size"] = {1, 2};
  EXPECT_TRUE(has(err(m), "'patch_size'")) << err(m);
  m = j;
  m["attention_head_dim"] = 10;  // RoPE split [6, 2, 2] is fine; 9 gives [5, 2, 2]
  EXPECT_EQ(err(m), "no error");
  m["attention_head_dim"] = 9;
  EXPECT_TRUE(has(err(m), "RoPE split")) << err(m);
  m = j;
  m["_class_name"] = "FluxTransformer2DModel";
  EXPECT_TRUE(has(err(m), "_class_name")) << err(m);
  EXPECT_THROW(WanConfig::preset("7B"), vqad::Error);
}

}  // namespace
