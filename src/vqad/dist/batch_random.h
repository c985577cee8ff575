// Random draws that do not depend on how the global batch is split over data-parallel ranks.
//
// Every rank holds the same generator state. A per-sample draw (noise [B, ...], timesteps [B])
// is made for the whole global batch, [count * B, ...], and a rank keeps the rows
// index, index + count, index + 2 count, ... : the rows of its samples in the global batch
// (the DP-strided sampler gives SP group g the rows g::count of the global order). So a run on
// W ranks with per-rank batch B draws exactly what one process with batch W * B draws for the
// same samples, every rank's generator advances alike, and a checkpoint's generator state
// resumes on any world size. With count 1 (one process) the draws are the plain draws.
#pragma once
#include <torch/torch.h>

namespace vqad::dist {

struct BatchShard {
  int64_t index = 0;  // data-parallel rank (= SP group)
  int64_t count = 1;  // data-parallel degree
};

// Set once by the trainer (process-wide: a process is one rank of one job).
void set_batch_shard(BatchShard shard);
BatchShard batch_shard();

// `local_sizes[0]` is the per-rank batch; the result has `local_sizes`.
torch::Tensor randn_batch(at::IntArrayRef local_sizes, torch::Generator& gen, torch::TensorOptions options);
torch::Tensor rand_batch(at::IntArrayRef local_sizes, torch::Generator& gen, torch::TensorOptions options);
torch::Tensor normal_batch(double mean, double std, at::IntArrayRef local_sizes, torch::Generator& gen,
                           torch::TensorOptions options);
// This rank's rows of a tensor that holds the whole global batch along dim 0.
torch::Tensor local_rows(const torch::Tensor& global);

}  // namespace vqad::dist
