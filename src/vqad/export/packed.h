// Packed NVFP4 export (spec/linear_qat.md "Packed export", spec/nvfp4.md): a Diffusers
// transformer directory whose quantized linears `<m>` are stored in ModelOpt's layout
//   <m>.weight          U8 [N, K/2]      E2M1 codes, even k in the low nibble
//   <m>.weight_scale    F8_E4M3 [N, K/16] per-block decode scales, row-major
//   <m>.weight_scale_2  F32 scalar        the weight's global decode scale
//   <m>.input_scale     F32 scalar        the activation's decode scale (fixed-scale layers)
//   <m>.weight_scale_swizzled F8_E4M3     the 128x4 layout (only with --swizzled-scales)
// plus every other tensor as in the ordinary export, config.json["quantization_config"]
// (ModelOpt's converted form, what vLLM / TensorRT-LLM read) and hf_quant_config.json.
//
// Codes and scales come from vqad's own quantizer, exactly as the fake-quant linear
// quantizes the weight in training (bf16(W), dynamic encode scale s_enc = 2688 /
// amax(bf16(W)), quantize_block). The global scales are stored as the decode factors
// training multiplies by: weight_scale_2 = 1 / s_enc_w and input_scale = 1 / s_enc_x
// (each within an ulp of ModelOpt's amax / 2688), so that
//   e2m1(code) * f32(weight_scale) * weight_scale_2 == FQ(W) of training, bit for bit,
// and an engine's alpha = input_scale * weight_scale_2 is the alpha training used.
// All-zero blocks get the scale 1.0 as in ModelOpt (their codes are 0, so they decode to 0).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vqad/model/quant_plan.h"
#include "vqad/model/wan/model.h"
#include "vqad/numerics/nvfp4.h"

namespace vqad::deploy {

inline constexpr const char* kPackedFormat = "nvfp4_modelopt";
inline constexpr const char* kDenseFormat = "diffusers";

// The packed tensors of one linear.
struct PackedLinear {
  torch::Tensor weight;                 // U8 [N, K/2]
  torch::Tensor weight_scale;           // F8_E4M3 [N, K/16]
  torch::Tensor weight_scale_2;         // F32 0-d
  torch::Tensor input_scale;            // F32 0-d, undefined for dynamic activations
  torch::Tensor weight_scale_swizzled;  // F8_E4M3 [round_up(N,128), round_up(K/16,4)], when asked for
  float weight_encode_scale = 0.0f;     // s_enc_w of training
};

// Packs the fp32/bf16 master weight [N, K] of linear `module` exactly as the fake-quant
// linear quantizes it. act_mode: dynamic (no input_scale), unit (input_scale 1) or static
// (input_scale = 1 / s_enc_x of act_amax). Errors name the module: K % 16 != 0,
// non-finite weights, a static mode without a positive amax.
// weight_amax replaces amax(bf16(W)) in the weight scale: the shared scale of a q/k/v
// group (linear_quantization.shared_qkv_scale), the max over the group's weights.
PackedLinear pack_linear(const std::string& module, const torch::Tensor& weight, nvfp4::ScaleMode act_mode,
                         std::optional<float> act_amax, bool swizzled_scales,
                         std::optional<float> weight_amax = std::nullopt);

// ModelOpt's converted config.json block for a plan; `ignore` lists the linears left unquantized.
nlohmann::json modelopt_quantization_config(const model::QuantPlan& plan, const std::vector<std::string>& ignore);

struct ExportOptions {
  std::string format = kDenseFormat;  // "diffusers" (dense copy) | "nvfp4" (packed)
  std::string role = "student";
  bool swizzled_scales = false;       // packed only: also write <m>.weight_scale_swizzled
  bool overwrite = false;
  std::string act_amax_json;          // packed only: amax table overriding the metadata's
};

struct ExportSummary {
  std::string out_dir;
  std::string format;
  int64_t quantized_linears = 0;
  int64_t quantized_parameters = 0;   // N * K summed over the packed linears
  int64_t quantized_bytes = 0;        // bytes of their packed tensors (codes, scales, global scales)
  double bytes_per_parameter() const {
    return quantized_parameters ? static_cast<double>(quantized_bytes) / static_cast<double>(quantized_parameters)
                                : 0.0;
  }
};

// `vqad export SOURCE OUT`: SOURCE is a checkpoint-<step> directory (the role's weights
// and the checkpoint's metadata) or an export directory (transformer/ + metadata.json).
// Dense: the role's transformer directory copied. Packed: every linear of the run's quant
// plan packed (the plan of training_contract.linear_quantization; static layers take
// their amax from linear_quantization.input_amax or options.act_amax_json). Metadata names
// the format, the plan and the source; lineage continues through it.
ExportSummary export_model(const std::string& source, const std::string& out_dir, const ExportOptions& options);

// ---- loading an export for inference ---------------------------------------------------------
enum class ModelKind { kDense, kFakeQuant, kPackedNvfp4 };
const char* model_kind_name(ModelKind k);

struct InferenceModel {
  std::shared_ptr<model::WanModel> model;
  ModelKind kind = ModelKind::kDense;
  model::QuantPlan plan;     // the plan the export was trained with (empty when dense)
  nlohmann::json metadata;   // the export's metadata.json (null when absent)
  std::vector<std::pair<std::string, std::shared_ptr<ops::LinearQuant>>> quants;
};

// A model directory (Diffusers, a vqad checkpoint role directory, a dense or packed vqad
// export) built in the current attention scope for inference:
//   packed export -> the packed linears (stored codes and scales, the plan's activation
//                    scales): the trained fake-quant student's forward, bit for bit;
//   a vqad checkpoint/export with a quant plan -> the plan's fake-quant linears;
//   otherwise dense.
// Parameters are frozen (requires_grad false).
// The vqad metadata of a model directory (beside its transformer/ directory, or the
// checkpoint's above a role directory) and the role it belongs to; null when none.
nlohmann::json model_metadata(const std::string& path, std::string* role = nullptr);

InferenceModel load_inference_model(const std::string& path, const model::WanModelOptions& options = {});

}  // namespace vqad::deploy
