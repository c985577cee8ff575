// `vqad calibrate`: the calibration pass of the QAD linear method (seeds/003 Stage A,
// spec/linear_qat.md "Calibration"). The recipe's student is built with its nvfp4_qad
// plan, the static (FFN) linears in calibration mode; training_batches of the recipe's own
// data (same dataset, sampler, seed and per-rank shards as `vqad train`) run through the
// student's forward, where every static linear runs the dense path and records max|x|.
// The maxima are all-reduced with MAX across the ranks of a launched job, a static linear
// that saw no activation is an error naming it, and the table {"b<block>.<sub>": amax}
// (the documented key naming: spec/linear_qat.md, model/quant_plan.h) is written to the
// output file, which training.linear_quantization.act_amax_json then loads (training,
// checkpoint metadata, packed export).
//
// Student inputs per batch, by dataset kind:
//   t2v rows:  x_t = (1 - sigma) x0 + sigma noise at a timestep drawn uniformly from the
//              student's flow-matching grid (sft's noising, uniform weighting);
//   ODE pairs: the cached teacher state ode_start at its anchor timestep (1000 sigma).
// text_only datasets carry no latents and are refused (calibrate with a t2v dataset
// through --training.data.data_path).
#pragma once
#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "vqad/train/config.h"

namespace vqad::train {

struct CalibrateOptions {
  torch::Device device = torch::kCPU;
  std::string out;      // the amax table file (rank 0 writes it)
  int64_t batches = 0;  // 0: training.linear_quantization.calibration_batches
};

struct CalibrateSummary {
  std::string out;
  int64_t batches = 0;
  int64_t samples = 0;   // over every rank
  int world_size = 1;
  std::map<std::string, float> amax;  // module name -> calibrated amax (after the MAX reduction)
  nlohmann::json table;               // what was written
};

CalibrateSummary calibrate_run(const RunConfig& run, const CalibrateOptions& options);

}  // namespace vqad::train
