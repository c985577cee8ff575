// Wan2.1 DiT: key table on the meta device, one block against an independent
// implementation, RoPE against the direct formula, patchify, checkpointing, role scopes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"

namespace {

using vqad::AttentionBackend;
using vqad::model::BlockTaps;
using vqad::model::WanConfig;
using vqad::model::WanModel;
using vqad::model::WanModelOptions;
using Shape = std::vector<int64_t>;
using KeyTable = std::map<std::string, Shape>;

// research/fastvideo_training.md §5.2, 1.3B column; per-block rows for N = 0..num_layers-1.
KeyTable key_table_1_3b() {
  KeyTable t = {
      {"patch_embedding.weight", {1536, 16, 1, 2, 2}},
      {"patch_embedding.bias", {1536}},
      {"condition_embedder.time_embedder.linear_1.weight", {1536, 256}},
      {"condition_embedder.time_embedder.linear_1.bias", {1536}},
      {"condition_embedder.time_embedder.linear_2.weight", {1536, 1536}},
      {"condition_embedder.time_embedder.linear_2.bias", {1536}},
      {"condition_embedder.time_proj.weight", {9216, 1536}},
      {"condition_embedder.time_proj.bias", {9216}},
      {"condition_embedder.text_embedder.linear_1.weight", {1536, 4096}},
      {"condition_embedder.text_embedder.linear_1.bias", {1536}},
      {"condition_embedder.text_embedder.linear_2.weight", {1536, 1536}},
      {"condition_embedder.text_embedder.linear_2.bias", {1536}},
      {"proj_out.weight", {64, 1536}},
      {"proj_out.bias", {64}},
      {"scale_shift_table", {1, 2, 1536}},
  };
  const std::vector<std::pair<std::string, Shape>> block = {
      {"attn1.to_q.weight", {1536, 1536}},   {"attn1.to_q.bias", {1536}},
      {"attn1.to_k.weight", {1536, 1536}},   {"attn1.to_k.bias", {1536}},
      {"attn1.to_v.weight", {1536, 1536}},   {"attn1.to_v.bias", {1536}},
      {"attn1.to_out.0.weight", {1536, 1536}}, {"attn1.to_out.0.bias", {1536}},
      {"attn1.norm_q.weight", {1536}},       {"attn1.norm_k.weight", {1536}},
      {"attn2.to_q.weight", {1536, 1536}},   {"attn2.to_q.bias", {1536}},
      {"attn2.to_k.weight", {1536, 1536}},   {"attn2.to_k.bias", {1536}},
      {"attn2.to_v.weight", {1536, 1536}},   {"attn2.to_v.bias", {1536}},
      {"attn2.to_out.0.weight", {1536, 1536}}, {"attn2.to_out.0.bias", {1536}},
      {"attn2.norm_q.weight", {1536}},       {"attn2.norm_k.weight", {1536}},
      {"norm2.weight", {1536}},              {"norm2.bias", {1536}},
      {"ffn.net.0.proj.weight", {8960, 1536}}, {"ffn.net.0.proj.bias", {8960}},
      {"ffn.net.2.weight", {1536, 8960}},    {"ffn.net.2.bias", {1536}},
      {"scale_shift_table", {1, 6, 1536}},
  };
  for (int n = 0; n < 30; ++n)
    for (const auto& [k, s] : block) t["blocks." + std::to_string(n) + "." + k] = s;
  return t;
}

// The same table for 14B: dim 5120, 40 heads, 40 layers, ffn 13824.
KeyTable key_table_14b() {
  KeyTable t = {
      {"patch_embedding.weight", {5120, 16, 1, 2, 2}},
      {"patch_embedding.bias", {5120}},
      {"condition_embedder.time_embedder.linear_1.weight", {5120, 256}},
      {"condition_embedder.time_embedder.linear_1.bias", {5120}},
      {"condition_embedder.time_embedder.linear_2.weight", {5120, 5120}},
      {"condition_embedder.time_embedder.linear_2.bias", {5120}},
      {"condition_embedder.time_proj.weight", {30720, 5120}},
      {"condition_embedder.time_proj.bias", {30720}},
      {"condition_embedder.text_embedder.linear_1.weight", {5120, 4096}},
      {"condition_embedder.text_embedder.linear_1.bias", {5120}},
      {"condition_embedder.text_embedder.linear_2.weight", {5120, 5120}},
      {"condition_embedder.text_embedder.linear_2.bias", {5120}},
      {"proj_out.weight", {64, 5120}},
      {"proj_out.bias", {64}},
      {"scale_shift_table", {1, 2, 5120}},
  };
  const std::vector<std::pair<std::string, Shape>> block = {
      {"attn1.to_q.weight", {5120, 5120}},   {"attn1.to_q.bias", {5120}},
      {"attn1.to_k.weight", {5120, 5120}},   {"attn1.to_k.bias", {5120}},
      {"attn1.to_v.weight", {5120, 5120}},   {"attn1.to_v.bias", {5120}},
      {"attn1.to_out.0.weight", {5120, 5120}}, {"attn1.to_out.0.bias", {5120}},
      {"attn1.norm_q.weight", {5120}},       {"attn1.norm_k.weight", {5120}},
      {"attn2.to_q.weight", {5120, 5120}},   {"attn2.to_q.bias", {5120}},
      {"attn2.to_k.weight", {5120, 5120}},   {"attn2.to_k.bias", {5120}},
      {"attn2.to_v.weight", {5120, 5120}},   {"attn2.to_v.bias", {5120}},
      {"attn2.to_out.0.weight", {5120, 5120}}, {"attn2.to_out.0.bias", {5120}},
      {"attn2.norm_q.weight", {5120}},       {"attn2.norm_k.weight", {5120}},
      {"norm2.weight", {5120}},              {"norm2.bias", {5120}},
      {"ffn.net.0.proj.weight", {13824, 5120}}, {"ffn.net.0.proj.bias", {13824}},
      {"ffn.net.2.weight", {5120, 13824}},   {"ffn.net.2.bias", {5120}},
      {"scale_shift_table", {1, 6, 5120}},
  };
  for (int n = 0; n < 40; ++n)
    for (const auto& [k, s] : block) t["blocks." + std::to_string(n) + "." + k] = s;
  return t;
}

void expect_keys(WanModel& model, const KeyTable& table) {
  auto params = model.named_parameters(true);
  EXPECT_EQ(params.size(), table.size());
  for (const auto& item : params) {
    EXPECT_TRUE(item.value().is_meta()) << item.key();
    auto it = table.find(item.key());
    if (it == table.end()) {
      ADD_FAILURE() << "unexpected key " << item.key();
      continue;
    }
    EXPECT_EQ(item.value().sizes().vec(), it->second) << item.key();
  }
  for (const auto& [k, _] : table) EXPECT_TRUE(params.contains(k)) << "missing key " << k;
}

TEST(WanModelKeys, Diffusers13BOnMetaDevice) {
  WanModelOptions o;
  o.device = torch::Device(torch::kMeta);
  WanModel model(WanConfig::wan_1_3b(), o);
  auto table = key_table_1_3b();
  ASSERT_EQ(table.size(), 825u);
  expect_keys(model, table);
  int64_t numel = 0;
  for (const auto& p : model.parameters()) numel += p.numel();
  EXPECT_EQ(numel, 1418996800);  // research §5.1
  // Every projection is a hookable Linear: 4 embedder + 1 time_proj + proj_out + 10 per block.
  EXPECT_EQ(model.named_linears().size(), 6u + 30u * 10u);
}

TEST(WanModelKeys, Diffusers14BOnMetaDevice) {
  WanModelOptions o;
  o.device = torch::Device(torch::kMeta);
  WanModel model(WanConfig::wan_14b(), o);
  auto table = key_table_14b();
  ASSERT_EQ(table.size(), 15u + 27u * 40u);
  expect_keys(model, table);
}

TEST(WanModelKeys, GateCompressOnlyWhenConfiguredOrVsa) {
  WanModelOptions o;
  o.device = torch::Device(torch::kMeta);
  WanConfig c = WanConfig::tiny();
  WanModel dense(c, o);
  EXPECT_FALSE(dense.named_parameters().contains("blocks.0.to_gate_compress.weight"));
  {
    vqad::ops::AttentionBackendScope scope(AttentionBackend::kVsaQatTrainC128);
    WanModel vsa(c, o);
    auto p = vsa.named_parameters();
    ASSERT_TRUE(p.contains("blocks.1.to_gate_compress.weight"));
    EXPECT_EQ(p["blocks.1.to_gate_compress.weight"].sizes().vec(), (Shape{64, 64}));
    EXPECT_EQ(p.size(), 15u + 29u * 2u);
  }
  WanConfig g = c;
  g.gate_compress = true;
  WanModel cpu_gate(g, WanModelOptions{torch::kCPU, torch::kFloat32, false});
  auto w = cpu_gate.named_parameters()["blocks.0.to_gate_compress.weight"];
  EXPECT_EQ(w.abs().sum().item<float>(), 0.0f);  // zero-initialised
}

// ----------------------------------------------------------------------------------------
// Independent block math in float64: no model code, only the parameter tensors by name.

using P = std::map<std::string, torch::Tensor>;

torch::Tensor d(const torch::Tensor& t) { return t.to(torch::kFloat64); }

torch::Tensor lin(const torch::Tensor& x, const P& p, const std::string& n) {
  return torch::matmul(x, d(p.at(n + ".weight")).t()) + d(p.at(n + ".bias"));
}
torch::Tensor ln_plain(const torch::Tensor& x, double eps) {
  auto mean = x.mean(-1, true);
  auto var = (x - mean).pow(2).mean(-1, true);
  return (x - mean) / torch::sqrt(var + eps);
}
torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x / torch::sqrt(x.pow(2).mean(-1, true) + eps) * d(w);
}
torch::Tensor gelu_tanh(const torch::Tensor& x) {
  return 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
}
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  // [B, L, H, D]
  auto s = torch::einsum("blhd,bmhd->bhlm", {q, k}) / std::sqrt(static_cast<double>(q.size(3)));
  auto pr = torch::exp(s - std::get<0>(s.max(-1, true)));
  pr = pr / pr.sum(-1, true);
  return torch::einsum("bhlm,bmhd->blhd", {pr, v});
}

// Angle of pair j of token (t, h, w): the axis owning j, the pair index inside that axis.
double rope_angle(int64_t t, int64_t h, int64_t w, int64_t j, int64_t head_dim, double theta) {
  const int64_t dh = 2 * (head_dim / 6), dt = head_dim - 2 * dh;
  int64_t pos, jj, axis_dim;
  if (2 * j < dt) {
    pos = t, jj = j, axis_dim = dt;
  } else if (2 * j < dt + dh) {
    pos = h, jj = j - dt / 2, axis_dim = dh;
  } else {
    pos = w, jj = j - (dt + dh) / 2, axis_dim = dh;
  }
  return static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(jj) / axis_dim);
}

// x [B, L, H, D] float64; rotation as a complex product (x0 + i x1) * exp(i angle).
torch::Tensor rope_ref(const torch::Tensor& x, std::array<int64_t, 3> g, double theta) {
  const int64_t D = x.size(3);
  auto ang = torch::empty({x.size(1), D / 2}, torch::kFloat64);
  auto a = ang.accessor<double, 2>();
  for (int64_t t = 0; t < g[0]; ++t)
    for (int64_t h = 0; h < g[1]; ++h)
      for (int64_t w = 0; w < g[2]; ++w)
        for (int64_t j = 0; j < D / 2; ++j)
          a[(t * g[1] + h) * g[2] + w][j] = rope_angle(t, h, w, j, D, theta);
  auto z = torch::view_as_complex(x.reshape({x.size(0), x.size(1), x.size(2), D / 2, 2}).contiguous());
  auto rot = torch::polar(torch::ones_like(ang), ang).unsqueeze(0).unsqueeze(2);
  return torch::view_as_real(z * rot).reshape(x.sizes());
}

struct RefOut {
  torch::Tensor out, attn_out, ffn_out;
};

RefOut block_ref(const torch::Tensor& x_in, const torch::Tensor& time_mod, const torch::Tensor& ctx_in,
                 const P& p, int64_t heads, std::array<int64_t, 3> grid, double eps) {
  auto x = d(x_in), ctx = d(ctx_in);
  const int64_t B = x.size(0), L = x.size(1), Lt = ctx.size(1);
  auto e = d(p.at("scale_shift_table")) + d(time_mod);  // [B, 6, dim]
  auto m = [&](int i) { return e.select(1, i).unsqueeze(1); };
  auto h1 = ln_plain(x, eps) * (1 + m(1)) + m(0);
  auto q = rms(lin(h1, p, "attn1.to_q"), p.at("attn1.norm_q.weight"), eps).reshape({B, L, heads, -1});
  auto k = rms(lin(h1, p, "attn1.to_k"), p.at("attn1.norm_k.weight"), eps).reshape({B, L, heads, -1});
  auto v = lin(h1, p, "attn1.to_v").reshape({B, L, heads, -1});
  q = rope_ref(q, grid, 10000.0);
  k = rope_ref(k, grid, 10000.0);
  RefOut r;
  r.attn_out = lin(attention(q, k, v).reshape({B, L, -1}), p, "attn1.to_out.0");
  x = x + r.attn_out * m(2);
  auto h2 = ln_plain(x, eps) * d(p.at("norm2.weight")) + d(p.at("norm2.bias"));
  auto cq = rms(lin(h2, p, "attn2.to_q"), p.at("attn2.norm_q.weight"), eps).reshape({B, L, heads, -1});
  auto ck = rms(lin(ctx, p, "attn2.to_k"), p.at("attn2.norm_k.weight"), eps).reshape({B, Lt, heads, -1});
  auto cv = lin(ctx, p, "attn2.to_v").reshape({B, Lt, heads, -1});
  x = x + lin(attention(cq, ck, cv).reshape({B, L, -1}), p, "attn2.to_out.0");
  auto h3 = ln_plain(x, eps) * (1 + m(4)) + m(3);
  r.ffn_out = lin(gelu_tanh(lin(h3, p, "ffn.net.0.proj")), p, "ffn.net.2");
  r.out = x + r.ffn_out * m(5);
  return r;
}

void randomize(torch::nn::Module& m) {
  torch::NoGradGuard g;
  for (auto& item : m.named_parameters()) {
    auto& t = item.value();
    if (item.key().find("norm") != std::string::npos)
      t.copy_(1 + 0.3 * torch::randn_like(t));  // non-trivial norm weights and biases
    else if (item.key().find("scale_shift_table") != std::string::npos)
      t.copy_(0.5 * torch::randn_like(t));
  }
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(WanModelBlock, MatchesIndependentFloat64Implementation) {
  torch::manual_seed(11);
  WanConfig c = WanConfig::tiny();
  WanModel model(c, WanModelOptions{torch::kCPU, torch::kFloat32, false});
  randomize(model);
  const std::array<int64_t, 3> grid{3, 2, 5};  // L = 30, no axis a multiple of another
  const int64_t B = 2, L = 30, Lt = 7, dim = c.dim();
  auto x = torch::randn({B, L, dim});
  auto time_mod = 0.5 * torch::randn({B, 6, dim});
  auto ctx = torch::randn({B, Lt, dim});

  vqad::model::WanConditioning cond;
  cond.time_mod = time_mod;
  cond.context = ctx;
  std::tie(cond.rope_cos, cond.rope_sin) =
      vqad::model::rope_tables(grid, c.attention_head_dim, 10000.0, 1024, torch::kCPU);
  cond.grid = grid;
  BlockTaps taps;
  torch::Tensor got;
  {
    torch::NoGradGuard g;
    got = model.block(1).forward(x, cond, &taps);
  }
  P p;
  for (const auto& item : model.named_parameters()) {
    const std::string prefix = "blocks.1.";
    if (item.key().rfind(prefix, 0) == 0) p[item.key().substr(prefix.size())] = item.value().detach();
  }
  auto ref = block_ref(x, time_mod, ctx, p, c.num_attention_heads, grid, c.eps);
  const double scale = ref.out.abs().max().item<double>();
  EXPECT_GT(scale, 0.5);
  EXPECT_LT(max_abs_diff(got, ref.out), 2e-5 * scale) << "block output";
  EXPECT_LT(max_abs_diff(taps.attn_out, ref.attn_out), 2e-5 * ref.attn_out.abs().max().item<double>());
  EXPECT_LT(max_abs_diff(taps.ffn_out, ref.ffn_out), 2e-5 * ref.ffn_out.abs().max().item<double>());
  EXPECT_EQ(got.scalar_type(), torch::kFloat32);
}

TEST(WanModelRope, TablesAndRotationMatchDirectFormula) {
  const std::array<int64_t, 3> grid{4, 3, 5};
  for (int64_t head_dim : {128, 32}) {
    auto [cos, sin] = vqad::model::rope_tables(grid, head_dim, 10000.0, 1024, torch::kCPU);
    ASSERT_EQ(cos.sizes().vec(), (Shape{60, head_dim / 2}));
    ASSERT_EQ(cos.scalar_type(), torch::kFloat32);
    auto c = cos.accessor<float, 2>(), s = sin.accessor<float, 2>();
    double worst = 0;
    for (int64_t t = 0; t < grid[0]; ++t)
      for (int64_t h = 0; h < grid[1]; ++h)
        for (int64_t w = 0; w < grid[2]; ++w)
          for (int64_t j = 0; j < head_dim / 2; ++j) {
            const int64_t l = (t * grid[1] + h) * grid[2] + w;
            const double a = rope_angle(t, h, w, j, head_dim, 10000.0);
            // fp32 rounding of the float64 value: within half an ulp of 1.
            worst = std::max({worst, std::abs(c[l][j] - std::cos(a)), std::abs(s[l][j] - std::sin(a))});
          }
    EXPECT_LT(worst, 6e-8) << "head_dim " << head_dim;

    torch::manual_seed(3);
    auto x = torch::randn({2, 60, 3, head_dim});
    auto got = vqad::model::apply_rope(x, cos, sin);
    auto ref = rope_ref(d(x), grid, 10000.0);
    EXPECT_LT(max_abs_diff(got, ref), 4e-6) << "head_dim " << head_dim;
    auto xb = x.to(torch::kBFloat16);
    EXPECT_EQ(vqad::model::apply_rope(xb, cos, sin).scalar_type(), torch::kBFloat16);
  }
  // 128 splits into 44 / 42 / 42.
  EXPECT_EQ(WanConfig::wan_1_3b().rope_axes_dims(), (std::array<int64_t, 3>{44, 42, 42}));
  EXPECT_THROW(vqad::model::rope_tables({1025, 1, 1}, 128, 10000.0, 1024, torch::kCPU), vqad::Error);
}

TEST(WanModelPatchify, InverseAndConvEquivalence) {
  torch::manual_seed(5);
  const std::array<int64_t, 3> patch{1, 2, 2};
  auto x = torch::randn({2, 16, 3, 6, 10});
  auto tokens = vqad::model::patchify(x, patch, /*channel_last=*/true);
  ASSERT_EQ(tokens.sizes().vec(), (Shape{2, 3 * 3 * 5, 64}));
  EXPECT_TRUE(torch::equal(vqad::model::unpatchify(tokens, {3, 3, 5}, patch, 16), x));
  auto y = torch::randn({2, 45, 64});
  EXPECT_TRUE(torch::equal(vqad::model::patchify(vqad::model::unpatchify(y, {3, 3, 5}, patch, 16), patch, true), y));
  // Channel layout (pt, ph, pw, C), C fastest: token 0, feature 1 is channel 1 of pixel (0, 0, 0).
  EXPECT_EQ(y[0][0][1].item<float>(), vqad::model::unpatchify(y, {3, 3, 5}, patch, 16)[0][1][0][0][0].item<float>());
  // ... and feature 16 is channel 0 of pixel (0, 0, 1).
  EXPECT_EQ(y[0][0][16].item<float>(), vqad::model::unpatchify(y, {3, 3, 5}, patch, 16)[0][0][0][0][1].item<float>());

  // Patch embedding as a linear equals the Diffusers Conv3d.
  vqad::model::PatchEmbedding pe(16, 24, patch, torch::TensorOptions());
  auto got = pe.forward(x);  // [B, L, 24]
  auto conv = torch::conv3d(x, pe.weight, pe.bias, {1, 2, 2});  // [B, 24, 3, 3, 5]
  auto ref = conv.flatten(2).transpose(1, 2);
  EXPECT_LT(max_abs_diff(got, ref), 1e-5);
  EXPECT_THROW(pe.forward(torch::randn({1, 16, 2, 5, 4})), vqad::Error);
}

TEST(WanModelForward, SplitEqualsWholeAndShapes) {
  torch::manual_seed(7);
  WanConfig c = WanConfig::tiny();
  WanModel model(c, WanModelOptions{torch::kCPU, torch::kFloat32, false});
  randomize(model);
  auto x = torch::randn({2, 16, 3, 4, 6});
  auto t = torch::tensor({999.0f, 37.5f});
  auto text = torch::randn({2, c.text_len, c.text_dim});
  torch::NoGradGuard g;
  std::vector<BlockTaps> taps;
  auto whole = model.forward(x, t, text, &taps);
  ASSERT_EQ(whole.sizes(), x.sizes());
  ASSERT_EQ(taps.size(), 2u);
  EXPECT_EQ(taps[0].attn_out.sizes().vec(), (Shape{2, 3 * 2 * 3, 64}));
  auto e = model.embed(x, t, text);
  EXPECT_EQ(e.cond.time_mod.scalar_type(), torch::kFloat32);
  auto h = model.forward_blocks(0, 1, e.hidden, e.cond);
  h = model.forward_blocks(1, 2, h, e.cond);
  EXPECT_TRUE(torch::equal(model.head(h, e.cond), whole));
  EXPECT_THROW(model.forward_blocks(1, 3, h, e.cond), vqad::Error);
  // Timestep sinusoid: cos first.
  auto s = vqad::model::timestep_sinusoid(torch::tensor({2.0f}), 256);
  EXPECT_FLOAT_EQ(s[0][0].item<float>(), std::cos(2.0f));
  EXPECT_FLOAT_EQ(s[0][128].item<float>(), std::sin(2.0f));
  EXPECT_NEAR(s[0][1].item<float>(), std::cos(2.0 * std::exp(-std::log(10000.0) / 128)), 1e-6);

  // BF16 compute stays close to fp32 compute and returns bf16.
  model.set_compute_dtype(torch::kBFloat16);
  auto low = model.forward(x, t, text);
  EXPECT_EQ(low.scalar_type(), torch::kBFloat16);
  const double rel = (low.to(torch::kFloat32) - whole).norm().item<double>() / whole.norm().item<double>();
  EXPECT_LT(rel, 0.05);
  EXPECT_GT(rel, 0.0);
}

// Same seed -> same weights; run forward + backward and return every gradient.
std::map<std::string, torch::Tensor> grads_of(bool checkpointing, bool detach_hidden) {
  torch::manual_seed(21);
  WanConfig c = WanConfig::tiny();
  WanModel model(c, WanModelOptions{torch::kCPU, torch::kFloat32, checkpointing});
  randomize(model);
  auto x = torch::randn({1, 16, 2, 4, 4});
  auto t = torch::tensor({500.0f});
  auto text = torch::randn({1, 5, c.text_dim});
  torch::Tensor out;
  if (detach_hidden) {  // layer reconstruction: blocks fed from a detached activation
    auto e = model.embed(x, t, text);
    out = model.forward_blocks(0, 2, e.hidden.detach(), e.cond);
  } else {
    out = model.forward(x, t, text);
  }
  (out * out).sum().backward();
  std::map<std::string, torch::Tensor> g;
  for (const auto& item : model.named_parameters())
    g[item.key()] = item.value().grad().defined() ? item.value().grad().clone() : torch::Tensor();
  return g;
}

TEST(WanModelCheckpoint, SameGradientsAsWithout) {
  for (bool detach : {false, true}) {
    auto plain = grads_of(false, detach);
    auto ckpt = grads_of(true, detach);
    ASSERT_EQ(plain.size(), ckpt.size());
    int compared = 0;
    for (const auto& [k, g] : plain) {
      if (!g.defined()) {
        EXPECT_FALSE(ckpt[k].defined()) << k;
        continue;
      }
      ASSERT_TRUE(ckpt[k].defined()) << k << " (detach " << detach << ")";
      EXPECT_LE(max_abs_diff(g, ckpt[k]), 1e-6 * (1 + g.abs().max().item<double>())) << k;
      ++compared;
    }
    EXPECT_GE(compared, 2 * 27) << "block parameters must all get gradients (detach " << detach << ")";
  }
}

TEST(WanModelCheckpoint, AutogradGradReturnsParameterGradients) {
  torch::manual_seed(4);
  WanConfig c = WanConfig::tiny();
  c.num_layers = 1;
  WanModel a(c, WanModelOptions{torch::kCPU, torch::kFloat32, true});
  auto x = torch::randn({1, 16, 1, 4, 4});
  auto text = torch::randn({1, 3, c.text_dim});
  auto out = a.forward(x, torch::tensor({10.0f}), text);
  auto w = a.named_parameters()["blocks.0.attn1.to_q.weight"];
  auto g = torch::autograd::grad({out.sum()}, {w});
  ASSERT_TRUE(g[0].defined());
  EXPECT_GT(g[0].abs().sum().item<double>(), 0.0);
  EXPECT_FALSE(w.grad().defined());  // grad() must not accumulate into .grad
}

TEST(WanModelRoles, DifferentBackendsInOneProcess) {
  WanConfig c = WanConfig::tiny();
  WanModelOptions o{torch::kCPU, torch::kFloat32, false};
  EXPECT_FALSE(vqad::ops::attention_scope_active());
  std::shared_ptr<WanModel> student, teacher;
  {
    vqad::ops::AttentionBackendScope s(AttentionBackend::kVsaTrain);
    student = std::make_shared<WanModel>(c, o);
    {
      vqad::ops::AttentionBackendScope t(AttentionBackend::kTorchSdpa);
      teacher = std::make_shared<WanModel>(c, o);
    }
    EXPECT_EQ(vqad::ops::current_attention_spec().backend, AttentionBackend::kVsaTrain);
  }
  EXPECT_FALSE(vqad::ops::attention_scope_active());
  EXPECT_EQ(vqad::ops::current_attention_spec().backend, vqad::ops::kDefaultAttentionBackend);
  auto critic = std::make_shared<WanModel>(c, o);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(student->block(i).attention_spec().backend, AttentionBackend::kVsaTrain);
    EXPECT_EQ(teacher->block(i).attention_spec().backend, AttentionBackend::kTorchSdpa);
    EXPECT_EQ(critic->block(i).attention_spec().backend, vqad::ops::kDefaultAttentionBackend);
  }
  // The backends are used, not just recorded: with the same weights (gates aside) the
  // VSA student at sparsity 0.75 and the dense teacher compute different outputs.
  {
    torch::NoGradGuard ng;
    auto src = teacher->named_parameters();
    for (auto& item : student->named_parameters())
      if (src.contains(item.key())) item.value().copy_(src[item.key()]);
  }
  student->set_vsa_sparsity(0.75);
  auto x = torch::randn({1, 16, 4, 8, 16});  // grid 4 x 4 x 8: 4 C64 cubes
  auto text = torch::randn({1, 3, c.text_dim});
  torch::NoGradGuard g;
  auto od = teacher->forward(x, torch::tensor({1.0f}), text);
  auto os = student->forward(x, torch::tensor({1.0f}), text);
  EXPECT_GT((od - os).abs().max().item<double>(), 1e-3);
}

// A LinearQuant that records calls and returns a recognisable result.
class CountingQuant : public vqad::ops::LinearQuant {
 public:
  int calls = 0;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) override {
    ++calls;
    EXPECT_EQ(w.scalar_type(), torch::kFloat32);  // the fp32 master is handed over
    return torch::nn::functional::linear(x, w.to(x.scalar_type()), b.to(x.scalar_type())) * 0;
  }
  std::string describe() const override { return "zero"; }
};

TEST(WanModelLinearHook, QuantReplacesTheLinearMath) {
  torch::manual_seed(9);
  WanConfig c = WanConfig::tiny();
  WanModel m(c, WanModelOptions{torch::kCPU, torch::kFloat32, false});
  auto names = m.named_linears();
  ASSERT_EQ(names.size(), 6u + 2u * 10u);
  bool found = false;
  for (auto& [n, l] : names) found |= (n == "blocks.1.ffn.net.0.proj");
  EXPECT_TRUE(found);
  auto q = std::make_shared<CountingQuant>();
  m.attach_linear_quant("proj_out", q);
  auto x = torch::randn({1, 16, 1, 4, 4});
  auto text = torch::randn({1, 3, c.text_dim});
  torch::NoGradGuard g;
  auto out = m.forward(x, torch::tensor({3.0f}), text);
  EXPECT_EQ(q->calls, 1);
  EXPECT_EQ(out.abs().sum().item<float>(), 0.0f);
  m.attach_linear_quant("proj_out", nullptr);
  EXPECT_GT(m.forward(x, torch::tensor({3.0f}), text).abs().sum().item<float>(), 0.0f);
  EXPECT_THROW(m.attach_linear_quant("blocks.9.attn1.to_q", q), vqad::Error);
}

}  // namespace
