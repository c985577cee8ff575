// Run configuration: FastVideo's YAML schema (models / method / training /
// callbacks / pipeline), `--a.b.c value` overrides with FastVideo's casting
// rules, and strict validation against one descriptor per key (config/schema.h).
//
// Compatibility: a FastVideo recipe loads unchanged; its `_target_` class
// paths are mapped to vqad methods and models through config/targets.h.
// Typed training values keep FastVideo's `int(x or default)` reading, so an
// explicit 0 / "" / false / null in a training section means "the default"
// (e.g. `sp_size: 0` -> num_gpus), exactly as FastVideo parses it.
// Deliberate differences: FastVideo ignores unknown keys and warns about
// unknown constructor arguments; vqad rejects them (a typo must not cost a
// GPU day), and it refuses keys it parses but does not implement yet (LoRA,
// trackers other than jsonl, ...) instead of silently running without them.
// A callback set to null (`--callbacks.validation none`) is removed; a validation
// callback with every_steps 0 is off. Errors name the key path, the value found
// and the valid choices.
//
// Layout of the module: value.h (scalars), yaml.h (YAML <-> JSON), overrides.h,
// schema.h (key descriptors + the typed section reader), targets.h (`_target_`
// tables and enums), sections.h (per-section schemas and readers, internal),
// resolved.cpp (the resolved dump), run_config.cpp (entry points, cross-section rules).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vqad/config/overrides.h"
#include "vqad/config/schema.h"
#include "vqad/config/targets.h"
#include "vqad/config/value.h"
#include "vqad/config/yaml.h"
#include "vqad/core/attention_backend.h"

namespace vqad::train {

using config::Json;
using config::apply_override;
using config::cast_override_value;
using config::dump_yaml;
using config::parse_overrides;
using config::yaml_to_json;

// ---------------------------------------------------------------------------
// models.<role>
// ---------------------------------------------------------------------------
// LoRA is not supported yet: loading refuses a `lora` mapping that asks for adapters, so
// this stays at its defaults (vqad fine-tunes every weight of the role).
struct LoraConfig {
  bool enable = false;
  int64_t rank = 0;
  double alpha = 0.0;
  std::vector<std::string> target_modules;
};

struct RoleConfig {
  std::string name;    // student / teacher / critic
  std::string target;  // `_target_` as written
  std::string model_kind;  // "wan"
  std::string init_from;   // model id or local Diffusers directory (required)
  bool trainable = true;
  bool disable_custom_init_weights = false;
  double flow_shift = 3.0;
  // Resolved: the role's own value, else training.model's; "" = off.
  std::string enable_gradient_checkpointing_type;
  std::string transformer_override_safetensor;  // "" = none
  // FastVideo's selector picks the fastest dense backend when none is named.
  AttentionBackend attention_backend = AttentionBackend::kFlashAttn;
  // Resolved linear quant config: the role's `quant_config`, else (student
  // only) pipeline.dit_config.quant_config; "none" = dense. Teacher and critic
  // never inherit it (spec/linear_qat.md).
  std::string quant_config = "none";
  LoraConfig lora;
};

// ---------------------------------------------------------------------------
// method
// ---------------------------------------------------------------------------
struct CfgUncondConfig {
  std::string on_missing = "error";  // error | ignore
  std::string text = "keep";         // keep | zero | negative_prompt (drop is rejected for Wan)
};

struct ShiftedOdeSchedule {
  bool present = false;
  double flow_shift = 0.0;
  int64_t teacher_steps = 0, student_steps = 0, version = 1;
  std::vector<int64_t> indices;
  std::vector<double> sigmas, timesteps;
};

struct SftConfig {
  std::string attn_kind;  // informational in FastVideo (derived from the backend)
};

struct Dmd2Config {
  RolloutMode rollout_mode = RolloutMode::kDataLatent;
  std::vector<double> dmd_denoising_steps;  // timesteps in (0, 1000], floats allowed
  int64_t generator_update_interval = 1;    // <= 0 in the YAML means every step (-> 1)
  double min_timestep_ratio = 0.0, max_timestep_ratio = 1.0;
  double real_score_guidance_scale = 1.0;
  bool warp_denoising_step = false;
  double fake_score_learning_rate = 0.0;
  std::array<double, 2> fake_score_betas{0.9, 0.999};
  LrSchedule fake_score_lr_scheduler = LrSchedule::kConstant;
  std::optional<CfgUncondConfig> cfg_uncond;
  ShiftedOdeSchedule shifted_ode_schedule;
  // vqad extension (vqad has no text encoder): the negative prompt's text embedding for
  // the teacher's unconditional branch, a .safetensors file with one [L, D] or [1, L, D]
  // tensor, or a text_only/t2v parquet dataset whose first row holds it. Needed unless
  // cfg_uncond.text is keep or zero.
  std::string negative_prompt_embedding;
};

struct LayerReconConfig {
  int64_t group_size = 5;
  double energy_floor = 1e-6;
  std::string input_source = "ode_start";      // ode_start
  std::string propagation = "teacher";         // teacher
  std::string loss = "mse";                    // mse
  std::string trainable_scope = "quantized_path";
  bool checkpoint_blocks = true;
  std::vector<std::string> trainable_modules{"to_q",   "to_k",   "to_v",  "to_out",
                                             "norm_q", "norm_k", "attn2", "ffn"};
};

struct ReconOdeConfig {
  double attention_weight = 0.25, mlp_weight = 0.25, ode_weight = 0.5;
  int64_t student_steps = 3;
  std::string loss = "mse";
  std::string trainable_scope = "quantized_path";
  bool checkpoint_blocks = true;
  std::vector<std::string> trainable_modules{"to_q",   "to_k",   "to_v",  "to_out", "norm_q",
                                             "norm_k", "attn2",  "ffn",   "to_gate_compress"};
};

struct MethodConfig {
  std::string target;  // as written
  MethodKind kind = MethodKind::kSft;
  SftConfig sft;               // valid when kind == kSft
  Dmd2Config dmd2;             // valid when kind == kDmd2
  LayerReconConfig layer_recon;
  ReconOdeConfig recon_ode;
  std::vector<std::string> roles() const;  // roles the method needs, in build order
};

// ---------------------------------------------------------------------------
// training (FastVideo's TrainingConfig, research §3.3)
// ---------------------------------------------------------------------------
struct DistributedConfig {
  int64_t num_gpus = 1;
  int64_t tp_size = 1;
  int64_t sp_size = 1;             // default: num_gpus
  int64_t hsdp_replicate_dim = 1;
  int64_t hsdp_shard_dim = 1;      // default: num_gpus
  bool pin_cpu_memory = false;
  bool reshard_after_forward = true;
  int64_t fsdp_modules_per_group = 1;
  bool shard_frozen_roles = true;  // false: frozen roles (teacher) keep full weights on every rank
  // true: with sharding and gradient accumulation, each rank keeps its full unreduced
  // gradients across the micro-steps and reduces once per optimizer step
  bool accumulate_unreduced_gradients = false;
  // bf16: the parameters the BF16 compute reads only rounded (linear weights and biases) are
  // all-gathered as BF16, the rest as fp32 (exact either way); fp32: everything as fp32
  std::string gather_dtype = "bf16";
  std::string reduce_dtype = "fp32";  // fp32 | bf16
  bool fsdp_symmetric_memory = false;  // accepted for FastVideo recipes; a GPU-memory knob
  int64_t dp_size() const { return num_gpus / sp_size; }
};

struct DataSource {
  std::string path;
  int64_t repeat = 1;
};

struct DataConfig {
  std::vector<DataSource> data_path;  // from a string ("a:2,b"), a list or a map path->repeat
  std::string preprocessed_data_type = "t2v";  // t2v | text_only
  int64_t train_batch_size = 1;
  int64_t dataloader_num_workers = 0;
  double training_cfg_rate = 0.0;
  int64_t seed = 0;
  int64_t num_height = 0, num_width = 0, num_latent_t = 0, num_frames = 0;
  // vqad: when data_path is an ODE-trajectory cache, the teacher step indices of the
  // anchors to train on (e.g. [0, 16, 32]); empty = every cached anchor.
  std::vector<int64_t> ode_anchor_indices;
};

struct OptimizerConfig {
  double learning_rate = 0.0;
  std::array<double, 2> betas{0.9, 0.999};
  double weight_decay = 0.0;
  double eps = 1e-8;  // AdamW epsilon (FastVideo uses torch's default)
  LrSchedule lr_scheduler = LrSchedule::kConstant;
  int64_t lr_warmup_steps = 0;
  int64_t lr_num_cycles = 0;
  double lr_power = 0.0;
  double min_lr_ratio = 0.5;
  std::optional<bool> fused;  // fused AdamW kernel (speed only; same math)
};

struct LoopConfig {
  int64_t max_train_steps = 0;
  int64_t gradient_accumulation_steps = 1;
};

struct CheckpointConfig {
  std::string output_dir;
  std::string resume_from_checkpoint;  // "" | "latest" | path
  int64_t training_state_checkpointing_steps = 0;  // 0 = never
  int64_t checkpoints_total_limit = 0;             // 0 = keep all
};

struct TrackerConfig {
  std::vector<std::string> trackers;
  std::string entity;
  std::string project_name = "fastvideo";
  std::string run_name;
};

struct VsaConfig {
  double sparsity = 0.0;
  bool cache_tile_buf = false;
  // Optional linear ramp to `sparsity`: +decay_rate every decay_interval_steps
  // (0 = constant at `sparsity`).
  double decay_rate = 0.0;
  int64_t decay_interval_steps = 0;
  std::string selection = "top-k";  // top-k | top-p
  double top_p = 1.0;
};

struct ModelTrainingConfig {
  std::string weighting_scheme = "uniform";  // uniform | logit_normal | mode
  double logit_mean = 0.0, logit_std = 1.0, mode_scale = 1.0;
  bool precondition_outputs = false;
  std::string enable_gradient_checkpointing_type;  // "" | full | ops | block_skip
};

struct TrainingConfig {
  DistributedConfig distributed;
  DataConfig data;
  OptimizerConfig optimizer;
  LoopConfig loop;
  CheckpointConfig checkpoint;
  TrackerConfig tracker;
  VsaConfig vsa;
  ModelTrainingConfig model;
  std::string dit_precision = "fp32";  // fp32 | bf16 (master weights)
  std::string model_path;              // default: models.student.init_from
};

// ---------------------------------------------------------------------------
// callbacks and pipeline
// ---------------------------------------------------------------------------
struct GradClipConfig {
  bool enabled = false;
  double max_grad_norm = 1.0;
  bool log_grad_norms = true;
};

struct EmaConfig {
  bool enabled = false;
  double decay = 0.9999;
  int64_t start_iter = 0;
};

struct ValidationConfig {
  bool enabled = false;
  std::string target;
  std::string pipeline_target;
  std::string dataset_file;
  std::string output_dir;  // "" = training.checkpoint.output_dir
  int64_t every_steps = 0;
  std::vector<int64_t> sampling_steps;
  std::vector<double> sampling_timesteps;
  double guidance_scale = 5.0;
  bool run_at_start = true;
  int64_t height = 0, width = 0, num_frames = 0;  // 0 = from training.data
  bool offload_training_state = false;
  bool unload_pipeline_after_validation = false;
  bool attn_qat_infer = false;
  bool use_validation_media_conditioning = false;
  // vqad: Wan VAE for decoding the samples to MP4 + a contact sheet. "" = the student's
  // Diffusers root when it has vae/, else none; "none" = never decode.
  std::string vae;
  int64_t fps = 16;  // of the MP4s
};

struct CallbacksConfig {
  GradClipConfig grad_clip;
  EmaConfig ema;
  ValidationConfig validation;
  std::vector<std::string> order;  // callback names in YAML order (dispatch order)
};

struct PipelineConfig {
  std::optional<double> flow_shift;
  std::string quant_config = "none";  // pipeline.dit_config.quant_config
  std::vector<double> dmd_denoising_steps;
  bool warp_denoising_step = false;
  std::string negative_prompt;
};

// ---------------------------------------------------------------------------
// The whole run
// ---------------------------------------------------------------------------
struct RunConfig {
  std::map<std::string, RoleConfig> models;
  MethodConfig method;
  TrainingConfig training;
  CallbacksConfig callbacks;
  PipelineConfig pipeline;

  std::string source_path;               // "" when parsed from a string
  std::string source_sha256;             // of the file bytes (or the string)
  std::vector<std::string> overrides;    // as given on the command line
  Json raw;                              // the YAML after overrides, before typing
  Json resolved;                         // every value, defaults filled in
  std::string resolved_yaml;             // dump_yaml(resolved)
  std::string resolved_sha256;           // of resolved_yaml

  const RoleConfig& role(const std::string& name) const;
};

// Loads, applies overrides (tokens `--a.b v` / `--a.b=v`), validates.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});
RunConfig parse_run_config(const std::string& yaml_text,
                           const std::vector<std::string>& overrides = {},
                           const std::string& source_name = "");


// Every section schema of the run config, in document order (for `vqad config --keys`
// and the docs): one descriptor per key with its type, default, help and status.
std::vector<const config::SectionSchema*> run_config_schemas();

}  // namespace vqad::train
