// The sparse-QAD methods on tiny models (spec/sparse_qad.md): the trainable scope,
// layer_recon (S0) and recon_ode (S1) losses against independent recomputations, the
// gradient scope (only trainable modules, group-local in S0), checkpointed taps, and the
// load-time config errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "vqad/core/error.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention.h"
#include "vqad/sample/schedule.h"
#include "vqad/train/config.h"
#include "vqad/train/methods/layer_recon.h"
#include "vqad/train/methods/recon_ode.h"
#include "vqad/train/param_groups.h"
#include "vqad/train/roles.h"

using namespace vqad;

namespace {

const std::vector<std::string> kS0Modules{"to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k", "attn2", "ffn"};

model::WanConfig small_config(int64_t layers) {
  auto c = model::WanConfig::tiny();
  c.num_layers = layers;
  return c;
}

// A role built by hand: fp32 compute so the recomputations below can be compared tightly.
std::shared_ptr<train::Role> make_role(const std::string& name, const model::WanConfig& c, bool trainable,
                                       uint64_t seed, torch::ScalarType dtype = torch::kFloat32) {
  auto r = std::make_shared<train::Role>();
  r->name = name;
  r->config.name = name;
  r->config.trainable = trainable;
  r->config.attention_backend = AttentionBackend::kTorchSdpa;
  model::WanModelOptions o;
  o.compute_dtype = dtype;
  torch::manual_seed(seed);
  {
    ops::AttentionBackendScope scope(AttentionBackend::kTorchSdpa);
    r->model = std::make_shared<model::WanModel>(c, o);
  }
  for (auto& p : r->model->parameters()) p.set_requires_grad(trainable);
  return r;
}

// Student = teacher's weights with the blocks perturbed (the embeddings stay shared).
std::shared_ptr<train::Role> make_student(const model::WanConfig& c, uint64_t seed, double noise = 0.05) {
  auto s = make_role("student", c, true, seed);
  torch::NoGradGuard ng;
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed + 99);
  for (auto& item : s->model->named_parameters())
    if (item.key().rfind("blocks.", 0) == 0)
      item.value().add_(at::randn(item.value().sizes(), g, torch::TensorOptions(torch::kFloat32)) * noise);
  return s;
}

data::Batch ode_batch(const model::WanConfig& c, int64_t B, uint64_t seed, std::vector<int64_t> steps,
                      const std::vector<float>& sigmas) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f = torch::TensorOptions(torch::kFloat32);
  data::Batch b;
  b.ode_start = at::randn({B, c.in_channels, 2, 4, 4}, g, f);
  b.ode_target = at::randn({B, c.in_channels, 2, 4, 4}, g, f) * 0.5;
  b.ode_sigma = torch::tensor(sigmas, f);
  std::vector<float> t;
  for (float s : sigmas) t.push_back(1000.0f * s);
  b.ode_timestep = torch::tensor(t, f);
  b.ode_teacher_step = std::move(steps);
  b.text = at::randn({B, 6, c.text_dim}, g, f) * 0.3;
  b.text_mask = torch::ones({B, 6}, torch::kInt64);
  return b;
}

// h -> block i -> h, through the block's own forward (not forward_blocks).
torch::Tensor run_block(model::WanModel& m, int64_t i, const torch::Tensor& h, const model::WanConditioning& cond,
                        model::BlockTaps* taps = nullptr) {
  return m.block(i).forward(h, cond, taps);
}

bool has_grad(const torch::Tensor& p) { return p.grad().defined() && p.grad().abs().sum().item<double>() > 0; }

}  // namespace

// ---------------------------------------------------------------------------------------
// Trainable scope
// ---------------------------------------------------------------------------------------
TEST(TrainableScope, SelectsExactlyTheQuantizedPath) {
  auto r = make_role("student", small_config(2), true, 1);
  auto names = train::apply_trainable_scope(*r->model, kS0Modules, "method.trainable_modules");
  // Independent rule, written out per parameter kind of a Wan block.
  auto expected = [](const std::string& n) {
    if (n.rfind("blocks.", 0) != 0) return false;  // embeddings, proj_out, head table
    for (const char* s : {".attn1.to_q.", ".attn1.to_k.", ".attn1.to_v.", ".attn1.to_out.0.", ".attn1.norm_q.",
                          ".attn1.norm_k.", ".attn2.", ".ffn."})
      if (n.find(s) != std::string::npos) return true;
    return false;  // norm2, scale_shift_table
  };
  size_t want = 0;
  for (const auto& item : r->model->named_parameters()) {
    const bool e = expected(item.key());
    want += e;
    EXPECT_EQ(item.value().requires_grad(), e) << item.key();
    EXPECT_EQ(std::find(names.begin(), names.end(), item.key()) != names.end(), e) << item.key();
  }
  EXPECT_EQ(names.size(), want);
  EXPECT_GT(want, 0u);
  auto trainable = r->trainable_parameters();
  EXPECT_EQ(trainable.size(), want);
}

TEST(TrainableScope, FastVideoNamesMatchTheSameModules) {
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.attn1.to_q"), "blocks.3.to_q");
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.attn1.to_out.0"), "blocks.3.to_out");
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.attn1.norm_k"), "blocks.3.norm_k");
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.norm2"), "blocks.3.self_attn_residual_norm.norm");
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.ffn.net.0.proj"), "blocks.3.ffn.fc_in");
  EXPECT_EQ(train::wan_fastvideo_module_path("blocks.3.ffn.net.2"), "blocks.3.ffn.fc_out");
  // A FastVideo-only name selects the Diffusers parameters.
  auto r = make_role("student", small_config(2), true, 1);
  auto names = train::apply_trainable_scope(*r->model, {"self_attn_residual_norm", "ffn.fc_in"}, "k");
  std::vector<std::string> want;
  for (int b = 0; b < 2; ++b)
    for (const char* s : {"ffn.net.0.proj.weight", "ffn.net.0.proj.bias", "norm2.weight", "norm2.bias"})
      want.push_back("blocks." + std::to_string(b) + "." + s);
  std::sort(names.begin(), names.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names, want);
  EXPECT_TRUE(train::in_trainable_scope("blocks.0.to_gate_compress.weight", {"to_gate_compress"}));
  EXPECT_FALSE(train::in_trainable_scope("blocks.0.scale_shift_table", kS0Modules));
  EXPECT_FALSE(train::in_trainable_scope("condition_embedder.time_proj.weight", kS0Modules));
}

TEST(TrainableScope, UnknownModuleNameFailsNamingTheKey) {
  auto r = make_role("student", small_config(2), true, 1);
  try {
    train::apply_trainable_scope(*r->model, {"to_q", "to_qq_typo"}, "method.trainable_modules");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("method.trainable_modules"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("to_qq_typo"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// Checkpointed taps
// ---------------------------------------------------------------------------------------
TEST(CheckpointedTaps, SameTapsAndGradientsAsWithoutCheckpointing) {
  auto c = small_config(2);
  auto a = make_role("student", c, true, 3);
  auto b = make_role("student", c, true, 3);
  b->model->set_gradient_checkpointing(true);
  auto batch = ode_batch(c, 2, 7, {0, 0}, {1.0f, 1.0f});
  std::vector<torch::Tensor> grads[2];
  std::vector<model::BlockTaps> taps[2];
  int k = 0;
  for (auto* r : {a.get(), b.get()}) {
    auto e = r->model->embed(batch.ode_start, batch.ode_timestep, batch.text);
    auto h = r->model->forward_blocks(0, 2, e.hidden, e.cond, &taps[k]);
    auto loss = taps[k][0].attn_out.pow(2).mean() + 0.5 * taps[k][1].ffn_out.pow(2).mean() + h.mean();
    loss.backward();
    for (auto& p : r->model->parameters()) grads[k].push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    ++k;
  }
  ASSERT_EQ(taps[1].size(), 2u);
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(torch::equal(taps[0][l].attn_out, taps[1][l].attn_out));
    EXPECT_TRUE(torch::equal(taps[0][l].ffn_out, taps[1][l].ffn_out));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_EQ(grads[0][i].defined(), grads[1][i].defined()) << i;
    if (grads[0][i].defined()) EXPECT_TRUE(torch::allclose(grads[0][i], grads[1][i], 1e-5, 1e-6)) << i;
  }
}

// ---------------------------------------------------------------------------------------
// layer_recon
// ---------------------------------------------------------------------------------------
TEST(LayerRecon, LossMatchesAnIndependentRecomputation) {
  auto c = small_config(4);
  auto teacher = make_role("teacher", c, false, 11);
  auto student = make_student(c, 11);
  train::RunConfig run;
  run.method.layer_recon.group_size = 2;
  run.method.layer_recon.checkpoint_blocks = false;
  train::LayerReconMethod m(run, student, teacher);
  ASSERT_EQ(m.num_groups(), 2);
  auto batch = ode_batch(c, 3, 5, {0, 4, 8}, {1.0f, 0.96f, 0.92f});
  torch::Tensor want;
  {
    torch::NoGradGuard ng;
    auto e = teacher->model->embed(batch.ode_start, batch.ode_timestep, batch.text);
    std::vector<torch::Tensor> h{e.hidden};
    for (int64_t i = 0; i < 4; ++i) h.push_back(run_block(*teacher->model, i, h.back(), e.cond));
    double total = 0;
    for (int g = 0; g < 2; ++g) {
      auto s = h[2 * g];
      for (int64_t i = 2 * g; i < 2 * g + 2; ++i) s = run_block(*student->model, i, s, e.cond);
      const auto& in = h[2 * g];
      const auto& out = h[2 * g + 2];
      for (int64_t b = 0; b < 3; ++b) {
        const double num = (s[b] - out[b]).pow(2).mean().item<double>();
        const double den = std::max((out[b] - in[b]).pow(2).mean().item<double>(), 1e-6);
        total += num / den;
      }
    }
    want = torch::tensor(total / 6.0, torch::kFloat64);
  }
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto r = m.micro_step(batch, gen, torch::kCPU, 1, 1.0);
  EXPECT_NEAR(r.metrics.at("loss"), want.item<double>(), 1e-5 * want.item<double>());
  EXPECT_GT(r.metrics.at("loss"), 0.0);
  EXPECT_EQ(r.role_loss.at("student"), r.metrics.at("loss"));
}

TEST(LayerRecon, EnergyFloorBoundsTheDenominator) {
  auto c = small_config(2);
  auto teacher = make_role("teacher", c, false, 11);
  auto student = make_student(c, 11);
  train::RunConfig run;
  run.method.layer_recon.group_size = 1;
  run.method.layer_recon.energy_floor = 1e3;  // far above any block update: den = floor
  train::LayerReconMethod m(run, student, teacher);
  auto batch = ode_batch(c, 2, 5, {0, 0}, {1.0f, 1.0f});
  auto st = m.teacher_states(batch, torch::kCPU);
  auto l = m.group_loss(0, st);
  torch::NoGradGuard ng;
  auto s = run_block(*student->model, 0, st.boundaries[0], st.cond);
  for (int64_t b = 0; b < 2; ++b)
    EXPECT_NEAR(l[b].item<double>(), (s[b] - st.boundaries[1][b]).pow(2).mean().item<double>() / 1e3, 1e-9);
}

TEST(LayerRecon, GradientsAreGroupLocalAndOnlyInTheScope) {
  auto c = small_config(4);
  auto teacher = make_role("teacher", c, false, 11);
  auto student = make_student(c, 11);
  train::apply_trainable_scope(*student->model, kS0Modules, "method.trainable_modules");
  train::RunConfig run;
  run.method.layer_recon.group_size = 2;
  train::LayerReconMethod m(run, student, teacher);  // checkpoint_blocks on (the default)
  auto batch = ode_batch(c, 2, 5, {0, 4}, {1.0f, 0.96f});
  auto st = m.teacher_states(batch, torch::kCPU);
  m.group_loss(1, st).mean().backward();
  for (const auto& item : student->model->named_parameters()) {
    const auto& n = item.key();
    const bool in_scope = train::in_trainable_scope(n, kS0Modules);
    const bool in_group1 = n.rfind("blocks.2.", 0) == 0 || n.rfind("blocks.3.", 0) == 0;
    if (!in_scope) {
      EXPECT_FALSE(item.value().grad().defined()) << n;
    } else if (in_group1) {
      EXPECT_TRUE(has_grad(item.value())) << n;
    } else {
      EXPECT_FALSE(has_grad(item.value())) << n << " (group 0 must get no gradient from group 1's loss)";
    }
  }
  for (const auto& p : teacher->model->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(LayerRecon, CheckpointedStepHasTheSameGradientAsPlain) {
  auto c = small_config(4);
  auto teacher = make_role("teacher", c, false, 11);
  std::vector<torch::Tensor> g[2];
  for (int k = 0; k < 2; ++k) {
    auto student = make_student(c, 11);
    train::RunConfig run;
    run.method.layer_recon.group_size = 2;
    run.method.layer_recon.checkpoint_blocks = k == 1;
    train::LayerReconMethod m(run, student, teacher);
    auto batch = ode_batch(c, 2, 5, {0, 4}, {1.0f, 0.96f});
    torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
    m.micro_step(batch, gen, torch::kCPU, 1, 0.5);
    for (auto& p : student->model->parameters()) g[k].push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  }
  for (size_t i = 0; i < g[0].size(); ++i) EXPECT_TRUE(torch::allclose(g[0][i], g[1][i], 1e-5, 1e-7)) << i;
}

TEST(LayerRecon, GroupSizeMustDivideTheBlocksAndEmbeddingsMustBeShared) {
  auto c = small_config(4);
  auto teacher = make_role("teacher", c, false, 11);
  train::RunConfig run;
  run.method.layer_recon.group_size = 3;
  try {
    train::LayerReconMethod m(run, make_student(c, 11), teacher);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("method.group_size"), std::string::npos) << e.what();
  }
  run.method.layer_recon.group_size = 2;
  try {
    train::LayerReconMethod m(run, make_role("student", c, true, 12), teacher);  // other embeddings
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embedding"), std::string::npos) << e.what();
  }
  auto batch = ode_batch(c, 1, 5, {0}, {1.0f});
  batch.ode_start = torch::Tensor();
  train::LayerReconMethod m(run, make_student(c, 11), teacher);
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_THROW(m.micro_step(batch, gen, torch::kCPU, 1, 1.0), Error);
}

// ---------------------------------------------------------------------------------------
// recon_ode
// ---------------------------------------------------------------------------------------
namespace {
train::FewStepSchedule s1_schedule() {
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
  return train::few_step_schedule(8.0, 48, 3, anchors, "test cache");
}
}  // namespace

TEST(ReconOde, TrainingScheduleIsSeed004s) {
  auto s = s1_schedule();
  EXPECT_EQ(s.indices, (std::vector<int64_t>{0, 16, 32}));
  ASSERT_EQ(s.sigmas.size(), 3u);
  EXPECT_EQ(s.sigmas[0], 1.0f);
  EXPECT_EQ(s.sigmas[1], 0.9411764144897461f);
  EXPECT_EQ(s.sigmas[2], 0.800000011920929f);
  EXPECT_EQ(s.timesteps[1], 941.1763916015625f);
  EXPECT_EQ(s.timesteps[2], 800.0f);
  auto j = s.to_json();
  EXPECT_EQ(j["indices"], nlohmann::json({0, 16, 32}));
  EXPECT_EQ(j["sigmas"][1].get<double>(), 0.9411764144897461);
}

TEST(ReconOde, AnchorNotInTheCacheFailsNamingTheKey) {
  std::vector<int64_t> anchors;
  for (int64_t i = 0; i < 48; i += 4) anchors.push_back(i);
  for (int64_t steps : {24, 5}) {
    try {
      train::few_step_schedule(8.0, 48, steps, anchors, "cache X");
      FAIL() << steps;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("method.student_steps"), std::string::npos) << e.what();
    }
  }
}

TEST(ReconOde, LossesMatchAnIndependentRecomputation) {
  auto c = small_config(3);
  auto teacher = make_role("teacher", c, false, 21);
  auto student = make_student(c, 21);
  train::RunConfig run;
  run.method.recon_ode.attention_weight = 0.25;
  run.method.recon_ode.mlp_weight = 0.3;
  run.method.recon_ode.ode_weight = 0.5;
  run.method.recon_ode.checkpoint_blocks = false;
  auto sched = s1_schedule();
  train::ReconOdeMethod m(run, student, teacher, sched);
  auto batch = ode_batch(c, 2, 9, {16, 32}, {sched.sigmas[1], sched.sigmas[2]});

  double la = 0, lm = 0, lo = 0;
  {
    torch::NoGradGuard ng;
    auto e = teacher->model->embed(batch.ode_start, batch.ode_timestep, batch.text);
    auto h = e.hidden;
    for (int64_t l = 0; l < 3; ++l) {
      model::BlockTaps tt, st;
      auto next = run_block(*teacher->model, l, h, e.cond, &tt);
      run_block(*student->model, l, h, e.cond, &st);
      la += (st.attn_out - tt.attn_out).pow(2).mean().item<double>() / 3.0;
      lm += (st.ffn_out - tt.ffn_out).pow(2).mean().item<double>() / 3.0;
      h = next;
    }
    // The full student forward, written out: embed, every block, head.
    auto es = student->model->embed(batch.ode_start, batch.ode_timestep, batch.text);
    auto hs = es.hidden;
    for (int64_t l = 0; l < 3; ++l) hs = run_block(*student->model, l, hs, es.cond);
    auto v = student->model->head(hs, es.cond);
    for (int64_t b = 0; b < 2; ++b) {
      auto x0 = batch.ode_start[b] - batch.ode_sigma[b].item<float>() * v[b];
      lo += (x0 - batch.ode_target[b]).pow(2).mean().item<double>() / 2.0;
    }
  }
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto r = m.micro_step(batch, gen, torch::kCPU, 1, 1.0);
  EXPECT_NEAR(r.metrics.at("loss_attn"), la, 1e-5 * la + 1e-9);
  EXPECT_NEAR(r.metrics.at("loss_mlp"), lm, 1e-5 * lm + 1e-9);
  EXPECT_NEAR(r.metrics.at("loss_ode"), lo, 1e-5 * lo);
  EXPECT_NEAR(r.metrics.at("loss"), 0.25 * la + 0.3 * lm + 0.5 * lo, 1e-5 * r.metrics.at("loss"));
  EXPECT_GT(la, 0);
  EXPECT_GT(lm, 0);
}

TEST(ReconOde, GradientIsThatOfTheWeightedSumAndCheckpointingAgrees) {
  auto c = small_config(2);
  auto teacher = make_role("teacher", c, false, 21);
  auto sched = s1_schedule();
  auto batch = ode_batch(c, 2, 9, {0, 16}, {sched.sigmas[0], sched.sigmas[1]});
  // Reference gradient: one backward of the whole loss built independently.
  auto ref = make_student(c, 21);
  train::apply_trainable_scope(*ref->model, kS0Modules, "k");
  {
    model::WanConditioning cond;
    torch::Tensor h;
    std::vector<torch::Tensor> ins;
    std::vector<model::BlockTaps> tts(2);
    {
      torch::NoGradGuard ng;
      auto e = teacher->model->embed(batch.ode_start, batch.ode_timestep, batch.text);
      cond = e.cond;
      h = e.hidden;
      for (int64_t l = 0; l < 2; ++l) {
        ins.push_back(h);
        h = run_block(*teacher->model, l, h, cond, &tts[l]);
      }
    }
    torch::Tensor total = torch::zeros({}, torch::kFloat32);
    for (int64_t l = 0; l < 2; ++l) {
      model::BlockTaps st;
      run_block(*ref->model, l, ins[l], cond, &st);
      total = total + 0.25 / 2 * (st.attn_out - tts[l].attn_out).pow(2).mean() +
              0.25 / 2 * (st.ffn_out - tts[l].ffn_out).pow(2).mean();
    }
    auto v = ref->model->forward(batch.ode_start, batch.ode_timestep, batch.text);
    auto x0 = batch.ode_start - batch.ode_sigma.reshape({2, 1, 1, 1, 1}) * v;
    total = total + 0.5 * (x0 - batch.ode_target).pow(2).mean();
    total.backward();
  }
  for (bool ckpt : {false, true}) {
    auto student = make_student(c, 21);
    train::apply_trainable_scope(*student->model, kS0Modules, "k");
    train::RunConfig run;
    run.method.recon_ode.checkpoint_blocks = ckpt;
    train::ReconOdeMethod m(run, student, teacher, sched);
    torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
    m.micro_step(batch, gen, torch::kCPU, 1, 1.0);
    auto rp = ref->model->named_parameters();
    for (const auto& item : student->model->named_parameters()) {
      const auto& want = rp[item.key()].grad();
      const auto& got = item.value().grad();
      ASSERT_EQ(want.defined(), got.defined()) << item.key();
      if (!want.defined()) {
        EXPECT_FALSE(train::in_trainable_scope(item.key(), kS0Modules)) << item.key();
        continue;
      }
      EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-7)) << item.key() << " ckpt " << ckpt;
    }
  }
}

TEST(ReconOde, RefusesPairsOutsideTheScheduleAndWrongSigmas) {
  auto c = small_config(2);
  auto teacher = make_role("teacher", c, false, 21);
  auto sched = s1_schedule();
  train::RunConfig run;
  train::ReconOdeMethod m(run, make_student(c, 21), teacher, sched);
  torch::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto bad_anchor = ode_batch(c, 1, 9, {4}, {0.98f});
  try {
    m.micro_step(bad_anchor, gen, torch::kCPU, 1, 1.0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("teacher step 4"), std::string::npos) << e.what();
  }
  auto bad_sigma = ode_batch(c, 1, 9, {16}, {0.9411765f});
  EXPECT_THROW(m.micro_step(bad_sigma, gen, torch::kCPU, 1, 1.0), Error);
}

TEST(SparseQadConfig, ReconOdeNeedsAVsaStudent) {
  const std::string y =
      "models:\n"
      "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
      "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n"
      "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:tiny\n"
      "    trainable: false\n    attention_backend: TORCH_SDPA\n"
      "method:\n  _target_: fastvideo.train.methods.reconstruction_ode.method.ReconstructionODEMethod\n"
      "training:\n  data:\n    data_path: /nonexistent\n  optimizer:\n    learning_rate: 1.0e-5\n"
      "  loop:\n    max_train_steps: 1\n  checkpoint:\n    output_dir: /tmp/x\n";
  try {
    train::parse_run_config(y);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("models.student.attention_backend"), std::string::npos) << e.what();
  }
  // A dense recon_ode student without the gates in the scope is accepted.
  auto ok = train::parse_run_config(y + "", {"--method.trainable_modules",
                                             "[to_q, to_k, to_v, to_out, norm_q, norm_k, attn2, ffn]"});
  EXPECT_EQ(ok.method.kind, train::MethodKind::kReconOde);
}

TEST(SparseQadConfig, LayerReconGroupSizeIsCheckedAgainstTheArchitecture) {
  const std::string y =
      "models:\n"
      "  student:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:1.3B\n"
      "    trainable: true\n    attention_backend: ATTN_QAT_TRAIN\n"
      "  teacher:\n    _target_: fastvideo.train.models.wan.WanModel\n    init_from: random:1.3B\n"
      "    trainable: false\n    attention_backend: TORCH_SDPA\n"
      "method:\n  _target_: fastvideo.train.methods.layer_reconstruction.method.LayerReconstructionMethod\n"
      "  group_size: 4\n"
      "training:\n  data:\n    data_path: /nonexistent\n  optimizer:\n    learning_rate: 1.0e-6\n"
      "  loop:\n    max_train_steps: 1\n  checkpoint:\n    output_dir: /tmp/x\n";
  auto run = train::parse_run_config(y);
  try {
    train::validate_layer_recon_config(run);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("method.group_size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("30 blocks"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(train::validate_layer_recon_config(train::parse_run_config(y, {"--method.group_size", "5"})));
}
