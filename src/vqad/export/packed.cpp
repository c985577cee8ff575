#include "vqad/export/packed.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/packed_weights.h"
#include "vqad/model/wan/weights.h"
#include "vqad/ops/nvfp4_linear.h"
#include "vqad/ops/nvfp4_packed_linear.h"
#include "vqad/ops/tensor_text.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/integrity.h"
#include "vqad/train/metadata.h"
#include "vqad/train/trainer.h"
#include "vqad/version.h"

namespace vqad::deploy {
namespace fs = std::filesystem;
namespace {

using nvfp4::ScaleMode;

constexpr uint8_t kE4M3One = 0x38;  // 1.0 in E4M3

torch::Tensor f32_scalar(float v) { return torch::full({}, v, torch::kFloat32); }

torch::Tensor bytes_tensor(const std::vector<uint8_t>& bytes, std::vector<int64_t> shape, torch::ScalarType dtype) {
  torch::Tensor t = torch::empty(shape, torch::kUInt8);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return dtype == torch::kUInt8 ? t : t.view(dtype);
}

nlohmann::json read_json_file(const fs::path& p) {
  std::ifstream f(p);
  VQAD_CHECK(f.good(), p.string(), ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail(p.string(), ": invalid JSON: ", e.what());
  }
}

// A checkpoint-<step> directory (role weights under <role>/transformer) or an export
// directory (transformer/ + metadata.json).
struct Source {
  std::string path;
  std::string kind;      // "checkpoint" | "export"
  std::string role;
  fs::path transformer;  // directory with config.json and the weights
  nlohmann::json meta;
};

Source resolve_source(const std::string& path, const std::string& role) {
  const fs::path p(path);
  VQAD_CHECK(fs::is_directory(p), "export: source ", path, " is not a directory");
  Source s;
  s.path = fs::absolute(p).string();
  if (fs::is_directory(p / role / "transformer")) {
    VQAD_CHECK(fs::is_regular_file(p / train::kCheckpointMarker), "export: ", path, ": incomplete checkpoint (no ",
               train::kCheckpointMarker, " marker)");
    s.kind = "checkpoint";
    s.role = role;
    s.transformer = p / role / "transformer";
  } else if (fs::is_directory(p / "transformer") && fs::is_regular_file(p / "metadata.json")) {
    s.kind = "export";
    s.transformer = p / "transformer";
  } else {
    fail("export: ", path, " is neither a checkpoint holding role '", role, "' (no ", (p / role / "transformer").string(),
         ") nor a vqad export (transformer/ and metadata.json)");
  }
  // Packed from the bytes its metadata records, or not at all.
  train::require_intact(path, "export");
  s.meta = train::read_metadata(path);
  if (s.kind == "export") {
    const auto& ex = s.meta.value("export", nlohmann::json::object());
    s.role = ex.value("role", std::string("student"));
    VQAD_CHECK(s.role == role, "export: ", path, " is an export of role '", s.role, "', not of '", role, "'");
  }
  return s;
}

// The run's quant plan of the student, with its amax table; errors when there is none.
std::pair<model::QuantPlan, std::map<std::string, float>> source_plan(const Source& src, const ExportOptions& o) {
  const auto& tc = src.meta.value("training_contract", nlohmann::json::object());
  const nlohmann::json lq = tc.value("linear_quantization", nlohmann::json());
  VQAD_CHECK(src.role == "student", "export --format nvfp4: role '", src.role, "' of ", src.path,
             " has no quant plan (only the student is quantized)");
  VQAD_CHECK(lq.is_object(), "export --format nvfp4: ", src.path,
             " has no quant plan (metadata training_contract.linear_quantization is ",
             lq.is_null() ? std::string("null: the run trained dense linears") : lq.dump(), "); nothing to pack");
  model::QuantPlan plan = model::QuantPlan::from_json(lq, src.path + ": training_contract.linear_quantization");
  VQAD_CHECK(!plan.empty(), "export --format nvfp4: ", src.path, ": the quant plan lists no linears");
  std::map<std::string, float> table;
  if (!o.act_amax_json.empty()) {
    table = model::load_amax_table(o.act_amax_json);
  } else if (lq.contains("input_amax") && !lq["input_amax"].is_null()) {
    table = model::amax_table_from_json(lq["input_amax"], src.path + ": training_contract.linear_quantization.input_amax");
  }
  return {std::move(plan), std::move(table)};
}

ExportSummary export_packed(const Source& src, const std::string& out_dir, const ExportOptions& o) {
  VQAD_CHECK(src.meta.value("export", nlohmann::json::object()).value("format", std::string(kDenseFormat)) !=
                 kPackedFormat,
             "export --format nvfp4: ", src.path, " is already a packed NVFP4 export");
  auto [plan, table] = source_plan(src, o);
  {
    const auto already = model::read_packed_nvfp4_linears(src.transformer.string());
    VQAD_CHECK(already.empty(), "export --format nvfp4: ", src.path, " already holds packed NVFP4 linears (",
               already.empty() ? std::string() : already.begin()->first, ", ...)");
  }
  model::WeightState state = model::read_weights(src.transformer.string());

  // Every plan entry must name a 2-D weight of the checkpoint.
  std::map<std::string, const model::QuantPlanEntry*> by_weight;
  for (const auto& e : plan.entries) {
    const std::string key = e.module + ".weight";
    auto it = state.tensors.find(key);
    VQAD_CHECK(it != state.tensors.end(), "export --format nvfp4: the quant plan names linear '", e.module,
               "' but ", state.source, " has no tensor ", key);
    VQAD_CHECK(it->second.dim() == 2, "export --format nvfp4: ", key, " is ", ops::shape_str(it->second.sizes()),
               ", expected a linear weight [N, K]");
    by_weight[key] = &e;
  }
  std::vector<std::string> ignore;
  for (const auto& [key, t] : state.tensors) {
    if (!key.ends_with(".weight") || t.dim() != 2 || by_weight.count(key)) continue;
    ignore.push_back(key.substr(0, key.size() - 7));
  }

  // Shared global scales (plan.shared_qkv_scale): one weight amax per q/k/v group, the max
  // over its members' bf16 weights; static members take the group's max input amax.
  std::map<std::string, float> shared_weight_amax;
  nlohmann::json shared_groups = nlohmann::json::object();
  for (const auto& [group, members] : model::shared_scale_groups(plan)) {
    float m = 0.0f;
    for (const auto& mod : members) m = std::fmax(m, ops::bf16_amax_cpu(state.tensors.at(mod + ".weight")));
    for (const auto& mod : members) shared_weight_amax[mod] = m;
    shared_groups[group] = members;
  }
  const std::map<std::string, float> group_input_amax = model::shared_group_input_amax(plan, table);

  ExportSummary summary;
  summary.out_dir = out_dir;
  summary.format = kPackedFormat;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  nlohmann::json linears = nlohmann::json::object();
  for (const auto& [key, t] : state.tensors) {
    auto it = by_weight.find(key);
    if (it == by_weight.end()) {
      tensors.emplace_back(key, t);
      continue;
    }
    const model::QuantPlanEntry& e = *it->second;
    std::optional<float> amax;
    if (e.activation_mode == ScaleMode::kStatic) {
      const float* a = model::lookup_amax(table, e.module);
      int block = 0;
      std::string sub;
      const std::string tkey =
          model::split_block_name(e.module, &block, &sub) ? "b" + std::to_string(block) + "." + sub : e.module;
      VQAD_CHECK(a, "export --format nvfp4: static linear '", e.module, "' has no calibrated input amax (table key '",
                 tkey, "' in ", o.act_amax_json.empty() ? "training_contract.linear_quantization.input_amax"
                                                        : o.act_amax_json,
                 ")");
      amax = group_input_amax.count(e.module) ? group_input_amax.at(e.module) : *a;
    }
    std::optional<float> wamax;
    if (auto w = shared_weight_amax.find(e.module); w != shared_weight_amax.end()) wamax = w->second;
    const PackedLinear p = pack_linear(e.module, t, e.activation_mode, amax, o.swizzled_scales, wamax);
    const int64_t n = t.size(0), k = t.size(1);
    summary.quantized_linears += 1;
    summary.quantized_parameters += n * k;
    tensors.emplace_back(e.module + ".weight", p.weight);
    tensors.emplace_back(e.module + ".weight_scale", p.weight_scale);
    tensors.emplace_back(e.module + ".weight_scale_2", p.weight_scale_2);
    summary.quantized_bytes += p.weight.numel() + p.weight_scale.numel() + 4;
    nlohmann::json info = {{"activation", nvfp4::scale_mode_name(e.activation_mode)},
                           {"weight_scale_2", p.weight_scale_2.item<float>()},
                           {"shape", {n, k}}};
    if (p.input_scale.defined()) {
      tensors.emplace_back(e.module + ".input_scale", p.input_scale);
      summary.quantized_bytes += 4;
      info["input_scale"] = p.input_scale.item<float>();
    }
    if (amax) info["input_amax"] = *amax;
    if (p.weight_scale_swizzled.defined()) {
      tensors.emplace_back(e.module + ".weight_scale_swizzled", p.weight_scale_swizzled);
      summary.quantized_bytes += p.weight_scale_swizzled.numel();
    }
    linears[e.module] = std::move(info);
  }

  train::check_export_target(out_dir, src.path, o.overwrite);
  train::build_and_publish_export(out_dir, [&](const fs::path& tmp) {
    train::create_dir_or_fail((tmp / "transformer").string(), "export");
    io::save_safetensors((tmp / "transformer" / "diffusion_pytorch_model.safetensors").string(), tensors,
                         {{"format", "pt"}, {"quantization", kPackedFormat}});
    const fs::path cfg_path = src.transformer / "config.json";
    VQAD_CHECK(fs::is_regular_file(cfg_path), "export: ", src.path, ": no ", cfg_path.string());
    nlohmann::json cfg = read_json_file(cfg_path);
    const nlohmann::json qc = modelopt_quantization_config(plan, ignore);
    cfg["quantization_config"] = qc;
    st::write_file_atomic((tmp / "transformer" / "config.json").string(), {cfg.dump(2) + "\n"});
    nlohmann::json hf = {{"producer", qc["producer"]},
                         {"quantization",
                          {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", 16},
                           {"exclude_modules", ignore}}}};
    st::write_file_atomic((tmp / "transformer" / "hf_quant_config.json").string(), {hf.dump(2) + "\n"});

    nlohmann::json meta = src.meta;
    const nlohmann::json previous_export = meta.value("export", nlohmann::json());
    meta["checkpoint_state"] = "inference_export";
    meta["export"] = {{"role", src.role},
                      {"format", kPackedFormat},
                      {"source_checkpoint", src.path},
                      {"source_kind", src.kind},
                      {"created_at", train::utc_now_iso()},
                      {"swizzled_scales", o.swizzled_scales},
                      {"quant_plan", plan.to_json()},
                      {"packed_linears", linears},
                      {"shared_scale_groups", shared_groups},
                      {"layout",
                       {{"weight", "U8 [N, K/2], E2M1 codes, even k in the low nibble"},
                        {"weight_scale", "F8_E4M3 [N, K/16] row-major block decode scales (all-zero blocks: 1.0)"},
                        {"weight_scale_2", "F32 scalar, 1 / s_enc of the weight (amax(bf16 W) / 2688 within an ulp)"},
                        {"input_scale", "F32 scalar, 1 / s_enc of the activation (static: calibrated amax / 2688 "
                                        "within an ulp; unit: 1); absent for dynamic activations"},
                        {"dequantize", "e2m1(code) * f32(weight_scale) * weight_scale_2 == FQ(W) of training"}}},
                      {"sizes",
                       {{"quantized_linears", summary.quantized_linears},
                        {"quantized_parameters", summary.quantized_parameters},
                        {"quantized_bytes", summary.quantized_bytes},
                        {"bytes_per_parameter", summary.bytes_per_parameter()}}}};
    if (!previous_export.is_null()) meta["export"]["source_export"] = previous_export;
    train::write_metadata(tmp.string(), meta);
  });
  return summary;
}

nlohmann::json find_metadata(const fs::path& dir, std::string* role) {
  const fs::path d = fs::is_regular_file(dir) ? dir.parent_path() : dir;
  // An export (metadata beside transformer/), an export's transformer/ directory, or a
  // checkpoint's <role>/ or <role>/transformer/ directory.
  for (const fs::path& p : {d, d.parent_path(), d.parent_path().parent_path()}) {
    if (p.empty() || !fs::is_regular_file(p / "metadata.json")) continue;
    nlohmann::json meta = read_json_file(p / "metadata.json");
    if (meta.contains("export") && meta["export"].is_object()) {
      *role = meta["export"].value("role", std::string("student"));
    } else {
      // Checkpoint: the role is the directory under the checkpoint root.
      fs::path rel = fs::relative(fs::absolute(d), fs::absolute(p));
      *role = rel.empty() || rel == "." ? std::string() : rel.begin()->string();
    }
    return meta;
  }
  return nullptr;
}

}  // namespace

nlohmann::json model_metadata(const std::string& path, std::string* role) {
  std::string r;
  nlohmann::json meta = find_metadata(fs::path(model::locate_weights(path).transformer_dir), &r);
  if (role) *role = r;
  return meta;
}

PackedLinear pack_linear(const std::string& module, const torch::Tensor& weight, ScaleMode act_mode,
                         std::optional<float> act_amax, bool swizzled_scales, std::optional<float> weight_amax) {
  VQAD_CHECK(weight.defined() && weight.dim() == 2, "pack NVFP4 linear '", module, "': expected a weight [N, K], got ",
             weight.defined() ? ops::shape_str(weight.sizes()) : std::string("undefined"));
  const int64_t n = weight.size(0), k = weight.size(1);
  VQAD_CHECK(k > 0 && k % nvfp4::kBlock == 0, "pack NVFP4 linear '", module, "': K = ", k,
             " is not a multiple of 16 (weight ", ops::shape_str(weight.sizes()),
             "); NVFP4 packs 16-element blocks along K");
  VQAD_CHECK(weight.is_floating_point(), "pack NVFP4 linear '", module, "': weight dtype ",
             c10::toString(weight.scalar_type()), " is not floating point");
  // The operand the fake-quant linear quantizes: the master weight rounded to BF16.
  const torch::Tensor wb = weight.detach().to(torch::kCPU).to(torch::kBFloat16).to(torch::kFloat32).contiguous();
  VQAD_CHECK(torch::isfinite(wb).all().item<bool>(), "pack NVFP4 linear '", module,
             "': the weight holds non-finite values (after rounding to BF16); refusing to pack");
  const float own_amax = ops::bf16_amax_cpu(wb);
  VQAD_CHECK(!weight_amax || (*weight_amax >= own_amax && std::isfinite(*weight_amax)), "pack NVFP4 linear '", module,
             "': a shared weight amax must be finite and cover the weight's own amax ", own_amax);
  const float s_enc = nvfp4::encode_scale_from_amax(weight_amax ? *weight_amax : own_amax);
  const nvfp4::QuantizedMatrix q = nvfp4::quantize_matrix(wb.data_ptr<float>(), n, k, s_enc);
  std::vector<uint8_t> scales = q.scales;
  for (auto& b : scales)
    if (b == 0) b = kE4M3One;  // ModelOpt's convention for all-zero blocks; their codes are 0
  PackedLinear p;
  p.weight_encode_scale = s_enc;
  p.weight = bytes_tensor(q.packed_codes(), {n, k / 2}, torch::kUInt8);
  p.weight_scale = bytes_tensor(scales, {n, k / nvfp4::kBlock}, torch::kFloat8_e4m3fn);
  p.weight_scale_2 = f32_scalar(1.0f / s_enc);
  if (act_mode == ScaleMode::kUnit) {
    p.input_scale = f32_scalar(1.0f);
  } else if (act_mode == ScaleMode::kStatic) {
    VQAD_CHECK(act_amax && *act_amax > 0.0f && std::isfinite(*act_amax), "pack NVFP4 linear '", module,
               "': a static activation scale needs a positive finite calibrated amax");
    p.input_scale = f32_scalar(1.0f / ops::static_activation_encode_scale(*act_amax));
  }
  if (swizzled_scales) {
    const int64_t cols = k / nvfp4::kBlock;
    std::vector<uint8_t> sw(static_cast<size_t>(nvfp4::swizzled_scales_size(n, cols)));
    nvfp4::swizzle_scales(scales.data(), n, cols, sw.data());
    const int64_t rows_padded = (n + nvfp4::kSwizzleRows - 1) / nvfp4::kSwizzleRows * nvfp4::kSwizzleRows;
    p.weight_scale_swizzled =
        bytes_tensor(sw, {rows_padded, static_cast<int64_t>(sw.size()) / rows_padded}, torch::kFloat8_e4m3fn);
  }
  return p;
}

nlohmann::json modelopt_quantization_config(const model::QuantPlan& plan, const std::vector<std::string>& ignore) {
  bool dynamic = false;
  for (const auto& e : plan.entries) dynamic = dynamic || e.activation_mode == ScaleMode::kDynamic;
  const nlohmann::json fp4 = {{"num_bits", 4}, {"type", "float"}, {"group_size", 16}};
  nlohmann::json weights = fp4, acts = fp4;
  weights["dynamic"] = false;
  acts["dynamic"] = dynamic;
  return {{"quant_method", "modelopt"},
          {"quant_algo", "NVFP4"},
          {"group_size", 16},
          {"kv_cache_quant_algo", nullptr},
          {"producer", {{"name", "vqad"}, {"version", VQAD_VERSION}}},
          {"config_groups",
           {{"group_0", {{"input_activations", acts}, {"weights", weights}, {"targets", {"Linear"}}}}}},
          {"ignore", ignore},
          {"exclude_modules", ignore}};
}

ExportSummary export_model(const std::string& source, const std::string& out_dir, const ExportOptions& o) {
  VQAD_CHECK(o.format == kDenseFormat || o.format == "nvfp4", "export: unknown --format '", o.format,
             "' (valid: diffusers, nvfp4)");
  VQAD_CHECK(o.format == "nvfp4" || (!o.swizzled_scales && o.act_amax_json.empty()),
             "export: --swizzled-scales and --act-amax apply only to --format nvfp4");
  const Source src = resolve_source(source, o.role);
  if (o.format == "nvfp4") return export_packed(src, out_dir, o);
  VQAD_CHECK(src.kind == "checkpoint", "export --format diffusers: ", source,
             " is already an export (copy the directory, or pass --format nvfp4 to pack it)");
  ExportSummary s;
  s.out_dir = train::export_checkpoint(source, out_dir, o.role, o.overwrite);
  s.format = kDenseFormat;
  return s;
}

const char* model_kind_name(ModelKind k) {
  switch (k) {
    case ModelKind::kDense: return "dense";
    case ModelKind::kFakeQuant: return "fake-quant";
    case ModelKind::kPackedNvfp4: return "packed-nvfp4";
  }
  return "?";
}

InferenceModel load_inference_model(const std::string& path, const model::WanModelOptions& options) {
  InferenceModel r;
  std::map<std::string, model::PackedNvfp4Linear> packed = model::read_packed_nvfp4_linears(path);
  r.model = model::wan_from_pretrained(path, options);
  std::string role;
  r.metadata = model_metadata(path, &role);
  nlohmann::json lq;
  if (r.metadata.is_object() && role == "student")
    lq = r.metadata.value("training_contract", nlohmann::json::object()).value("linear_quantization", nlohmann::json());
  if (lq.is_object()) r.plan = model::QuantPlan::from_json(lq, path + ": training_contract.linear_quantization");

  if (!packed.empty()) {
    r.kind = ModelKind::kPackedNvfp4;
    const nlohmann::json ex = r.metadata.is_object() ? r.metadata.value("export", nlohmann::json()) : nlohmann::json();
    VQAD_CHECK(ex.is_object() && ex.contains("packed_linears") && ex["packed_linears"].is_object(), "packed model ",
               path, ": no metadata.json with export.packed_linears (the activation scales of its ", packed.size(),
               " NVFP4 linears); it is not a vqad packed export");
    const auto& infos = ex["packed_linears"];
    for (auto it = infos.begin(); it != infos.end(); ++it)
      VQAD_CHECK(packed.count(it.key()), "packed model ", path, ": metadata lists packed linear '", it.key(),
                 "' but the weights do not hold it packed");
    for (auto& [name, lin] : packed) {
      VQAD_CHECK(infos.contains(name), "packed model ", path, ": linear '", name,
                 "' is packed but export.packed_linears does not list it");
      const auto& info = infos[name];
      const std::string mode_s = info.value("activation", std::string());
      const ScaleMode mode = nvfp4::parse_scale_mode(mode_s.c_str(), ("export.packed_linears." + name).c_str());
      float amax = 0.0f;
      if (mode == ScaleMode::kStatic) {
        VQAD_CHECK(info.contains("input_amax") && info["input_amax"].is_number(), "packed model ", path,
                   ": static linear '", name, "' has no export.packed_linears input_amax");
        amax = info["input_amax"].get<float>();
      }
      auto q = std::make_shared<ops::Nvfp4PackedLinear>(name, lin.unit_weight, lin.weight_scale_2, mode, amax);
      r.model->attach_linear_quant(name, q);
      r.quants.emplace_back(name, q);
    }
  } else if (!r.plan.empty()) {
    r.kind = ModelKind::kFakeQuant;
    model::QuantConfig cfg;
    cfg.method = r.plan.method;
    std::map<std::string, float> table;
    if (lq.contains("input_amax") && !lq["input_amax"].is_null())
      table = model::amax_table_from_json(lq["input_amax"], path + ": training_contract.linear_quantization.input_amax");
    r.quants = model::apply_quant_plan(*r.model, r.plan, cfg, table);
  }
  for (auto& p : r.model->parameters()) p.set_requires_grad(false);
  r.model->train(false);
  return r;
}

}  // namespace vqad::deploy
