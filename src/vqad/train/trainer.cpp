#include "vqad/train/trainer.h"

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/metrics.h"
#include "vqad/core/progress.h"
#include "vqad/core/safetensors.h"
#include "vqad/data/loader.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/sampler.h"
#include "vqad/model/wan/model.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/lr_schedule.h"
#include "vqad/train/metadata.h"
#include "vqad/train/methods/dmd2.h"
#include "vqad/train/methods/sft.h"
#include "vqad/train/validation.h"

#ifdef VQAD_WITH_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fs = std::filesystem;

namespace vqad::train {

torch::Device parse_device(const std::string& s) {
  if (s == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  torch::Device d(torch::kCPU);
  try {
    d = torch::Device(s);
  } catch (const std::exception&) {
    fail("--device: unknown device '", s, "' (valid: cpu, cuda, cuda:N, auto)");
  }
  VQAD_CHECK(d.is_cpu() || d.is_cuda(), "--device: '", s, "' is not supported (valid: cpu, cuda, cuda:N, auto)");
  if (d.is_cuda()) {
    VQAD_CHECK(torch::cuda::is_available(), "--device ", s,
               ": CUDA is not available in this build or on this machine (a CPU build links LibTorch "
               "without CUDA; build on a GPU machine)");
  }
  return d;
}

namespace {
std::string hex_encode(const torch::Tensor& bytes) {
  auto t = bytes.contiguous();
  const uint8_t* p = t.data_ptr<uint8_t>();
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(t.numel() * 2);
  for (int64_t i = 0; i < t.numel(); ++i) {
    s.push_back(d[p[i] >> 4]);
    s.push_back(d[p[i] & 15]);
  }
  return s;
}
torch::Tensor hex_decode(const std::string& s, const std::string& where) {
  VQAD_CHECK(s.size() % 2 == 0, where, ": malformed generator state");
  auto t = torch::empty({static_cast<int64_t>(s.size() / 2)}, torch::kUInt8);
  uint8_t* p = t.data_ptr<uint8_t>();
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(where, ": malformed generator state");
  };
  for (size_t i = 0; i < s.size() / 2; ++i) p[i] = static_cast<uint8_t>(nib(s[2 * i]) << 4 | nib(s[2 * i + 1]));
  return t;
}

double peak_memory_gib(torch::Device device) {
#ifdef VQAD_WITH_TORCH_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);
  }
#endif
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);
  return 0.0;
}

// Model FLOPs of one fwd+bwd step (no recompute): 6 * linear params * tokens + attention.
double step_flops(const model::WanConfig& c, int64_t tokens_per_sample, int64_t batch, int64_t text_len) {
  const double dim = static_cast<double>(c.dim()), L = static_cast<double>(tokens_per_sample);
  const double per_block_params = 4 * dim * dim /*self*/ + 2 * dim * dim + 2 * dim * dim /*cross*/ +
                                  2 * dim * static_cast<double>(c.ffn_dim);
  const double linear = 6.0 * per_block_params * c.num_layers * L * batch;
  const double self_attn = 3.5 * 4.0 * L * L * dim * c.num_layers * batch;
  const double cross_attn = 3.5 * 4.0 * L * static_cast<double>(text_len) * dim * c.num_layers * batch;
  return linear + self_attn + cross_attn;
}
}  // namespace

struct Trainer::Impl {
  std::shared_ptr<data::ParquetDataset> dataset;
  std::unique_ptr<data::PrefetchLoader> loader;
  std::map<std::string, std::unique_ptr<torch::optim::AdamW>> optimizers;
  std::map<std::string, LrScheduleConfig> schedules;
  std::map<std::string, double> base_lr;
  std::map<std::string, long> updates;  // optimizer steps taken per role (LR schedule position)
  std::unique_ptr<TrainingMethod> method;
  std::unique_ptr<ValidationRunner> validation;
  torch::Generator gen;
  long start_step = 0;
  std::string started_at;
};

Trainer::Trainer(RunConfig run, TrainerOptions options)
    : impl_(std::make_unique<Impl>()), run_(std::move(run)), options_(options) {
  const auto& tc = run_.training;
  VQAD_CHECK(run_.method.kind == MethodKind::kSft || run_.method.kind == MethodKind::kDmd2, "method '",
             method_name(run_.method.kind), "' is not available in this vqad build (available: sft, dmd2)");
  // VSA on a GPU needs the VSA kernels in this build: fail here, before any weights load.
  for (const auto& name : run_.method.roles()) {
    const auto b = run_.role(name).attention_backend;
    if (!model::is_vsa_backend(b) || !options_.device.is_cuda() || ops::vsa_cuda_path_built()) continue;
    const std::string msg = "models." + name + ".attention_backend: " + attention_backend_name(b) +
                            ": the video-sparse attention CUDA kernels are not part of this vqad build (on " +
                            options_.device.str() + "; VSA runs on the CPU here, or use --models." + name +
                            ".attention_backend ATTN_QAT_TRAIN for the dense variant)";
    if (options_.dry_run)
      log::warn(msg);
    else
      fail(msg);
  }
  VQAD_CHECK(!tc.checkpoint.output_dir.empty(), "training.checkpoint.output_dir is empty (where should checkpoints go?)");
  VQAD_CHECK(tc.loop.max_train_steps > 0, "training.loop.max_train_steps must be > 0, found ", tc.loop.max_train_steps);
  VQAD_CHECK(tc.distributed.num_gpus == 1, "training.distributed.num_gpus = ", tc.distributed.num_gpus,
             ": this vqad build trains on one device (multi-GPU sharding is not available yet); run the recipe "
             "on one GPU with --training.distributed.num_gpus 1 --training.distributed.sp_size 1 "
             "--training.distributed.hsdp_replicate_dim 1 --training.distributed.hsdp_shard_dim 1");
  VQAD_CHECK(!tc.data.data_path.empty(), "training.data.data_path: no dataset path given");
  VQAD_CHECK(tc.dit_precision == "fp32", "training.dit_precision: vqad keeps FP32 master weights (found '",
             tc.dit_precision, "')");
  // EMA would change what is exported: refused rather than ignored.
  VQAD_CHECK(!run_.callbacks.ema.enabled, "callbacks.ema: EMA weights are not available in this vqad build; "
             "remove the ema callback");
  impl_->started_at = utc_now_iso();
  impl_->gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(tc.data.seed));

  // Roles, in the method's build order, each in its own backend scope.
  uint64_t seed = static_cast<uint64_t>(tc.data.seed);
  for (const auto& name : run_.method.roles()) {
    RoleBuildOptions ro;
    ro.device = options_.device;
    ro.seed = seed++;
    roles_[name] = build_role(run_, name, ro);
  }
  auto student = roles_.at("student");
  VQAD_CHECK(student->config.trainable, "models.student.trainable must be true for ", method_name(run_.method.kind));

  // Data.
  const auto& mc = student->model->config();
  data::DatasetOptions dopt;
  dopt.kind = tc.data.preprocessed_data_type == "text_only" ? data::DataKind::TextOnly : data::DataKind::T2V;
  dopt.text_len = mc.text_len;
  dopt.text_dim = mc.text_dim;
  dopt.num_latent_t = tc.data.num_latent_t;
  dopt.cfg_rate = tc.data.training_cfg_rate;
  dopt.seed = tc.data.seed;
  std::vector<std::pair<std::string, int64_t>> sources;
  for (const auto& src : tc.data.data_path) sources.emplace_back(src.path, src.repeat);
  impl_->dataset = data::ParquetDataset::open_sources(sources, dopt);
  auto sopt = data::sampler_options_for_rank(impl_->dataset->size(), tc.data.train_batch_size, 1, 1, 0, tc.data.seed);
  impl_->loader = std::make_unique<data::PrefetchLoader>(impl_->dataset, data::DpSpBatchSampler(sopt), 2);

  // Optimizers and schedules, one per trainable role. The dmd2 critic takes the
  // method's fake_score_* learning rate, betas and schedule (same weight decay and eps).
  for (auto& [name, role] : roles_) {
    if (!role->config.trainable) continue;
    const auto& oc = tc.optimizer;
    double lr = oc.learning_rate;
    std::array<double, 2> betas = oc.betas;
    LrSchedule sched = oc.lr_scheduler;
    if (run_.method.kind == MethodKind::kDmd2 && name == "critic") {
      lr = run_.method.dmd2.fake_score_learning_rate;
      betas = run_.method.dmd2.fake_score_betas;
      sched = run_.method.dmd2.fake_score_lr_scheduler;
    }
    auto params = role->trainable_parameters();
    VQAD_CHECK(!params.empty(), "models.", name, " is trainable but has no trainable parameters");
    torch::optim::AdamWOptions ao(lr);
    ao.betas({betas[0], betas[1]}).weight_decay(oc.weight_decay).eps(oc.eps);
    impl_->optimizers[name] = std::make_unique<torch::optim::AdamW>(params, ao);
    impl_->base_lr[name] = lr;
    impl_->schedules[name] = lr_schedule_from(oc, sched, tc.loop.max_train_steps);
    impl_->updates[name] = 0;
  }
  if (run_.method.kind == MethodKind::kDmd2)
    impl_->method = std::make_unique<Dmd2Method>(run_, student, roles_.at("teacher"), roles_.at("critic"));
  else
    impl_->method = std::make_unique<SftMethod>(run_, student);
  const auto& vc = run_.callbacks.validation;
  if (vc.enabled && (vc.every_steps > 0 || vc.run_at_start))
    impl_->validation = std::make_unique<ValidationRunner>(run_, student, options_.device);
}

Trainer::~Trainer() = default;

void Trainer::print_dry_run() const {
  std::cout << "# resolved config (sha256 " << run_.resolved_sha256 << ", source sha256 " << run_.source_sha256
            << ")\n"
            << run_.resolved_yaml << "\n";
  double total_gib = 0;
  for (const auto& [name, role] : roles_) {
    int64_t n = 0;
    for (const auto& p : role->model->parameters()) n += p.numel();
    // fp32 master weights (+ fp32 grads + two AdamW moments when trainable).
    const double gib = static_cast<double>(n) * (role->config.trainable ? 16.0 : 4.0) / (1024.0 * 1024.0 * 1024.0);
    total_gib += gib;
    std::cout << "# role " << name << ": " << wan_model_kind(role->model->config()) << ", " << n
              << " parameters, attention " << attention_backend_name(role->config.attention_backend)
              << ", weights+grads+optimizer " << gib << " GiB\n";
    std::cout << "# quant plan (" << name << "): "
              << (role->plan.empty() ? std::string("none (dense linears)\n") : role->plan.to_text());
  }
  std::cout << "# memory estimate (parameters, gradients, optimizer state; activations not included): " << total_gib
            << " GiB\n";
}

static void save_trainer_checkpoint(const RunConfig& run, const std::map<std::string, std::shared_ptr<Role>>& roles,
                                    const std::string& output_dir, long step,
                                    std::map<std::string, std::unique_ptr<torch::optim::AdamW>>& optimizers,
                                    const std::map<std::string, long>& updates,
                                    const data::PrefetchLoader& loader, torch::Generator& gen,
                                    const std::string& started_at, std::vector<std::string>* written) {
  auto path = write_checkpoint_dir(output_dir, step, [&](const std::string& dir) {
    for (auto& [name, role] : roles) {
      if (!role->config.trainable) continue;
      const fs::path rd = fs::path(dir) / name;
      model::save_diffusers(*role->model, rd.string());
      torch::save(*optimizers.at(name), (rd / "optimizer.pt").string());
    }
    nlohmann::json state;
    state["step"] = step;
    state["data"] = loader.state();
    state["generator_state"] = hex_encode(gen.get_state());
    state["optimizer_updates"] = updates;
    st::write_file_atomic((fs::path(dir) / "trainer_state.json").string(), {state.dump(2) + "\n"});
    st::write_file_atomic((fs::path(dir) / "resolved.yaml").string(), {run.resolved_yaml});
    write_metadata(dir, build_metadata(run, roles, step, started_at));
  });
  if (written) written->push_back(path);
  apply_retention(output_dir, static_cast<int>(run.training.checkpoint.checkpoints_total_limit));
  log::info("checkpoint ", path);
}

TrainSummary Trainer::run() {
  const auto& tc = run_.training;
  auto& I = *impl_;
  TrainSummary summary;
  const std::string out = tc.checkpoint.output_dir;
  fs::create_directories(out);

  // Resume.
  auto resume = resolve_resume(tc.checkpoint.resume_from_checkpoint, out);
  if (resume) {
    log::info("resuming from ", resume->path, " (step ", resume->step, ")");
    for (auto& [name, role] : roles_) {
      if (!role->config.trainable) continue;
      const fs::path rd = fs::path(resume->path) / name;
      VQAD_CHECK(fs::is_directory(rd), resume->path, ": no weights for role '", name, "'");
      model::load_weights(*role->model, model::read_weights(rd.string()));
      torch::load(*I.optimizers.at(name), (rd / "optimizer.pt").string());
    }
    std::ifstream f(fs::path(resume->path) / "trainer_state.json");
    VQAD_CHECK(f.good(), resume->path, ": trainer_state.json missing");
    nlohmann::json state = nlohmann::json::parse(f);
    I.loader->load_state(state.at("data"));
    I.gen.set_state(hex_decode(state.at("generator_state").get<std::string>(), resume->path));
    for (auto& [name, n] : I.updates) {
      if (state.contains("optimizer_updates") && state["optimizer_updates"].contains(name))
        n = state["optimizer_updates"][name].get<long>();
      else
        n = resume->step;  // checkpoints written before per-role counts: every step updated
    }
    I.start_step = resume->step;
  }
  MetricsWriter metrics = resume ? MetricsWriter::open_for_resume((fs::path(out) / "metrics.jsonl").string(), I.start_step)
                                 : MetricsWriter((fs::path(out) / "metrics.jsonl").string(), false);
  if (!resume) st::write_file_atomic((fs::path(out) / "resolved.yaml").string(), {run_.resolved_yaml});

  const long max_steps = tc.loop.max_train_steps;
  const long accum = std::max<long>(1, tc.loop.gradient_accumulation_steps);
  const long save_every = tc.checkpoint.training_state_checkpointing_steps;
  auto student = roles_.at("student");
  const auto t_run = std::chrono::steady_clock::now();
  std::unique_ptr<Progress> bar;
  if (options_.progress) bar = std::make_unique<Progress>("train", max_steps - I.start_step, "step");
  summary.first_step = I.start_step + 1;
  long last_saved = -1;
  if (I.validation && I.validation->at_start() && I.start_step == 0) metrics.log(0, I.validation->run(0));

  for (long step = I.start_step + 1; step <= max_steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    // VSA roles run this step at the schedule's sparsity (training.vsa).
    bool any_vsa = false;
    const double vsa_sparsity = vsa_sparsity_at_step(tc.vsa, step);
    for (auto& [name, role] : roles_)
      if (model::is_vsa_backend(role->config.attention_backend)) {
        role->model->set_vsa_sparsity(vsa_sparsity);
        any_vsa = true;
      }
    for (auto& [name, opt] : I.optimizers) opt->zero_grad(true);
    std::map<std::string, double> rec, role_loss;
    int64_t tokens = 0;
    for (long micro = 0; micro < accum; ++micro) {
      data::Batch batch = I.loader->next();
      auto r = I.method->micro_step(batch, I.gen, options_.device, step, 1.0 / static_cast<double>(accum));
      for (const auto& [k, v] : r.metrics) rec[k] += v / static_cast<double>(accum);
      for (const auto& [k, v] : r.role_loss) role_loss[k] += v / static_cast<double>(accum);
      tokens += r.tokens;
    }
    const double loss = rec.at("loss");
    for (const auto& name : I.method->roles_to_update(step)) {
      auto& opt = I.optimizers.at(name);
      auto& role = *roles_.at(name);
      const double rloss = role_loss.count(name) ? role_loss.at(name) : loss;
      auto params = role.trainable_parameters();
      double norm;
      if (run_.callbacks.grad_clip.enabled) {
        norm = torch::nn::utils::clip_grad_norm_(params, run_.callbacks.grad_clip.max_grad_norm);
      } else {
        std::vector<torch::Tensor> norms;
        for (auto& p : params)
          if (p.grad().defined()) norms.push_back(p.grad().detach().to(torch::kFloat32).norm());
        norm = norms.empty() ? 0.0 : torch::stack(norms).norm().item<double>();
      }
      if (!std::isfinite(rloss) || !std::isfinite(norm)) {
        std::string bad;
        int nbad = 0;
        for (const auto& item : role.model->named_parameters()) {
          const auto& g = item.value().grad();
          if (g.defined() && !torch::isfinite(g).all().item<bool>() && nbad++ < 8) bad += " " + item.key();
        }
        fail("step ", step, ": non-finite ", std::isfinite(rloss) ? "gradient" : "loss", " in role '", name,
             "' (loss ", rloss, ", grad norm ", norm, "); parameters with non-finite gradients:",
             bad.empty() ? std::string(" none") : bad, nbad > 8 ? " ..." : "",
             ". The weights were not updated; the last checkpoint in ", out, " is intact");
      }
      rec["grad_norm/" + name] = norm;
      const double lr = I.base_lr.at(name) * lr_multiplier(I.schedules.at(name), I.updates.at(name));
      for (auto& g : opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
      rec["lr/" + name] = lr;
      opt->step();
      ++I.updates.at(name);
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec["step_time_s"] = dt;
    if (any_vsa) rec["vsa_sparsity"] = vsa_sparsity;
    rec["tokens_per_s"] = static_cast<double>(tokens) / dt;
    rec["mem_peak_gib"] = peak_memory_gib(options_.device);
    if (options_.device.is_cuda() && run_.method.kind == MethodKind::kSft) {
      const auto& mc = student->model->config();
      const int64_t per_sample = tokens / std::max<int64_t>(1, tc.data.train_batch_size * accum);
      rec["mfu"] = step_flops(mc, per_sample, tc.data.train_batch_size * accum, mc.text_len) / dt / 989e12;
    }
    if (I.validation && I.validation->due(step))
      for (const auto& [k, v] : I.validation->run(step)) rec[k] = v;
    metrics.log(step, rec);
    summary.losses.push_back(loss);
    summary.last_step = step;
    if (bar) {
      char post[96];
      std::snprintf(post, sizeof(post), "loss %.4f", loss);
      bar->set_postfix(post);
      bar->update(1);
    }
    if (save_every > 0 && step % save_every == 0) {
      save_trainer_checkpoint(run_, roles_, out, step, I.optimizers, I.updates, *I.loader, I.gen, I.started_at,
                              &summary.checkpoints);
      last_saved = step;
    }
  }
  if (bar) bar->finish();
  if (save_every > 0 && last_saved != summary.last_step && summary.last_step > 0)
    save_trainer_checkpoint(run_, roles_, out, summary.last_step, I.optimizers, I.updates, *I.loader, I.gen, I.started_at,
                            &summary.checkpoints);
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
  return summary;
}

std::string export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& role,
                              bool overwrite) {
  const fs::path src = fs::path(checkpoint_dir) / role / "transformer";
  VQAD_CHECK(fs::is_directory(src), checkpoint_dir, ": no weights for role '", role, "' (expected ", src.string(),
             "; checkpoints hold only trainable roles)");
  VQAD_CHECK(fs::is_regular_file(fs::path(checkpoint_dir) / kCheckpointMarker), checkpoint_dir,
             ": incomplete checkpoint (no ", kCheckpointMarker, " marker)");
  nlohmann::json meta = read_metadata(checkpoint_dir);
  if (fs::exists(out_dir)) {
    VQAD_CHECK(overwrite, "export: ", out_dir, " already exists (pass --overwrite to replace it)");
  }
  const fs::path tmp = fs::path(out_dir).string() + ".tmp-export-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp / "transformer");
  for (const auto& e : fs::directory_iterator(src))
    if (e.is_regular_file()) fs::copy_file(e.path(), tmp / "transformer" / e.path().filename());
  meta["checkpoint_state"] = "inference_export";
  meta["export"] = {{"role", role}, {"source_checkpoint", fs::absolute(checkpoint_dir).string()},
                    {"created_at", utc_now_iso()}};
  write_metadata(tmp.string(), meta);
  fsync_tree(tmp.string());
  if (fs::exists(out_dir)) fs::remove_all(out_dir);
  fs::rename(tmp, out_dir);
  fsync_dir(fs::absolute(out_dir).parent_path().string());
  return out_dir;
}

}  // namespace vqad::train
