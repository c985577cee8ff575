// seeds/003's QAD linears from a recipe (issue: seed-003 QAD, shared q/k/v scales):
//  - spec conformance of the rounding order vqad chose for the QAD linear (static and unit
//    activation scales), checked bit for bit against a reference written here;
//  - the training.linear_quantization keys do what their descriptors say (plan toggles,
//    skip_blocks, gate quantization, refusals where a key would do nothing);
//  - calibrate -> amax table -> training loads it, with the table equal to an independent
//    max|x| recomputation, and a static linear without an amax an error naming it;
//  - shared_qkv_scale: equal global scales in training and in the packed export, equal to
//    the scale of the concatenated weights; off keeps each linear's own scale.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tests/support/errors.h"
#include "vqad/config/linear_quantization.h"
#include "vqad/core/error.h"
#include "vqad/data/dataset.h"
#include "vqad/data/loader.h"
#include "vqad/data/sampler.h"
#include "vqad/dist/batch_random.h"
#include "vqad/export/packed.h"
#include "vqad/io/tensors.h"
#include "vqad/model/quant_plan.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"
#include "vqad/train/calibrate.h"
#include "vqad/train/metadata.h"
#include "vqad/train/role_quant.h"
#include "vqad/train/trainer.h"
#include "test_dist_util.h"
#include "test_export_util.h"
#include "test_train_util.h"

namespace {

namespace fs = std::filesystem;
using vqad::model::QuantConfig;
using vqad::model::QuantMethod;
using vqad::nvfp4::ScaleMode;

using vqad::test::error_of;

// ---- reference: the unit-scaled operand e2m1(code) * S from the scalar block quantizer ----
torch::Tensor ref_unit_operand(const torch::Tensor& t, float s_enc) {
  const torch::Tensor v = t.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty_like(v);
  const float* p = v.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < v.numel(); b += 16) {
    const auto q = vqad::nvfp4::quantize_block(p + b, s_enc);
    const float S = vqad::nvfp4::e4m3_decode(q.scale_bits);
    for (int i = 0; i < 16; ++i) o[b + i] = vqad::nvfp4::e2m1_decode(q.codes[i]) * S;
  }
  return out;
}

float ref_bf16_amax(const torch::Tensor& t) {
  return t.to(torch::kBFloat16).to(torch::kFloat32).abs().max().item<float>();
}

// seeds/003's nvfp4_gemm on a CPU: w_sf = 2688 / amax(W) (fp32, reciprocal then multiply),
// alpha = (1 / w_sf) / input_sf, out = bf16(alpha * acc), then out + bf16(bias) in BF16.
torch::Tensor seed003_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, float input_sf,
                             float w_amax = -1.0f) {
  const float w_sf = (1.0f / std::max(w_amax >= 0.0f ? w_amax : ref_bf16_amax(w), 1e-12f)) * 2688.0f;
  const float alpha = (1.0f / w_sf) / input_sf;
  const torch::Tensor acc = torch::mm(ref_unit_operand(x, input_sf), ref_unit_operand(w, w_sf).t());
  torch::Tensor out = (acc * alpha).to(torch::kBFloat16);
  if (b.defined()) out = (out.to(torch::kFloat32) + b.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16);
  return out.to(torch::kFloat32);
}

// The same with the bias folded into one rounding (vqad's order before seeds/003's).
torch::Tensor one_rounding_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                  float input_sf) {
  const float w_sf = (1.0f / std::max(ref_bf16_amax(w), 1e-12f)) * 2688.0f;
  const float alpha = (1.0f / input_sf) * (1.0f / w_sf);
  torch::Tensor acc = torch::mm(ref_unit_operand(x, input_sf), ref_unit_operand(w, w_sf).t()) * alpha;
  return (acc + b.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16).to(torch::kFloat32);
}

// The spec's choice (spec/linear_qat.md "QAD linear method", seeds/003): a static scale is
// 2688 / amax computed once in double and rounded to fp32; an fp32 reciprocal-then-multiply
// would round twice.
TEST(QadSeed003Spec, StaticScaleIsComputedOnceInDoubleAndRoundedToFp32) {
  torch::manual_seed(31);
  const torch::Tensor a = torch::rand({4000}) * 50.0f + 1e-3f;
  int differs = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float amax = a[i].item<float>();
    const float want = static_cast<float>(2688.0 / static_cast<double>(amax));
    EXPECT_EQ(vqad::ops::static_activation_encode_scale(amax), want) << amax;
    differs += (1.0f / amax) * 2688.0f != want;
  }
  EXPECT_GT(differs, 0) << "no amax where the two roundings differ: the test could not tell them apart";
  EXPECT_EQ(vqad::ops::static_activation_encode_scale(0.0f), static_cast<float>(2688.0 / 1e-12));
  // The packed export stores input_scale = 1 / s_enc of that scale (ModelOpt's decode direction).
  const auto p = vqad::deploy::pack_linear("blocks.0.ffn.net.0.proj", torch::randn({16, 32}), ScaleMode::kStatic,
                                           3.3f, false);
  EXPECT_EQ(p.input_scale.item<float>(), 1.0f / static_cast<float>(2688.0 / static_cast<double>(3.3f)));
}

// The QAD linear (static and unit): alpha = (1/w_sf)/input_sf and the bias added to the
// GEMM's BF16 output, bit for bit; the dynamic (nvfp4_qat_train) linear keeps one rounding.
TEST(QadSeed003Spec, QadLinearAlphaAndBiasOrderBitForBit) {
  torch::manual_seed(7);
  const torch::Tensor x = torch::randn({37, 64}) * 3.0f;
  const torch::Tensor w = torch::randn({24, 64}) * 0.2f;
  const torch::Tensor b = torch::randn({24}) * 4.0f;
  // An amax whose alpha differs between (1/w_sf)/input_sf and (1/input_sf)*(1/w_sf).
  const float w_sf = (1.0f / ref_bf16_amax(w)) * 2688.0f;
  float amax = 0.0f;
  for (int i = 0; i < 1000 && amax == 0.0f; ++i) {
    const float a = 5.0f + 0.0173f * static_cast<float>(i);
    const float sx = vqad::ops::static_activation_encode_scale(a);
    if ((1.0f / w_sf) / sx != (1.0f / sx) * (1.0f / w_sf)) amax = a;
  }
  ASSERT_GT(amax, 0.0f);
  const float sx = vqad::ops::static_activation_encode_scale(amax);
  vqad::ops::Nvfp4QadLinear stat("blocks.0.ffn.net.0.proj", ScaleMode::kStatic, amax);
  vqad::ops::Nvfp4QadLinear unit("blocks.0.attn1.to_q", ScaleMode::kUnit);
  torch::NoGradGuard ng;
  const torch::Tensor ys = stat.forward(x, w, b), yu = unit.forward(x, w, b);
  EXPECT_TRUE(torch::equal(ys, seed003_linear(x, w, b, sx)));
  EXPECT_TRUE(torch::equal(yu, seed003_linear(x, w, b, 1.0f)));
  // The test tells the orders apart.
  EXPECT_FALSE(torch::equal(ys, one_rounding_linear(x, w, b, sx)));
  EXPECT_FALSE(torch::equal(yu, one_rounding_linear(x, w, b, 1.0f)));
  // bf16 activations give the same values; the packed linear (stored operand) the same bits.
  EXPECT_TRUE(torch::equal(stat.forward(x.to(torch::kBFloat16), w, b).to(torch::kFloat32), ys));
  const float s_enc_w = vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(w));
  vqad::ops::Nvfp4PackedLinear packed("p", ref_unit_operand(w, s_enc_w), 1.0f / s_enc_w, ScaleMode::kStatic, amax);
  EXPECT_TRUE(torch::equal(packed.forward(x, torch::Tensor(), b), ys));
  // Dynamic activations (nvfp4_qat_train, seeds/004) keep alpha = (1/s_x)(1/s_w) and one rounding.
  const float sxd = vqad::nvfp4::encode_scale_from_amax(ref_bf16_amax(x));
  EXPECT_TRUE(torch::equal(vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kDynamic), one_rounding_linear(x, w, b, sxd)));
}

// ---- plan toggles ---------------------------------------------------------------------------
std::vector<std::string> wan_linear_names(int blocks, bool gates) {
  std::vector<std::string> n = {"condition_embedder.time_proj"};
  for (int b = 0; b < blocks; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* a : {"attn1", "attn2"})
      for (const char* s : {".to_q", ".to_k", ".to_v", ".to_out.0"}) n.push_back(p + a + s);
    n.push_back(p + "ffn.net.0.proj");
    n.push_back(p + "ffn.net.2");
    if (gates) n.push_back(p + "to_gate_compress");
  }
  n.push_back("proj_out");
  return n;
}

std::map<std::string, int> kinds(const vqad::model::QuantPlan& plan) {
  std::map<std::string, int> k;
  for (const auto& e : plan.entries) k[vqad::model::linear_kind(e.module)] += 1;
  return k;
}

TEST(QadPlanToggles, EachToggleDoesWhatItSays) {
  QuantConfig cfg;
  cfg.method = QuantMethod::kNvfp4Qad;
  const auto names = wan_linear_names(3, true);
  auto plan = vqad::model::build_quant_plan(names, cfg);
  EXPECT_EQ(kinds(plan), (std::map<std::string, int>{{"attention", 24}, {"ffn", 6}}));  // gates off by default
  cfg.quantize_gate = true;
  plan = vqad::model::build_quant_plan(names, cfg);
  EXPECT_EQ(kinds(plan), (std::map<std::string, int>{{"attention", 24}, {"ffn", 6}, {"gate", 3}}));
  EXPECT_EQ(plan.find("blocks.1.to_gate_compress")->activation_mode, ScaleMode::kUnit);
  cfg.quantize_attention = false;
  plan = vqad::model::build_quant_plan(names, cfg);
  EXPECT_EQ(kinds(plan), (std::map<std::string, int>{{"ffn", 6}, {"gate", 3}}));
  cfg.quantize_attention = true;
  cfg.quantize_ffn = false;
  plan = vqad::model::build_quant_plan(names, cfg);
  EXPECT_EQ(kinds(plan), (std::map<std::string, int>{{"attention", 24}, {"gate", 3}}));
  cfg.quantize_ffn = true;
  cfg.skip_blocks = {0, 2};
  plan = vqad::model::build_quant_plan(names, cfg);
  EXPECT_EQ(plan.entries.size(), 11u);
  for (const auto& e : plan.entries) EXPECT_EQ(e.module.rfind("blocks.1.", 0), 0u) << e.module;
  // Errors: a gate on a model without gates, a block that does not exist, nothing to quantize.
  QuantConfig g;
  g.method = QuantMethod::kNvfp4QatTrain;
  g.quantize_gate = true;
  EXPECT_NE(error_of([&] { vqad::model::build_quant_plan(wan_linear_names(2, false), g); })
                .find("quantize_gate is set but the model has no to_gate_compress linears"),
            std::string::npos);
  QuantConfig s;
  s.method = QuantMethod::kNvfp4Qad;
  s.skip_blocks = {5};
  EXPECT_NE(error_of([&] { vqad::model::build_quant_plan(names, s); })
                .find("skip_blocks lists block 5 but the model's blocks are 0..2"),
            std::string::npos);
  s.skip_blocks = {0, 1, 2};
  EXPECT_NE(error_of([&] { vqad::model::build_quant_plan(names, s); }).find("matched none of the model's"),
            std::string::npos);
}

// ---- run config ----------------------------------------------------------------------------
std::string recipe(const fs::path& data, const std::string& out, const std::string& quant,
                   const std::string& lq = "") {
  std::string y = "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
                  "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
                  "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
                  "training:\n  data:\n    data_path: " + data.string() + "\n"
                  "    train_batch_size: 2\n    seed: 5\n"
                  "  optimizer:\n    learning_rate: 1.0e-3\n"
                  "  loop:\n    max_train_steps: 1\n"
                  "  checkpoint:\n    output_dir: " + out + "\n    training_state_checkpointing_steps: 1\n";
  if (!lq.empty()) y += "  linear_quantization:\n" + lq;
  if (quant != "none") y += "pipeline:\n  dit_config:\n    quant_config: " + quant + "\n";
  return y;
}

TEST(QadRunConfig, LinearQuantizationKeysAreReadAndRefusedWhereTheyDoNothing) {
  const fs::path d = "/nonexistent-data";
  auto run = vqad::train::parse_run_config(
      recipe(d, "/tmp/o", "nvfp4_qad",
             "    quantize_gate: false\n    quantize_attention: false\n    skip_blocks: [1]\n"
             "    shared_qkv_scale: true\n    act_amax_json: t.json\n    calibration_batches: 3\n"));
  const auto q = vqad::train::linear_quantization_config(run);
  EXPECT_FALSE(q.quantize_attention);
  EXPECT_TRUE(q.quantize_ffn);
  EXPECT_EQ(q.skip_blocks, std::vector<int64_t>{1});
  EXPECT_TRUE(q.shared_qkv_scale);
  EXPECT_EQ(q.act_amax_json, "t.json");
  EXPECT_EQ(q.calibration_batches, 3);
  const QuantConfig qc = vqad::train::role_quant_config(run, "student");
  EXPECT_EQ(qc.method, QuantMethod::kNvfp4Qad);
  EXPECT_FALSE(qc.quantize_attention);
  EXPECT_TRUE(qc.shared_qkv_scale);
  EXPECT_EQ(qc.act_amax_json, "t.json");
  // The resolved dump carries the section and loads back to the same values.
  auto again = vqad::train::parse_run_config(run.resolved_yaml);
  EXPECT_EQ(vqad::train::linear_quantization_config(again).skip_blocks, std::vector<int64_t>{1});
  // Overrides reach it; recipes without the section resolve without it.
  auto o = vqad::train::parse_run_config(recipe(d, "/tmp/o", "nvfp4_qad"),
                                         {"--training.linear_quantization.shared_qkv_scale", "true"});
  EXPECT_TRUE(vqad::train::linear_quantization_config(o).shared_qkv_scale);
  EXPECT_FALSE(vqad::train::parse_run_config(recipe(d, "/tmp/o", "nvfp4_qad")).resolved["training"].contains(
      "linear_quantization"));
  // Refusals naming the key.
  auto err = [&](const std::string& quant, const std::string& lq) {
    return error_of([&] { vqad::train::parse_run_config(recipe(d, "/tmp/o", quant, lq)); });
  };
  EXPECT_NE(err("none", "    shared_qkv_scale: true\n").find("'training.linear_quantization.shared_qkv_scale': the "
                                                             "student's linears are dense"),
            std::string::npos);
  EXPECT_NE(err("none", "    skip_blocks: [0]\n").find("'training.linear_quantization.skip_blocks'"), std::string::npos);
  EXPECT_NE(err("nvfp4_qat_train", "    act_amax_json: t.json\n")
                .find("'training.linear_quantization.act_amax_json': quant_config nvfp4_qat_train has no static"),
            std::string::npos);
  EXPECT_NE(err("nvfp4_qad", "    quantize_ffn: false\n    quantize_attention: false\n")
                .find("are all false"),
            std::string::npos);
  EXPECT_NE(err("nvfp4_qad", "    calibration_batches: 0\n").find("calibration_batches': must be >= 1"),
            std::string::npos);
  EXPECT_NE(err("nvfp4_qad", "    quantise_ffn: false\n").find("quantise_ffn"), std::string::npos);
  // Defaults change nothing for a dense student.
  EXPECT_EQ(err("none", "    quantize_ffn: true\n    shared_qkv_scale: false\n"), "");
}

// ---- calibrate -> table -> training ----------------------------------------------------------
// A LinearQuant that records max|x| and runs the dense linear (what calibration claims to do,
// written independently of CalibrationScope).
struct MaxRecorder : vqad::ops::LinearQuant {
  float m = 0.0f;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) override {
    m = std::max(m, x.detach().abs().max().to(torch::kFloat32).item<float>());
    return vqad::ops::dense_linear(x, w, b);
  }
  std::string describe() const override { return "max recorder"; }
};

TEST(QadCalibrate, TableEqualsIndependentMaxAndTrainingLoadsIt) {
  const fs::path root = vqad::test_train::fresh_test_dir("vqad_qad_calib");
  vqad::test_train::write_tiny_dataset(root / "data", 10, 4);
  const std::string yaml = recipe(root / "data", (root / "run").string(), "nvfp4_qad");
  const auto run = vqad::train::parse_run_config(yaml);
  vqad::train::CalibrateOptions co;
  co.out = (root / "amax.json").string();
  co.batches = 3;
  const auto summary = vqad::train::calibrate_run(run, co);
  EXPECT_EQ(summary.samples, 6);
  EXPECT_EQ(summary.amax.size(), 4u);  // 2 blocks x 2 FFN linears
  std::ifstream f(co.out);
  const auto table = nlohmann::json::parse(f);
  ASSERT_EQ(table.size(), 4u);
  for (const char* k : {"b0.ffn.net.0.proj", "b0.ffn.net.2", "b1.ffn.net.0.proj", "b1.ffn.net.2"})
    EXPECT_TRUE(table.contains(k)) << table.dump();

  // Independent recomputation: the student as training builds it, the static linears
  // replaced by max recorders, the documented inputs (sft's noising, uniform timesteps).
  vqad::train::RoleBuildOptions ro;
  ro.seed = 5;
  auto student = vqad::train::build_role_for_calibration(run, "student", ro);
  std::map<std::string, std::shared_ptr<MaxRecorder>> rec;
  for (const auto& e : student->plan.entries) {
    if (e.activation_mode != ScaleMode::kStatic) continue;
    rec[e.module] = std::make_shared<MaxRecorder>();
    student->model->attach_linear_quant(e.module, rec[e.module]);
  }
  ASSERT_EQ(rec.size(), 4u);
  vqad::data::DatasetSpec ds;
  ds.sources = {{(root / "data").string(), 1}};
  ds.text_len = student->model->config().text_len;
  ds.text_dim = student->model->config().text_dim;
  ds.seed = 5;
  auto dataset = vqad::data::make_dataset(ds);
  vqad::dist::set_batch_shard({0, 1});
  vqad::data::PrefetchLoader loader(dataset,
                                    vqad::data::DpSpBatchSampler(vqad::data::sampler_options_for_rank(
                                        dataset->size(), 2, 1, 1, 0, 5)),
                                    0);
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  {
    torch::NoGradGuard ng;
    for (int i = 0; i < 3; ++i) {
      auto batch = loader.next();
      auto x0 = batch.latent.to(torch::kBFloat16);
      auto noise = vqad::dist::randn_batch(batch.latent.sizes(), gen, torch::TensorOptions(torch::kFloat32))
                       .to(torch::kBFloat16);
      auto u = vqad::dist::rand_batch({x0.size(0)}, gen, torch::TensorOptions(torch::kFloat64));
      std::vector<double> tv;
      for (int64_t j = 0; j < x0.size(0); ++j)
        tv.push_back(student->grid.timestep(student->grid.index_from_uniform(u[j].item<double>())));
      auto t = torch::tensor(tv, torch::kFloat64);
      student->model->forward(student->grid.add_noise(x0, noise, t), t.to(torch::kFloat32),
                              batch.text.to(torch::kBFloat16));
    }
  }
  for (const auto& [name, r] : rec) {
    int block = 0;
    std::string sub;
    ASSERT_TRUE(vqad::model::split_block_name(name, &block, &sub));
    const std::string key = "b" + std::to_string(block) + "." + sub;
    EXPECT_GT(r->m, 0.0f);
    EXPECT_EQ(table.at(key).get<float>(), r->m) << key;
    EXPECT_EQ(summary.amax.at(name), r->m) << name;
  }

  // Training without the table: the static linear is an error naming it.
  const std::string e = error_of([&] { (void)vqad::train::Trainer(run, vqad::test_train::quiet()); });
  EXPECT_NE(e.find("no calibrated input amax for static linear 'blocks.0.ffn.net.0.proj' (table key "
                   "'b0.ffn.net.0.proj')"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("training.linear_quantization.act_amax_json is not set"), std::string::npos) << e;
  // A table missing one linear: named too.
  {
    nlohmann::json partial = table;
    partial.erase("b1.ffn.net.2");
    std::ofstream pf(root / "partial.json");
    pf << partial.dump();
  }
  const std::string e2 = error_of([&] {
    (void)vqad::train::Trainer(vqad::train::parse_run_config(yaml, {"--training.linear_quantization.act_amax_json",
                                                              (root / "partial.json").string()}),
                         vqad::test_train::quiet());
  });
  EXPECT_NE(e2.find("static linear 'blocks.1.ffn.net.2' (table key 'b1.ffn.net.2' in "), std::string::npos) << e2;

  // With it: the student's static linears carry the table's values, one step trains, the
  // checkpoint metadata records the table and the packed export's input_scale follows it.
  auto trun = vqad::train::parse_run_config(yaml, {"--training.linear_quantization.act_amax_json", co.out});
  vqad::train::Trainer trainer(trun, vqad::test_train::quiet());
  for (const auto& l : vqad::model::qad_linears(trainer.roles().at("student")->quants)) {
    if (l->activation_mode() != ScaleMode::kStatic) continue;
    ASSERT_TRUE(l->input_amax().has_value()) << l->name();
    EXPECT_EQ(*l->input_amax(), summary.amax.at(l->name())) << l->name();
  }
  auto s = trainer.run();
  ASSERT_EQ(s.checkpoints.size(), 1u);
  const auto meta = vqad::train::read_metadata(s.checkpoints.back());
  EXPECT_EQ(meta.at("training_contract").at("linear_quantization").at("input_amax"), table);
  vqad::deploy::export_model(s.checkpoints.back(), (root / "packed").string(), {.format = "nvfp4"});
  auto packed = vqad::io::load_safetensors((root / "packed/transformer/diffusion_pytorch_model.safetensors").string());
  EXPECT_EQ(packed.at("blocks.1.ffn.net.2.input_scale").item<float>(),
            1.0f / vqad::ops::static_activation_encode_scale(table.at("b1.ffn.net.2").get<float>()));

  // The CLI writes the same table.
  const std::string cmd = std::string(VQAD_BINARY) + " calibrate " + (root / "recipe.yaml").string() + " --out " +
                          (root / "cli.json").string() + " --batches 3 --device cpu > " +
                          (root / "cli.log").string() + " 2>&1";
  {
    std::ofstream rf(root / "recipe.yaml");
    rf << yaml;
  }
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream cf(root / "cli.json");
  EXPECT_EQ(nlohmann::json::parse(cf), table);
  std::ifstream lf(root / "cli.log");
  const std::string log((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  EXPECT_NE(log.find("calibrated 4 static linear(s) over 6 sample(s)"), std::string::npos) << log;
  fs::remove_all(root);
}

// Two launched ranks, batch 2 each: every rank sees its half of each global batch of 4 (the
// same rows, noise and timesteps as one process with batch 4: per-rank sampling draws the
// global batch), so the MAX over the ranks is the one-process table of batch 4.
TEST(QadCalibrate, LaunchedRanksReduceWithMax) {
  VQAD_SKIP_WITHOUT_GLOO();
  const fs::path root = vqad::test_train::fresh_test_dir("vqad_qad_calib_dist");
  vqad::test_train::write_tiny_dataset(root / "data", 12, 6);
  std::string y = recipe(root / "data", (root / "run").string(), "nvfp4_qad");
  {
    std::ofstream(root / "recipe.yaml") << y;
  }
  const auto two = vqad::test_dist::run_vqad("launch --nproc 2 calibrate " + (root / "recipe.yaml").string() +
                                                 " --out " + (root / "w2.json").string() +
                                                 " --batches 2 --device cpu --dist-timeout 60",
                                             root / "w2.log");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_TRUE(vqad::test_dist::contains(two.output, "over 8 sample(s) (2 batch(es) x 2 rank(s), MAX across ranks)"))
      << two.output;
  const auto one = vqad::test_dist::run_vqad("calibrate " + (root / "recipe.yaml").string() + " --out " +
                                                 (root / "w1.json").string() +
                                                 " --batches 2 --device cpu --training.data.train_batch_size 4",
                                             root / "w1.log");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  std::ifstream f1(root / "w1.json"), f2(root / "w2.json");
  const auto t1 = nlohmann::json::parse(f1), t2 = nlohmann::json::parse(f2);
  ASSERT_EQ(t1.size(), 4u);
  EXPECT_EQ(t1, t2);
  fs::remove_all(root);
}

TEST(QadCalibrate, RefusesWhatItCannotCalibrate) {
  const fs::path d = "/nonexistent-data";
  vqad::train::CalibrateOptions co;
  co.out = "/tmp/never.json";
  EXPECT_NE(error_of([&] { vqad::train::calibrate_run(vqad::train::parse_run_config(recipe(d, "/tmp/o",
                                                                                            "nvfp4_qat_train")),
                                                      co); })
                .find("models.student.quant_config is 'nvfp4_qat_train'"),
            std::string::npos);
  co.out.clear();
  EXPECT_NE(error_of([&] {
              vqad::train::calibrate_run(vqad::train::parse_run_config(recipe(d, "/tmp/o", "nvfp4_qad")), co);
            }).find("--out FILE is required"),
            std::string::npos);
}

// ---- shared q/k/v scales -------------------------------------------------------------------
TEST(QadSharedQkv, GroupsAreSelfQkvAndCrossKv) {
  QuantConfig cfg;
  cfg.method = QuantMethod::kNvfp4Qad;
  cfg.shared_qkv_scale = true;
  const auto plan = vqad::model::build_quant_plan(wan_linear_names(2, false), cfg);
  const auto groups = vqad::model::shared_scale_groups(plan);
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].first, "blocks.0.attn1.qkv");
  EXPECT_EQ(groups[0].second,
            (std::vector<std::string>{"blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v"}));
  EXPECT_EQ(groups[1].first, "blocks.0.attn2.kv");
  EXPECT_EQ(groups[1].second, (std::vector<std::string>{"blocks.0.attn2.to_k", "blocks.0.attn2.to_v"}));
  EXPECT_TRUE(vqad::model::QuantPlan::from_json(plan.to_json(), "p").shared_qkv_scale);
  cfg.shared_qkv_scale = false;
  const auto off = vqad::model::build_quant_plan(wan_linear_names(2, false), cfg);
  EXPECT_TRUE(vqad::model::shared_scale_groups(off).empty());
  EXPECT_FALSE(off.to_json().contains("shared_qkv_scale"));  // plans of today's runs are unchanged
}

TEST(QadSharedQkv, ForwardUsesTheConcatenatedWeightScale) {
  torch::manual_seed(12);
  const torch::Tensor x = torch::randn({9, 32});
  const torch::Tensor wq = torch::randn({16, 32}) * 0.1f, wk = torch::randn({16, 32}) * 0.7f,
                      wv = torch::randn({16, 32}) * 0.3f;
  const torch::Tensor b = torch::randn({16});
  auto group = std::make_shared<vqad::ops::WeightScaleGroup>(
      "blocks.0.attn1.qkv", std::vector<std::string>{"q", "k", "v"},
      [&] { return std::vector<torch::Tensor>{wq, wk, wv}; });
  EXPECT_EQ(group->amax().item<float>(), ref_bf16_amax(torch::cat({wq, wk, wv})));
  torch::NoGradGuard ng;
  for (const auto& w : {wq, wk, wv}) {
    vqad::ops::Nvfp4QadLinear shared("s", ScaleMode::kUnit);
    shared.set_weight_scale_group(group);
    const torch::Tensor y = shared.forward(x, w, b);
    EXPECT_TRUE(torch::equal(y, seed003_linear(x, w, b, 1.0f, ref_bf16_amax(torch::cat({wq, wk, wv})))));
    // Off: each linear its own scale, exactly the ungrouped linear.
    vqad::ops::Nvfp4QadLinear own("o", ScaleMode::kUnit);
    EXPECT_TRUE(torch::equal(own.forward(x, w, b), seed003_linear(x, w, b, 1.0f)));
    EXPECT_TRUE(torch::equal(own.forward(x, w, b), vqad::ops::nvfp4_linear(x, w, b, ScaleMode::kUnit)));
    vqad::ops::Nvfp4DynamicLinear dyn("d");
    dyn.set_weight_scale_group(group);
    const float sxd = vqad::nvfp4::encode_scale_from_amax(ref_bf16_amax(x));
    const float s_w = vqad::nvfp4::encode_scale_from_amax(group->amax().item<float>());
    const torch::Tensor acc = torch::mm(ref_unit_operand(x, sxd), ref_unit_operand(w, s_w).t()) *
                              ((1.0f / sxd) * (1.0f / s_w));
    EXPECT_TRUE(torch::equal(dyn.forward(x, w, b),
                             (acc + b.to(torch::kBFloat16).to(torch::kFloat32)).to(torch::kBFloat16).to(torch::kFloat32)));
  }
  // The k weight holds the group's amax: its shared scale is its own.
  vqad::ops::Nvfp4QadLinear sk("k", ScaleMode::kUnit);
  sk.set_weight_scale_group(group);
  EXPECT_TRUE(torch::equal(sk.forward(x, wk, b), vqad::ops::nvfp4_linear(x, wk, b, ScaleMode::kUnit)));
  EXPECT_FALSE(torch::equal(
      [&] {
        vqad::ops::Nvfp4QadLinear sq("q", ScaleMode::kUnit);
        sq.set_weight_scale_group(group);
        return sq.forward(x, wq, b);
      }(),
      vqad::ops::nvfp4_linear(x, wq, b, ScaleMode::kUnit)));
}

// The tiny model's default init gives q, k and v the same bf16 amax (about 1/sqrt(K)):
// scale k and v so that sharing the scale changes something. The caller rewrites the
// checkpoint's metadata afterwards (its file hashes).
void scale_qkv_weights(const fs::path& ckpt) {
  const fs::path f = ckpt / "student/transformer/diffusion_pytorch_model.safetensors";
  auto tensors = vqad::io::load_safetensors(f.string());
  std::vector<std::pair<std::string, torch::Tensor>> list;
  for (auto& [k, v] : tensors) {
    torch::Tensor t = v.clone();
    if (k.find("attn1.to_k.weight") != std::string::npos) t.mul_(3.0f);
    if (k.find("attn1.to_v.weight") != std::string::npos) t.mul_(0.37f);
    if (k.find("attn2.to_v.weight") != std::string::npos) t.mul_(2.5f);
    list.emplace_back(k, t);
  }
  tensors.clear();
  vqad::io::save_safetensors(f.string(), list, {{"format", "pt"}});
}

void shared_export(QuantMethod method) {
  using namespace vqad::test_export;
  const fs::path dir = fresh_dir(std::string("shared_") + vqad::model::quant_method_name(method));
  TinyCheckpoint ck = write_tiny_checkpoint(dir / "checkpoint-1", method, 21);
  scale_qkv_weights(dir / "checkpoint-1");
  // The run trained with shared_qkv_scale: its plan says so.
  ck.plan.shared_qkv_scale = true;
  auto meta = vqad::train::read_metadata((dir / "checkpoint-1").string());
  nlohmann::json lq = meta["training_contract"]["linear_quantization"];
  lq["shared_qkv_scale"] = true;
  meta["training_contract"]["linear_quantization"] = lq;
  vqad::train::write_metadata((dir / "checkpoint-1").string(), meta);
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "packed").string(), {.format = "nvfp4"});
  auto t = vqad::io::load_safetensors((dir / "packed/transformer/diffusion_pytorch_model.safetensors").string());
  auto w = vqad::model::read_weights((dir / "checkpoint-1/student").string());
  for (int b = 0; b < 2; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const auto& [attn, subs] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"attn1", {"to_q", "to_k", "to_v"}}, {"attn2", {"to_k", "to_v"}}}) {
      std::vector<torch::Tensor> ws;
      for (const auto& s : subs) ws.push_back(w.tensors.at(p + attn + "." + s + ".weight"));
      const float want = 1.0f / vqad::nvfp4::encode_scale_from_amax(ref_bf16_amax(torch::cat(ws)));
      for (const auto& s : subs) {
        const std::string m = p + attn + "." + s;
        EXPECT_EQ(t.at(m + ".weight_scale_2").item<float>(), want) << m;
        if (method == QuantMethod::kNvfp4Qad) EXPECT_EQ(t.at(m + ".input_scale").item<float>(), 1.0f) << m;
      }
    }
    // Cross-attention q keeps its own scale.
    const std::string q2 = p + "attn2.to_q";
    EXPECT_EQ(t.at(q2 + ".weight_scale_2").item<float>(),
              1.0f / vqad::nvfp4::encode_scale_from_amax(ref_bf16_amax(w.tensors.at(q2 + ".weight"))));
  }
  const auto pmeta = vqad::train::read_metadata((dir / "packed").string());
  EXPECT_EQ(pmeta.at("export").at("shared_scale_groups").size(), 4u);
  // Export -> load -> forward equals the shared-scale fake-quant student bit for bit.
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  auto student = ck.student();
  auto loaded = vqad::deploy::load_inference_model((dir / "packed").string());
  torch::NoGradGuard ng;
  const TinyInputs in = tiny_inputs(3);
  const torch::Tensor a = student->forward(in.x, in.t, in.text);
  EXPECT_TRUE(torch::equal(a, loaded.model->forward(in.x, in.t, in.text)));
  // ... and differs from the student with per-linear scales (the option is not a no-op).
  ck.plan.shared_qkv_scale = false;
  EXPECT_FALSE(torch::equal(a, ck.student()->forward(in.x, in.t, in.text)));
  fs::remove_all(dir);
}

TEST(QadSharedQkv, PackedExportScalesAreEqualAndLoadBitExactQad) { shared_export(QuantMethod::kNvfp4Qad); }
TEST(QadSharedQkv, PackedExportScalesAreEqualAndLoadBitExactDynamic) { shared_export(QuantMethod::kNvfp4QatTrain); }

TEST(QadSharedQkv, OffKeepsEachLinearsOwnScale) {
  using namespace vqad::test_export;
  const fs::path dir = fresh_dir("shared_off");
  write_tiny_checkpoint(dir / "checkpoint-1", QuantMethod::kNvfp4Qad, 21);
  scale_qkv_weights(dir / "checkpoint-1");
  vqad::train::write_metadata((dir / "checkpoint-1").string(),
                              vqad::train::read_metadata((dir / "checkpoint-1").string()));
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "packed").string(), {.format = "nvfp4"});
  auto t = vqad::io::load_safetensors((dir / "packed/transformer/diffusion_pytorch_model.safetensors").string());
  auto w = vqad::model::read_weights((dir / "checkpoint-1/student").string());
  for (const char* s : {"to_q", "to_k", "to_v"}) {
    const std::string m = std::string("blocks.0.attn1.") + s;
    EXPECT_EQ(t.at(m + ".weight_scale_2").item<float>(),
              1.0f / vqad::nvfp4::encode_scale_from_amax(ref_bf16_amax(w.tensors.at(m + ".weight"))))
        << m;
  }
  EXPECT_NE(t.at("blocks.0.attn1.to_q.weight_scale_2").item<float>(),
            t.at("blocks.0.attn1.to_k.weight_scale_2").item<float>());
  EXPECT_TRUE(vqad::train::read_metadata((dir / "packed").string()).at("export").at("shared_scale_groups").empty());
  fs::remove_all(dir);
}

}  // namespace
