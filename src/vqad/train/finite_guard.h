// Non-finite guards of the training loop: nothing non-finite may reach a checkpoint.
//
// A NaN/Inf in a batch, a loss, a gradient, an updated weight or an optimizer moment
// stops the run with one message that names the role, the first offending tensor (for
// data: the parquet file and row) and the last checkpoint that is actually good.
// Each check is one reduction per tensor and a single device->host sync.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vqad/data/dataset.h"

namespace vqad::train {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Names of the tensors holding a NaN or an Inf, in order, at most `limit`; the total count
// goes to *count when given. Undefined tensors are skipped.
std::vector<std::string> nonfinite_tensors(const NamedTensors& tensors, size_t limit = 8, size_t* count = nullptr);

// "file <path> row <r> (id <id>): <what>" (parquet data; other kinds: "dataset index <i>")
// of every batch row whose latent, text embedding or ODE pair holds a NaN/Inf; empty when
// the batch is finite.
std::vector<std::string> nonfinite_batch_rows(const data::Batch& batch, const data::Dataset& dataset);

// The truthful tail of a non-finite message: which checkpoint is the last good one.
std::string last_good_checkpoint_text(const std::string& last_good, const std::string& output_dir);

}  // namespace vqad::train
