// `vqad op attention` end to end: safetensors in, safetensors out, compared
// with the op called directly on the same inputs.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/cli.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/attention_qat.h"

namespace {

namespace fs = std::filesystem;

using vqad::test::CliResult;
using vqad::test::run_vqad;
fs::path temp_dir(const std::string& name) { return vqad::test::cli_temp_dir(name); }

}  // namespace

TEST(AttnQatCli, MatchesOpForwardAndBackward) {
  const fs::path dir = temp_dir("attn_cli");
  torch::manual_seed(7);
  // F32 q and BF16 k/v: the tool computes in BF16 either way.
  torch::Tensor q = torch::randn({1, 29, 2, 32});
  torch::Tensor k = torch::randn({1, 41, 2, 32}).to(torch::kBFloat16);
  torch::Tensor v = torch::randn({1, 41, 2, 32}).to(torch::kBFloat16);
  torch::Tensor d_o = torch::randn({1, 29, 2, 32});
  vqad::io::save_safetensors((dir / "in.safetensors").string(),
                             {{"q", q}, {"k", k}, {"v", v}, {"do", d_o}});

  for (const std::string mode : {"consistent", "fastvideo"}) {
    const fs::path out = dir / ("out_" + mode + ".safetensors");
    const CliResult r = run_vqad("op attention " + (dir / "in.safetensors").string() + " " +
                                     out.string() + " --backend ATTN_QAT_TRAIN --block-n 16 --bwd-mode " + mode,
                                 dir);
    ASSERT_EQ(r.rc, 0) << r.output;
    auto got = vqad::io::load_safetensors(out.string());
    for (const char* name : {"o", "dq", "dk", "dv"}) {
      ASSERT_TRUE(got.count(name)) << "missing " << name;
      EXPECT_EQ(got[name].scalar_type(), torch::kFloat32) << name;
    }

    vqad::ops::AttnQatOptions opts;
    opts.block_n = 16;
    opts.bwd_mode = vqad::ops::parse_attn_qat_bwd_mode(mode);
    torch::Tensor qb = q.to(torch::kBFloat16).requires_grad_(true);
    torch::Tensor kb = k.clone().requires_grad_(true), vb = v.clone().requires_grad_(true);
    torch::Tensor o = vqad::ops::attention_qat(qb, kb, vb, opts);
    o.backward(d_o.to(torch::kBFloat16));
    EXPECT_TRUE(torch::equal(got["o"], o.detach().to(torch::kFloat32))) << mode;
    EXPECT_TRUE(torch::equal(got["dq"], qb.grad().to(torch::kFloat32))) << mode;
    EXPECT_TRUE(torch::equal(got["dk"], kb.grad().to(torch::kFloat32))) << mode;
    EXPECT_TRUE(torch::equal(got["dv"], vb.grad().to(torch::kFloat32))) << mode;
  }

  // The dense comparison backend: close to float64 attention on the bf16 inputs.
  vqad::io::save_safetensors((dir / "in_nodo.safetensors").string(), {{"q", q}, {"k", k}, {"v", v}});
  const fs::path out = dir / "dense.safetensors";
  const CliResult r = run_vqad("op attention " + (dir / "in_nodo.safetensors").string() + " " +
                                   out.string() + " --backend TORCH_SDPA",
                               dir);
  ASSERT_EQ(r.rc, 0) << r.output;
  auto got = vqad::io::load_safetensors(out.string());
  auto bhld = [](const torch::Tensor& t) {
    return t.to(torch::kBFloat16).to(torch::kDouble).permute({0, 2, 1, 3});
  };
  torch::Tensor p =
      torch::softmax(torch::matmul(bhld(q), bhld(k).transpose(-1, -2)) / std::sqrt(32.0), -1);
  torch::Tensor expect = torch::matmul(p, bhld(v)).permute({0, 2, 1, 3});
  EXPECT_EQ(got.count("dq"), 0u) << "no do given, so no gradients";
  const double err = (got["o"].to(torch::kDouble) - expect).abs().max().item<double>();
  EXPECT_LT(err, 1e-4);  // fp32 scores, softmax and products on the bf16 operands
  fs::remove_all(dir);
}

TEST(AttnQatCli, BadInputsAreNamed) {
  const fs::path dir = temp_dir("attn_cli_bad");
  torch::Tensor q = torch::randn({1, 8, 1, 16});
  vqad::io::save_safetensors((dir / "noqk.safetensors").string(), {{"q", q}, {"v", q}});
  CliResult r = run_vqad("op attention " + (dir / "noqk.safetensors").string() + " " +
                             (dir / "o.safetensors").string() + " --backend ATTN_QAT_TRAIN",
                         dir);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("'k'"), std::string::npos) << r.output;

  vqad::io::save_safetensors((dir / "ok.safetensors").string(), {{"q", q}, {"k", q}, {"v", q}});
  r = run_vqad("op attention " + (dir / "ok.safetensors").string() + " " +
                   (dir / "o.safetensors").string() + " --backend NOPE",
               dir);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("ATTN_QAT_TRAIN"), std::string::npos) << r.output;  // lists valid names
  r = run_vqad("op attention " + (dir / "ok.safetensors").string() + " " +
                   (dir / "o.safetensors").string() + " --backend ATTN_QAT_TRAIN --bwd-mode sloppy",
               dir);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("sloppy"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "o.safetensors"));
  fs::remove_all(dir);
}
