#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "vqad/core/error.h"
#include "vqad/core/sha256.h"
#include "vqad/train/config.h"

namespace fs = std::filesystem;
using namespace vqad::train;

namespace {

const std::string kRecipe =
    std::string(VQAD_SOURCE_DIR) + "/configs/qad_wan2_1_mixkit/stage1_attn_qat_sft.yaml";

// A minimal valid SFT config; tests append or override pieces.
const char* kSft = R"(
models:
  student:
    _target_: fastvideo.train.models.wan.WanModel
    init_from: /models/wan
method:
  _target_: fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod
training:
  optimizer:
    learning_rate: 1.0e-5
)";

const char* kDmd = R"(
models:
  student:
    _target_: fastvideo.train.models.wan.WanModel
    init_from: base
    transformer_override_safetensor: stage1/transformer/model.safetensors
    attention_backend: ATTN_QAT_TRAIN
  teacher:
    _target_: fastvideo.train.models.wan.WanModel
    init_from: base
    trainable: false
    disable_custom_init_weights: true
    attention_backend: FLASH_ATTN
  critic:
    _target_: fastvideo.train.models.wan.WanModel
    init_from: base
    trainable: true
    disable_custom_init_weights: true
    attention_backend: FLASH_ATTN
method:
  _target_: fastvideo.train.methods.distribution_matching.dmd2.DMD2Method
  rollout_mode: data_latent
  generator_update_interval: 5
  dmd_denoising_steps: [1000, 941.18, 800]
  min_timestep_ratio: 0.02
  max_timestep_ratio: 0.98
  real_score_guidance_scale: 3.0
  fake_score_learning_rate: 2.0e-6
  fake_score_betas: [0.9, 0.999]
  fake_score_lr_scheduler: constant
training:
  distributed: {num_gpus: 4, sp_size: 1, tp_size: 1, hsdp_replicate_dim: 4, hsdp_shard_dim: 1}
  optimizer: {learning_rate: 2.0e-6, weight_decay: 0.01}
pipeline:
  flow_shift: 3
  dit_config:
    quant_config: nvfp4_qat_train
)";

// Expects parsing to fail with a message containing every needle.
void expect_error(const std::string& yaml, const std::vector<std::string>& overrides,
                  const std::vector<std::string>& needles) {
  try {
    parse_run_config(yaml, overrides, "test.yaml");
    FAIL() << "expected a config error containing '" << needles.at(0) << "'";
  } catch (const vqad::Error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
TEST(Sha256, KnownVectors) {
  EXPECT_EQ(vqad::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(vqad::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(vqad::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  vqad::Sha256 h;  // one million 'a' fed in odd-sized pieces (buffer boundaries)
  std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    size_t n = std::min(left, chunk.size());
    h.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55 / 56 / 64 bytes: the padding edge cases.
  EXPECT_EQ(vqad::sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(vqad::sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(vqad::sha256_hex(std::string(64, 'a')),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST(Sha256, FileMatchesString) {
  fs::path p = fs::temp_directory_path() / ("vqad_sha_" + std::to_string(::getpid()));
  std::string data(3 * 1024 * 1024 + 17, 'x');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 % 251);
  std::ofstream(p, std::ios::binary) << data;
  EXPECT_EQ(vqad::sha256_file(p.string()), vqad::sha256_hex(data));
  fs::remove(p);
  EXPECT_THROW(vqad::sha256_file("/nonexistent/vqad/file"), vqad::Error);
}

// ---------------------------------------------------------------------------
TEST(Config, Stage1RecipeLoadsWithFastVideoTargets) {
  RunConfig c = load_run_config(kRecipe);
  EXPECT_EQ(c.method.kind, MethodKind::kSft);
  const RoleConfig& s = c.role("student");
  EXPECT_EQ(s.model_kind, "wan");
  EXPECT_EQ(s.attention_backend, vqad::AttentionBackend::kAttnQatTrain);
  EXPECT_TRUE(s.trainable);
  EXPECT_DOUBLE_EQ(s.flow_shift, 3.0);  // not set in the recipe -> FastVideo default
  EXPECT_EQ(s.enable_gradient_checkpointing_type, "full");  // from training.model
  EXPECT_EQ(s.quant_config, "none");
  const auto& t = c.training;
  EXPECT_EQ(t.distributed.num_gpus, 4);
  EXPECT_EQ(t.distributed.sp_size, 4);
  EXPECT_EQ(t.distributed.hsdp_shard_dim, 4);
  EXPECT_EQ(t.distributed.dp_size(), 1);
  ASSERT_EQ(t.data.data_path.size(), 1u);
  EXPECT_EQ(t.data.data_path[0].path, "data/HD-Mixkit-Finetune-Wan/combined_parquet_dataset");
  EXPECT_DOUBLE_EQ(t.data.training_cfg_rate, 0.1);
  EXPECT_EQ(t.data.seed, 1000);
  EXPECT_EQ(t.data.num_latent_t, 20);
  EXPECT_DOUBLE_EQ(t.optimizer.learning_rate, 1e-6);
  EXPECT_DOUBLE_EQ(t.optimizer.weight_decay, 0.01);
  EXPECT_EQ(t.optimizer.lr_scheduler, LrSchedule::kConstant);
  EXPECT_EQ(t.loop.max_train_steps, 4000);
  EXPECT_EQ(t.checkpoint.training_state_checkpointing_steps, 500);
  EXPECT_EQ(t.model_path, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers");
  EXPECT_TRUE(c.callbacks.grad_clip.enabled);
  EXPECT_DOUBLE_EQ(c.callbacks.grad_clip.max_grad_norm, 1.0);
  EXPECT_TRUE(c.callbacks.validation.enabled);
  EXPECT_EQ(c.callbacks.validation.every_steps, 50);
  EXPECT_EQ(c.callbacks.validation.sampling_steps, (std::vector<int64_t>{50}));
  EXPECT_EQ(c.callbacks.order, (std::vector<std::string>{"grad_clip", "validation"}));
  ASSERT_TRUE(c.pipeline.flow_shift.has_value());
  EXPECT_DOUBLE_EQ(*c.pipeline.flow_shift, 1.0);
  EXPECT_EQ(c.source_sha256, vqad::sha256_file(kRecipe));
  EXPECT_EQ(c.resolved_sha256, vqad::sha256_hex(c.resolved_yaml));
}

TEST(Config, ResolvedDumpRoundTrips) {
  for (const std::string& yaml : {std::string(kSft), std::string(kDmd)}) {
    RunConfig a = parse_run_config(yaml);
    RunConfig b = parse_run_config(a.resolved_yaml);
    EXPECT_EQ(a.resolved_yaml, b.resolved_yaml);
    EXPECT_EQ(a.resolved_sha256, b.resolved_sha256);
    EXPECT_NE(a.source_sha256, b.source_sha256);
  }
  RunConfig r = load_run_config(kRecipe);
  EXPECT_EQ(parse_run_config(r.resolved_yaml).resolved_yaml, r.resolved_yaml);
  // Values that must stay floats / strings through the dump.
  EXPECT_NE(r.resolved_yaml.find("learning_rate: 1.0e-06"), std::string::npos) << r.resolved_yaml;
}

TEST(Config, DefaultsFollowFastVideoParser) {
  RunConfig c = parse_run_config(std::string(kSft) + R"(
  distributed:
    num_gpus: 8
    sp_size: 0
  data:
    train_batch_size: 0
)", {"--training.optimizer.min_lr_ratio", "0.0"});
  // `x or default`: explicit zeros fall back to the parser defaults.
  EXPECT_EQ(c.training.distributed.sp_size, 8);
  EXPECT_EQ(c.training.distributed.hsdp_shard_dim, 8);
  EXPECT_EQ(c.training.data.train_batch_size, 1);
  EXPECT_DOUBLE_EQ(c.training.optimizer.min_lr_ratio, 0.5);
  EXPECT_EQ(c.training.tracker.project_name, "fastvideo");
  EXPECT_EQ(c.role("student").attention_backend, vqad::AttentionBackend::kFlashAttn);
  EXPECT_EQ(c.training.optimizer.betas, (std::array<double, 2>{0.9, 0.999}));
}

TEST(Config, Dmd2MethodKeysAndQuantInheritance) {
  RunConfig c = parse_run_config(kDmd);
  EXPECT_EQ(c.method.kind, MethodKind::kDmd2);
  const auto& d = c.method.dmd2;
  EXPECT_EQ(d.rollout_mode, RolloutMode::kDataLatent);
  EXPECT_EQ(d.dmd_denoising_steps, (std::vector<double>{1000, 941.18, 800}));
  EXPECT_EQ(d.generator_update_interval, 5);
  EXPECT_DOUBLE_EQ(d.min_timestep_ratio, 0.02);
  EXPECT_DOUBLE_EQ(d.fake_score_learning_rate, 2e-6);
  EXPECT_EQ(c.role("student").quant_config, "nvfp4_qat_train");
  EXPECT_EQ(c.role("teacher").quant_config, "none");  // never inherited by frozen roles
  EXPECT_EQ(c.role("critic").quant_config, "none");
  EXPECT_FALSE(c.role("teacher").trainable);
  EXPECT_EQ(c.method.roles(), (std::vector<std::string>{"student", "teacher", "critic"}));
  // Aliases; FastVideo coerces generator_update_interval <= 0 to 1, vqad refuses it.
  RunConfig e = parse_run_config(kDmd, {"--method.rollout_mode", "sim"});
  EXPECT_EQ(e.method.dmd2.rollout_mode, RolloutMode::kSimulate);
  try {
    parse_run_config(kDmd, {"--method.generator_update_interval", "0"});
    FAIL() << "expected an error";
  } catch (const vqad::Error& err) {
    EXPECT_NE(std::string(err.what()).find("method.generator_update_interval"), std::string::npos) << err.what();
  }
}

TEST(Config, MethodTargetTable) {
  EXPECT_EQ(method_from_target("fastvideo.train.methods.distribution_matching.dmd2.DMD2Method"), MethodKind::kDmd2);
  EXPECT_EQ(method_from_target("fastvideo.train.methods.fine_tuning.finetune.FineTuneMethod"), MethodKind::kSft);
  EXPECT_EQ(method_from_target("fastvideo.train.methods.layer_reconstruction.method.LayerReconstructionMethod"),
            MethodKind::kLayerRecon);
  EXPECT_EQ(method_from_target("fastvideo.train.methods.reconstruction_ode.method.ReconstructionODEMethod"),
            MethodKind::kReconOde);
  EXPECT_EQ(method_from_target("recon_ode"), MethodKind::kReconOde);
  EXPECT_FALSE(method_from_target("fastvideo.train.methods.knowledge_distillation.kd.KDMethod").has_value());
}

TEST(Config, LayerReconAndReconOdeMethods) {
  std::string base = R"(
models:
  student: {_target_: fastvideo.train.methods.layer_reconstruction.model.LayerReconstructionWanModel, init_from: base, attention_backend: ATTN_QAT_TRAIN}
  teacher: {_target_: fastvideo.train.models.wan.WanModel, init_from: base, trainable: false, attention_backend: TORCH_SDPA}
training:
  optimizer: {learning_rate: 1.0e-5}
)";
  RunConfig l = parse_run_config(base + R"(
method:
  _target_: fastvideo.train.methods.layer_reconstruction.method.LayerReconstructionMethod
  group_size: 5
  energy_floor: 1.0e-6
  input_source: ode_start
  propagation: teacher
  checkpoint_blocks: true
)");
  EXPECT_EQ(l.method.kind, MethodKind::kLayerRecon);
  EXPECT_EQ(l.method.layer_recon.group_size, 5);
  EXPECT_EQ(l.method.layer_recon.trainable_modules.size(), 8u);
  const std::string ode_method = R"(
method:
  _target_: fastvideo.train.methods.reconstruction_ode.method.ReconstructionODEMethod
  attention_weight: 0.25
  mlp_weight: 0.25
  ode_weight: 0.5
  student_steps: 3
)";
  // recon_ode trains the VSA compression gates: a dense student is refused, naming the key.
  expect_error(base + ode_method, {}, {"models.student.attention_backend", "to_gate_compress"});
  RunConfig r = parse_run_config(base + ode_method, {"--models.student.attention_backend", "VSA_QAT_TRAIN_C128"});
  EXPECT_EQ(r.method.kind, MethodKind::kReconOde);
  EXPECT_DOUBLE_EQ(r.method.recon_ode.ode_weight, 0.5);
  EXPECT_EQ(r.method.recon_ode.trainable_modules.back(), "to_gate_compress");
  expect_error(base + "method: {_target_: layer_recon, group_size: 0}\n", {}, {"method.group_size"});
}

// ---------------------------------------------------------------------------
TEST(ConfigOverrides, CastingRules) {
  EXPECT_EQ(cast_override_value("true"), Json(true));
  EXPECT_EQ(cast_override_value("FALSE"), Json(false));
  EXPECT_TRUE(cast_override_value("None").is_null());
  EXPECT_TRUE(cast_override_value("null").is_null());
  EXPECT_EQ(cast_override_value("42"), Json(42));
  EXPECT_EQ(cast_override_value("-7"), Json(-7));
  EXPECT_EQ(cast_override_value("1_000"), Json(1000));  // Python int() accepts underscores
  EXPECT_TRUE(cast_override_value("1e-5").is_number_float());
  EXPECT_DOUBLE_EQ(cast_override_value("1e-5").get<double>(), 1e-5);
  EXPECT_DOUBLE_EQ(cast_override_value("2.5").get<double>(), 2.5);
  EXPECT_TRUE(std::isinf(cast_override_value("inf").get<double>()));
  EXPECT_EQ(cast_override_value("[1, 2.5, x]"), Json::parse(R"([1, 2.5, "x"])"));
  EXPECT_EQ(cast_override_value("ATTN_QAT_TRAIN"), Json("ATTN_QAT_TRAIN"));
  EXPECT_EQ(cast_override_value("0x10"), Json("0x10"));  // int("0x10") fails in Python
}

TEST(ConfigOverrides, AppliedBeforeValidation) {
  RunConfig c = parse_run_config(kSft, {"--training.loop.max_train_steps", "12",
                                        "--training.optimizer.learning_rate=3e-4",
                                        "--models.student.attention_backend", "ATTN_QAT_TRAIN",
                                        "--training.optimizer.betas", "[0.8, 0.95]",
                                        "--training.data.data_path", "a:2,b",
                                        "--training.tracker.trackers", "[none]"});
  EXPECT_EQ(c.training.loop.max_train_steps, 12);
  EXPECT_DOUBLE_EQ(c.training.optimizer.learning_rate, 3e-4);
  EXPECT_EQ(c.role("student").attention_backend, vqad::AttentionBackend::kAttnQatTrain);
  EXPECT_EQ(c.training.optimizer.betas, (std::array<double, 2>{0.8, 0.95}));
  ASSERT_EQ(c.training.data.data_path.size(), 2u);
  EXPECT_EQ(c.training.data.data_path[0].path, "a");
  EXPECT_EQ(c.training.data.data_path[0].repeat, 2);
  EXPECT_EQ(c.training.data.data_path[1].repeat, 1);
  // The raw tree records the overridden values (for checkpoint metadata).
  EXPECT_EQ(c.raw["training"]["loop"]["max_train_steps"], Json(12));
  EXPECT_EQ(c.overrides.size(), 11u);  // tokens as given (one used --key=value)
  // An override replaces a non-mapping intermediate and creates missing maps.
  Json root = Json::parse(R"({"a": 5})");
  apply_override(root, "a.b.c", Json(1));
  EXPECT_EQ(root, Json::parse(R"({"a": {"b": {"c": 1}}})"));
  // A typo in an override is caught like a typo in the file.
  expect_error(kSft, {"--training.optimizer.learnig_rate", "1e-4"},
               {"training.optimizer.learnig_rate", "learning_rate"});
}

TEST(ConfigOverrides, MalformedTokens) {
  EXPECT_THROW(parse_overrides({"training.loop.max_train_steps", "3"}), vqad::Error);
  EXPECT_THROW(parse_overrides({"--training.loop.max_train_steps"}), vqad::Error);
  EXPECT_THROW(parse_overrides({"--a..b", "1"}), vqad::Error);
  auto o = parse_overrides({"--a.b=x=y"});
  ASSERT_EQ(o.size(), 1u);
  EXPECT_EQ(o[0].second, Json("x=y"));
}

// ---------------------------------------------------------------------------
// Error classes: each names the key path, the value found and the choices.
TEST(ConfigErrors, MisspelledAttentionBackend) {
  std::string yaml = std::string(kSft);
  yaml.replace(yaml.find("    init_from: /models/wan\n"), 0, "    attention_backend: ATTN_QAT_TRIAN\n");
  expect_error(yaml, {}, {"models.student.attention_backend", "ATTN_QAT_TRIAN", "ATTN_QAT_TRAIN", "TORCH_SDPA",
                          "FLASH_ATTN", "VSA_QAT_TRAIN_C128"});
}

TEST(ConfigErrors, UnknownKeyInTypedSection) {
  expect_error(std::string(kSft) + "  loop:\n    max_train_stepz: 10\n", {},
               {"training.loop.max_train_stepz", "10", "max_train_steps", "gradient_accumulation_steps"});
  expect_error(std::string(kSft) + "extra_section: 1\n", {}, {"extra_section", "models, method, training"});
  expect_error(kSft, {"--models.student.flowshift", "3"}, {"models.student.flowshift", "flow_shift"});
  expect_error(kSft, {"--method.bogus", "1"}, {"method.bogus"});
}

TEST(ConfigErrors, WrongType) {
  expect_error(kSft, {"--training.loop.max_train_steps", "many"},
               {"training.loop.max_train_steps", "'many'", "integer"});
  expect_error(kSft, {"--models.student.trainable", "1"}, {"models.student.trainable", "true or false"});
  expect_error(kSft, {"--training.loop.max_train_steps", "2.5"}, {"training.loop.max_train_steps", "2.5"});
  expect_error(std::string(kSft) + "  data: 5\n", {}, {"training.data", "expected a mapping"});
  expect_error(kSft, {"--training.optimizer.betas", "[0.9]"}, {"training.optimizer.betas"});
}

TEST(ConfigErrors, UnknownEnums) {
  expect_error(kSft, {"--training.optimizer.lr_scheduler", "cosin"},
               {"training.optimizer.lr_scheduler", "cosin", "cosine", "constant_with_warmup"});
  expect_error(kSft, {"--method._target_", "fastvideo.train.methods.foo.FooMethod"},
               {"method._target_", "FooMethod", "DMD2Method", "dmd2", "sft"});
  expect_error(kDmd, {"--method.rollout_mode", "teleport"},
               {"method.rollout_mode", "teleport", "simulate", "data_latent"});
  expect_error(kDmd, {"--method.fake_score_lr_scheduler", "warmup"},
               {"method.fake_score_lr_scheduler", "warmup", "constant"});
  expect_error(kSft, {"--models.student._target_", "my.Model"}, {"models.student._target_", "WanModel"});
  expect_error(kSft, {"--training.data.preprocessed_data_type", "i2v"},
               {"training.data.preprocessed_data_type", "i2v", "t2v, text_only"});
  expect_error(kDmd, {"--pipeline.dit_config.quant_config", "int4"},
               {"pipeline.dit_config.quant_config", "int4", "nvfp4_qat_train"});
  expect_error(kSft, {"--callbacks.logger.every", "3"}, {"callbacks.logger", "grad_clip, validation, ema"});
}

TEST(ConfigErrors, InconsistentDistributedDims) {
  expect_error(kSft, {"--training.distributed.num_gpus", "4", "--training.distributed.hsdp_replicate_dim", "2",
                      "--training.distributed.hsdp_shard_dim", "4"},
               {"training.distributed", "hsdp_replicate_dim (2)", "hsdp_shard_dim (4)", "num_gpus (4)"});
  expect_error(kSft, {"--training.distributed.num_gpus", "4", "--training.distributed.sp_size", "3"},
               {"training.distributed.sp_size", "3"});
  expect_error(kSft, {"--training.distributed.tp_size", "2"}, {"training.distributed.tp_size"});
}

TEST(ConfigErrors, MethodRoleRules) {
  expect_error(kDmd, {"--models.teacher.trainable", "true"}, {"models.teacher.trainable", "frozen"});
  expect_error(kDmd, {"--training.data.preprocessed_data_type", "text_only"},
               {"method.rollout_mode", "simulate"});
  expect_error(kDmd, {"--method.min_timestep_ratio", "0.99"}, {"method.min_timestep_ratio"});
  expect_error(kDmd, {"--method.dmd_denoising_steps", "[]"}, {"method.dmd_denoising_steps"});
  expect_error(kDmd, {"--method.dmd_denoising_steps", "[1000, 1500]"}, {"method.dmd_denoising_steps", "1500"});
  std::string no_critic = kDmd;
  no_critic.erase(no_critic.find("  critic:"), no_critic.find("method:") - no_critic.find("  critic:"));
  expect_error(no_critic, {}, {"models.critic", "dmd2"});
  expect_error(std::string(kSft), {"--models.teacher._target_", "wan", "--models.teacher.init_from", "x"},
               {"models.teacher", "unused role"});
  expect_error(kSft, {"--training.optimizer.learning_rate", "0"}, {"training.optimizer.learning_rate"});
  expect_error(kSft, {"--training.checkpoint.training_state_checkpointing_steps", "10"},
               {"training.checkpoint.output_dir"});
}

TEST(ConfigErrors, StructuralProblems) {
  expect_error("", {}, {"empty"});
  expect_error("models: [1, 2]\n", {}, {"models"});
  expect_error("models:\n  student: {init_from: x}\nmethod: {_target_: sft}\ntraining: {}\n", {},
               {"models.student._target_"});
  expect_error(std::string(kSft) + "training:\n  loop: {}\n", {}, {"duplicate key 'training'"});
  expect_error("models: {student: [\n", {}, {"invalid YAML"});
  try {
    load_run_config("/nonexistent/vqad/run.yaml");
    FAIL();
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/vqad/run.yaml"), std::string::npos);
  }
}

TEST(ConfigYaml, ScalarResolutionAndQuoting) {
  Json j = yaml_to_json("a: 'true'\nb: yes\nc: ~\nd: 1.5\ne: \"3\"\nf: 1_000\ng: abc\n", "t");
  EXPECT_EQ(j["a"], Json("true"));
  EXPECT_EQ(j["b"], Json(true));
  EXPECT_TRUE(j["c"].is_null());
  EXPECT_EQ(j["d"], Json(1.5));
  EXPECT_EQ(j["e"], Json("3"));
  EXPECT_EQ(j["f"], Json(1000));
  EXPECT_EQ(j["g"], Json("abc"));
  // Dumping keeps the types: strings that look like other types get quoted.
  EXPECT_EQ(yaml_to_json(dump_yaml(j), "dump"), j);
}

// The CLI subcommand: prints both hashes and the resolved config.
TEST(ConfigCli, ValidatesAndDumps) {
  std::string out_path = (fs::temp_directory_path() / ("vqad_cfg_cli_" + std::to_string(::getpid()))).string();
  std::string cmd = std::string(VQAD_BINARY) + " config " + kRecipe +
                    " --training.loop.max_train_steps 7 --dump > " + out_path + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(out_path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("max_train_steps: 7"), std::string::npos) << text;
  EXPECT_NE(text.find("# source_sha256: " + vqad::sha256_file(kRecipe)), std::string::npos) << text;
  EXPECT_NE(text.find("attention_backend: ATTN_QAT_TRAIN"), std::string::npos);

  std::string bad = std::string(VQAD_BINARY) + " config " + kRecipe +
                    " --models.student.attention_backend ATTN_QAT_TRIAN > " + out_path + " 2>&1";
  int rc = std::system(bad.c_str());
  EXPECT_NE(rc, 0);
  std::ifstream in2(out_path);
  std::string err((std::istreambuf_iterator<char>(in2)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("models.student.attention_backend"), std::string::npos) << err;
  EXPECT_NE(err.find("ATTN_QAT_TRAIN"), std::string::npos) << err;
  fs::remove(out_path);
}

// ---------------------------------------------------------------------------
// Keys vqad parses but does not implement are refused at load, naming the key;
// the values that ask for nothing are accepted.
TEST(ConfigUnsupported, LoraIsRefusedNamingTheKey) {
  expect_error(kSft, {"--models.student.lora.enable", "true", "--models.student.lora.rank", "16"},
               {"models.student.lora", "is not supported yet", "LoRA"});
  expect_error(kSft, {"--models.student.lora.rank", "8"}, {"models.student.lora", "is not supported yet"});
  RunConfig off = parse_run_config(kSft, {"--models.student.lora.enable", "false"});
  EXPECT_FALSE(off.role("student").lora.enable);
  EXPECT_EQ(off.resolved_yaml.find("lora"), std::string::npos);
  EXPECT_EQ(parse_run_config(off.resolved_yaml).resolved_yaml, off.resolved_yaml);
}

TEST(ConfigUnsupported, OtherUnimplementedKeysAreRefused) {
  expect_error(kSft, {"--training.optimizer.fused", "true"}, {"training.optimizer.fused", "is not supported yet"});
  expect_error(kSft, {"--training.tracker.trackers", "[jsonl, wandb]"},
               {"training.tracker.trackers[1]", "wandb", "is not supported yet"});
  expect_error(kSft, {"--callbacks.validation.attn_qat_infer", "true"},
               {"callbacks.validation.attn_qat_infer", "is not supported yet"});
  expect_error(kSft, {"--training.data.dataloader_num_workers", "4"},
               {"training.data.dataloader_num_workers", "is not supported yet", "found 4"});
  expect_error(kSft, {"--callbacks.ema.decay", "0.999"}, {"callbacks.ema", "is not supported yet"});
  expect_error(kSft, {"--training.model.enable_gradient_checkpointing_type", "ops"},
               {"training.model.enable_gradient_checkpointing_type", "'ops' is not supported yet"});
  // What asks for nothing (or what vqad does anyway) loads.
  RunConfig c = parse_run_config(kSft, {"--training.optimizer.fused", "false", "--training.tracker.trackers",
                                        "[none, jsonl]", "--training.data.dataloader_num_workers", "1"});
  EXPECT_EQ(c.training.optimizer.fused, std::optional<bool>(false));
  EXPECT_EQ(c.training.data.dataloader_num_workers, 1);
}

// `--callbacks.X none` removes callback X; every_steps 0 turns validation off.
TEST(ConfigCallbacks, NoneRemovesACallbackAndEveryStepsZeroTurnsValidationOff) {
  for (const char* none : {"none", "null", "None"}) {
    RunConfig c = load_run_config(kRecipe, {"--callbacks.validation", none});
    EXPECT_FALSE(c.callbacks.validation.enabled) << none;
    EXPECT_TRUE(c.callbacks.grad_clip.enabled);
    EXPECT_EQ(c.callbacks.order, (std::vector<std::string>{"grad_clip"}));
    EXPECT_EQ(c.resolved_yaml.find("ValidationCallback"), std::string::npos);
    EXPECT_EQ(parse_run_config(c.resolved_yaml).resolved_yaml, c.resolved_yaml);
  }
  RunConfig both = load_run_config(kRecipe, {"--callbacks.validation", "none", "--callbacks.grad_clip", "none"});
  EXPECT_FALSE(both.callbacks.grad_clip.enabled);
  EXPECT_TRUE(both.callbacks.order.empty());
  EXPECT_EQ(parse_run_config(both.resolved_yaml).resolved_yaml, both.resolved_yaml);
  RunConfig zero = load_run_config(kRecipe, {"--callbacks.validation.every_steps", "0"});
  EXPECT_FALSE(zero.callbacks.validation.enabled);
  EXPECT_EQ(zero.callbacks.validation.every_steps, 0);
  // A removed callback can be added back by a later override.
  RunConfig again = load_run_config(kRecipe, {"--callbacks.grad_clip", "none", "--callbacks.grad_clip.max_grad_norm",
                                              "0.5"});
  EXPECT_TRUE(again.callbacks.grad_clip.enabled);
  EXPECT_DOUBLE_EQ(again.callbacks.grad_clip.max_grad_norm, 0.5);
}

// One descriptor per key: every key that a section reads is in its table with help,
// and the statuses say which keys are implemented, refused or still planned.
TEST(ConfigSchema, EveryKeyHasOneDescriptorWithHelpAndStatus) {
  std::map<std::string, int> planned, refused;
  for (const auto* s : run_config_schemas()) {
    std::set<std::string> seen;
    for (const auto& k : s->keys) {
      EXPECT_TRUE(seen.insert(k.key).second) << s->path << "." << k.key << " has two descriptors";
      EXPECT_FALSE(k.help.empty()) << s->path << "." << k.key;
      if (k.status == vqad::config::KeyStatus::kPlanned) {
        EXPECT_FALSE(k.planned_by.empty()) << s->path << "." << k.key;
        ++planned[s->path];
      }
      if (k.status == vqad::config::KeyStatus::kNotSupportedYet) ++refused[s->path + "." + k.key];
      if (k.type == vqad::config::KeyType::kChoice && !k.default_value.is_null()) {
        EXPECT_NE(std::find(k.choices.begin(), k.choices.end(), k.default_value.get<std::string>()), k.choices.end())
            << s->path << "." << k.key;
      }
    }
  }
  // training.vsa acts on its keys since the VSA model integration (cache_tile_buf true is refused).
  EXPECT_EQ(planned["training.vsa"], 0);
  // layer_recon, recon_ode and the shifted ODE schedule act on every key they parse.
  EXPECT_EQ(planned["method (layer_recon)"], 0);
  EXPECT_EQ(planned["method (recon_ode)"], 0);
  EXPECT_EQ(planned["method.shifted_ode_schedule"], 0);
  EXPECT_GT(planned["training.distributed"], 0);
  EXPECT_EQ(refused.count("models.<role>.lora"), 1u);
  EXPECT_EQ(refused.count("training.optimizer.fused"), 1u);
  EXPECT_EQ(refused.count("callbacks.<validation>.attn_qat_infer"), 1u);
}
