// `vqad op attention` with the VSA backends: safetensors in (q, k, v, do, optional gate),
// safetensors out (o, dq, dk, dv, dgate, sel_index, sel_count), equal to the op called
// directly on the same inputs; argument errors name the flag.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/cli.h"
#include "vqad/io/tensors.h"
#include "vqad/ops/vsa_attention.h"

namespace {

namespace fs = std::filesystem;

using vqad::test::CliResult;
using vqad::test::run_vqad;
fs::path temp_dir(const std::string& name) { return vqad::test::cli_temp_dir(name); }
using vqad::test::has;

}  // namespace

TEST(VsaCli, MatchesTheOpWithGateAndSelection) {
  const fs::path dir = temp_dir("vsa_cli");
  torch::manual_seed(17);
  const int64_t B = 2, L = 5 * 6 * 9, H = 2, D = 32;
  torch::Tensor q = torch::randn({B, L, H, D}), k = torch::randn({B, L, H, D}).to(torch::kBFloat16);
  torch::Tensor v = torch::randn({B, L, H, D}), gate = torch::randn({B, L, H, D}) * 0.5;
  torch::Tensor d_o = torch::randn({B, L, H, D});
  vqad::io::save_safetensors((dir / "in.safetensors").string(),
                             {{"q", q}, {"k", k}, {"v", v}, {"do", d_o}, {"gate", gate}});
  struct Case {
    std::string backend, extra;
    vqad::AttentionBackend b;
    vqad::ops::VsaOptions o;
  };
  vqad::ops::VsaOptions topk;
  topk.sparsity = 0.5;
  vqad::ops::VsaOptions topp = topk;
  topp.selection = vqad::vsa_ref::Selection::kTopP;
  topp.top_p = 0.6;
  const Case cases[] = {
      {"VSA_QAT_TRAIN_C128", "", vqad::AttentionBackend::kVsaQatTrainC128, topk},
      {"VSA_TRAIN", "--selection top-p --top-p 0.6", vqad::AttentionBackend::kVsaTrain, topp},
      {"VSA_QAT_TRAIN_C64", "--bwd-mode fastvideo", vqad::AttentionBackend::kVsaQatTrainC64,
       [&] {
         auto o = topk;
         o.bwd_mode = vqad::ops::AttnQatBwdMode::kFastVideo;
         return o;
       }()},
      {"VSA_TRAIN_C128", "", vqad::AttentionBackend::kVsaTrainC128, topk},
  };
  for (const Case& c : cases) {
    const fs::path out = dir / ("out_" + c.backend + ".safetensors");
    const CliResult r = run_vqad("op attention " + (dir / "in.safetensors").string() + " " + out.string() +
                                     " --backend " + c.backend + " --grid 5,6,9 --sparsity 0.5 " + c.extra,
                                 dir);
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_TRUE(has(r.output, "sel_index")) << r.output;
    std::map<std::string, std::string> meta;
    auto got = vqad::io::load_safetensors(out.string(), &meta);
    EXPECT_EQ(meta["grid"], "5,6,9");
    for (const char* name : {"o", "dq", "dk", "dv", "dgate", "sel_index", "sel_count"})
      ASSERT_TRUE(got.count(name)) << c.backend << ": missing " << name;

    auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).detach().requires_grad_(true); };
    torch::Tensor qb = bf(q), kb = bf(k), vb = bf(v), gb = bf(gate);
    vqad::vsa_ref::SelectionLists sel;
    torch::Tensor o = vqad::ops::vsa_attention(qb, kb, vb, gb, {5, 6, 9}, c.b, c.o, &sel);
    o.backward(d_o.to(torch::kBFloat16));
    EXPECT_TRUE(torch::equal(got["o"], o.detach().to(torch::kFloat32))) << c.backend;
    EXPECT_TRUE(torch::equal(got["dq"], qb.grad().to(torch::kFloat32))) << c.backend;
    EXPECT_TRUE(torch::equal(got["dk"], kb.grad().to(torch::kFloat32))) << c.backend;
    EXPECT_TRUE(torch::equal(got["dv"], vb.grad().to(torch::kFloat32))) << c.backend;
    EXPECT_TRUE(torch::equal(got["dgate"], gb.grad().to(torch::kFloat32))) << c.backend;
    const torch::Tensor idx = got["sel_index"], cnt = got["sel_count"];
    ASSERT_EQ(idx.scalar_type(), torch::kInt32);
    ASSERT_EQ(idx.sizes(), (std::vector<int64_t>{B, H, sel.num_q_cubes, sel.max_kv}));
    ASSERT_EQ(cnt.sizes(), (std::vector<int64_t>{B, H, sel.num_q_cubes}));
    EXPECT_TRUE(std::equal(sel.index.begin(), sel.index.end(), idx.data_ptr<int32_t>())) << c.backend;
    EXPECT_TRUE(std::equal(sel.count.begin(), sel.count.end(), cnt.data_ptr<int32_t>())) << c.backend;
  }
  fs::remove_all(dir);
}

TEST(VsaCli, WithoutGateOrDo) {
  const fs::path dir = temp_dir("vsa_cli_nogate");
  torch::manual_seed(18);
  torch::Tensor q = torch::randn({1, 128, 1, 16});
  vqad::io::save_safetensors((dir / "in.safetensors").string(), {{"q", q}, {"k", q * 0.5}, {"v", q + 1}});
  const fs::path out = dir / "out.safetensors";
  const CliResult r = run_vqad("op attention " + (dir / "in.safetensors").string() + " " + out.string() +
                                   " --backend VSA_QAT_TRAIN_C128 --grid 4,4,8 --sparsity 0",
                               dir);
  ASSERT_EQ(r.rc, 0) << r.output;
  std::map<std::string, std::string> meta;
  auto got = vqad::io::load_safetensors(out.string(), &meta);
  EXPECT_EQ(meta["gate"], "zero");
  EXPECT_TRUE(got.count("o") && got.count("sel_index") && got.count("sel_count"));
  EXPECT_FALSE(got.count("dq") || got.count("dgate"));
  fs::remove_all(dir);
}

TEST(VsaCli, ArgumentErrorsNameTheFlag) {
  const fs::path dir = temp_dir("vsa_cli_err");
  torch::Tensor q = torch::randn({1, 128, 1, 16});
  vqad::io::save_safetensors((dir / "in.safetensors").string(), {{"q", q}, {"k", q}, {"v", q}});
  const std::string base = "op attention " + (dir / "in.safetensors").string() + " " + (dir / "o.st").string();
  CliResult r = run_vqad(base + " --backend VSA_TRAIN --sparsity 0.5", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--grid")) << r.output;
  r = run_vqad(base + " --backend VSA_TRAIN --grid 4,4", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--grid")) << r.output;
  r = run_vqad(base + " --backend VSA_TRAIN --grid 4,4,8", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--sparsity")) << r.output;
  r = run_vqad(base + " --backend VSA_TRAIN --grid 4,4,4 --sparsity 0.5", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "64 tokens but L = 128")) << r.output;
  r = run_vqad(base + " --backend VSA_TRAIN --grid 4,4,8 --sparsity 0.5 --selection top-z", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "--selection")) << r.output;
  r = run_vqad(base + " --backend ATTN_QAT_TRAIN --grid 4,4,8", dir);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_TRUE(has(r.output, "only for the VSA backends")) << r.output;
  fs::remove_all(dir);
}
