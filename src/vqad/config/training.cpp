// The `training` section: distributed, data, optimizer, loop, checkpoint, tracker, vsa, model.
#include <algorithm>
#include <sstream>

#include "vqad/config/linear_quantization.h"
#include "vqad/config/sections.h"

namespace vqad::train::sections {

namespace {

const char* kShardingKnob = "a sharding option vqad does not offer (only its default is accepted)";
const std::vector<std::string> kCheckpointingTypes = {"", "full", "ops", "block_skip"};

const SectionSchema& distributed_schema() {
  static const SectionSchema s{
      "training.distributed",
      {
          key("num_gpus", K::kInt, 1, "world size (GPUs of the run; the launched ranks)", true),
          key("tp_size", K::kInt, 1, "tensor parallel size; must be 1 (vqad has no tensor parallelism)", true),
          key("sp_size", K::kInt, nullptr,
              "sequence parallel (Ulysses) size; divides num_gpus and the heads; default num_gpus", true),
          key("hsdp_replicate_dim", K::kInt, 1, "HSDP replica groups", true),
          key("hsdp_shard_dim", K::kInt, nullptr,
              "HSDP shard group size (parameters, gradients and AdamW state split over it); default num_gpus, "
              "-1 = the rest",
              true),
          planned(key("pin_cpu_memory", K::kBool, false, "pin host memory of sharded state"), kShardingKnob),
          key("reshard_after_forward", K::kBool, true,
              "free a gathered unit after its forward (gathered again for its backward); false keeps it until its "
              "backward"),
          key("fsdp_modules_per_group", K::kInt, 1, "blocks per sharding unit (gathered and released together)"),
          key("shard_frozen_roles", K::kBool, true,
              "with hsdp_shard_dim > 1, also shard the frozen roles (teacher); false keeps their full weights on "
              "every rank (no gathers in their forwards, more memory)"),
          key("accumulate_unreduced_gradients", K::kBool, false,
              "with hsdp_shard_dim > 1 and loop.gradient_accumulation_steps > 1: every rank keeps the full fp32 "
              "gradients of its trainable roles across the micro-steps and reduce-scatters them once per optimizer "
              "step (no communication per micro-step; costs the full gradients on every rank). false: each "
              "micro-step reduce-scatters its gradients into the shards. Replicated data parallelism always "
              "reduces once per step"),
          choice_key("gather_dtype", {"bf16", "fp32"}, "bf16",
                     "dtype of the parameter all-gathers before a unit's forward and backward (hsdp_shard_dim > 1): "
                     "bf16 moves the weights and biases of the linear layers and the patch embedding (which the BF16 "
                     "compute reads only rounded to BF16) as BF16 and the rest (norms, modulation tables) as fp32, "
                     "about half the bytes and the same arithmetic as fp32; fp32 moves every parameter as fp32. "
                     "Checkpoints always gather fp32"),
          planned(choice_key("reduce_dtype", {"fp32", "bf16"}, "fp32", "gradient reduction dtype", true),
                  kShardingKnob),
          planned(key("fsdp_symmetric_memory", K::kBool, false, "symmetric-memory collectives (a GPU-memory knob)"),
                  kShardingKnob),
      }};
  return s;
}

const SectionSchema& data_schema() {
  static const SectionSchema s{
      "training.data",
      {
          key("data_path", K::kAny, nullptr,
              "parquet dataset directories: 'a:2,b' (path:repeat), a list, or a mapping path -> repeat"),
          choice_key("preprocessed_data_type", {"t2v", "text_only"}, "t2v", "dataset schema", true),
          key("train_batch_size", K::kInt, 1, "samples per micro-batch", true),
          key("dataloader_num_workers", K::kInt, 0,
              "background reader threads: vqad reads batches on one thread, so 0 and 1 are accepted; more "
              "is not supported yet",
              true),
          key("training_cfg_rate", K::kFloat, 0.0, "text dropout probability (classifier-free guidance training)",
              true),
          key("seed", K::kInt, 0, "seed of the sampler, the dropout and the trainer's generator", true),
          key("num_height", K::kInt, 0, "video height in pixels (0 = from the data)", true),
          key("num_width", K::kInt, 0, "video width in pixels (0 = from the data)", true),
          key("num_latent_t", K::kInt, 0, "latent frames (0 = from the data)", true),
          key("num_frames", K::kInt, 0, "video frames (0 = from the data)", true),
          key("ode_anchor_indices", K::kIntList, Json::array(),
              "vqad: when data_path is an ODE-trajectory cache, the teacher step indices of the anchors to "
              "train on (e.g. [0, 16, 32]); empty = every cached anchor",
              true),
      }};
  return s;
}

const SectionSchema& optimizer_schema() {
  static const SectionSchema s{
      "training.optimizer",
      {
          key("learning_rate", K::kFloat, 0.0, "AdamW learning rate of the student", true),
          key("betas", K::kPair, Json::array({0.9, 0.999}), "AdamW betas: [b1, b2] or 'b1,b2'"),
          key("weight_decay", K::kFloat, 0.0, "AdamW decoupled weight decay", true),
          key("eps", K::kFloat, 1e-8, "AdamW epsilon", true),
          key("lr_scheduler", K::kString, "constant", "LR schedule: " + lr_schedule_choices(), true),
          key("lr_warmup_steps", K::kInt, 0, "linear warmup steps", true),
          key("lr_num_cycles", K::kInt, 0, "cosine cycles", true),
          key("lr_power", K::kFloat, 0.0, "polynomial power (0 = 1)", true),
          key("min_lr_ratio", K::kFloat, 0.5, "cosine_with_min_lr floor as a fraction of the LR", true),
          not_supported_yet(key("fused", K::kBool, nullptr, "the fused AdamW kernel; vqad's AdamW is LibTorch's "
                                                            "per-parameter loop"),
                            false),
      }};
  return s;
}

const SectionSchema& loop_schema() {
  static const SectionSchema s{
      "training.loop",
      {
          key("max_train_steps", K::kInt, 0, "optimizer steps of the run", true),
          key("gradient_accumulation_steps", K::kInt, 1, "micro-batches per optimizer step", true),
      }};
  return s;
}

const SectionSchema& checkpoint_schema() {
  static const SectionSchema s{
      "training.checkpoint",
      {
          key("output_dir", K::kString, "", "run directory: checkpoints, metrics.jsonl, resolved.yaml", true),
          key("resume_from_checkpoint", K::kString, "", "'' | latest | a checkpoint directory", true),
          key("training_state_checkpointing_steps", K::kInt, 0, "checkpoint every N steps (0 = only at the end "
                                                                "when set)",
              true),
          key("checkpoints_total_limit", K::kInt, 0, "checkpoints kept (0 = all)", true),
      }};
  return s;
}

const SectionSchema& tracker_schema() {
  static const SectionSchema s{
      "training.tracker",
      {
          key("trackers", K::kStringList, Json::array(),
              "metric sinks: none, jsonl (vqad always writes <output_dir>/metrics.jsonl); wandb and swanlab are "
              "not supported yet"),
          key("entity", K::kString, "", "tracker account (recorded in the resolved config)", true),
          key("project_name", K::kString, "fastvideo", "tracker project (recorded in the resolved config)", true),
          key("run_name", K::kString, "", "run name (recorded in checkpoint metadata)", true),
      }};
  return s;
}

const SectionSchema& vsa_schema() {
  static const SectionSchema s{
      "training.vsa",
      {
          key("sparsity", K::kFloat, 0.0, "fraction of KV cubes skipped by VSA backends, in [0, 1)", true),
          key("cache_tile_buf", K::kBool, false,
              "FastVideo's step-lifetime tile cache; vqad's tiled buffers live for one call, so only false"),
          key("decay_rate", K::kFloat, 0.0,
              "sparsity ramp: sparsity at step s = min(sparsity, decay_rate * floor(s / decay_interval_steps))",
              true),
          key("decay_interval_steps", K::kInt, 0, "steps between sparsity increases (0 = constant)", true),
          choice_key("selection", {"top-k", "top-p"}, "top-k", "cube selection rule", true),
          key("top_p", K::kFloat, 1.0, "top-p mass, in (0, 1] (1.0 = effective_topk cubes)", true),
      }};
  return s;
}

const SectionSchema& linear_quantization_schema() {
  static const SectionSchema s{
      "training.linear_quantization",
      {
          key("act_amax_json", K::kString, "",
              "nvfp4_qad: JSON table {\"b<block>.<sub>\": amax} of the static (FFN) linears' calibrated input amax, "
              "as `vqad calibrate` writes it; every static linear must have an entry"),
          key("calibration_batches", K::kInt, 8,
              "`vqad calibrate`: training batches run through the student to record max|x| of the static linears"),
          key("quantize_attention", K::kBool, true,
              "quantize the targeted attention projections (to_q, to_k, to_v, to_out of self- and cross-attention)"),
          key("quantize_ffn", K::kBool, true, "quantize the targeted FFN linears"),
          key("quantize_gate", K::kBool, false,
              "also quantize the VSA compression gates to_gate_compress (unit activation scale for nvfp4_qad), as "
              "seeds/003 does; needs a VSA student"),
          key("skip_blocks", K::kIntList, Json::array(), "transformer block indices whose linears stay high precision"),
          key("shared_qkv_scale", K::kBool, false,
              "one weight and one activation global scale for the q/k/v of each self-attention and the k/v of each "
              "cross-attention, in training and in the packed export (engines that fuse QKV require it)"),
          choice_key("gemm", {"auto", "fake_quant", "fp4"}, "auto",
                     "forward GEMM of the NVFP4 linears: fake_quant (dequantized operands, BF16 GEMM; every device), "
                     "fp4 (E2M1 codes through cuBLASLt's block-scaled FP4 GEMM; needs sm_100 / sm_120, an error "
                     "elsewhere) or auto (fp4 where the device has FP4 tensor cores, else fake_quant); the backward "
                     "is the same for all"),
      }};
  return s;
}

const SectionSchema& model_schema() {
  static const SectionSchema s{
      "training.model",
      {
          choice_key("weighting_scheme", {"uniform", "logit_normal", "mode"}, "uniform", "timestep sampling density",
                     true),
          key("logit_mean", K::kFloat, 0.0, "logit_normal mean", true),
          key("logit_std", K::kFloat, 1.0, "logit_normal std", true),
          key("mode_scale", K::kFloat, 1.0, "mode weighting scale", true),
          key("precondition_outputs", K::kBool, false, "train on the x0 preconditioned output"),
          choice_key("enable_gradient_checkpointing_type", kCheckpointingTypes, "",
                     "activation recompute of trainable roles: '' (off) or full (ops and block_skip are not "
                     "supported yet)",
                     true),
      }};
  return s;
}

const SectionSchema& training_schema() {
  static const SectionSchema s{
      "training",
      {
          key("distributed", K::kMapping, nullptr, "world layout"),
          key("data", K::kMapping, nullptr, "dataset and batch"),
          key("optimizer", K::kMapping, nullptr, "AdamW and LR schedule"),
          key("loop", K::kMapping, nullptr, "steps"),
          key("checkpoint", K::kMapping, nullptr, "checkpoints and resume"),
          key("tracker", K::kMapping, nullptr, "metric sinks"),
          key("vsa", K::kMapping, nullptr, "video-sparse attention"),
          key("model", K::kMapping, nullptr, "flow-matching details of the student"),
          key("linear_quantization", K::kMapping, nullptr, "the student's NVFP4 linears (plan toggles, amax table)"),
          choice_key("dit_precision", {"fp32", "bf16"}, "fp32", "master weight precision (vqad keeps fp32)", true),
          key("model_path", K::kString, nullptr, "default: models.student.init_from", true),
      }};
  return s;
}

std::vector<DataSource> parse_data_path(const Section& s) {
  const Json* v = s.get("data_path");
  std::string path = s.key_path("data_path");
  std::vector<DataSource> out;
  if (!v || falsy(*v)) return out;
  if (v->is_object()) {
    for (auto it = v->begin(); it != v->end(); ++it)
      out.push_back({it.key(), as_int(s.ctx(), path + "." + it.key(), it.value())});
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back({as_string(s.ctx(), path + "[" + std::to_string(i) + "]", (*v)[i]), 1});
  } else {
    // "a:2,b" -> a repeated twice, b once.
    std::stringstream ss(as_string(s.ctx(), path, *v));
    std::string item;
    while (std::getline(ss, item, ',')) {
      item = trim(item);
      if (item.empty()) continue;
      DataSource d{item, 1};
      size_t colon = item.rfind(':');
      int64_t rep = 0;
      if (colon != std::string::npos && is_int_text(item.substr(colon + 1), &rep)) {
        d.path = item.substr(0, colon);
        d.repeat = rep;
      }
      out.push_back(d);
    }
  }
  for (const auto& d : out) {
    check(!d.path.empty(), s.ctx(), path, "empty data path");
    check(d.repeat >= 1, s.ctx(), path,
          "repeat count for '" + d.path + "' must be >= 1, found " + std::to_string(d.repeat));
  }
  return out;
}

std::string fmt(double v) { return format_double(v); }

}  // namespace

const std::vector<const SectionSchema*>& training_schemas() {
  static const std::vector<const SectionSchema*> v = {
      &training_schema(), &distributed_schema(), &data_schema(),  &optimizer_schema(), &loop_schema(),
      &checkpoint_schema(), &tracker_schema(), &vsa_schema(), &model_schema(),
      &linear_quantization_schema()};
  return v;
}

TrainingConfig parse_training(const Ctx& ctx, const Json* node, const Json& models) {
  Section t(ctx, node, training_schema(), "training");
  TrainingConfig c;
  {
    Section d = t.sub("distributed", distributed_schema());
    auto& x = c.distributed;
    x.num_gpus = d.i64("num_gpus");
    x.tp_size = d.i64("tp_size");
    x.sp_size = d.i64("sp_size", x.num_gpus);
    x.hsdp_replicate_dim = d.i64("hsdp_replicate_dim");
    x.hsdp_shard_dim = d.i64("hsdp_shard_dim", x.num_gpus);
    x.pin_cpu_memory = d.boolean("pin_cpu_memory");
    x.reshard_after_forward = d.boolean("reshard_after_forward");
    x.fsdp_modules_per_group = d.i64("fsdp_modules_per_group");
    x.shard_frozen_roles = d.boolean("shard_frozen_roles");
    x.accumulate_unreduced_gradients = d.boolean("accumulate_unreduced_gradients");
    x.gather_dtype = d.choice("gather_dtype");
    x.reduce_dtype = d.choice("reduce_dtype");
    x.fsdp_symmetric_memory = d.boolean("fsdp_symmetric_memory");
    d.finish();
    const std::string p = "training.distributed";
    check(x.num_gpus >= 1, ctx, p + ".num_gpus", "must be >= 1, found " + std::to_string(x.num_gpus));
    check(x.tp_size == 1, ctx, p + ".tp_size",
          "tensor parallelism is not supported; tp_size must be 1, found " + std::to_string(x.tp_size));
    check(x.sp_size >= 1 && x.num_gpus % x.sp_size == 0, ctx, p + ".sp_size",
          "must be >= 1 and divide num_gpus (" + std::to_string(x.num_gpus) + "), found " +
              std::to_string(x.sp_size));
    if (x.hsdp_shard_dim == -1 && x.hsdp_replicate_dim >= 1 && x.num_gpus % x.hsdp_replicate_dim == 0)
      x.hsdp_shard_dim = x.num_gpus / x.hsdp_replicate_dim;  // FSDP's "-1 = the rest"
    check(x.hsdp_replicate_dim >= 1, ctx, p + ".hsdp_replicate_dim",
          "must be >= 1, found " + std::to_string(x.hsdp_replicate_dim));
    check(x.hsdp_shard_dim >= 1, ctx, p + ".hsdp_shard_dim", "must be >= 1, found " + std::to_string(x.hsdp_shard_dim));
    check(x.hsdp_replicate_dim * x.hsdp_shard_dim == x.num_gpus, ctx, p,
          "inconsistent dims: hsdp_replicate_dim (" + std::to_string(x.hsdp_replicate_dim) + ") x hsdp_shard_dim (" +
              std::to_string(x.hsdp_shard_dim) + ") = " + std::to_string(x.hsdp_replicate_dim * x.hsdp_shard_dim) +
              " must equal num_gpus (" + std::to_string(x.num_gpus) + ")");
    check(x.fsdp_modules_per_group >= 1, ctx, p + ".fsdp_modules_per_group", "must be >= 1");
    // Sharding options vqad does not offer: a value that asks for one is refused rather than
    // ignored (the defaults ask for nothing).
    check(x.reduce_dtype == "fp32", ctx, p + ".reduce_dtype",
          "vqad reduces gradients in fp32 only, found '" + x.reduce_dtype + "'");
    check(!x.pin_cpu_memory, ctx, p + ".pin_cpu_memory",
          "vqad keeps sharded state on the training device (no host offload); leave the default (false)");
    check(!x.fsdp_symmetric_memory, ctx, p + ".fsdp_symmetric_memory",
          "vqad's collectives do not use symmetric memory; leave the default (false)");
  }
  {
    Section d = t.sub("data", data_schema());
    auto& x = c.data;
    x.data_path = parse_data_path(d);
    x.preprocessed_data_type = d.choice("preprocessed_data_type");
    x.train_batch_size = d.i64("train_batch_size");
    x.dataloader_num_workers = d.i64("dataloader_num_workers");
    x.training_cfg_rate = d.f64("training_cfg_rate");
    x.seed = d.i64("seed");
    x.num_height = d.i64("num_height");
    x.num_width = d.i64("num_width");
    x.num_latent_t = d.i64("num_latent_t");
    x.num_frames = d.i64("num_frames");
    x.ode_anchor_indices = d.i64_list("ode_anchor_indices");
    d.finish();
    const std::string p = "training.data";
    check(x.train_batch_size >= 1, ctx, p + ".train_batch_size", "must be >= 1");
    check(x.dataloader_num_workers >= 0, ctx, p + ".dataloader_num_workers", "must be >= 0");
    check(x.dataloader_num_workers <= 1, ctx, p + ".dataloader_num_workers",
          "more than one reader thread is not supported yet (vqad reads batches on one background thread); "
          "found " + std::to_string(x.dataloader_num_workers) + ": set 0 or 1");
    check(x.training_cfg_rate >= 0.0 && x.training_cfg_rate <= 1.0, ctx, p + ".training_cfg_rate",
          "must be in [0, 1], found " + fmt(x.training_cfg_rate));
    for (auto [k, v] : {std::pair<const char*, int64_t>{"num_height", x.num_height},
                        {"num_width", x.num_width},
                        {"num_latent_t", x.num_latent_t},
                        {"num_frames", x.num_frames}})
      check(v >= 0, ctx, p + "." + k, "must be >= 0, found " + std::to_string(v));
  }
  {
    Section o = t.sub("optimizer", optimizer_schema());
    auto& x = c.optimizer;
    x.learning_rate = o.f64("learning_rate");
    x.betas = o.betas("betas");
    x.weight_decay = o.f64("weight_decay");
    x.eps = o.f64("eps");
    std::string sched = o.str("lr_scheduler");
    auto ls = parse_lr_schedule(sched);
    if (!ls)
      key_fail(ctx, "training.optimizer.lr_scheduler", "unknown LR schedule '", sched, "' (valid: ",
               lr_schedule_choices(), ")");
    x.lr_scheduler = *ls;
    x.lr_warmup_steps = o.i64("lr_warmup_steps");
    x.lr_num_cycles = o.i64("lr_num_cycles");
    x.lr_power = o.f64("lr_power");
    x.min_lr_ratio = o.f64("min_lr_ratio");
    if (const Json* f = o.get("fused")) x.fused = config::as_bool(ctx, "training.optimizer.fused", *f);
    o.finish();
    const std::string p = "training.optimizer";
    check(x.learning_rate >= 0.0, ctx, p + ".learning_rate", "must be >= 0, found " + fmt(x.learning_rate));
    check(x.weight_decay >= 0.0, ctx, p + ".weight_decay", "must be >= 0, found " + fmt(x.weight_decay));
    check(x.eps > 0.0, ctx, p + ".eps", "must be > 0, found " + fmt(x.eps));
    check(x.lr_warmup_steps >= 0, ctx, p + ".lr_warmup_steps", "must be >= 0");
    check(x.lr_num_cycles >= 0, ctx, p + ".lr_num_cycles", "must be >= 0");
    check(x.min_lr_ratio >= 0.0 && x.min_lr_ratio <= 1.0, ctx, p + ".min_lr_ratio",
          "must be in [0, 1], found " + fmt(x.min_lr_ratio));
  }
  {
    Section l = t.sub("loop", loop_schema());
    c.loop.max_train_steps = l.i64("max_train_steps");
    c.loop.gradient_accumulation_steps = l.i64("gradient_accumulation_steps");
    l.finish();
    check(c.loop.max_train_steps >= 0, ctx, "training.loop.max_train_steps", "must be >= 0");
    check(c.loop.gradient_accumulation_steps >= 1, ctx, "training.loop.gradient_accumulation_steps", "must be >= 1");
  }
  {
    Section k = t.sub("checkpoint", checkpoint_schema());
    auto& x = c.checkpoint;
    x.output_dir = k.str("output_dir");
    x.resume_from_checkpoint = k.str("resume_from_checkpoint");
    x.training_state_checkpointing_steps = k.i64("training_state_checkpointing_steps");
    x.checkpoints_total_limit = k.i64("checkpoints_total_limit");
    k.finish();
    check(x.training_state_checkpointing_steps >= 0, ctx, "training.checkpoint.training_state_checkpointing_steps",
          "must be >= 0");
    check(x.checkpoints_total_limit >= 0, ctx, "training.checkpoint.checkpoints_total_limit", "must be >= 0");
    check(x.training_state_checkpointing_steps == 0 || !x.output_dir.empty(), ctx, "training.checkpoint.output_dir",
          "must be set when training_state_checkpointing_steps > 0");
  }
  {
    Section r = t.sub("tracker", tracker_schema());
    auto& x = c.tracker;
    x.trackers = r.str_list("trackers");
    x.entity = r.str("entity");
    x.project_name = r.str("project_name");
    x.run_name = r.str("run_name");
    r.finish();
    const std::vector<std::string> available = {"none", "jsonl"}, planned_sinks = {"wandb", "swanlab"};
    for (size_t i = 0; i < x.trackers.size(); ++i) {
      const std::string p = "training.tracker.trackers[" + std::to_string(i) + "]";
      const std::string& name = x.trackers[i];
      if (std::find(planned_sinks.begin(), planned_sinks.end(), name) != planned_sinks.end())
        key_fail(ctx, p, "tracker '", name, "' is not supported yet (vqad writes <output_dir>/metrics.jsonl; "
                 "valid: ", join(available), ")");
      if (std::find(available.begin(), available.end(), name) == available.end())
        key_fail(ctx, p, "unknown tracker '", name, "' (valid: ", join(available), ")");
    }
  }
  {
    Section v = t.sub("vsa", vsa_schema());
    auto& x = c.vsa;
    x.sparsity = v.f64("sparsity");
    x.cache_tile_buf = v.boolean("cache_tile_buf");
    x.decay_rate = v.f64("decay_rate");
    x.decay_interval_steps = v.i64("decay_interval_steps");
    x.selection = v.choice("selection");
    x.top_p = v.f64("top_p");
    v.finish();
    check(x.sparsity >= 0.0 && x.sparsity < 1.0, ctx, "training.vsa.sparsity",
          "must be in [0, 1), found " + fmt(x.sparsity));
    check(x.decay_rate >= 0.0, ctx, "training.vsa.decay_rate", "must be >= 0");
    check(x.decay_interval_steps >= 0, ctx, "training.vsa.decay_interval_steps", "must be >= 0");
    check(x.decay_rate == 0.0 || x.decay_interval_steps > 0, ctx, "training.vsa.decay_interval_steps",
          "must be > 0 when decay_rate is set");
    check(x.top_p > 0.0 && x.top_p <= 1.0, ctx, "training.vsa.top_p", "must be in (0, 1], found " + fmt(x.top_p));
    // vqad's tiled VSA scratch lives for one call (a step-lifetime tile cache breaks
    // activation checkpointing); there is no cache to turn on.
    check(!x.cache_tile_buf, ctx, "training.vsa.cache_tile_buf",
          "vqad has no step-lifetime VSA tile cache (tiled buffers live for one call); remove the key or set false");
  }
  {
    Section m = t.sub("model", model_schema());
    auto& x = c.model;
    x.weighting_scheme = m.choice("weighting_scheme");
    x.logit_mean = m.f64("logit_mean");
    x.logit_std = m.f64("logit_std");
    x.mode_scale = m.f64("mode_scale");
    x.precondition_outputs = m.boolean("precondition_outputs");
    x.enable_gradient_checkpointing_type = m.choice("enable_gradient_checkpointing_type");
    m.finish();
    check(x.logit_std > 0.0, ctx, "training.model.logit_std", "must be > 0");
    check_checkpointing_type(ctx, "training.model.enable_gradient_checkpointing_type",
                             x.enable_gradient_checkpointing_type);
  }
  (void)t.get("linear_quantization");  // read by parse_linear_quantization (run_config.cpp)
  c.dit_precision = t.choice("dit_precision");
  c.model_path = t.str("model_path", "");
  if (c.model_path.empty() && models.is_object() && models.contains("student") && models["student"].is_object() &&
      models["student"].contains("init_from") && models["student"]["init_from"].is_string())
    c.model_path = models["student"]["init_from"].get<std::string>();
  t.finish();
  return c;
}

const std::vector<std::string>& checkpointing_types() { return kCheckpointingTypes; }

void check_checkpointing_type(const Ctx& ctx, const std::string& path, const std::string& value) {
  if (value == "ops" || value == "block_skip")
    key_fail(ctx, path, "'", value, "' is not supported yet (vqad recomputes whole blocks: use full, or leave it "
             "unset for no recompute)");
}

LinearQuantizationConfig parse_linear_quantization(const Ctx& ctx, const Json* training) {
  LinearQuantizationConfig x;
  const Json* node = training && training->is_object() && training->contains("linear_quantization")
                         ? &(*training)["linear_quantization"]
                         : nullptr;
  if (node && node->is_null()) node = nullptr;
  if (node && !node->is_object())
    fail("config ", ctx.source, ": key 'training.linear_quantization': expected a mapping, found ", describe(*node));
  Section q(ctx, node, linear_quantization_schema(), "training.linear_quantization");
  x.act_amax_json = q.str("act_amax_json");
  x.calibration_batches = q.i64("calibration_batches");
  x.quantize_attention = q.boolean("quantize_attention");
  x.quantize_ffn = q.boolean("quantize_ffn");
  x.quantize_gate = q.boolean("quantize_gate");
  x.skip_blocks = q.i64_list("skip_blocks");
  x.shared_qkv_scale = q.boolean("shared_qkv_scale");
  x.gemm = q.choice("gemm");
  q.finish();
  check(x.calibration_batches >= 1, ctx, "training.linear_quantization.calibration_batches",
        "must be >= 1, found " + std::to_string(x.calibration_batches));
  for (auto b : x.skip_blocks)
    check(b >= 0, ctx, "training.linear_quantization.skip_blocks",
          "block indices must be >= 0, found " + std::to_string(b));
  check(x.quantize_attention || x.quantize_ffn || x.quantize_gate, ctx, "training.linear_quantization",
        "quantize_attention, quantize_ffn and quantize_gate are all false (for dense linears set quant_config none)");
  return x;
}

Json to_json(const LinearQuantizationConfig& q) {
  return {{"act_amax_json", q.act_amax_json},
          {"calibration_batches", q.calibration_batches},
          {"quantize_attention", q.quantize_attention},
          {"quantize_ffn", q.quantize_ffn},
          {"quantize_gate", q.quantize_gate},
          {"skip_blocks", q.skip_blocks.empty() ? Json::array() : Json(q.skip_blocks)},
          {"shared_qkv_scale", q.shared_qkv_scale},
          {"gemm", q.gemm}};
}

}  // namespace vqad::train::sections
