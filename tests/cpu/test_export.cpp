// Packed NVFP4 export (export/packed.h): the packed tensors decode to FQ(W) of training,
// export -> load -> forward equals the fake-quant student bit for bit on a tiny model,
// bad inputs give one-line errors, lineage continues through the export.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/support/errors.h"
#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/export/packed.h"
#include "vqad/io/tensors.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/packed_weights.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/metadata.h"
#include "test_export_util.h"

namespace {

namespace fs = std::filesystem;
using vqad::model::QuantMethod;
using vqad::model::WanConfig;
using vqad::model::WanModel;
using vqad::nvfp4::ScaleMode;
using namespace vqad::test_export;

using vqad::test::error_of;

TEST(ExportPack, PackedTensorsDecodeToTheFakeQuantWeight) {
  torch::manual_seed(11);
  torch::Tensor w = torch::randn({40, 96}) * 0.05;
  w.narrow(0, 3, 1).narrow(1, 16, 16).zero_();   // an all-zero block
  w.index_put_({5, 7}, 3.0);                      // a heavy tail sets the global scale
  for (bool swizzled : {false, true}) {
    const auto p = vqad::deploy::pack_linear("m", w, ScaleMode::kDynamic, std::nullopt, swizzled);
    ASSERT_EQ(p.weight.scalar_type(), torch::kUInt8);
    ASSERT_EQ(p.weight.sizes(), (std::vector<int64_t>{40, 48}));
    ASSERT_EQ(p.weight_scale.scalar_type(), torch::kFloat8_e4m3fn);
    ASSERT_EQ(p.weight_scale.sizes(), (std::vector<int64_t>{40, 6}));
    ASSERT_EQ(p.weight_scale_2.dim(), 0);
    EXPECT_FALSE(p.input_scale.defined());
    // Reference FQ(W): the scalar quantizer on bf16(W) with the dynamic weight scale.
    const torch::Tensor wb = w.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
    const float s_enc = vqad::nvfp4::encode_scale_from_amax(wb.abs().max().item<float>());
    EXPECT_EQ(p.weight_encode_scale, s_enc);
    EXPECT_EQ(p.weight_scale_2.item<float>(), 1.0f / s_enc);
    const auto q = vqad::nvfp4::quantize_matrix(wb.data_ptr<float>(), 40, 96, s_enc);
    const uint8_t* codes = p.weight.data_ptr<uint8_t>();
    const torch::Tensor sb = p.weight_scale.view(torch::kUInt8).contiguous();
    const float ws2 = p.weight_scale_2.item<float>();
    int64_t zero_blocks = 0;
    for (int64_t i = 0; i < 40 * 96; ++i) {
      const uint8_t c = (i % 2 == 0) ? (codes[i / 2] & 0xF) : (codes[i / 2] >> 4);
      const uint8_t s = sb.data_ptr<uint8_t>()[i / 16];
      const float y = vqad::nvfp4::e2m1_decode(c) * vqad::nvfp4::e4m3_decode(s) * ws2;
      ASSERT_EQ(y, q.values[i]) << "element " << i;
      ASSERT_EQ(std::signbit(y), std::signbit(q.values[i])) << "element " << i;
      if (q.scales[i / 16] == 0) {
        ASSERT_EQ(s, 0x38) << "all-zero blocks carry the scale 1.0";
        zero_blocks += i % 16 == 0;
      } else {
        ASSERT_EQ(s, q.scales[i / 16]);
      }
    }
    EXPECT_EQ(zero_blocks, 1);
    // And the unit operand the training linear multiplies is e2m1 * S.
    const torch::Tensor wu = vqad::ops::nvfp4_unit_operand_cpu(w, s_enc);
    const torch::Tensor fq = wu * (1.0f / s_enc);
    EXPECT_TRUE(torch::equal(fq, torch::from_blob(const_cast<float*>(q.values.data()), {40, 96})));
    if (swizzled) {
      ASSERT_TRUE(p.weight_scale_swizzled.defined());
      EXPECT_EQ(p.weight_scale_swizzled.sizes(), (std::vector<int64_t>{128, 8}));
      std::vector<uint8_t> back(40 * 6);
      vqad::nvfp4::unswizzle_scales(p.weight_scale_swizzled.view(torch::kUInt8).contiguous().data_ptr<uint8_t>(), 40,
                                    6, back.data());
      EXPECT_EQ(0, std::memcmp(back.data(), sb.data_ptr<uint8_t>(), back.size()));
    } else {
      EXPECT_FALSE(p.weight_scale_swizzled.defined());
    }
  }
}

TEST(ExportPack, InputScalesAreTheTrainingDecodeScales) {
  const torch::Tensor w = torch::randn({16, 32});
  const auto unit = vqad::deploy::pack_linear("u", w, ScaleMode::kUnit, std::nullopt, false);
  EXPECT_EQ(unit.input_scale.item<float>(), 1.0f);
  const auto stat = vqad::deploy::pack_linear("s", w, ScaleMode::kStatic, 3.7f, false);
  EXPECT_EQ(stat.input_scale.item<float>(), 1.0f / vqad::ops::static_activation_encode_scale(3.7f));
  EXPECT_NEAR(stat.input_scale.item<float>(), 3.7f / 2688.0f, 1e-9);
  EXPECT_NE(error_of([&] { vqad::deploy::pack_linear("s", w, ScaleMode::kStatic, std::nullopt, false); })
                .find("'s': a static activation scale needs"),
            std::string::npos);
}

TEST(ExportPack, BadWeightsAreErrorsNamingTheLinear) {
  const std::string k40 = error_of([] {
    vqad::deploy::pack_linear("blocks.0.ffn.net.2", torch::randn({8, 40}), ScaleMode::kDynamic, std::nullopt, false);
  });
  EXPECT_NE(k40.find("'blocks.0.ffn.net.2': K = 40 is not a multiple of 16"), std::string::npos) << k40;
  torch::Tensor bad = torch::randn({8, 32});
  bad.index_put_({1, 2}, std::numeric_limits<float>::infinity());
  const std::string inf = error_of([&] { vqad::deploy::pack_linear("x", bad, ScaleMode::kDynamic, std::nullopt, false); });
  EXPECT_NE(inf.find("'x': the weight holds non-finite values"), std::string::npos) << inf;
}

// export -> load -> forward equals the fake-quant student bit for bit.
void round_trip(QuantMethod method, const std::string& name) {
  vqad::ops::AttentionBackendScope scope(vqad::AttentionBackend::kTorchSdpa);
  const fs::path dir = fresh_dir(name);
  const TinyCheckpoint ck = write_tiny_checkpoint(dir / "checkpoint-3", method, 21);
  const fs::path out = dir / "packed";
  const auto summary = vqad::deploy::export_model((dir / "checkpoint-3").string(), out.string(),
                                                  {.format = "nvfp4", .swizzled_scales = true});
  EXPECT_EQ(summary.quantized_linears, static_cast<int64_t>(ck.plan.entries.size()));
  EXPECT_GT(summary.bytes_per_parameter(), 0.5625);  // 4-bit codes + one E4M3 byte per 16, plus the rest

  // The file holds the ModelOpt layout, config.json the converted quantization_config.
  auto tensors = vqad::io::load_safetensors((out / "transformer/diffusion_pytorch_model.safetensors").string());
  const std::string m = "blocks.1.ffn.net.0.proj";
  ASSERT_TRUE(tensors.count(m + ".weight"));
  EXPECT_EQ(tensors.at(m + ".weight").scalar_type(), torch::kUInt8);
  EXPECT_EQ(tensors.at(m + ".weight_scale").scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(tensors.at(m + ".weight_scale_2").dim(), 0);
  EXPECT_EQ(tensors.count(m + ".input_scale"), method == QuantMethod::kNvfp4Qad ? 1u : 0u);
  EXPECT_EQ(tensors.at(m + ".bias").scalar_type(), torch::kFloat32);
  EXPECT_EQ(tensors.at("proj_out.weight").scalar_type(), torch::kFloat32);
  int64_t bytes = 0, params = 0;
  for (const auto& e : ck.plan.entries) {
    for (const char* s : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale", ".weight_scale_swizzled"})
      if (tensors.count(e.module + s)) bytes += tensors.at(e.module + s).nbytes();
    params += tensors.at(e.module + ".weight").numel() * 2;
  }
  EXPECT_EQ(summary.quantized_bytes, bytes);
  EXPECT_EQ(summary.quantized_parameters, params);
  std::ifstream cf(out / "transformer/config.json");
  const auto cfg = nlohmann::json::parse(cf);
  const auto& qc = cfg.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "modelopt");
  EXPECT_EQ(qc.at("quant_algo"), "NVFP4");
  EXPECT_EQ(qc.at("group_size"), 16);
  EXPECT_EQ(qc.at("config_groups").at("group_0").at("input_activations").at("dynamic"),
            method == QuantMethod::kNvfp4QatTrain);
  bool proj_out_ignored = false;
  for (const auto& s : qc.at("ignore")) proj_out_ignored = proj_out_ignored || s == "proj_out";
  EXPECT_TRUE(proj_out_ignored);
  EXPECT_TRUE(fs::is_regular_file(out / "transformer/hf_quant_config.json"));

  // Metadata names the format, the plan and the source; lineage verifies.
  const auto meta = vqad::train::read_metadata(out.string());
  EXPECT_EQ(meta.at("export").at("format"), vqad::deploy::kPackedFormat);
  EXPECT_EQ(meta.at("export").at("source_checkpoint"), fs::absolute(dir / "checkpoint-3").string());
  EXPECT_EQ(meta.at("export").at("quant_plan").at("count"), ck.plan.entries.size());
  EXPECT_EQ(meta.at("checkpoint").at("id"), ck.id);
  EXPECT_TRUE(vqad::train::verify_lineage(out.string()).empty());

  // The fake-quant student, and the packed model loaded for inference.
  auto student = ck.student();
  auto loaded = vqad::deploy::load_inference_model(out.string());
  EXPECT_EQ(loaded.kind, vqad::deploy::ModelKind::kPackedNvfp4);
  EXPECT_EQ(loaded.quants.size(), ck.plan.entries.size());
  torch::NoGradGuard no_grad;
  for (int trial = 0; trial < 2; ++trial) {
    const TinyInputs in = tiny_inputs(100 + trial);
    const torch::Tensor a = student->forward(in.x, in.t, in.text);
    const torch::Tensor b = loaded.model->forward(in.x, in.t, in.text);
    EXPECT_TRUE(torch::equal(a, b)) << "max diff " << (a - b).abs().max().item<float>();
  }
  // The dequantized weights are FQ(W): a model built from them (init_from) and quantized
  // again is a different model, so the packed linears really carry the stored operand.
  auto as_init = vqad::model::wan_from_pretrained(out.string());
  const torch::Tensor fqw = as_init->named_parameters()[m + ".weight"];
  const torch::Tensor master = student->named_parameters()[m + ".weight"];
  const float s_enc = vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(master));
  EXPECT_TRUE(torch::equal(fqw, vqad::ops::nvfp4_unit_operand_cpu(master, s_enc) * (1.0f / s_enc)));

  // A dense export of the same checkpoint loads as a fake-quant model with the same forward.
  vqad::deploy::export_model((dir / "checkpoint-3").string(), (dir / "dense").string(), {});
  auto fq = vqad::deploy::load_inference_model((dir / "dense").string());
  EXPECT_EQ(fq.kind, vqad::deploy::ModelKind::kFakeQuant);
  const TinyInputs in = tiny_inputs(7);
  EXPECT_TRUE(torch::equal(fq.model->forward(in.x, in.t, in.text), student->forward(in.x, in.t, in.text)));
  // And packing that export gives the same file as packing the checkpoint.
  vqad::deploy::export_model((dir / "dense").string(), (dir / "packed2").string(),
                             {.format = "nvfp4", .swizzled_scales = true});
  auto t2 = vqad::io::load_safetensors((dir / "packed2/transformer/diffusion_pytorch_model.safetensors").string());
  ASSERT_EQ(t2.size(), tensors.size());
  for (const auto& [k, v] : tensors) {
    const torch::Tensor w2 = t2.at(k);
    ASSERT_EQ(v.scalar_type(), w2.scalar_type()) << k;
    EXPECT_TRUE(v.element_size() == 1 ? torch::equal(v.view(torch::kUInt8), w2.view(torch::kUInt8))
                                      : torch::equal(v, w2))
        << k;
  }
  const auto meta2 = vqad::train::read_metadata((dir / "packed2").string());
  EXPECT_EQ(meta2.at("export").at("source_kind"), "export");
  EXPECT_EQ(meta2.at("export").at("source_export").at("role"), "student");
  EXPECT_TRUE(vqad::train::verify_lineage((dir / "packed2").string()).empty());
  fs::remove_all(dir);
}

TEST(ExportPacked, RoundTripForwardIsBitExactDynamicLinears) { round_trip(QuantMethod::kNvfp4QatTrain, "dyn"); }
TEST(ExportPacked, RoundTripForwardIsBitExactQadLinears) { round_trip(QuantMethod::kNvfp4Qad, "qad"); }

TEST(ExportPacked, PackedExportIsAValidInitFrom) {
  const fs::path dir = fresh_dir("init");
  write_tiny_checkpoint(dir / "checkpoint-1", QuantMethod::kNvfp4QatTrain, 3);
  vqad::deploy::export_model((dir / "checkpoint-1").string(), (dir / "packed").string(), {.format = "nvfp4"});
  vqad::model::WeightState st = vqad::model::read_weights((dir / "packed").string());
  EXPECT_EQ(vqad::model::read_packed_nvfp4_linears((dir / "packed").string()).size(), 20u);
  for (const auto& [k, t] : st.tensors) EXPECT_TRUE(t.is_floating_point()) << k;
  auto m = vqad::model::wan_from_pretrained((dir / "packed").string());
  EXPECT_EQ(m->named_parameters().size(), st.tensors.size());
  fs::remove_all(dir);
}

TEST(ExportPacked, BadInputsAreOneLineErrors) {
  const fs::path dir = fresh_dir("bad");
  // No quant plan: a dense run.
  write_tiny_checkpoint(dir / "dense-ckpt", QuantMethod::kNone, 1);
  std::string e = error_of([&] {
    vqad::deploy::export_model((dir / "dense-ckpt").string(), (dir / "o1").string(), {.format = "nvfp4"});
  });
  EXPECT_NE(e.find("has no quant plan (metadata training_contract.linear_quantization is null"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // A plan naming a linear the checkpoint lacks.
  write_tiny_checkpoint(dir / "missing", QuantMethod::kNvfp4QatTrain, 1, {{"blocks.7.attn1.to_q", 0}});
  e = error_of([&] { vqad::deploy::export_model((dir / "missing").string(), (dir / "o2").string(), {.format = "nvfp4"}); });
  EXPECT_NE(e.find("the quant plan names linear 'blocks.7.attn1.to_q' but"), std::string::npos) << e;
  EXPECT_NE(e.find("has no tensor blocks.7.attn1.to_q.weight"), std::string::npos) << e;
  // A planned linear whose K is not a multiple of 16.
  write_tiny_checkpoint(dir / "k40", QuantMethod::kNvfp4QatTrain, 1, {{"extra.proj", 40}});
  e = error_of([&] { vqad::deploy::export_model((dir / "k40").string(), (dir / "o3").string(), {.format = "nvfp4"}); });
  EXPECT_NE(e.find("'extra.proj': K = 40 is not a multiple of 16"), std::string::npos) << e;
  // A static linear without a calibrated amax.
  write_tiny_checkpoint(dir / "nocal", QuantMethod::kNvfp4Qad, 1, {}, /*with_amax=*/false);
  e = error_of([&] { vqad::deploy::export_model((dir / "nocal").string(), (dir / "o4").string(), {.format = "nvfp4"}); });
  EXPECT_NE(e.find("static linear 'blocks.0.ffn.net.0.proj' has no calibrated input amax (table key "
                   "'b0.ffn.net.0.proj'"),
            std::string::npos)
      << e;
  // Another role than the student, an unknown format, a packed source.
  e = error_of([&] {
    vqad::deploy::export_model((dir / "missing").string(), (dir / "o5").string(), {.format = "fp4"});
  });
  EXPECT_NE(e.find("unknown --format 'fp4'"), std::string::npos) << e;
  for (const char* o : {"o1", "o2", "o3", "o4", "o5"}) EXPECT_FALSE(fs::exists(dir / o)) << o;

  // The CLI prints one line and exits 1.
  const fs::path log = dir / "cli.log";
  const std::string cmd = std::string(VQAD_BINARY) + " export " + (dir / "dense-ckpt").string() + " " +
                          (dir / "o6").string() + " --format nvfp4 > " + log.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 1);
  std::ifstream lf(log);
  std::string text((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("vqad: error: export --format nvfp4: ", 0), 0u) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
  fs::remove_all(dir);
}

TEST(ExportPacked, CliPacksACheckpoint) {
  const fs::path dir = fresh_dir("cli");
  write_tiny_checkpoint(dir / "checkpoint-2", QuantMethod::kNvfp4Qad, 4);
  const fs::path log = dir / "cli.log";
  const std::string cmd = std::string(VQAD_BINARY) + " export " + (dir / "checkpoint-2").string() + " " +
                          (dir / "out").string() + " --format nvfp4 --swizzled-scales > " + log.string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream lf(log);
  std::string text((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("(nvfp4_modelopt)"), std::string::npos) << text;
  EXPECT_NE(text.find("packed 20 linears"), std::string::npos) << text;
  auto t = vqad::io::load_safetensors((dir / "out/transformer/diffusion_pytorch_model.safetensors").string());
  EXPECT_TRUE(t.count("blocks.0.attn1.to_q.weight_scale_swizzled"));
  fs::remove_all(dir);
}

}  // namespace
