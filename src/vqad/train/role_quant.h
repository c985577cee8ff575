// The student's quant config of a run (models.<role>.quant_config with
// training.linear_quantization) and the role builder of the calibration pass.
#pragma once
#include <memory>
#include <string>

#include "vqad/model/quant_plan.h"
#include "vqad/train/roles.h"

namespace vqad::train {

// models.<role>.quant_config with training.linear_quantization (plan toggles, skip_blocks,
// shared_qkv_scale, act_amax_json) for a quantized role; method none otherwise.
model::QuantConfig role_quant_config(const RunConfig& run, const std::string& role_name);

// build_role, except that nvfp4_qad static linears may lack a calibrated amax (they are
// left for a CalibrationScope: `vqad calibrate`). build_role refuses them, naming the linear.
std::shared_ptr<Role> build_role_for_calibration(const RunConfig& run, const std::string& role_name,
                                                 const RoleBuildOptions& options);

}  // namespace vqad::train
