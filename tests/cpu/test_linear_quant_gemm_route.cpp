// training.linear_quantization.gemm (the NVFP4 linears' forward GEMM route: auto |
// fake_quant | fp4) on a CPU: values and refusals of the key, what the role builder
// resolves and records in the checkpoint metadata, that auto and fake_quant are the
// fake-quant linear bit for bit on a device without FP4 tensor cores, that fp4 is refused
// there with one line naming the key and the device, and the packed weight's FP4 operand
// (codes and scales recovered from the unit-scaled weight) on fresh random weights. Also
// `vqad calibrate` with training.distributed.num_gpus > 1 in a single process: refused with
// the `vqad launch --nproc N calibrate` form.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <limits>
#include <string>

#include "tests/support/errors.h"
#include "vqad/config/linear_quantization.h"
#include "vqad/core/error.h"
#include "vqad/model/quant_plan.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"
#include "vqad/train/metadata.h"
#include "vqad/train/role_quant.h"
#include "vqad/train/roles.h"

namespace {

namespace fs = std::filesystem;
using vqad::nvfp4::ScaleMode;
using vqad::ops::Nvfp4GemmRoute;

using vqad::test::error_of;

std::string recipe(const std::string& quant, const std::string& lq = "") {
  std::string y =
      "models:\n  student:\n    _target_: fastvideo.train.models.wan.WanModel\n"
      "    init_from: random:tiny\n    trainable: true\n    attention_backend: TORCH_SDPA\n"
      "method:\n  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod\n"
      "training:\n  data:\n    data_path: /nonexistent-data\n    train_batch_size: 1\n    seed: 5\n"
      "  optimizer:\n    learning_rate: 1.0e-3\n  loop:\n    max_train_steps: 1\n"
      "  checkpoint:\n    output_dir: /tmp/vqad_gemm_route_run\n";
  if (!lq.empty()) y += "  linear_quantization:\n" + lq;
  if (quant != "none") y += "pipeline:\n  dit_config:\n    quant_config: " + quant + "\n";
  return y;
}

TEST(LinearQuantGemmRoute, ConfigKeyValuesDefaultsAndRefusals) {
  using vqad::train::linear_quantization_config;
  using vqad::train::parse_run_config;
  // Default auto, with and without the section.
  EXPECT_EQ(linear_quantization_config(parse_run_config(recipe("nvfp4_qat_train"))).gemm, "auto");
  EXPECT_EQ(vqad::train::role_quant_config(parse_run_config(recipe("nvfp4_qat_train")), "student").gemm_route,
            Nvfp4GemmRoute::kAuto);
  for (const auto& [text, route] : std::vector<std::pair<std::string, Nvfp4GemmRoute>>{
           {"auto", Nvfp4GemmRoute::kAuto},
           {"fake_quant", Nvfp4GemmRoute::kFakeQuant},
           {"fp4", Nvfp4GemmRoute::kFp4}}) {
    const auto run = parse_run_config(recipe("nvfp4_qad", "    gemm: " + text + "\n"));
    EXPECT_EQ(linear_quantization_config(run).gemm, text);
    EXPECT_EQ(vqad::train::role_quant_config(run, "student").gemm_route, route) << text;
    // The resolved dump carries the key and loads back to it.
    EXPECT_EQ(run.resolved["training"]["linear_quantization"]["gemm"], text);
    EXPECT_EQ(linear_quantization_config(parse_run_config(run.resolved_yaml)).gemm, text);
    // A command-line override reaches it.
    const auto o = parse_run_config(recipe("nvfp4_qad"), {"--training.linear_quantization.gemm", text});
    EXPECT_EQ(linear_quantization_config(o).gemm, text);
  }
  auto err = [](const std::string& quant, const std::string& lq) {
    return error_of([&] { parse_run_config(recipe(quant, lq)); });
  };
  const std::string bad = err("nvfp4_qad", "    gemm: fp8\n");
  EXPECT_NE(bad.find("training.linear_quantization.gemm"), std::string::npos) << bad;
  EXPECT_NE(bad.find("fp8"), std::string::npos) << bad;
  EXPECT_NE(bad.find("fake_quant"), std::string::npos) << bad;  // names the valid values
  EXPECT_NE(err("nvfp4_qad", "    gemm: 4\n").find("training.linear_quantization.gemm"), std::string::npos);
  // With dense linears the key would do nothing: refused (auto, the default, is accepted).
  EXPECT_NE(err("none", "    gemm: fp4\n").find("'training.linear_quantization.gemm': the student's linears are dense"),
            std::string::npos);
  EXPECT_EQ(err("none", "    gemm: auto\n"), "");
}

TEST(LinearQuantGemmRoute, NamesParseAndResolveOnCpu) {
  for (auto r : {Nvfp4GemmRoute::kAuto, Nvfp4GemmRoute::kFakeQuant, Nvfp4GemmRoute::kFp4})
    EXPECT_EQ(vqad::ops::parse_nvfp4_gemm_route(vqad::ops::nvfp4_gemm_route_name(r), "k"), r);
  const std::string e = error_of([] { vqad::ops::parse_nvfp4_gemm_route("FP4", "sample --gemm"); });
  EXPECT_NE(e.find("sample --gemm: unknown NVFP4 GEMM route 'FP4' (valid: auto, fake_quant, fp4)"), std::string::npos)
      << e;
  const torch::Device cpu(torch::kCPU);
  std::string why;
  EXPECT_FALSE(vqad::ops::nvfp4_fp4_route_available(cpu, &why));
  EXPECT_NE(why.find("cpu is not a GPU"), std::string::npos) << why;
  EXPECT_EQ(vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kAuto, cpu, "k"), Nvfp4GemmRoute::kFakeQuant);
  EXPECT_EQ(vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kFakeQuant, cpu, "k"), Nvfp4GemmRoute::kFakeQuant);
  const std::string r = error_of([&] { vqad::ops::resolve_nvfp4_gemm_route(Nvfp4GemmRoute::kFp4, cpu, "the.key"); });
  EXPECT_EQ(r.find('\n'), std::string::npos) << r;
  EXPECT_EQ(r.rfind("the.key: the fp4 GEMM route needs a GPU with FP4 tensor cores, but device cpu is not a GPU", 0),
            0u)
      << r;
}

TEST(LinearQuantGemmRoute, AutoIsTheFakeQuantLinearBitForBitWhereNoFp4AndFp4IsRefused) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({2, 7, 48}) * torch::exp(torch::randn({2, 7, 48}));
  const torch::Tensor w = torch::randn({24, 48}) * 0.1, b = torch::randn({24});
  for (auto mode : {ScaleMode::kDynamic, ScaleMode::kStatic, ScaleMode::kUnit}) {
    const torch::Tensor fq = vqad::ops::nvfp4_linear(x, w, b, mode, 3.0f);
    EXPECT_TRUE(torch::equal(
        vqad::ops::nvfp4_linear(x, w, b, mode, 3.0f, torch::Tensor(), Nvfp4GemmRoute::kAuto), fq));
    EXPECT_TRUE(torch::equal(
        vqad::ops::nvfp4_linear(x, w, b, mode, 3.0f, torch::Tensor(), Nvfp4GemmRoute::kFakeQuant), fq));
    const std::string e = error_of(
        [&] { vqad::ops::nvfp4_linear(x, w, b, mode, 3.0f, torch::Tensor(), Nvfp4GemmRoute::kFp4); });
    EXPECT_NE(e.find("fp4 GEMM route needs a GPU with FP4 tensor cores"), std::string::npos) << e;
  }
  // The LinearQuant objects carry the route and say so.
  vqad::ops::Nvfp4QadLinear q("blocks.0.ffn.net.0.proj", ScaleMode::kStatic, 3.0f);
  const torch::Tensor fq = q.forward(x, w, b);
  EXPECT_EQ(q.describe().find("gemm:"), std::string::npos);
  q.set_gemm_route(Nvfp4GemmRoute::kAuto);
  EXPECT_TRUE(torch::equal(q.forward(x, w, b), fq));
  EXPECT_NE(q.describe().find("gemm:auto"), std::string::npos) << q.describe();
  q.set_gemm_route(Nvfp4GemmRoute::kFp4);
  EXPECT_NE(error_of([&] { q.forward(x, w, b); }).find("FP4 tensor cores"), std::string::npos);
  EXPECT_EQ(vqad::ops::gemm_route_of(q), Nvfp4GemmRoute::kFp4);
  // The packed linear too.
  const float s_enc_w = vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(w));
  vqad::ops::Nvfp4PackedLinear p("blocks.0.ffn.net.0.proj", vqad::ops::nvfp4_unit_operand_cpu(w, s_enc_w),
                                 1.0f / s_enc_w, ScaleMode::kStatic, 3.0f);
  torch::NoGradGuard ng;
  const torch::Tensor pf = p.forward(x, torch::Tensor(), b);
  EXPECT_TRUE(torch::equal(pf, fq));
  std::vector<std::pair<std::string, std::shared_ptr<vqad::ops::LinearQuant>>> quants{
      {"p", std::shared_ptr<vqad::ops::LinearQuant>(&p, [](auto*) {})}};
  EXPECT_EQ(vqad::ops::set_nvfp4_gemm_route(quants, Nvfp4GemmRoute::kAuto), 1u);
  EXPECT_EQ(p.gemm_route(), Nvfp4GemmRoute::kAuto);
  EXPECT_TRUE(torch::equal(p.forward(x, torch::Tensor(), b), pf));
  p.set_gemm_route(Nvfp4GemmRoute::kFp4);
  EXPECT_NE(error_of([&] { p.forward(x, torch::Tensor(), b); }).find("FP4 tensor cores"), std::string::npos);
}

TEST(LinearQuantGemmRoute, RoleBuilderResolvesLogsAndRecordsTheRoute) {
  vqad::train::RoleBuildOptions ro;  // CPU
  {
    const auto run = vqad::train::parse_run_config(recipe("nvfp4_qat_train", "    gemm: auto\n"));
    const auto role = vqad::train::build_role(run, "student", ro);
    EXPECT_EQ(role->quant_config.gemm_route, Nvfp4GemmRoute::kFakeQuant);
    ASSERT_FALSE(role->quants.empty());
    for (const auto& [name, q] : role->quants)
      EXPECT_EQ(vqad::ops::gemm_route_of(*q), Nvfp4GemmRoute::kFakeQuant) << name;
    const auto meta = vqad::train::build_metadata(run, {{"student", role}}, 1, "2026-01-01T00:00:00.000000+00:00");
    const auto& lq = meta.at("training_contract").at("linear_quantization");
    EXPECT_EQ(lq.at("gemm_route"), "fake_quant");
    EXPECT_NE(lq.at("forward").get<std::string>().find("BF16 GEMM"), std::string::npos);
    // The plan read back from the metadata ignores the record (plans are the linears).
    EXPECT_EQ(vqad::model::QuantPlan::from_json(lq, "m").entries.size(), role->quants.size());
  }
  // fp4 on a device without FP4 tensor cores: one line naming the key and the device.
  const auto run = vqad::train::parse_run_config(recipe("nvfp4_qat_train", "    gemm: fp4\n"));
  const std::string e = error_of([&] { vqad::train::build_role(run, "student", ro); });
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_NE(e.find("training.linear_quantization.gemm: the fp4 GEMM route needs a GPU with FP4 tensor cores, but "
                   "device cpu is not a GPU"),
            std::string::npos)
      << e;
}

TEST(LinearQuantGemmRoute, PackedWeightCodesRecoveredExactlyFromTheUnitWeight) {
  torch::manual_seed(17);
  const int64_t n = 37, k = 96;
  torch::Tensor w = torch::randn({n, k}) * torch::exp(torch::randn({n, k}) * 2.0);
  w.index_put_({0, torch::indexing::Slice(0, 16)}, 0.0f);           // a zero block
  w.index_put_({1, torch::indexing::Slice(16, 32)}, 1e-30f);        // underflows to scale 0
  w.index_put_({2, torch::indexing::Slice(32, 48)}, 0.25f);         // one value: max code 6 at S = 1/24
  w.index_put_({3, torch::indexing::Slice(48, 64)}, -3.0f);
  for (float s_enc : {1.0f, vqad::nvfp4::encode_scale_from_amax(vqad::ops::bf16_amax_cpu(w)), 2688.0f / 0.01f}) {
    const torch::Tensor wu = vqad::ops::nvfp4_unit_operand_cpu(w, s_enc);
    const auto c = vqad::ops::nvfp4_codes_from_unit_weight(wu);
    ASSERT_EQ(c.codes.sizes(), (std::vector<int64_t>{n, k / 2}));
    ASSERT_EQ(c.scales.sizes(), (std::vector<int64_t>{n, k / 16}));
    std::vector<float> back(n * k);
    const auto codes = vqad::nvfp4::unpack_codes(
        std::vector<uint8_t>(c.codes.data_ptr<uint8_t>(), c.codes.data_ptr<uint8_t>() + c.codes.numel()));
    vqad::nvfp4::dequantize_matrix(codes.data(), c.scales.data_ptr<uint8_t>(), n, k, 1.0f, back.data());
    EXPECT_TRUE(torch::equal(torch::from_blob(back.data(), {n, k}, torch::kFloat32), wu)) << "s_enc " << s_enc;
    // Where the quantizer's block holds its largest code 6 (every non-degenerate block of
    // these weights), the recovered codes and scales are the quantizer's own.
    const torch::Tensor wb = w.to(torch::kBFloat16).to(torch::kFloat32).contiguous();
    const auto ref = vqad::nvfp4::quantize_matrix(wb.data_ptr<float>(), n, k, s_enc);
    int64_t same = 0, blocks = 0;
    for (int64_t b = 0; b < n * k / 16; ++b) {
      bool has6 = false;
      for (int i = 0; i < 16; ++i) has6 = has6 || (ref.codes[b * 16 + i] & 7) == 7;
      if (!has6) continue;
      ++blocks;
      bool eq = ref.scales[b] == c.scales.data_ptr<uint8_t>()[b];
      for (int i = 0; i < 16; ++i) {
        const uint8_t a = ref.codes[b * 16 + i], g = codes[b * 16 + i];
        eq = eq && (a == g || ((a & 7) == 0 && (g & 7) == 0));  // +-0 hold the same value
      }
      same += eq;
    }
    EXPECT_GT(blocks, n * k / 16 / 2);
    EXPECT_EQ(same, blocks) << "s_enc " << s_enc;
  }
  // Not an NVFP4 value: refused, naming the row and the block.
  torch::Tensor bad = vqad::ops::nvfp4_unit_operand_cpu(w, 1.0f);
  bad.index_put_({5, 20}, 0.123456f);
  const std::string e = error_of([&] { vqad::ops::nvfp4_codes_from_unit_weight(bad); });
  EXPECT_NE(e.find("row 5 block 1 (columns 16..31) is not an NVFP4 value"), std::string::npos) << e;
  torch::Tensor nan = vqad::ops::nvfp4_unit_operand_cpu(w, 1.0f);
  nan.index_put_({7, 0}, std::numeric_limits<float>::quiet_NaN());
  EXPECT_NE(error_of([&] { vqad::ops::nvfp4_codes_from_unit_weight(nan); }).find("row 7 block 0"), std::string::npos);
}

TEST(LinearQuantGemmRoute, CalibrateWithSeveralGpusInOneProcessNamesTheLaunchForm) {
  const fs::path dir = fs::temp_directory_path() / ("vqad_test_calib_gpus_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path yaml = dir / "recipe.yaml";
  std::ofstream(yaml) << recipe("nvfp4_qad");
  const fs::path log = dir / "cli.log";
  const std::string cmd = std::string(VQAD_BINARY) + " calibrate " + yaml.string() + " --out " +
                          (dir / "t.json").string() + " --training.distributed.num_gpus 2 > " + log.string() +
                          " 2>&1";
  const int status = std::system(cmd.c_str());
  std::stringstream out;
  out << std::ifstream(log).rdbuf();
  EXPECT_NE(WEXITSTATUS(status), 0) << out.str();
  EXPECT_NE(out.str().find("training.distributed.num_gpus = 2 but vqad calibrate runs as a single process"),
            std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find("`vqad launch --nproc 2 calibrate " + yaml.string()), std::string::npos) << out.str();
  EXPECT_FALSE(fs::exists(dir / "t.json"));
  fs::remove_all(dir);
}

}  // namespace
