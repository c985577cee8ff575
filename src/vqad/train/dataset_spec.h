// The dataset a run reads: training.data (sources, kind, geometry, CFG rate, seed), the
// student's text geometry, and the ODE anchors the method asks for. `vqad train` and
// `vqad calibrate` read the same rows through it.
#pragma once
#include "vqad/data/dataset.h"
#include "vqad/model/wan/config.h"
#include "vqad/train/config.h"

namespace vqad::train {

data::DatasetSpec training_dataset_spec(const RunConfig& run, const model::WanConfig& student);

}  // namespace vqad::train
