#include "vqad/train/demo.h"

#include <chrono>
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

std::shared_ptr<model::WanModel> load_eval_model(const std::string& dir, bool quantized, torch::Device device) {
  model::WanModelOptions mo;
  mo.compute_dtype = torch::kBFloat16;
  std::shared_ptr<model::WanModel> m;
  {
    ops::AttentionBackendScope scope(quantized ? AttentionBackend::kAttnQatTrain : AttentionBackend::kTorchSdpa);
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
// the mean |temporal difference| and the mean |horizontal difference| -> [N, 4C].
torch::Tensor video_features(const torch::Tensor& x) {
  auto f = x.to(torch::kFloat32);
  auto mean = f.mean({2, 3, 4});
  auto std = f.std({2, 3, 4}, /*unbiased=*/false);
  auto dt = (f.narrow(2, 1, f.size(2) - 1) - f.narrow(2, 0, f.size(2) - 1)).abs().mean({2, 3, 4});
  auto dw = (f.narrow(4, 1, f.size(4) - 1) - f.narrow(4, 0, f.size(4) - 1)).abs().mean({2, 3, 4});
  return torch::cat({mean, std, dt, dw}, 1);
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

}  // namespace

DemoReport run_demo(const DemoOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  DemoReport rep;
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

  // Synthetic latent videos (tiny geometry) with caption embeddings for the tiny model.
  const auto tiny = model::WanConfig::tiny();
  data::SynthOptions so;
  so.latent_t = 4;
  so.latent_h = 8;
  so.latent_w = 8;
  so.text_dim = tiny.text_dim;
  so.seed = 7;
  data::WriterOptions wo;
  data::SynthOptions ho = so;
  ho.seed = 7777;  // held-out: different videos and captions
  fs::remove_all(fs::path(o.out) / "data");  // cheap and deterministic: always rewritten
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "train").string(), o.train_rows, so, wo);
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "heldout").string(), o.heldout_rows, ho, wo);
  std::cout << "synthetic data: " << o.train_rows << " train / " << o.heldout_rows << " held-out rows, latents [16, "
            << so.latent_t << ", " << so.latent_h << ", " << so.latent_w << "]" << std::endl;

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
    if (std::string(name) == "stage2_dmd")
      for (const auto& kv : o.stage2_set) ov.push_back("--" + kv);
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
  auto s1 = run_stage("stage1_attn_qat_sft", demo_configs::kStage1Yaml, o, o.stage1_steps, stage1_export);
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
    // Held-out prompts x 4 initial noises; the same noise for every sampler.
    std::vector<torch::Tensor> texts, noises;
    auto sgen = at::make_generator<at::CPUGeneratorImpl>(2024);
    for (int64_t i = 0; i < held->size(); ++i) {
      auto b = held->get_batch({i});
      for (int k = 0; k < 4; ++k) {
        texts.push_back(b.text);
        noises.push_back(at::randn(b.latent.sizes(), sgen, torch::TensorOptions(torch::kFloat32)));
      }
    }
    auto text = torch::cat(texts, 0).to(o.device, torch::kBFloat16);
    auto noise = torch::cat(noises, 0).to(o.device);
    auto uncond = torch::zeros_like(text);
    auto ref = euler_sample(*teacher, noise, text, uncond, guidance, 48, 3.0);
    auto few = euler_sample(*teacher, noise, text, uncond, guidance, 3, 3.0);
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(77);
    auto st1 = dmd_sample(*qat, grid, noise, text, steps, g1);
    auto g2 = at::make_generator<at::CPUGeneratorImpl>(77);
    auto st2 = dmd_sample(*dmd, grid, noise, text, steps, g2);
    auto rel = [&](const torch::Tensor& a) { return ((a - ref).pow(2).sum() / ref.pow(2).sum()).item<double>(); };
    rep.samples = ref.size(0);
    rep.fd_teacher_3 = feature_distance(few, ref);
    rep.fd_stage1_3 = feature_distance(st1, ref);
    rep.fd_dmd_3 = feature_distance(st2, ref);
    rep.mse_teacher_3 = rel(few);
    rep.mse_stage1_3 = rel(st1);
    rep.mse_dmd_3 = rel(st2);
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

std::string demo_report_text(const DemoReport& r) {
  std::ostringstream os;
  char buf[256];
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
    std::snprintf(buf, sizeof(buf), "%-40s %16s %20s\n", "sampler", "feature dist.", "rel. MSE vs teacher");
    os << buf;
    std::snprintf(buf, sizeof(buf), "%-40s %16s %20s\n", "teacher, 48 Euler steps, CFG (reference)", "0", "0");
    os << buf;
    std::snprintf(buf, sizeof(buf), "%-40s %16.4f %20.4f\n", "teacher, 3 Euler steps, CFG", r.fd_teacher_3,
                  r.mse_teacher_3);
    os << buf;
    std::snprintf(buf, sizeof(buf), "%-40s %16.4f %20.4f\n", "stage-1 student, 3 DMD steps (no DMD2)", r.fd_stage1_3,
                  r.mse_stage1_3);
    os << buf;
    std::snprintf(buf, sizeof(buf), "%-40s %16.4f %20.4f\n", "stage-2 DMD2 student, 3 steps", r.fd_dmd_3, r.mse_dmd_3);
    os << buf;
    if (r.stage2_train_last > 0) {
      std::snprintf(buf, sizeof(buf), "stage 2 loss (generator + critic): %.4f -> %.4f\n", r.stage2_train_first,
                    r.stage2_train_last);
      os << buf;
    }
    os << "DMD2 moved the 3-step student toward the teacher's distribution (feature distance "
       << r.fd_stage1_3 << " -> " << r.fd_dmd_3 << "): " << (r.fd_dmd_3 < r.fd_stage1_3 ? "yes" : "NO")
       << "; closer than the teacher's own 3 Euler steps: " << (r.fd_dmd_3 < r.fd_teacher_3 ? "yes" : "no")
       << "\n";
  }
  os << "lineage verified: " << (r.lineage_verified ? "yes" : "NO") << "\n";
  std::snprintf(buf, sizeof(buf), "wall time: %.1f s\n", r.seconds);
  os << buf;
  return os.str();
}

}  // namespace vqad::train
