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
#include "vqad/train/metadata.h"
#include "vqad/train/roles.h"
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
                       const std::string& export_dir) {
  const std::string text = substitute(yaml, o.out);
  fs::create_directories(fs::path(o.out) / "configs");
  const std::string cfg_path = (fs::path(o.out) / "configs" / (name + ".yaml")).string();
  std::ofstream(cfg_path) << text;
  std::vector<std::string> overrides;
  if (steps > 0) {
    overrides = {"--training.loop.max_train_steps", std::to_string(steps),
                 "--training.checkpoint.training_state_checkpointing_steps", std::to_string(steps)};
  }
  RunConfig run = load_run_config(cfg_path, overrides);
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

}  // namespace

DemoReport run_demo(const DemoOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  DemoReport rep;
  // Refuse to clear a directory the demo did not create.
  if (fs::exists(o.out)) {
    const bool ours = fs::exists(fs::path(o.out) / kDemoMarker);
    VQAD_CHECK(ours || fs::is_empty(o.out), "demo: ", o.out,
               " exists and was not made by vqad demo; choose another --out");
    fs::remove_all(o.out);
  }
  fs::create_directories(o.out);
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
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "train").string(), o.train_rows, so, wo);
  data::SynthOptions ho = so;
  ho.seed = 7777;  // held-out: different videos and captions
  data::write_synthetic_dataset((fs::path(o.out) / "data" / "heldout").string(), o.heldout_rows, ho, wo);
  std::cout << "synthetic data: " << o.train_rows << " train / " << o.heldout_rows << " held-out rows, latents [16, "
            << so.latent_t << ", " << so.latent_h << ", " << so.latent_w << "]" << std::endl;

  const std::string teacher_export = (fs::path(o.out) / "teacher_export").string();
  const std::string stage1_export = (fs::path(o.out) / "stage1_export").string();
  auto s0 = run_stage("teacher", demo_configs::kTeacherYaml, o, o.teacher_steps, teacher_export);
  auto s1 = run_stage("stage1_attn_qat_sft", demo_configs::kStage1Yaml, o, o.stage1_steps, stage1_export);
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
  rep.teacher_loss = tl / count;
  rep.ptq_loss = pl / count;
  rep.qat_loss = ql / count;
  rep.ptq_error = pe / tn;
  rep.qat_error = qe / tn;
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
  std::snprintf(buf, sizeof(buf), "training loss: teacher %.4f -> %.4f, stage 1 %.4f -> %.4f\n", r.teacher_train_first,
                r.teacher_train_last, r.stage1_train_first, r.stage1_train_last);
  os << buf;
  os << "QAT beats PTQ (error vs teacher): " << (r.qat_error < r.ptq_error ? "yes" : "NO")
     << "; (held-out loss): " << (r.qat_loss < r.ptq_loss ? "yes" : "NO") << "\n";
  os << "lineage verified: " << (r.lineage_verified ? "yes" : "NO") << "\n";
  std::snprintf(buf, sizeof(buf), "wall time: %.1f s\n", r.seconds);
  os << buf;
  return os.str();
}

}  // namespace vqad::train
