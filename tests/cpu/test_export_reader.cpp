// The independent Python reader (tests/tools/read_nvfp4.py, numpy + safetensors, no
// vqad code) decodes a packed export with ModelOpt's formula and must match vqad's
// FQ(W) bit for bit; it runs in the tools venv (tests/tools/tools_venv.sh) and the test
// is skipped, with the reason, where that venv cannot be made.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "vqad/export/packed.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/nvfp4_fake_quant.h"
#include "test_export_util.h"

namespace {

namespace fs = std::filesystem;
using namespace vqad::test_export;

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// {exit status, stdout + stderr}
std::pair<int, std::string> run(const std::string& cmd, const fs::path& log) {
  const int rc = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(log)};
}

TEST(ExportReader, IndependentPythonReaderMatchesFakeQuantBitForBit) {
  const fs::path dir = fresh_dir("reader");
  const std::string tools = std::string(VQAD_SOURCE_DIR) + "/tests/tools";
  auto [venv_rc, venv_out] = run("bash " + tools + "/tools_venv.sh 2>" + (dir / "venv.err").string(), dir / "venv.out");
  if (venv_rc != 0) {
    GTEST_SKIP() << "no numpy/safetensors venv for tests/tools/read_nvfp4.py: " << slurp(dir / "venv.err");
  }
  std::string python = venv_out.substr(0, venv_out.find('\n'));

  const TinyCheckpoint ck = write_tiny_checkpoint(dir / "checkpoint-5", vqad::model::QuantMethod::kNvfp4Qad, 9);
  vqad::deploy::export_model((dir / "checkpoint-5").string(), (dir / "packed").string(),
                             {.format = "nvfp4", .swizzled_scales = true});
  // vqad's FQ(W) of every planned linear: the fake-quant op on the BF16-rounded master
  // weight with the dynamic weight scale, in fp32.
  auto master = vqad::io::load_safetensors((dir / "checkpoint-5/student/transformer/"
                                                  "diffusion_pytorch_model.safetensors").string());
  std::vector<std::pair<std::string, torch::Tensor>> ref;
  for (const auto& e : ck.plan.entries) {
    const torch::Tensor wb = master.at(e.module + ".weight").to(torch::kBFloat16).to(torch::kFloat32);
    ref.emplace_back(e.module, vqad::ops::nvfp4_fake_quant(wb, vqad::ops::ScaleMode::kDynamic));
  }
  vqad::io::save_safetensors((dir / "fq.safetensors").string(), ref);
  const std::string reader = python + " " + tools + "/read_nvfp4.py " + (dir / "packed").string();
  auto [rc, out] = run(reader + " --reference " + (dir / "fq.safetensors").string() + " --json " +
                           (dir / "report.json").string(),
                       dir / "reader.log");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("20 NVFP4 layers"), std::string::npos) << out;
  EXPECT_NE(out.find("20 equal to FQ(W) bit for bit"), std::string::npos) << out;
  const auto report = nlohmann::json::parse(slurp(dir / "report.json"));
  const auto meta = vqad::train::read_metadata((dir / "packed").string());
  EXPECT_EQ(report.at("quantized_bytes"), meta.at("export").at("sizes").at("quantized_bytes"));
  EXPECT_EQ(report.at("quantized_parameters"), meta.at("export").at("sizes").at("quantized_parameters"));

  // The reader can fail: one value of the reference off by an ulp.
  torch::Tensor& first = ref.front().second;
  first.view(torch::kInt32).view(-1)[5] += 1;
  vqad::io::save_safetensors((dir / "fq_bad.safetensors").string(), ref);
  auto [rc2, out2] = run(reader + " --reference " + (dir / "fq_bad.safetensors").string(), dir / "reader2.log");
  EXPECT_EQ(rc2, 1) << out2;
  EXPECT_NE(out2.find("FAILED: " + ref.front().first + ": 1 of"), std::string::npos) << out2;
  fs::remove_all(dir);
}

}  // namespace
