#include "vqad/train/roles.h"

#include "vqad/config/linear_quantization.h"
#include "vqad/train/role_quant.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/attention.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {

std::vector<torch::Tensor> Role::trainable_parameters() const {
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

static std::pair<model::QuantPlan, std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>>
attach_quant_plan_with_table(model::WanModel& model, const model::QuantConfig& config,
                             const std::map<std::string, float>& amax_table);

std::pair<model::QuantPlan, std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>>
attach_quant_plan(model::WanModel& model, const model::QuantConfig& config) {
  return attach_quant_plan_with_table(model, config, {});
}

std::pair<model::QuantPlan, std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>>>
attach_quant_plan_with_table(model::WanModel& model, const model::QuantConfig& config,
                             const std::map<std::string, float>& amax_table) {
  std::vector<std::string> names;
  for (auto& [n, lin] : model.named_linears()) names.push_back(n);
  model::QuantPlan plan = model::build_quant_plan(names, config);
  auto quants = model::apply_quant_plan(model, plan, config, amax_table);
  return {std::move(plan), std::move(quants)};
}

model::QuantConfig role_quant_config(const RunConfig& run, const std::string& role_name) {
  model::QuantConfig qc;
  qc.method = model::parse_quant_method(run.role(role_name).quant_config, "models." + role_name + ".quant_config");
  if (!qc.enabled()) return qc;
  const LinearQuantizationConfig lq = linear_quantization_config(run);
  qc.act_amax_json = lq.act_amax_json;
  qc.quantize_attention = lq.quantize_attention;
  qc.quantize_ffn = lq.quantize_ffn;
  qc.quantize_gate = lq.quantize_gate;
  qc.skip_blocks = lq.skip_blocks;
  qc.shared_qkv_scale = lq.shared_qkv_scale;
  qc.gemm_route = ops::parse_nvfp4_gemm_route(lq.gemm, "training.linear_quantization.gemm");
  return qc;
}

double vsa_sparsity_at_step(const VsaConfig& vsa, long step) {
  if (vsa.decay_rate <= 0.0) return vsa.sparsity;
  VQAD_CHECK(vsa.decay_interval_steps > 0, "training.vsa.decay_interval_steps must be > 0 when decay_rate is set");
  const double ramp = vsa.decay_rate * static_cast<double>(std::max<long>(step, 0) / vsa.decay_interval_steps);
  return std::min(vsa.sparsity, ramp);
}

ops::AttentionSpec role_attention_spec(const RunConfig& run, const std::string& role_name) {
  ops::AttentionSpec spec;
  spec.backend = run.role(role_name).attention_backend;
  const VsaConfig& v = run.training.vsa;
  spec.vsa.sparsity = vsa_sparsity_at_step(v, 1);
  spec.vsa.selection = ops::parse_vsa_selection(v.selection, "training.vsa.selection");
  spec.vsa.top_p = v.top_p;
  return spec;
}

model::WanConfig role_architecture(const RunConfig& run, const std::string& role_name) {
  const RoleConfig& rc = run.role(role_name);
  const std::string key = "models." + role_name + ".init_from";
  const std::string random_prefix = "random:";
  if (rc.init_from.rfind(random_prefix, 0) == 0) {
    try {
      return model::WanConfig::preset(rc.init_from.substr(random_prefix.size()));
    } catch (const Error& e) {
      fail(key, ": '", rc.init_from, "': ", e.what());
    }
  }
  VQAD_CHECK(fs::exists(rc.init_from), key, ": '", rc.init_from, "' is not a local path");
  const auto src = model::locate_weights(rc.init_from);
  VQAD_CHECK(!src.config_path.empty(), key, ": '", rc.init_from, "' has no transformer config.json");
  return model::WanConfig::from_file(src.config_path);
}

static nlohmann::json read_parent_metadata(const std::string& init_from) {
  for (fs::path p : {fs::path(init_from) / "metadata.json", fs::path(init_from).parent_path() / "metadata.json"}) {
    if (fs::is_regular_file(p)) {
      std::ifstream f(p);
      try {
        return nlohmann::json::parse(f);
      } catch (const std::exception& e) {
        fail(p.string(), ": malformed metadata JSON: ", e.what());
      }
    }
  }
  return nullptr;
}

static std::shared_ptr<Role> build_role_impl(const RunConfig& run, const std::string& role_name,
                                             const RoleBuildOptions& options, bool allow_uncalibrated);

std::shared_ptr<Role> build_role(const RunConfig& run, const std::string& role_name,
                                 const RoleBuildOptions& options) {
  return build_role_impl(run, role_name, options, false);
}

std::shared_ptr<Role> build_role_for_calibration(const RunConfig& run, const std::string& role_name,
                                                 const RoleBuildOptions& options) {
  return build_role_impl(run, role_name, options, true);
}

static std::shared_ptr<Role> build_role_impl(const RunConfig& run, const std::string& role_name,
                                             const RoleBuildOptions& options, bool allow_uncalibrated) {
  const RoleConfig& rc = run.role(role_name);
  const std::string key = "models." + role_name;
  auto role = std::make_shared<Role>();
  role->name = role_name;
  role->config = rc;
  role->grid = FlowMatchGrid(rc.flow_shift);

  model::WanModelOptions mopt;
  mopt.device = torch::kCPU;  // weights are read on the CPU, then moved
  mopt.compute_dtype = options.compute_dtype;
  mopt.gradient_checkpointing = rc.trainable && rc.enable_gradient_checkpointing_type == "full";
  VQAD_CHECK(rc.enable_gradient_checkpointing_type.empty() || rc.enable_gradient_checkpointing_type == "full",
             key, ".enable_gradient_checkpointing_type: '", rc.enable_gradient_checkpointing_type,
             "' is not supported by vqad (valid: full, or unset)");

  {
    ops::AttentionBackendScope scope(role_attention_spec(run, role_name));
    const std::string random_prefix = "random:";
    if (rc.init_from.rfind(random_prefix, 0) == 0) {
      const std::string preset = rc.init_from.substr(random_prefix.size());
      torch::manual_seed(options.seed);
      model::WanConfig wc;
      try {
        wc = model::WanConfig::preset(preset);
      } catch (const Error& e) {
        fail(key, ".init_from: '", rc.init_from, "': ", e.what());
      }
      role->model = std::make_shared<model::WanModel>(wc, mopt);
      role->init_kind = "random";
      if (role->model->config().gate_compress) role->compression_gate_initialization = "zero";
    } else {
      VQAD_CHECK(fs::exists(rc.init_from), key, ".init_from: '", rc.init_from,
                 "' is not a local path (vqad does not download models: give a local Diffusers "
                 "directory, a vqad export, or random:<preset> with preset tiny, tiny-hd128, tiny-4head, 1.3B or 14B)");
      // A vqad checkpoint or export is used only if its files are the ones its metadata records.
      if (const std::string md = metadata_dir_of(rc.init_from); !md.empty()) require_intact(md, key + ".init_from");
      model::LoadReport report;
      role->model = model::wan_from_pretrained(rc.init_from, mopt, &report);
      if (role->model->config().gate_compress)
        role->compression_gate_initialization = report.gates_zeroed() ? "zero" : "checkpoint";
      if (report.gates_zeroed())
        log::info(key, ": ", rc.init_from, " has no to_gate_compress weights; the ",
                  report.zeroed_gate_keys.size() / 2, " VSA compression gates start at zero");
      role->parent_metadata = read_parent_metadata(rc.init_from);
      role->init_kind = role->parent_metadata.is_null() ? "diffusers" : "vqad_export";
    }
  }
  if (!rc.transformer_override_safetensor.empty() && !rc.disable_custom_init_weights) {
    log::info(key, ": overriding weights from ", rc.transformer_override_safetensor);
    if (const std::string md = metadata_dir_of(fs::path(rc.transformer_override_safetensor).parent_path().string());
        !md.empty())
      require_intact(md, key + ".transformer_override_safetensor");
    const model::LoadReport report =
        model::load_weights(*role->model, model::read_weights(rc.transformer_override_safetensor));
    if (role->model->config().gate_compress)
      role->compression_gate_initialization = report.gates_zeroed() ? "zero" : "checkpoint";
    auto pm = read_parent_metadata(fs::path(rc.transformer_override_safetensor).parent_path().string());
    if (!pm.is_null()) {
      role->parent_metadata = pm;
      role->init_kind = "vqad_export";
    }
  }
  role->model->to(options.device);
  for (auto& p : role->model->parameters()) p.set_requires_grad(rc.trainable);
  role->model->train(rc.trainable);

  role->quant_config = role_quant_config(run, role_name);
  if (role->quant_config.enabled()) {
    role->quant_config.allow_uncalibrated = allow_uncalibrated;
    // The forward GEMM route for the role's device, once: fp4 where it cannot run is refused here.
    const ops::Nvfp4GemmRoute requested = role->quant_config.gemm_route;
    role->quant_config.gemm_route =
        ops::resolve_nvfp4_gemm_route(requested, options.device, "training.linear_quantization.gemm");
    std::string why;
    if (role->quant_config.gemm_route == ops::Nvfp4GemmRoute::kFp4) {
      why = "FP4 tensor cores on " + options.device.str();
    } else if (requested == ops::Nvfp4GemmRoute::kAuto) {
      ops::nvfp4_fp4_route_available(options.device, &why);
    } else {
      why = "as configured";
    }
    log::info(key, ": NVFP4 linear forward GEMM route ", ops::nvfp4_gemm_route_name(role->quant_config.gemm_route),
              " (training.linear_quantization.gemm ", ops::nvfp4_gemm_route_name(requested), "; ", why, ")");
    std::map<std::string, float> table;
    if (!role->quant_config.act_amax_json.empty()) {
      VQAD_CHECK(fs::is_regular_file(role->quant_config.act_amax_json), "training.linear_quantization.act_amax_json: '",
                 role->quant_config.act_amax_json, "' is not a file (write one with `vqad calibrate`)");
      table = model::load_amax_table(role->quant_config.act_amax_json);
    }
    try {
      std::tie(role->plan, role->quants) = attach_quant_plan_with_table(*role->model, role->quant_config, table);
    } catch (const Error& e) {
      fail(key, ": ", e.what(),
           role->quant_config.method == model::QuantMethod::kNvfp4Qad && role->quant_config.act_amax_json.empty()
               ? "; training.linear_quantization.act_amax_json is not set"
               : "");
    }
  }
  log::info(key, ": ", role->model->config().kind(), " (", role->init_kind, "), attention ",
            attention_backend_name(rc.attention_backend), ", linears ",
            role->plan.empty() ? std::string("dense") : std::to_string(role->plan.entries.size()) + " NVFP4",
            rc.trainable ? ", trainable" : ", frozen");
  return role;
}

}  // namespace vqad::train
