// training.linear_quantization: the student's NVFP4 linears beyond the method name of
// quant_config - seeds/003's QAD plan toggles, the calibrated amax table, shared q/k/v
// global scales. Parsed and validated with the rest of the config (config/training.cpp);
// the values live in RunConfig::resolved (training.linear_quantization, present when the
// recipe writes the section) and are read back here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vqad/config/run_config.h"

namespace vqad::train {

struct LinearQuantizationConfig {
  std::string act_amax_json;          // nvfp4_qad: the static linears' amax table ('' = none)
  int64_t calibration_batches = 8;    // `vqad calibrate`: batches per rank run through the student
  bool quantize_attention = true;     // to_q / to_k / to_v / to_out of self- and cross-attention
  bool quantize_ffn = true;           // both FFN linears
  bool quantize_gate = false;         // the VSA compression gate to_gate_compress
  std::vector<int64_t> skip_blocks;   // blocks left high precision
  bool shared_qkv_scale = false;      // one weight / activation global scale per q/k/v (and cross k/v)
  std::string gemm = "auto";          // forward GEMM route: auto | fake_quant | fp4 (ops::Nvfp4GemmRoute)
};

// The run's training.linear_quantization (defaults when the recipe has no such section).
LinearQuantizationConfig linear_quantization_config(const RunConfig& run);

namespace sections {
// Reads and validates training.linear_quantization of the raw `training` node (may be null).
LinearQuantizationConfig parse_linear_quantization(const config::Ctx& ctx, const Json* training);
Json to_json(const LinearQuantizationConfig& q);
}  // namespace sections

}  // namespace vqad::train
