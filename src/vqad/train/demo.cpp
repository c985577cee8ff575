#include "vqad/train/demo.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/synthetic.h"
#include "vqad/demo_configs.h"
#include "vqad/io/tensors.h"
#include "vqad/sample/ode_generate.h"
#include "vqad/sample/schedule.h"
#include "vqad/train/methods/dmd2.h"
#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/config.h"
#include "vqad/train/flow_matching.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "vqad/train/roles.h"
#include "vqad/train/sampling.h"
#include "vqad/train/trainer.h"

namespace fs = std::filesystem;

namespace vqad::train {
namespace {

constexpr const char* kDemoMarker = ".vqad-demo";

std::string substitute(std::string text, const std::string& out) {
  const std::string key = "{OUT}";
  for (size_t p = text.find(key); p != std::string::npos; p = text.find(key, p + out.size()))
    text.replace(p, key.size(), out);
  return text;
}

double mean_of(const std::vector<double>& v, size_t first, size_t count) {
  if (v.empty()) return 0;
  first = std::min(first, v.size() - 1);
  count = std::min(count, v.size() - first);
  return std::accumulate(v.begin() + first, v.begin() + first + count, 0.0) / static_cast<double>(count);
}

// Trains one stage from the embedded recipe and exports its final student.
TrainSummary run_stage(const std::string& name, const char* yaml, const DemoOptions& o, long steps,
                       const std::string& export_dir, const std::vector<std::string>& extra = {}) {
  if (o.reuse && fs::is_regular_file(fs::path(export_dir) / "metadata.json")) {
    std::cout << "== " << name << ": reusing " << export_dir << " ==" << std::endl;
    return {};
  }
  const std::string text = substitute(yaml, o.out);
  fs::create_directories(fs::path(o.out) / "configs");
  const std::string cfg_path = (fs::path(o.out) / "configs" / (name + ".yaml")).string();
  std::ofstream(cfg_path) << text;
  std::vector<std::string> overrides;
  if (steps > 0) {
    overrides = {"--training.loop.max_train_steps", std::to_string(steps),
                 "--training.checkpoint.training_state_checkpointing_steps", std::to_string(steps)};
  }
  if (o.batch_size > 0) {
    overrides.push_back("--training.data.train_batch_size");
    overrides.push_back(std::to_string(o.batch_size));
  }
  for (const auto& kv : extra) overrides.push_back("--" + kv);
  RunConfig run = load_run_config(cfg_path, overrides);
  fs::remove_all(run.training.checkpoint.output_dir);  // a fresh run, never a resume of an older one
  TrainerOptions topt;
  topt.device = o.device;
  topt.progress = o.progress;
  std::cout << "== " << name << ": " << run.training.loop.max_train_steps << " steps, student attention "
            << attention_backend_name(run.role("student").attention_backend) << ", linears "
            << run.role("student").quant_config << " ==" << std::endl;
  Trainer trainer(run, topt);
  TrainSummary s = trainer.run();
  VQAD_CHECK(!s.checkpoints.empty(), "demo ", name, ": no checkpoint was written");
  export_checkpoint(s.checkpoints.back(), export_dir, "student", true);
  std::cout << name << ": loss " << mean_of(s.losses, 0, 10) << " (first 10 steps) -> "
            << mean_of(s.losses, s.losses.size() >= 10 ? s.losses.size() - 10 : 0, 10) << " (last 10), "
            << s.seconds << " s, exported to " << export_dir << std::endl;
  return s;
}

std::shared_ptr<model::WanModel> load_eval_model(const std::string& dir, bool quantized, torch::Device device,
                                                 AttentionBackend backend = AttentionBackend::kAttnQatTrain,
                                                 double vsa_sparsity = 0.0) {
  model::WanModelOptions mo;
  mo.compute_dtype = torch::kBFloat16;
  std::shared_ptr<model::WanModel> m;
  {
    ops::AttentionSpec spec;
    spec.backend = quantized ? backend : AttentionBackend::kTorchSdpa;
    spec.vsa.sparsity = vsa_sparsity;
    ops::AttentionBackendScope scope(spec);
    m = model::wan_from_pretrained(dir, mo);
  }
  if (quantized) {
    model::QuantConfig qc;
    qc.method = model::QuantMethod::kNvfp4QatTrain;
    attach_quant_plan(*m, qc);
  }
  m->to(device);
  m->eval();
  return m;
}

// Per-sample features of latent videos [N, C, T, H, W]: per channel the mean, the std,
// and the mean |finite difference| along t, h and w -> [N, 5C]. An average of several
// modes (or a blurred sample) has a smaller std and smaller differences than a sample.
torch::Tensor video_features(const torch::Tensor& x) {
  auto f = x.to(torch::kFloat32);
  auto mean = f.mean({2, 3, 4});
  auto std = f.std({2, 3, 4}, /*unbiased=*/false);
  auto dt = (f.narrow(2, 1, f.size(2) - 1) - f.narrow(2, 0, f.size(2) - 1)).abs().mean({2, 3, 4});
  auto dh = (f.narrow(3, 1, f.size(3) - 1) - f.narrow(3, 0, f.size(3) - 1)).abs().mean({2, 3, 4});
  auto dw = (f.narrow(4, 1, f.size(4) - 1) - f.narrow(4, 0, f.size(4) - 1)).abs().mean({2, 3, 4});
  return torch::cat({mean, std, dt, dh, dw}, 1);
}

// Distance between two sample sets through their features, each feature standardized by
// the reference set's spread: sum_d ((mu_a - mu_r)^2 + (s_a - s_r)^2) / s_r^2 / D
// (a diagonal Frechet distance; 0 = same first and second moments as the reference).
double feature_distance(const torch::Tensor& a, const torch::Tensor& ref) {
  auto fa = video_features(a), fr = video_features(ref);
  auto mr = fr.mean(0), sr = fr.std(0, /*unbiased=*/false) + 1e-6;
  auto ma = fa.mean(0), sa = fa.std(0, /*unbiased=*/false);
  return (((ma - mr).pow(2) + (sa - sr).pow(2)) / sr.pow(2)).mean().item<double>();
}

// Mean |finite difference| over t, h, w of a sample set (the detail a sample carries).
double detail_of(const torch::Tensor& x) {
  auto f = x.to(torch::kFloat32);
  double d = 0;
  for (int64_t dim : {2, 3, 4})
    d += (f.narrow(dim, 1, f.size(dim) - 1) - f.narrow(dim, 0, f.size(dim) - 1)).abs().mean().item<double>();
  return d / 3.0;
}

struct SampleScore {
  double fd = 0, mse = 0, detail = 0;
};

SampleScore score_samples(const torch::Tensor& a, const torch::Tensor& ref) {
  SampleScore s;
  s.fd = feature_distance(a, ref);
  s.mse = ((a - ref).pow(2).sum() / ref.pow(2).sum()).item<double>();
  s.detail = detail_of(a) / detail_of(ref);
  return s;
}

// The demo's synthetic data: multi-modal rows (SynthOptions::modes), tiny geometry.
data::SynthOptions demo_synth(int64_t latent_h, int64_t latent_w) {
  data::SynthOptions so;
  so.latent_t = 4;
  so.latent_h = latent_h;
  so.latent_w = latent_w;
  so.text_dim = model::WanConfig::tiny().text_dim;
  so.seed = 7;
  so.modes = 3;
  so.captions = 8;
  so.detail = 0.3;
  return so;
}

void prepare_out(const DemoOptions& o) {
  // Refuse to clear a directory the demo did not create.
  if (fs::exists(o.out)) {
    const bool ours = fs::exists(fs::path(o.out) / kDemoMarker);
    VQAD_CHECK(ours || fs::is_empty(o.out), "demo: ", o.out,
               " exists and was not made by vqad demo; choose another --out");
    // Clear the contents, not the directory itself: --out may be an existing empty
    // directory (a mount point, or one whose parent this user cannot write).
    if (!o.reuse)
      for (const auto& e : fs::directory_iterator(o.out)) fs::remove_all(e.path());
  }
  create_dir_or_fail(o.out, "demo --out");
  std::ofstream(fs::path(o.out) / kDemoMarker) << "vqad demo output\n";
}

// Held-out prompts x `noises` initial noises (the same for every sampler).
void heldout_prompts(const data::ParquetDataset& held, int64_t noises, torch::Device device, torch::Tensor& text,
                     torch::Tensor& noise) {
  std::vector<torch::Tensor> texts, ns;
  auto sgen = at::make_generator<at::CPUGeneratorImpl>(2024);
  for (int64_t i = 0; i < held.size(); ++i) {
    auto b = held.get_batch({i});
    for (int64_t k = 0; k < noises; ++k) {
      texts.push_back(b.text);
      ns.push_back(at::randn(b.latent.sizes(), sgen, torch::TensorOptions(torch::kFloat32)));
    }
  }
  text = torch::cat(texts, 0).to(device, torch::kBFloat16);
  noise = torch::cat(ns, 0).to(device);
}

// Per block l of `student`: the teacher's block input h_l (teacher-driven, as layer_recon
// and recon_ode train) -> ||s_l(h_l) - h_{l+1}||^2 / ||h_{l+1} - h_l||^2, summed over the
// held-out rows x 3 noise levels before the ratio. Both share the teacher's embeddings.
std::vector<double> block_errors(model::WanModel& teacher, model::WanModel& student, const data::ParquetDataset& held,
                                 torch::Device device) {
  torch::NoGradGuard no_grad;
  const int64_t L = teacher.num_blocks();
  std::vector<double> num(size_t(L), 0.0), den(size_t(L), 0.0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4242);
  for (int64_t i = 0; i < held.size(); ++i) {
    auto b = held.get_batch({i});
    auto x0 = b.latent.to(device, torch::kFloat32);
    auto text = b.text.to(device, torch::kBFloat16);
    for (float sigma : {0.941176f, 0.8f, 0.5f}) {
      auto n = at::randn(b.latent.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(device);
      auto xt = ((1.0f - sigma) * x0 + sigma * n).to(torch::kBFloat16);
      auto t = torch::full({1}, 1000.0f * sigma, torch::TensorOptions(torch::kFloat32).device(device));
      auto e = teacher.embed(xt, t, text);
      auto h = e.hidden;
      for (int64_t l = 0; l < L; ++l) {
        auto next = teacher.forward_blocks(l, l + 1, h, e.cond);
        auto s = student.forward_blocks(l, l + 1, h, e.cond);
        num[size_t(l)] += (s.to(torch::kFloat32) - next.to(torch::kFloat32)).pow(2).sum().item<double>();
        den[size_t(l)] += (next.to(torch::kFloat32) - h.to(torch::kFloat32)).pow(2).sum().item<double>();
        h = next;
      }
    }
  }
  std::vector<double> r(static_cast<size_t>(L), 0.0);
  for (int64_t l = 0; l < L; ++l) r[size_t(l)] = num[size_t(l)] / std::max(den[size_t(l)], 1e-12);
  return r;
}

}  // namespace

// --recipe sparse (defined below).
DemoReport run_sparse_demo(const DemoOptions& o);

void check_demo_recipe(const std::string& recipe) {
  VQAD_CHECK(recipe == "dense" || recipe == "sparse", "demo: unknown --recipe '", recipe, "' (valid: ", kDemoRecipes,
             ")");
}

DemoReport run_demo(const DemoOptions& o) {
  check_demo_recipe(o.recipe);
  if (o.recipe == "sparse") return run_sparse_demo(o);
  const auto t0 = std::chrono::steady_clock::now();
  DemoReport rep;
  prepare_out(o);

  // Synthetic latent videos (tiny geometry) with caption embeddings for the tiny model.
  const auto tiny = model::WanConfig::tiny();
  data::SynthOptions so = demo_synth(8, 8);
  data::WriterOptions wo;
  data::SynthOptions ho = so;
  ho.seed = 7777;  // held-out: other rows (the same captions, fresh modes and detail draws)
  fs::remove_all(fs::path(o.out) / "data");  // cheap and deterministic: always rewritten
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "train").string(), o.train_rows, so, wo);
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "heldout").string(), o.heldout_rows, ho, wo);
  std::cout << "synthetic data: " << o.train_rows << " train / " << o.heldout_rows << " held-out rows, latents [16, "
            << so.latent_t << ", " << so.latent_h << ", " << so.latent_w << "], " << so.captions << " captions x "
            << so.modes << " modes, detail " << so.detail << std::endl;

  // Every stage's recipe is parsed (with the overrides) before the first step of the first stage.
  struct StageCheck {
    const char* name;
    const char* yaml;
    long steps;
  };
  const StageCheck stages[] = {{"teacher", demo_configs::kTeacherYaml, o.teacher_steps},
                               {"stage1_attn_qat_sft", demo_configs::kStage1Yaml, o.stage1_steps},
                               {"stage2_dmd", demo_configs::kStage2Yaml, o.stage2 ? o.stage2_steps : -1}};
  for (const auto& [name, yaml, steps] : stages) {
    if (steps < 0) continue;
    std::vector<std::string> ov;
    if (steps > 0) ov = {"--training.loop.max_train_steps", std::to_string(steps)};
    for (const auto& kv : std::string(name) == "stage2_dmd" ? o.stage2_set
                          : std::string(name) == "stage1_attn_qat_sft" ? o.stage1_set
                                                                       : std::vector<std::string>{})
      ov.push_back("--" + kv);
    try {
      parse_run_config(substitute(yaml, o.out), ov);
    } catch (const Error& e) {
      fail("demo: the ", name, " recipe is invalid with these options: ", e.what());
    }
  }
  const std::string teacher_export = (fs::path(o.out) / "teacher_export").string();
  const std::string stage1_export = (fs::path(o.out) / "stage1_export").string();
  const std::string stage2_export = (fs::path(o.out) / "stage2_export").string();
  // On a GPU the stage-1 student runs the ATTN_QAT_TRAIN kernels, which take 128-channel
  // heads: the demo's tiny models use one such head there (the CPU demo keeps 2 x 32).
  const std::vector<std::string> teacher_extra =
      o.device.is_cuda() ? std::vector<std::string>{"models.student.init_from=random:tiny-hd128"}
                         : std::vector<std::string>{};
  auto s0 = run_stage("teacher", demo_configs::kTeacherYaml, o, o.teacher_steps, teacher_export, teacher_extra);
  auto s1 = run_stage("stage1_attn_qat_sft", demo_configs::kStage1Yaml, o, o.stage1_steps, stage1_export, o.stage1_set);
  rep.stage1_export = stage1_export;
  rep.teacher_train_first = mean_of(s0.losses, 0, 10);
  rep.teacher_train_last = mean_of(s0.losses, s0.losses.size() >= 10 ? s0.losses.size() - 10 : 0, 10);
  rep.stage1_train_first = mean_of(s1.losses, 0, 10);
  rep.stage1_train_last = mean_of(s1.losses, s1.losses.size() >= 10 ? s1.losses.size() - 10 : 0, 10);

  std::cout << "== lineage of " << stage1_export << " ==\n" << lineage_text(read_metadata(stage1_export));
  auto problems = verify_lineage(stage1_export);
  rep.lineage_verified = problems.empty();
  for (const auto& p : problems) std::cout << "lineage problem: " << p << "\n";
  std::cout << (rep.lineage_verified ? "lineage verified" : "lineage NOT verified") << std::endl;

  // Held-out evaluation: the same noise and timesteps for every model.
  auto teacher = load_eval_model(teacher_export, false, o.device);
  auto ptq = load_eval_model(teacher_export, true, o.device);
  auto qat = load_eval_model(stage1_export, true, o.device);
  data::DatasetOptions dopt;
  dopt.text_len = tiny.text_len;
  dopt.text_dim = tiny.text_dim;
  auto held = data::ParquetDataset::open((fs::path(o.out) / "data" / "heldout").string(), dopt);
  FlowMatchGrid grid(3.0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12345);
  double tl = 0, pl = 0, ql = 0, pe = 0, qe = 0, tn = 0;
  int64_t count = 0;
  {
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < held->size(); ++i) {
      auto batch = held->get_batch({i});
      auto x0 = batch.latent.to(o.device, torch::kBFloat16);
      auto text = batch.text.to(o.device, torch::kBFloat16);
      for (int idx : {100, 300, 500, 700, 900}) {
        auto noise = at::randn(batch.latent.sizes(), gen, torch::TensorOptions(torch::kFloat32)).to(o.device, torch::kBFloat16);
        auto t = torch::tensor({grid.timestep(idx)}, torch::kFloat64);
        auto xt = grid.add_noise(x0, noise, t);
        auto tt = t.to(o.device, torch::kFloat32);
        auto target = (noise.to(torch::kFloat32) - x0.to(torch::kFloat32));
        auto vt = teacher->forward(xt, tt, text).to(torch::kFloat32);
        auto vp = ptq->forward(xt, tt, text).to(torch::kFloat32);
        auto vq = qat->forward(xt, tt, text).to(torch::kFloat32);
        tl += (vt - target).pow(2).mean().item<double>();
        pl += (vp - target).pow(2).mean().item<double>();
        ql += (vq - target).pow(2).mean().item<double>();
        pe += (vp - vt).pow(2).sum().item<double>();
        qe += (vq - vt).pow(2).sum().item<double>();
        tn += vt.pow(2).sum().item<double>();
        ++count;
      }
    }
  }
  rep.teacher_loss = tl / count;
  rep.ptq_loss = pl / count;
  rep.qat_loss = ql / count;
  rep.ptq_error = pe / tn;
  rep.qat_error = qe / tn;

  // Stage 2: DMD2 distillation of the stage-1 student into a 3-step generator.
  if (o.stage2) {
    auto s2 = run_stage("stage2_dmd", demo_configs::kStage2Yaml, o, o.stage2_steps, stage2_export, o.stage2_set);
    rep.stage2_ran = true;
    rep.stage2_train_first = mean_of(s2.losses, 0, 10);
    rep.stage2_train_last = mean_of(s2.losses, s2.losses.size() >= 10 ? s2.losses.size() - 10 : 0, 10);
    auto problems2 = verify_lineage(stage2_export);
    rep.lineage_verified = rep.lineage_verified && problems2.empty();
    for (const auto& p : problems2) std::cout << "lineage problem: " << p << "\n";
    std::cout << "== lineage of " << stage2_export << " ==\n" << lineage_text(read_metadata(stage2_export));
    std::vector<std::string> set2;
    for (const auto& kv : o.stage2_set) set2.push_back("--" + kv);
    RunConfig run2 = parse_run_config(substitute(demo_configs::kStage2Yaml, o.out), set2);
    const auto& steps = run2.method.dmd2.dmd_denoising_steps;
    const double guidance = run2.method.dmd2.real_score_guidance_scale;
    auto dmd = load_eval_model(stage2_export, true, o.device);
    torch::NoGradGuard no_grad;
    torch::Tensor text, noise;
    heldout_prompts(*held, o.eval_noises, o.device, text, noise);
    auto uncond = torch::zeros_like(text);
    auto ref = euler_sample(*teacher, noise, text, uncond, guidance, 48, 3.0);
    auto few = euler_sample(*teacher, noise, text, uncond, guidance, 3, 3.0);
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(77);
    auto st1 = dmd_sample(*qat, grid, noise, text, steps, g1);
    auto g2 = at::make_generator<at::CPUGeneratorImpl>(77);
    auto st2 = dmd_sample(*dmd, grid, noise, text, steps, g2);
    rep.samples = ref.size(0);
    const auto a = score_samples(few, ref), b = score_samples(st1, ref), c = score_samples(st2, ref);
    rep.fd_teacher_3 = a.fd;
    rep.fd_stage1_3 = b.fd;
    rep.fd_dmd_3 = c.fd;
    rep.mse_teacher_3 = a.mse;
    rep.mse_stage1_3 = b.mse;
    rep.mse_dmd_3 = c.mse;
    rep.detail_teacher_3 = a.detail;
    rep.detail_stage1_3 = b.detail;
    rep.detail_dmd_3 = c.detail;
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

namespace {

// The methods of a lineage text, newest first ("method X" of every level).
std::vector<std::string> chain_methods(const std::string& lineage) {
  std::vector<std::string> m;
  for (size_t p = lineage.find("method "); p != std::string::npos; p = lineage.find("method ", p + 7)) {
    size_t e = lineage.find_first_of(" ,;)\n", p + 7);
    m.push_back(lineage.substr(p + 7, e == std::string::npos ? std::string::npos : e - p - 7));
  }
  return m;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

DemoReport run_sparse_demo(const DemoOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  DemoReport rep;
  rep.recipe = "sparse";
  prepare_out(o);
  const auto tiny = model::WanConfig::tiny();
  // Latents [16, 4, 16, 16]: a 4 x 8 x 8 token grid, two whole C128 cubes (4 x 4 x 8).
  data::SynthOptions so = demo_synth(16, 16);
  data::WriterOptions wo;
  data::SynthOptions ho = so;
  ho.seed = 7777;
  data::SynthOptions po = so;  // the training captions as text-only rows: ODE-cache prompts, S2's data
  po.kind = data::DataKind::TextOnly;
  const fs::path data_dir = fs::path(o.out) / "data";
  fs::remove_all(data_dir);
  data::write_synthetic_dataset((data_dir / "train").string(), o.train_rows, so, wo);
  data::write_synthetic_dataset((data_dir / "heldout").string(), o.heldout_rows, ho, wo);
  data::write_synthetic_dataset((data_dir / "prompts").string(), o.train_rows, po, wo);
  // The negative prompt: the teacher's learned empty text (its text dropout zeroes the embedding).
  io::save_safetensors((data_dir / "negative_prompt.safetensors").string(),
                       {{"negative_prompt", torch::zeros({1, tiny.text_dim})}});
  std::cout << "synthetic data: " << o.train_rows << " train / " << o.heldout_rows << " held-out rows, latents [16, "
            << so.latent_t << ", " << so.latent_h << ", " << so.latent_w << "] (token grid 4 x 8 x 8), "
            << so.captions << " captions x " << so.modes << " modes, detail " << so.detail << std::endl;

  struct StageCheck {
    const char* name;
    const char* yaml;
    long steps;
    bool stage2;
  };
  const StageCheck stages[] = {{"teacher", demo_configs::kSparseTeacherYaml, o.teacher_steps, false},
                               {"stage0_layer_recon", demo_configs::kSparseStage0Yaml, o.stage0_steps, false},
                               {"stage1_recon_ode", demo_configs::kSparseStage1Yaml, o.stage1_steps, false},
                               {"stage2_dmd2", demo_configs::kSparseStage2Yaml, o.stage2 ? o.stage2_steps : -1, true}};
  for (const auto& st : stages) {
    if (st.steps < 0) continue;
    std::vector<std::string> ov;
    if (st.steps > 0) ov = {"--training.loop.max_train_steps", std::to_string(st.steps)};
    const bool s1 = std::string(st.name) == "stage1_recon_ode";
    for (const auto& kv : st.stage2 ? o.stage2_set : s1 ? o.stage1_set : std::vector<std::string>{})
      ov.push_back("--" + kv);
    try {
      parse_run_config(substitute(st.yaml, o.out), ov);
    } catch (const Error& e) {
      fail("demo: the sparse ", st.name, " recipe is invalid with these options: ", e.what());
    }
  }
  const std::string cfg_dir = (fs::path(o.out) / "configs").string();
  fs::create_directories(cfg_dir);
  const std::string ode_cfg = (fs::path(cfg_dir) / "sparse_ode_cache.yaml").string();
  const std::string ode_text = substitute(demo_configs::kSparseOdeCacheYaml, o.out);
  std::ofstream(ode_cfg) << ode_text;
  Json ode_root = yaml_to_json(ode_text, ode_cfg);
  {
    std::vector<std::string> ov = {"--ode_cache.device", o.device.str()};
    if (o.ode_trajectories > 0) {
      ov.push_back("--ode_cache.trajectories");
      ov.push_back(std::to_string(o.ode_trajectories));
    }
    for (const auto& [k, v] : parse_overrides(ov)) apply_override(ode_root, k, v);
  }
  const sample::OdeRecipe ode = sample::parse_ode_recipe(ode_root, ode_cfg);

  const auto ex = [&](const char* n) { return (fs::path(o.out) / n).string(); };
  const std::string teacher_export = ex("teacher_export"), s0_export = ex("stage0_export"),
                    s1_export = ex("stage1_export"), s2_export = ex("stage2_export");
  const std::vector<std::string> teacher_extra =
      o.device.is_cuda() ? std::vector<std::string>{"models.student.init_from=random:tiny-hd128"}
                         : std::vector<std::string>{};
  auto ts = std::chrono::steady_clock::now();
  auto r0 = run_stage("teacher", demo_configs::kSparseTeacherYaml, o, o.teacher_steps, teacher_export, teacher_extra);
  rep.stage_seconds.push_back({"teacher", seconds_since(ts)});
  rep.teacher_train_first = mean_of(r0.losses, 0, 10);
  rep.teacher_train_last = mean_of(r0.losses, r0.losses.size() >= 10 ? r0.losses.size() - 10 : 0, 10);

  ts = std::chrono::steady_clock::now();
  if (!(o.reuse && fs::is_regular_file(fs::path(ode.output_dir) / "COMPLETE"))) {
    fs::remove_all(ode.output_dir);
    std::cout << "== ode cache: " << ode.trajectories << " teacher trajectories, " << ode.teacher_steps
              << " shift-" << ode.flow_shift << " Euler steps, CFG " << ode.guidance_scale << ", anchors "
              << nlohmann::json(ode.anchors).dump() << " ==" << std::endl;
    sample::OdeGenerateOptions go;
    go.progress = o.progress;
    auto gs = sample::generate_ode_cache(ode, go);
    VQAD_CHECK(gs.complete, "demo: the ODE cache ", ode.output_dir, " is incomplete after generation");
    std::cout << "ode cache: " << gs.generated << " trajectories in " << gs.seconds << " s -> " << ode.output_dir
              << std::endl;
  }
  rep.ode_trajectories = ode.trajectories;
  rep.stage_seconds.push_back({"ode cache", seconds_since(ts)});

  ts = std::chrono::steady_clock::now();
  auto r1 = run_stage("stage0_layer_recon", demo_configs::kSparseStage0Yaml, o, o.stage0_steps, s0_export);
  rep.stage_seconds.push_back({"S0 layer_recon", seconds_since(ts)});
  ts = std::chrono::steady_clock::now();
  auto r2 = run_stage("stage1_recon_ode", demo_configs::kSparseStage1Yaml, o, o.stage1_steps, s1_export, o.stage1_set);
  rep.stage_seconds.push_back({"S1 recon_ode", seconds_since(ts)});
  rep.stage0_train_first = mean_of(r1.losses, 0, 10);
  rep.stage0_train_last = mean_of(r1.losses, r1.losses.size() >= 10 ? r1.losses.size() - 10 : 0, 10);
  rep.stage1_train_first = mean_of(r2.losses, 0, 10);
  rep.stage1_train_last = mean_of(r2.losses, r2.losses.size() >= 10 ? r2.losses.size() - 10 : 0, 10);
  rep.stage1_export = s1_export;
  if (o.stage2) {
    ts = std::chrono::steady_clock::now();
    auto r3 = run_stage("stage2_dmd2", demo_configs::kSparseStage2Yaml, o, o.stage2_steps, s2_export, o.stage2_set);
    rep.stage_seconds.push_back({"S2 dmd2", seconds_since(ts)});
    rep.stage2_ran = true;
    rep.stage2_train_first = mean_of(r3.losses, 0, 10);
    rep.stage2_train_last = mean_of(r3.losses, r3.losses.size() >= 10 ? r3.losses.size() - 10 : 0, 10);
  }

  // `vqad lineage --verify` of every export.
  rep.lineage_verified = true;
  std::vector<std::string> exports = {s0_export, s1_export};
  if (o.stage2) exports.push_back(s2_export);
  for (const auto& e : exports) {
    const std::string text = lineage_text(read_metadata(e));
    std::cout << "== lineage of " << e << " ==\n" << text;
    auto problems = verify_lineage(e);
    for (const auto& p : problems) std::cout << "lineage problem: " << p << "\n";
    std::cout << (problems.empty() ? "lineage verified" : "lineage NOT verified") << std::endl;
    rep.exports_verified.push_back({fs::path(e).filename().string(), problems.empty()});
    rep.lineage_verified = rep.lineage_verified && problems.empty();
    if (e == s2_export) {
      rep.stage2_lineage = text;
      rep.stage2_chain = chain_methods(text);
    }
  }

  // Per-block reconstruction error vs the teacher on held-out inputs.
  ts = std::chrono::steady_clock::now();
  std::vector<std::string> set1;
  for (const auto& kv : o.stage1_set) set1.push_back("--" + kv);
  const double sparsity =
      parse_run_config(substitute(demo_configs::kSparseStage1Yaml, o.out), set1).training.vsa.sparsity;
  const auto vsa = AttentionBackend::kVsaQatTrainC128;
  auto teacher = load_eval_model(teacher_export, false, o.device);
  data::DatasetOptions dopt;
  dopt.text_len = tiny.text_len;
  dopt.text_dim = tiny.text_dim;
  auto held = data::ParquetDataset::open((data_dir / "heldout").string(), dopt);
  auto add_block_error = [&](const std::string& name, const std::string& dir, AttentionBackend b) {
    auto m = load_eval_model(dir, true, o.device, b, sparsity);
    DemoReport::BlockError be;
    be.model = name;
    be.per_block = block_errors(*teacher, *m, *held, o.device);
    be.mean = std::accumulate(be.per_block.begin(), be.per_block.end(), 0.0) / double(be.per_block.size());
    rep.block_errors.push_back(be);
    return m;
  };
  add_block_error("PTQ: teacher + NVFP4, ATTN_QAT_TRAIN", teacher_export, AttentionBackend::kAttnQatTrain);
  add_block_error("S0 layer_recon (ATTN_QAT_TRAIN)", s0_export, AttentionBackend::kAttnQatTrain);
  add_block_error("PTQ: teacher + NVFP4, VSA_QAT_C128", teacher_export, vsa);
  auto s1 = add_block_error("S1 recon_ode (VSA_QAT_C128)", s1_export, vsa);

  // Few-step samples vs the 48-step CFG teacher (the cache's sampler) from the same noises.
  {
    torch::NoGradGuard no_grad;
    torch::Tensor text, noise;
    heldout_prompts(*held, o.eval_noises, o.device, text, noise);
    auto uncond = torch::zeros_like(text);
    const auto sched = sample::shifted_schedule(ode.flow_shift, int(ode.teacher_steps));
    std::vector<float> st, sg;
    for (int64_t i : {0, 16, 32}) {
      st.push_back(sched.timesteps[size_t(i)]);
      sg.push_back(sched.sigmas[size_t(i)]);
    }
    auto ref = euler_sample(*teacher, noise, text, uncond, ode.guidance_scale, int(ode.teacher_steps), ode.flow_shift);
    auto few = euler_sample(*teacher, noise, text, uncond, ode.guidance_scale, 3, ode.flow_shift);
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(77);
    auto x1 = shifted_dmd_sample(*s1, noise, text, st, sg, g1);
    rep.samples = ref.size(0);
    const auto a = score_samples(few, ref), b = score_samples(x1, ref);
    rep.fd_teacher_3 = a.fd;
    rep.mse_teacher_3 = a.mse;
    rep.detail_teacher_3 = a.detail;
    rep.fd_stage1_3 = b.fd;
    rep.mse_stage1_3 = b.mse;
    rep.detail_stage1_3 = b.detail;
    {
      auto s0 = load_eval_model(s0_export, true, o.device, vsa, sparsity);
      auto g0 = at::make_generator<at::CPUGeneratorImpl>(77);
      const auto c = score_samples(shifted_dmd_sample(*s0, noise, text, st, sg, g0), ref);
      rep.stage0_sampled = true;
      rep.fd_stage0_3 = c.fd;
      rep.mse_stage0_3 = c.mse;
      rep.detail_stage0_3 = c.detail;
    }
    if (o.stage2) {
      auto s2 = load_eval_model(s2_export, true, o.device, vsa, sparsity);
      auto g2 = at::make_generator<at::CPUGeneratorImpl>(77);
      auto x2 = shifted_dmd_sample(*s2, noise, text, st, sg, g2);
      const auto c = score_samples(x2, ref);
      rep.fd_dmd_3 = c.fd;
      rep.mse_dmd_3 = c.mse;
      rep.detail_dmd_3 = c.detail;
    }
  }
  rep.stage_seconds.push_back({"evaluation", seconds_since(ts)});
  rep.seconds = seconds_since(t0);
  return rep;
}

namespace {

// The sample-comparison table (both recipes).
void sample_table(std::ostringstream& os, const DemoReport& r, const char* s1_label, const char* s2_label) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%-44s %13s %13s %12s\n", "sampler", "feature dist.", "rel. MSE", "detail ratio");
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-44s %13s %13s %12s\n", "teacher, 48 Euler steps, CFG (reference)", "0", "0", "1");
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-44s %13.4f %13.4f %12.3f\n", "teacher, 3 Euler steps, CFG", r.fd_teacher_3,
                r.mse_teacher_3, r.detail_teacher_3);
  os << buf;
  if (r.stage0_sampled) {
    std::snprintf(buf, sizeof(buf), "%-44s %13.4f %13.4f %12.3f\n", "S0 as VSA-QAT (S1's start), 3-step shifted",
                  r.fd_stage0_3, r.mse_stage0_3, r.detail_stage0_3);
    os << buf;
  }
  std::snprintf(buf, sizeof(buf), "%-44s %13.4f %13.4f %12.3f\n", s1_label, r.fd_stage1_3, r.mse_stage1_3,
                r.detail_stage1_3);
  os << buf;
  if (r.stage2_ran) {
    std::snprintf(buf, sizeof(buf), "%-44s %13.4f %13.4f %12.3f\n", s2_label, r.fd_dmd_3, r.mse_dmd_3, r.detail_dmd_3);
    os << buf;
  }
  os << "feature dist.: diagonal Frechet distance of per-sample features (per channel: mean, std, mean |diff| along\n"
        "  t, h, w), each standardized by the reference's spread (0 = the reference's moments); rel. MSE:\n"
        "  ||x - x_ref||^2 / ||x_ref||^2 per noise (same noise, same prompt); detail ratio: mean |diff| of the\n"
        "  samples over the reference's (averaged modes and washed-out detail give < 1).\n";
  if (r.stage2_ran) {
    const bool fd = r.fd_dmd_3 < r.fd_teacher_3, mse = r.mse_dmd_3 < r.mse_teacher_3;
    const bool det = std::abs(r.detail_dmd_3 - 1.0) < std::abs(r.detail_teacher_3 - 1.0);
    os << "3-step DMD2 student vs the teacher's 3 Euler steps: feature distance " << (fd ? "better" : "WORSE")
       << ", rel. MSE " << (mse ? "better" : "worse") << ", detail ratio " << (det ? "closer to 1" : "farther from 1")
       << "\n";
  }
}

}  // namespace

std::string demo_report_text(const DemoReport& r) {
  std::ostringstream os;
  char buf[256];
  if (r.recipe == "sparse") {
    os << "== vqad demo --recipe sparse report (teacher -> ODE cache -> S0 layer_recon -> S1 recon_ode -> S2 DMD2) ==\n";
    os << "per-block output error vs the teacher, teacher-driven (block input = the teacher's state), held-out\n"
          "latents at sigma 0.94 / 0.8 / 0.5: ||s_l(h_l) - h_(l+1)||^2 / ||h_(l+1) - h_l||^2\n";
    std::snprintf(buf, sizeof(buf), "%-40s %10s  %s\n", "model", "mean", "per block");
    os << buf;
    for (const auto& b : r.block_errors) {
      std::string per;
      for (double v : b.per_block) {
        char t[32];
        std::snprintf(t, sizeof(t), "%s%.5f", per.empty() ? "" : " ", v);
        per += t;
      }
      std::snprintf(buf, sizeof(buf), "%-40s %10.5f  %s\n", b.model.c_str(), b.mean, per.c_str());
      os << buf;
    }
    if (r.block_errors.size() == 4) {
      os << "S0 vs PTQ (dense QAT): " << (r.block_errors[1].mean < r.block_errors[0].mean ? "lower" : "NOT lower")
         << "; S1 vs PTQ (VSA-QAT): " << (r.block_errors[3].mean < r.block_errors[2].mean ? "lower" : "NOT lower")
         << "\n(S1 trains the per-block reconstruction and the ODE endpoint together, method.attention_weight /\n"
            " mlp_weight / ode_weight; where the endpoint term dominates, its blocks move away from the teacher's:\n"
            " the 3-step table below shows what that bought)\n";
    }
    os << "== 3-step samplers vs the 48-step shift-8 CFG teacher, " << r.samples
       << " held-out samples (prompts x noises) ==\n";
    sample_table(os, r, "S1 recon_ode, 3-step shifted sampler", "S2 DMD2, 3-step shifted sampler");
    if (r.stage0_sampled) {
      std::snprintf(buf, sizeof(buf), "S1 vs its start (S0 as VSA-QAT), 3-step feature distance %.4f -> %.4f: %s\n",
                    r.fd_stage0_3, r.fd_stage1_3, r.fd_stage1_3 < r.fd_stage0_3 ? "lower" : "NOT lower");
      os << buf;
    }
    if (r.teacher_train_last > 0) {
      std::snprintf(buf, sizeof(buf), "training loss (first -> last 10 steps): teacher %.4f -> %.4f, S0 %.4f -> %.4f, "
                    "S1 %.4f -> %.4f", r.teacher_train_first, r.teacher_train_last, r.stage0_train_first,
                    r.stage0_train_last, r.stage1_train_first, r.stage1_train_last);
      os << buf;
      if (r.stage2_ran) {
        std::snprintf(buf, sizeof(buf), ", S2 %.4f -> %.4f", r.stage2_train_first, r.stage2_train_last);
        os << buf;
      }
      os << "\n";
    }
    os << "ODE cache: " << r.ode_trajectories << " trajectories; stage wall times:";
    for (const auto& [n, t] : r.stage_seconds) {
      std::snprintf(buf, sizeof(buf), " %s %.0f s;", n.c_str(), t);
      os << buf;
    }
    os << "\nlineage --verify:";
    for (const auto& [e, ok] : r.exports_verified) os << " " << e << " " << (ok ? "verified" : "FAILED") << ";";
    os << "\n";
    if (!r.stage2_chain.empty()) {
      os << "S2 lineage chain:";
      for (const auto& m : r.stage2_chain) os << " " << m;
      os << "\n";
    }
    os << "lineage verified: " << (r.lineage_verified ? "yes" : "NO") << "\n";
    std::snprintf(buf, sizeof(buf), "wall time: %.1f s\n", r.seconds);
    os << buf;
    return os.str();
  }
  os << "== vqad demo report (held-out synthetic samples x 5 timesteps) ==\n";
  std::snprintf(buf, sizeof(buf), "%-34s %12s %22s\n", "model", "FM loss", "rel. error vs teacher");
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-34s %12.5f %22s\n", "teacher (BF16, dense)", r.teacher_loss, "-");
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-34s %12.5f %22.5f\n", "PTQ: teacher + NVFP4, no training", r.ptq_loss, r.ptq_error);
  os << buf;
  std::snprintf(buf, sizeof(buf), "%-34s %12.5f %22.5f\n", "QAT: stage-1 student (NVFP4)", r.qat_loss, r.qat_error);
  os << buf;
  if (r.teacher_train_last > 0 && r.stage1_train_last > 0) {
    std::snprintf(buf, sizeof(buf), "training loss: teacher %.4f -> %.4f, stage 1 %.4f -> %.4f\n",
                  r.teacher_train_first, r.teacher_train_last, r.stage1_train_first, r.stage1_train_last);
    os << buf;
  } else {
    os << "training loss: n/a for stages reused from an earlier run (--reuse)\n";
  }
  os << "QAT beats PTQ (error vs teacher): " << (r.qat_error < r.ptq_error ? "yes" : "NO")
     << "; (held-out loss): " << (r.qat_loss < r.ptq_loss ? "yes" : "NO") << "\n";
  if (r.stage2_ran) {
    os << "== stage 2 (DMD2, 3-step NVFP4 student) vs the 48-step teacher, " << r.samples
       << " held-out samples (prompts x noises) ==\n";
    sample_table(os, r, "stage-1 student, 3 DMD steps (no DMD2)", "stage-2 DMD2 student, 3 steps");
    if (r.stage2_train_last > 0) {
      std::snprintf(buf, sizeof(buf), "stage 2 loss (generator + critic): %.4f -> %.4f\n", r.stage2_train_first,
                    r.stage2_train_last);
      os << buf;
    }
    os << "DMD2 moved the 3-step student toward the teacher's distribution (feature distance "
       << r.fd_stage1_3 << " -> " << r.fd_dmd_3 << "): " << (r.fd_dmd_3 < r.fd_stage1_3 ? "yes" : "NO") << "\n";
  }
  os << "lineage verified: " << (r.lineage_verified ? "yes" : "NO") << "\n";
  std::snprintf(buf, sizeof(buf), "wall time: %.1f s\n", r.seconds);
  os << buf;
  return os.str();
}

}  // namespace vqad::train
