// The torch-facing NVFP4 ops (ops/nvfp4_fake_quant.h) on CPU, and the
// `vqad op nvfp4-quantize` command end to end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/numerics/nvfp4.h"
#include "vqad/ops/nvfp4_fake_quant.h"

namespace nv = vqad::nvfp4;
using vqad::ops::ScaleMode;

namespace {

// Reference values for x (F32, any shape) through the scalar functions directly.
std::vector<float> reference_values(const torch::Tensor& x, float s_enc) {
  const torch::Tensor c = x.to(torch::kFloat).contiguous();
  std::vector<float> y(c.numel());
  nv::fake_quantize(c.data_ptr<float>(), y.data(), y.size(), s_enc);
  return y;
}

std::vector<float> to_vec(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

std::string temp_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() /
                 ("vqad_nvfp4_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// Runs the vqad binary; returns the exit code and fills `output` with stdout+stderr.
int run_vqad(const std::string& args, std::string* output) {
  const std::string log = temp_dir("log") + "/out.txt";
  const std::string cmd = std::string(VQAD_BINARY) + " " + args + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  *output = ss.str();
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST(Nvfp4Op, FakeQuantF32MatchesReferenceInEveryMode) {
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({3, 5, 32}) * 3;
  EXPECT_TRUE(same_bits(to_vec(vqad::ops::nvfp4_fake_quant(x, ScaleMode::kUnit)), reference_values(x, 1.0f)));
  const float amax = x.abs().max().item<float>();
  EXPECT_EQ(vqad::ops::nvfp4_amax(x).item<float>(), amax);
  EXPECT_TRUE(same_bits(to_vec(vqad::ops::nvfp4_fake_quant(x, ScaleMode::kDynamic)),
                        reference_values(x, nv::encode_scale_from_amax(amax))));
  const float s = nv::encode_scale_from_amax(2.0f);
  EXPECT_TRUE(same_bits(to_vec(vqad::ops::nvfp4_fake_quant(x, ScaleMode::kStatic, s)), reference_values(x, s)));
}

TEST(Nvfp4Op, Bf16OutputIsExactForUnitAndRoundedOnceOtherwise) {
  torch::manual_seed(2);
  const torch::Tensor x = (torch::randn({7, 48}) * 5).to(torch::kBFloat16);
  const torch::Tensor y = vqad::ops::nvfp4_fake_quant(x, ScaleMode::kUnit);
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(same_bits(to_vec(y), reference_values(x, 1.0f)));  // exact in BF16
  const torch::Tensor yd = vqad::ops::nvfp4_fake_quant(x, ScaleMode::kDynamic);
  const float s = nv::encode_scale_from_amax(x.to(torch::kFloat).abs().max().item<float>());
  const auto ref = reference_values(x, s);
  const torch::Tensor ref_bf16 = torch::from_blob(const_cast<float*>(ref.data()), {7, 48}).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(yd, ref_bf16));
}

TEST(Nvfp4Op, BackwardIsStraightThrough) {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    torch::Tensor x = (torch::randn({4, 64}) * 2).to(dtype).requires_grad_(true);
    const torch::Tensor g = torch::randn({4, 64}).to(dtype);
    const torch::Tensor y = vqad::ops::nvfp4_fake_quant(x, ScaleMode::kDynamic);
    EXPECT_TRUE(y.requires_grad());
    y.backward(g);
    ASSERT_TRUE(x.grad().defined());
    EXPECT_TRUE(torch::equal(x.grad(), g));
  }
}

TEST(Nvfp4Op, NonContiguousInputsGiveTheSameResult) {
  torch::manual_seed(4);
  const torch::Tensor base = torch::randn({6, 3, 32});
  const torch::Tensor xt = base.transpose(0, 1);  // [3, 6, 32], leading dims permuted
  const torch::Tensor y1 = vqad::ops::nvfp4_fake_quant(xt, ScaleMode::kDynamic);
  const torch::Tensor y2 = vqad::ops::nvfp4_fake_quant(xt.contiguous(), ScaleMode::kDynamic);
  EXPECT_TRUE(torch::equal(y1, y2));
  EXPECT_EQ(y1.sizes(), xt.sizes());
}

TEST(Nvfp4Op, BadInputsAreErrors) {
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const vqad::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([] { vqad::ops::nvfp4_fake_quant(torch::randn({2, 24}), ScaleMode::kUnit); }, "multiple of 16");
  expect_error([] { vqad::ops::nvfp4_fake_quant(torch::ones({2, 16}, torch::kInt), ScaleMode::kUnit); }, "dtype");
  expect_error([] { vqad::ops::nvfp4_fake_quant(torch::randn({2, 16}), ScaleMode::kUnit, 2.0f); }, "unit");
  expect_error([] { vqad::ops::nvfp4_fake_quant(torch::randn({2, 16}), ScaleMode::kStatic, 0.0f); }, "static");
  expect_error([] { vqad::ops::nvfp4_quantize(torch::randn({16, 20}), ScaleMode::kDynamic); }, "multiple of 16");
}

TEST(Nvfp4Op, QuantizePackDequantizeRoundTrip) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({2, 65, 48}) * 7;
  const auto q = vqad::ops::nvfp4_quantize(x, ScaleMode::kDynamic);
  ASSERT_EQ(q.packed_codes.sizes(), (std::vector<int64_t>{2, 65, 24}));
  ASSERT_EQ(q.scales.sizes(), (std::vector<int64_t>{2, 65, 3}));
  ASSERT_EQ(q.scales_swizzled.numel(), nv::swizzled_scales_size(130, 3));
  const float s_enc = nv::encode_scale_from_amax(x.abs().max().item<float>());
  EXPECT_EQ(q.s_enc.item<float>(), s_enc);
  const nv::QuantizedMatrix ref = nv::quantize_matrix(x.contiguous().data_ptr<float>(), 130, 48, s_enc);
  const torch::Tensor codes = vqad::ops::nvfp4_unpack_codes(q.packed_codes).contiguous();
  ASSERT_EQ(codes.sizes(), x.sizes());
  EXPECT_EQ(std::vector<uint8_t>(codes.data_ptr<uint8_t>(), codes.data_ptr<uint8_t>() + codes.numel()), ref.codes);
  const torch::Tensor sc = q.scales.contiguous();
  EXPECT_EQ(std::vector<uint8_t>(sc.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>() + sc.numel()), ref.scales);
  const torch::Tensor sw = q.scales_swizzled;
  EXPECT_EQ(std::vector<uint8_t>(sw.data_ptr<uint8_t>(), sw.data_ptr<uint8_t>() + sw.numel()), ref.scales_swizzled);
  const torch::Tensor y = vqad::ops::nvfp4_dequantize(q, torch::kFloat);
  EXPECT_TRUE(same_bits(to_vec(y), ref.values));
  EXPECT_TRUE(torch::equal(y, vqad::ops::nvfp4_fake_quant(x, ScaleMode::kDynamic)));
}

TEST(Nvfp4Cli, QuantizesEveryFloatTensor) {
  const std::string dir = temp_dir("cli");
  torch::manual_seed(6);
  const torch::Tensor a = torch::randn({4, 32}) * 3;
  const torch::Tensor b = (torch::randn({2, 3, 16}) * 100).to(torch::kBFloat16);
  vqad::io::save_safetensors(dir + "/in.safetensors",
                             {{"a", a}, {"b", b}, {"idx", torch::arange(3, torch::kLong)}});
  std::string out;
  ASSERT_EQ(run_vqad("op nvfp4-quantize " + dir + "/in.safetensors " + dir + "/out.safetensors --mode dynamic", &out), 0)
      << out;
  EXPECT_NE(out.find("idx"), std::string::npos) << "skipped tensor not reported: " << out;
  const auto f = vqad::st::File::open(dir + "/out.safetensors");
  EXPECT_FALSE(f.contains("idx.codes"));
  EXPECT_EQ(f.metadata().at("mode"), "dynamic");
  for (const auto& [name, x] : std::vector<std::pair<std::string, torch::Tensor>>{{"a", a}, {"b", b}}) {
    SCOPED_TRACE(name);
    const torch::Tensor xf = x.to(torch::kFloat).contiguous();
    const int64_t K = xf.size(-1), rows = xf.numel() / K;
    const float s_enc = nv::encode_scale_from_amax(xf.abs().max().item<float>());
    const nv::QuantizedMatrix ref = nv::quantize_matrix(xf.data_ptr<float>(), rows, K, s_enc);
    const auto& ci = f.info(name + ".codes");
    EXPECT_EQ(ci.dtype, vqad::st::DType::U8);
    EXPECT_EQ(ci.shape, xf.sizes().vec());
    EXPECT_EQ(std::vector<uint8_t>(f.data(name + ".codes"), f.data(name + ".codes") + ci.nbytes), ref.codes);
    auto scale_shape = xf.sizes().vec();
    scale_shape.back() = K / 16;
    const auto& si = f.info(name + ".scales");
    EXPECT_EQ(si.dtype, vqad::st::DType::U8);
    EXPECT_EQ(si.shape, scale_shape);
    EXPECT_EQ(std::vector<uint8_t>(f.data(name + ".scales"), f.data(name + ".scales") + si.nbytes), ref.scales);
    const auto& di = f.info(name + ".dequant");
    EXPECT_EQ(di.dtype, vqad::st::DType::F32);
    EXPECT_EQ(di.shape, xf.sizes().vec());
    std::vector<float> dq(ref.values.size());
    std::memcpy(dq.data(), f.data(name + ".dequant"), di.nbytes);
    EXPECT_TRUE(same_bits(dq, ref.values));
  }
  // static mode uses --amax for every tensor
  ASSERT_EQ(run_vqad("op nvfp4-quantize " + dir + "/in.safetensors " + dir + "/s.safetensors --mode static --amax 5", &out), 0)
      << out;
  const auto fs = vqad::st::File::open(dir + "/s.safetensors");
  std::vector<float> dq(a.numel());
  std::memcpy(dq.data(), fs.data("a.dequant"), dq.size() * 4);
  EXPECT_TRUE(same_bits(dq, reference_values(a, nv::encode_scale_from_amax(5.0f))));
  std::filesystem::remove_all(dir);
}

TEST(Nvfp4Cli, ErrorsNameTheProblem) {
  const std::string dir = temp_dir("cli_err");
  vqad::io::save_safetensors(dir + "/in.safetensors", {{"ok", torch::randn({2, 16})}, {"odd_tensor", torch::randn({2, 24})}});
  std::string out;
  EXPECT_NE(run_vqad("op nvfp4-quantize " + dir + "/in.safetensors " + dir + "/o.safetensors --mode unit", &out), 0);
  EXPECT_NE(out.find("odd_tensor"), std::string::npos) << out;
  EXPECT_NE(out.find("multiple of 16"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/o.safetensors"));
  vqad::io::save_safetensors(dir + "/good.safetensors", {{"ok", torch::randn({2, 16})}});
  EXPECT_NE(run_vqad("op nvfp4-quantize " + dir + "/good.safetensors " + dir + "/o.safetensors --mode static", &out), 0);
  EXPECT_NE(out.find("--amax"), std::string::npos) << out;
  EXPECT_NE(run_vqad("op nvfp4-quantize " + dir + "/good.safetensors " + dir + "/o.safetensors --mode dyn", &out), 0);
  EXPECT_NE(out.find("dyn"), std::string::npos) << out;
#ifndef VQAD_WITH_TORCH_CUDA
  EXPECT_NE(run_vqad("op nvfp4-quantize " + dir + "/good.safetensors " + dir + "/o.safetensors --mode unit --device cuda", &out), 0);
  EXPECT_NE(out.find("GPU"), std::string::npos) << out;
#endif
  std::filesystem::remove_all(dir);
}
