#include "vqad/train/trainer.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/metrics.h"
#include "vqad/core/progress.h"
#include "vqad/core/safetensors.h"
#include "vqad/data/dataset.h"
#include "vqad/data/loader.h"
#include "vqad/data/sampler.h"
#include "vqad/dist/batch_random.h"
#include "vqad/dist/data_parallel.h"
#include "vqad/dist/fully_sharded.h"
#include "vqad/dist/ulysses.h"
#include "vqad/dist/memory.h"
#include "vqad/model/wan/model.h"
#include "vqad/ops/attention_qat.h"
#include "vqad/core/signals.h"
#include "vqad/train/batch_log.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/checkpoint_writer.h"
#include "vqad/train/dataset_spec.h"
#include "vqad/train/determinism.h"
#include "vqad/train/finite_guard.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "vqad/train/methods/registry.h"
#include "vqad/train/optimizer.h"
#include "vqad/train/throughput.h"
#include "vqad/train/trainer_state.h"
#include "vqad/train/validation.h"

namespace fs = std::filesystem;

namespace vqad::train {

namespace {
// training.distributed.accumulate_unreduced_gradients in force: there are micro-steps whose
// gradients a sharded role keeps unreduced.
bool unreduced_accumulation(const TrainingConfig& tc) {
  return tc.distributed.accumulate_unreduced_gradients && tc.loop.gradient_accumulation_steps > 1;
}

// "BF16 for 99.0% of the elements (...), fp32 for the rest" for the log.
std::string gather_summary(const std::map<std::string, std::unique_ptr<dist::FullyShardedModel>>& sharded) {
  int64_t bf16 = 0, all = 0;
  for (const auto& [name, s] : sharded) {
    bf16 += s->bf16_gathered_elements();
    all += s->parameter_elements();
  }
  if (bf16 == 0) return "fp32";
  char pct[32];
  std::snprintf(pct, sizeof(pct), "%.1f%%",
                100.0 * static_cast<double>(bf16) / static_cast<double>(std::max<int64_t>(1, all)));
  return std::string("BF16 for ") + pct +
         " of the elements (the weights and biases of the linear layers and the patch embedding), fp32 for the rest";
}
}  // namespace

struct Trainer::Impl {
  const MethodRegistration* registration = nullptr;
  std::shared_ptr<const data::Dataset> dataset;
  std::unique_ptr<data::PrefetchLoader> loader;
  RoleOptimizers optimizers;
  std::unique_ptr<TrainingMethod> method;
  std::unique_ptr<ValidationRunner> validation;
  std::optional<DevicePeak> peak;  // MFU denominator (none: no MFU)
  std::unique_ptr<dist::DataParallel> dp;  // null in a one-process run
  // hsdp_shard_dim > 1: the roles' parameters sharded (by role; frozen roles unless
  // shard_frozen_roles is false); a trainable role's optimizer then updates its shards.
  std::map<std::string, std::unique_ptr<dist::FullyShardedModel>> sharded;
  torch::Generator gen;
  long start_step = 0;
  std::string started_at;
};

Trainer::Trainer(RunConfig run, TrainerOptions options)
    : impl_(std::make_unique<Impl>()), run_(std::move(run)), options_(options) {
  const auto& tc = run_.training;
  impl_->registration = &method_registration(run_);
  const MethodRegistration& method = *impl_->registration;
  // The method's own load-time checks (architecture, ODE-cache schedule), before any weights load.
  if (method.validate) method.validate(run_);
  // Backends without kernels in this build (e.g. VSA on a GPU without the VSA path) fail here, before any weights load.
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
  {
    const auto& d = tc.distributed;
    // A dry run builds and prints in one process, whatever the mesh.
    VQAD_CHECK(d.sp_size == 1 || method.whole_model_forwards, "training.distributed.sp_size = ", d.sp_size,
               ": method ", method.name, " runs block ranges with taps, which are not split over sequence-parallel "
               "ranks; use --training.distributed.sp_size 1 (the ranks then replicate)");
    VQAD_CHECK(d.hsdp_shard_dim == 1 || method.whole_model_forwards, "training.distributed.hsdp_shard_dim = ",
               d.hsdp_shard_dim, ": method ", method.name, " runs block ranges with taps, which sharded parameters "
               "do not serve; use --training.distributed.hsdp_replicate_dim ", d.num_gpus,
               " --training.distributed.hsdp_shard_dim 1 (the ranks then replicate)");
    if (!options_.dry_run)
      impl_->dp = dist::DataParallel::create({d.num_gpus, d.sp_size, d.hsdp_replicate_dim, d.hsdp_shard_dim});
  }
  VQAD_CHECK(!tc.data.data_path.empty(), "training.data.data_path: no dataset path given");
  VQAD_CHECK(tc.dit_precision == "fp32", "training.dit_precision: vqad keeps FP32 master weights (found '",
             tc.dit_precision, "')");
  if (options_.device.is_cuda()) set_deterministic_algorithms(options_.deterministic);
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
  // The CUDA attention kernels take head_dim 64 or 128: refuse other models here rather
  // than at the first attention call of the first step.
  if (options_.device.is_cuda()) {
    for (const auto& [name, role] : roles_) {
      const auto b = role->config.attention_backend;
      const int64_t hd = role->model->config().attention_head_dim;
      VQAD_CHECK(b != AttentionBackend::kAttnQatTrain || ops::attention_qat_cuda_head_dim_supported(hd), "models.",
                 name, ".attention_backend ATTN_QAT_TRAIN on ", options_.device.str(),
                 ": the CUDA kernels support head_dim 64 or 128, but this model has attention_head_dim ", hd,
                 " (use a model with 64- or 128-channel heads, e.g. random:tiny-hd128 for a tiny run)");
    }
  }
  if (tc.distributed.sp_size > 1) {
    for (const auto& [name, role] : roles_) {
      const int64_t heads = role->model->config().num_attention_heads;
      VQAD_CHECK(heads % tc.distributed.sp_size == 0, "training.distributed.sp_size = ", tc.distributed.sp_size,
                 ": Ulysses splits the attention heads over the SP ranks, but models.", name, " has ", heads,
                 " heads (sp_size must divide them)");
    }
  }
  auto student = roles_.at("student");
  VQAD_CHECK(student->config.trainable, "models.student.trainable must be true for ", method.name);
  if (method.prepare_roles) method.prepare_roles(run_, roles_);  // e.g. the trainable scope, before the optimizers

  // Data (parquet rows, synthetic rows or ODE-cache pairs: data::make_dataset decides).
  const auto& mc = student->model->config();
  impl_->dataset = data::make_dataset(training_dataset_spec(run_, mc));
  log::info("data: ", impl_->dataset->description());
  const int64_t dp_rank = impl_->dp ? impl_->dp->dp_rank() : 0, dp_size = impl_->dp ? impl_->dp->dp_size() : 1;
  dist::set_batch_shard({dp_rank, dp_size});
  auto sopt = data::sampler_options_for_rank(impl_->dataset->size(), tc.data.train_batch_size, dp_size, 1, dp_rank,
                                             tc.data.seed);
  impl_->loader = std::make_unique<data::PrefetchLoader>(impl_->dataset, data::DpSpBatchSampler(sopt), 2);

  // The method's optimizers (one per trainable role), the method, its validation.
  impl_->optimizers = build_optimizers(run_, method, roles_);
  impl_->method = method.create(run_, roles_);
  const auto& vc = run_.callbacks.validation;
  // Replicated: rank 0 samples. Sharded: every rank of the first shard group samples with it
  // (the sharded student's forward gathers its units over that group), rank 0 writes.
  const bool samples = !impl_->dp || impl_->dp->is_main() || impl_->dp->in_first_shard_group();
  if (vc.enabled && (vc.every_steps > 0 || vc.run_at_start) && samples)
    impl_->validation =
        std::make_unique<ValidationRunner>(run_, student, options_.device, !impl_->dp || impl_->dp->is_main());
  if (options_.device.is_cuda() && method.mfu_is_student_forward_backward) {
    impl_->peak = device_peak_flops(options_.device);
    if (!impl_->peak) log::warn("mfu: this device is not in vqad's peak-FLOPs table; mfu is not reported");
  }
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
    std::cout << "# role " << name << ": " << role->model->config().kind() << ", " << n
              << " parameters, attention " << attention_backend_name(role->config.attention_backend)
              << ", weights+grads+optimizer " << gib << " GiB\n";
    std::cout << "# quant plan (" << name << "): "
              << (role->plan.empty() ? std::string("none (dense linears)\n") : role->plan.to_text());
    if (!role->trainable_names.empty()) {
      std::cout << "# trainable parameters (" << name << ", method.trainable_modules";
      for (const auto& m : role->trainable_modules) std::cout << " " << m;
      std::cout << "): " << role->trainable_names.size() << "\n";
      for (const auto& n : role->trainable_names) std::cout << "#   " << n << "\n";
    }
  }
  std::cout << "# memory estimate (parameters, gradients, optimizer state; activations not included): " << total_gib
            << " GiB\n";
  // Per GPU for the configured mesh.
  const auto& d = run_.training.distributed;
  const auto& dc = run_.training.data;
  std::vector<dist::RoleFootprint> fp;
  for (const auto& [name, role] : roles_) fp.push_back({name, role->model->config(), role->config.trainable});
  const auto& student = *roles_.at("student");
  const auto& ps = student.model->config().patch_size;
  dist::MemoryMesh mm;
  mm.replicate = d.hsdp_replicate_dim;
  mm.shard = d.hsdp_shard_dim;
  mm.sp = d.sp_size;
  mm.batch = dc.train_batch_size;
  if (dc.num_latent_t > 0 && dc.num_height > 0 && dc.num_width > 0)
    mm.tokens_per_sample = dc.num_latent_t / ps[0] * (dc.num_height / 8 / ps[1]) * (dc.num_width / 8 / ps[2]);
  mm.activation_checkpointing = student.config.enable_gradient_checkpointing_type == "full";
  mm.blocks_per_unit = d.fsdp_modules_per_group;
  mm.reshard_after_forward = d.reshard_after_forward;
  mm.shard_frozen = d.shard_frozen_roles;
  mm.unreduced_accumulation = unreduced_accumulation(run_.training);
  const auto est = dist::estimate_memory(fp, mm);
  std::cout << "# per-GPU memory estimate, mesh " << d.num_gpus << " GPUs = replicate " << d.hsdp_replicate_dim
            << " x shard " << d.hsdp_shard_dim << ", sp " << d.sp_size << ":\n";
  std::istringstream lines(est.text);
  for (std::string l; std::getline(lines, l);) std::cout << "#   " << l << "\n";
}

TrainSummary Trainer::run() {
  const auto& tc = run_.training;
  auto& I = *impl_;
  TrainSummary summary;
  const std::string out = tc.checkpoint.output_dir;
  const bool main_rank = !I.dp || I.dp->is_main();  // logs, metrics and checkpoints
  // One run per output directory (rank 0 holds the lock for the job); what a dead run left
  // half-written goes first; a new run refuses a directory holding another run.
  std::optional<RunLock> lock;
  if (main_rank) {
    lock.emplace(out);
    remove_stale_checkpoint_temps(out);
    if (tc.checkpoint.resume_from_checkpoint.empty()) prepare_new_run_dir(out, options_.overwrite_run);
  }
  if (I.dp) I.dp->barrier("output directory " + out);  // the other ranks read it only once rank 0 holds it
  CheckpointWriter writer(out, static_cast<int>(tc.checkpoint.checkpoints_total_limit), options_.async_checkpoints);

  // Resume (verified against the checkpoint's recorded hashes before anything is loaded).
  auto resume = resolve_resume(tc.checkpoint.resume_from_checkpoint, out);
  nlohmann::json resumed_metadata;
  if (resume) {
    log::info("resuming from ", resume->path, " (step ", resume->step, ")");
    // A sharded run keeps the loaded AdamW moments on the host (views of the files) and
    // moves only its slices to the device when it shards them below.
    I.start_step = load_trainer_checkpoint(*resume, run_, roles_, I.optimizers, *I.loader, I.gen,
                                           I.dp && I.dp->sharded());
    resumed_metadata = read_metadata(resume->path);
    writer.set_last_good(resume->path);
  }
  std::optional<MetricsWriter> metrics;
  if (main_rank) {
    if (resume)
      metrics.emplace(MetricsWriter::open_for_resume((fs::path(out) / "metrics.jsonl").string(), I.start_step));
    else
      metrics.emplace((fs::path(out) / "metrics.jsonl").string(), false);
    if (!resume) {
      st::write_file_atomic((fs::path(out) / "resolved.yaml").string(), {run_.resolved_yaml});
      write_source_yaml(run_, out);
    }
  }
  if (I.dp) {
    // Same build and config on every rank, then rank 0's weights everywhere.
    I.dp->check_same("vqad executable sha256", dist::executable_sha256());
    I.dp->check_same("resolved config sha256", run_.resolved_sha256);
    for (auto& [name, role] : roles_) I.dp->broadcast_parameters(role->model->parameters(), "parameters " + name);
  }
  if (I.dp && I.dp->sharded()) {
    // Sharded data parallelism: each rank keeps its shards of every role (and of the AdamW
    // state a resume loaded); the trainable roles' optimizers update the shards.
    const auto& d = tc.distributed;
    std::vector<std::string> replicated;
    for (auto& [name, role] : roles_) {
      if (!d.shard_frozen_roles && !I.optimizers.count(name)) {
        replicated.push_back(name);  // frozen, full weights on every rank (already broadcast)
        continue;
      }
      auto s = std::make_unique<dist::FullyShardedModel>(
          name, role->model->shard_units(d.fsdp_modules_per_group),
          dist::ShardingOptions{I.dp->shard_group(), I.dp->replicate_group(), I.dp->dp_size(),
                                d.reshard_after_forward, d.gather_dtype == "bf16"});
      role->model->set_sharding(s.get(), d.fsdp_modules_per_group);
      if (auto it = I.optimizers.find(name); it != I.optimizers.end()) {
        auto& o = it->second;
        auto shards = s->trainable_shards();
        std::set<const c10::TensorImpl*> trainable, updated;
        for (const auto& p : role->model->parameters())
          if (p.requires_grad()) trainable.insert(p.unsafeGetTensorImpl());
        size_t outside = 0;
        for (const auto& p : o.params) {
          updated.insert(p.unsafeGetTensorImpl());
          outside += trainable.count(p.unsafeGetTensorImpl()) ? 0 : 1;
        }
        VQAD_CHECK(updated == trainable && updated.size() == o.params.size(), "training.distributed."
                   "hsdp_shard_dim = ", d.hsdp_shard_dim, ": models.", name, " has ", trainable.size(), " trainable "
                   "parameters but its optimizer updates ", o.params.size(), " (", outside, " of them not trainable "
                   "parameters of the model; sharding needs the two sets to be the same)");
        const auto opts = static_cast<const torch::optim::AdamWOptions&>(o.adamw->defaults());
        auto adamw = std::make_unique<torch::optim::AdamW>(shards, opts);
        s->shard_adamw_state(*o.adamw, *adamw);
        o.params = std::move(shards);
        o.adamw = std::move(adamw);
      }
      I.sharded[name] = std::move(s);
    }
    if (main_rank)
      log::info("sharded data parallel: parameters, gradients and AdamW state of ", I.sharded.size(),
                " role(s) split over shard groups of ", d.hsdp_shard_dim,
                replicated.empty() ? std::string() : " (frozen, replicated on every rank: " + replicated.front() +
                                           (replicated.size() > 1 ? " and " + std::to_string(replicated.size() - 1) +
                                                                        " more" : "") + ")",
                ", replicated ", d.hsdp_replicate_dim,
                "x; reshard after forward ", d.reshard_after_forward ? "on" : "off", ", ",
                d.fsdp_modules_per_group, " block(s) per unit; gradients reduce-scattered ",
                unreduced_accumulation(tc) ? "once per step (full gradients accumulated over the micro-steps)"
                    : "every micro-step", "; parameters gathered as ", gather_summary(I.sharded));
  }
  const bool sharded = !I.sharded.empty();
  // A sharded run's checkpoints are written by the ranks of the first shard group (global
  // ranks 0 .. S-1) together, each its units (CheckpointWriter::save_sharded); the other
  // replicate groups hold the same shards and write nothing.
  std::map<std::string, dist::FullyShardedModel*> sharded_trainable;
  std::map<std::string, int64_t> reduce_scatters_before;  // for the per-step counts in the metrics
  std::map<std::string, int64_t> all_gather_before;
  bool writes_part = false;
  if (sharded) {
    for (auto& [name, o] : I.optimizers) sharded_trainable[name] = I.sharded.at(name).get();
    dist::ProcessGroup* sg = I.dp->shard_group();
    writes_part = I.dp->in_first_shard_group();
    if (writes_part) writer.set_parts({sg, sg->rank(), sg->size(), sg->timeout()});
  }
  // Validation: rank 0 samples the student; a sharded student samples on every rank of the
  // first shard group, its forward gathering one unit at a time (released again after).
  const auto& vcfg = run_.callbacks.validation;
  auto validate = [&](long step) {
    std::map<std::string, double> r;
    if (!I.validation) return r;
    r = I.validation->run(step);
    if (I.sharded.count("student")) I.sharded.at("student")->release_all();
    return r;
  };

  const long max_steps = tc.loop.max_train_steps;
  const long accum = std::max<long>(1, tc.loop.gradient_accumulation_steps);
  const long save_every = tc.checkpoint.training_state_checkpointing_steps;
  auto student = roles_.at("student");
  const auto t_run = std::chrono::steady_clock::now();
  std::unique_ptr<Progress> bar;
  if (options_.progress && main_rank) bar = std::make_unique<Progress>("train", max_steps - I.start_step, "step");
  // Batch jobs (stdout not a terminal): progress lines, rank 0 only.
  BatchLog batch_log(I.start_step, max_steps, main_rank ? options_.log_every_steps : 0,
                     main_rank ? options_.log_every_s : 0.0);
  summary.first_step = I.start_step + 1;
  long last_saved = -1;
  // The writer's host buffers are allocated in the background while the first steps run.
  if (save_every > 0) {
    if (sharded && writes_part)
      prepare_sharded_trainer_checkpoint(writer, run_, sharded_trainable, I.optimizers);
    else if (!sharded && main_rank)
      prepare_trainer_checkpoint(writer, run_, roles_, I.optimizers);
  }
  // Replicated state: rank 0 snapshots it (its writer thread writes the files), the others
  // wait for the snapshot. Sharded: the first shard group snapshots its parts unit by unit
  // (one unit gathered at a time), rank 0's writer publishes them together.
  auto save = [&](long step) {
    const nlohmann::json mesh = I.dp ? I.dp->mesh_json() : nlohmann::json{{"world_size", 1}};
    if (sharded) {
      if (writes_part)
        summary.checkpoint_stall_s +=
            save_sharded_trainer_checkpoint(writer, run_, roles_, step, sharded_trainable, I.optimizers, *I.loader,
                                            I.gen, I.started_at, mesh, resumed_metadata);
    } else if (main_rank) {
      summary.checkpoint_stall_s += save_trainer_checkpoint(writer, run_, roles_, step, I.optimizers, *I.loader,
                                                            I.gen, I.started_at, mesh, resumed_metadata);
    }
    last_saved = step;
    if (I.dp) I.dp->barrier("checkpoint " + std::to_string(step));
  };
  auto last_good_text = [&] {
    writer.wait();
    return last_good_checkpoint_text(writer.last_good(), out);
  };
  if (ValidationRunner::at_start(vcfg) && I.start_step == 0 && I.validation) {
    auto r = validate(0);
    if (metrics) metrics->log(0, r);
  }

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
    for (auto& [name, opt] : I.optimizers) opt.adamw->zero_grad(true);
    std::map<std::string, double> rec, role_loss;
    int64_t tokens = 0;
    for (long micro = 0; micro < accum; ++micro) {
      data::Batch batch = I.loader->next();
      if (auto rows = nonfinite_batch_rows(batch, *I.dataset); !rows.empty())
        fail("step ", step, ": the batch holds non-finite values (NaN/Inf) in ", rows.size(), " row(s), first: ",
             rows[0], "; nothing of step ", step, " was saved; ", last_good_text());
      // Ulysses SP (sp_size > 1): the method's whole-model forwards split the sequence.
      dist::SequenceParallelScope sp_scope(I.dp ? I.dp->sp_group() : nullptr);
      // Sharded with accumulate_unreduced_gradients: only the last micro-step communicates.
      for (auto& [name, s] : I.sharded)
        s->set_gradient_sync(!unreduced_accumulation(tc) || micro + 1 == accum);
      auto r = I.method->micro_step(batch, I.gen, options_.device, step, 1.0 / static_cast<double>(accum));
      for (const auto& [k, v] : r.metrics) rec[k] += v / static_cast<double>(accum);
      for (const auto& [k, v] : r.role_loss) role_loss[k] += v / static_cast<double>(accum);
      tokens += r.tokens;
      // Sharded: what no hook reduce-scattered (the root unit) is, and every unit released.
      for (auto& [name, s] : I.sharded) s->finish_backward();
    }
    if (I.dp) {
      // One gradient all-reduce per updated role and step (none per micro-batch); the losses
      // every rank logs and checks are the global averages.
      for (const auto& name : I.method->roles_to_update(step)) {
        if (auto it = I.sharded.find(name); it != I.sharded.end())
          it->second->finish_step();
        else
          I.dp->average_gradients(roles_.at(name)->trainable_parameters(), name);
      }
      I.dp->average_metrics(rec, "step metrics");
      I.dp->average_metrics(role_loss, "role losses");
      tokens = static_cast<int64_t>(I.dp->sum_over_dp(static_cast<double>(tokens), "tokens"));
    }
    const double loss = rec.at("loss");
    for (const auto& name : I.method->roles_to_update(step)) {
      auto& opt = I.optimizers.at(name);
      auto& role = *roles_.at(name);
      const double rloss = role_loss.count(name) ? role_loss.at(name) : loss;
      dist::FullyShardedModel* sh = I.sharded.count(name) ? I.sharded.at(name).get() : nullptr;
      double norm;
      if (sh) {
        norm = run_.callbacks.grad_clip.enabled ? sh->clip_grad_norm(run_.callbacks.grad_clip.max_grad_norm)
                                                : sh->grad_norm();
      } else if (run_.callbacks.grad_clip.enabled) {
        norm = torch::nn::utils::clip_grad_norm_(opt.params, run_.callbacks.grad_clip.max_grad_norm);
      } else {
        std::vector<torch::Tensor> norms;
        for (auto& p : opt.params)
          if (p.grad().defined()) norms.push_back(p.grad().detach().to(torch::kFloat32).norm());
        norm = norms.empty() ? 0.0 : torch::stack(norms).norm().item<double>();
      }
      if (!std::isfinite(rloss) || !std::isfinite(norm)) {
        std::string bad;
        int nbad = 0;
        if (sh) {
          for (const auto& n : sh->nonfinite_parameters(true))
            if (nbad++ < 8) bad += " " + n;
        } else {
          for (const auto& item : role.model->named_parameters()) {
            const auto& g = item.value().grad();
            if (g.defined() && !torch::isfinite(g).all().item<bool>() && nbad++ < 8) bad += " " + item.key();
          }
        }
        fail("step ", step, ": non-finite ", std::isfinite(rloss) ? "gradient" : "loss", " in role '", name,
             "' (loss ", rloss, ", grad norm ", norm, "); parameters with non-finite gradients:",
             bad.empty() ? std::string(" none") : bad, nbad > 8 ? " ..." : "",
             ". The weights were not updated and nothing of step ", step, " was saved; ", last_good_text());
      }
      rec["grad_norm/" + name] = norm;
      const double lr = opt.step();
      rec["lr/" + name] = lr;
      // The update itself (e.g. an infinite LR) may be what turns the weights non-finite.
      NamedTensors weights;
      if (!sh)
        for (const auto& item : role.model->named_parameters(true))
          if (item.value().requires_grad()) weights.emplace_back(item.key(), item.value());
      size_t nbad = 0;
      auto bad = sh ? sh->nonfinite_parameters(false) : nonfinite_tensors(weights, 1, &nbad);
      if (sh) nbad = bad.size();
      if (!bad.empty())
        fail("step ", step, ": the optimizer update made ", nbad, " weight tensor(s) of role '", name,
             "' non-finite (first: ", bad[0], "; loss ", rloss, ", grad norm ", norm, ", lr ", lr,
             " were finite); nothing of step ", step, " was saved; ", last_good_text());
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec["step_time_s"] = dt;
    if (any_vsa) rec["vsa_sparsity"] = vsa_sparsity;
    rec["tokens_per_s"] = static_cast<double>(tokens) / dt;
    rec["mem_peak_gib"] = peak_memory_gib(options_.device);
    if (I.peak) {
      const auto& mc = student->model->config();
      // tokens are the global batch's; MFU is per device.
      const int64_t dp = I.dp ? I.dp->dp_size() : 1, world = I.dp ? I.dp->world_size() : 1;
      const int64_t per_sample = tokens / std::max<int64_t>(1, tc.data.train_batch_size * accum * dp);
      rec["mfu"] = step_flops(mc, per_sample, tc.data.train_batch_size * accum * dp, mc.text_len) / dt /
                   I.peak->bf16_dense_flops / static_cast<double>(world);
    }
    if (ValidationRunner::due(vcfg, step) && I.validation)
      for (const auto& [k, v] : validate(step)) rec[k] = v;
    // A sharded trainable role's gradient reduce-scatters of this step (per rank).
    for (const auto& [name, s] : I.sharded)
      if (I.optimizers.count(name)) {
        const int64_t n = s->reduce_scatters_issued();
        rec["reduce_scatters/" + name] = static_cast<double>(n - reduce_scatters_before[name]);
        reduce_scatters_before[name] = n;
      }
    // Every sharded role's parameter all-gathers of this step (MiB received per rank).
    for (const auto& [name, s] : I.sharded) {
      const int64_t b = s->all_gather_bytes();
      rec["all_gather_mib/" + name] = static_cast<double>(b - all_gather_before[name]) / (1024.0 * 1024.0);
      all_gather_before[name] = b;
    }
    if (metrics) metrics->log(step, rec);
    summary.losses.push_back(loss);
    summary.last_step = step;
    if (bar) {
      char post[96];
      std::snprintf(post, sizeof(post), "loss %.4f", loss);
      bar->set_postfix(post);
      bar->update(1);
    }
    if (save_every > 0 && step % save_every == 0) save(step);
    batch_log.step(step, loss, dt, tokens, rec["mem_peak_gib"]);
    int sig = stop_signal();
    // Every rank stops at the same step when any of them was signalled (SIGTERM stands in
    // for a signal another rank received).
    if (I.dp && I.dp->sum(sig ? 1.0 : 0.0, "stop request") > 0 && !sig) sig = SIGTERM;
    if (sig) {
      summary.stop_signal = sig;
      if (main_rank) log::warn(signal_name(sig), " received: stopping after step ", step);
      break;
    }
  }
  if (bar) bar->finish();
  if (save_every > 0 && last_saved != summary.last_step && summary.last_step > 0) save(summary.last_step);
  writer.wait();  // the last checkpoint is on disk (or its failure is thrown) before the run returns
  if (I.dp) I.dp->barrier("checkpoints written");
  summary.checkpoints = writer.written();
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
  return summary;
}

}  // namespace vqad::train
