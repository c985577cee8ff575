#include "vqad/dist/batch_random.h"

#include <atomic>

#include "vqad/core/error.h"

namespace vqad::dist {
namespace {
std::atomic<int64_t> g_index{0};
std::atomic<int64_t> g_count{1};

std::vector<int64_t> global_sizes(at::IntArrayRef local, int64_t count) {
  VQAD_CHECK(!local.empty(), "batch draw: a per-sample draw needs a batch dimension");
  auto g = local.vec();
  g[0] *= count;
  return g;
}
}  // namespace

void set_batch_shard(BatchShard s) {
  VQAD_CHECK(s.count >= 1 && s.index >= 0 && s.index < s.count, "batch shard: index ", s.index, " outside [0, ",
             s.count, ")");
  g_index = s.index;
  g_count = s.count;
}

BatchShard batch_shard() { return {g_index.load(), g_count.load()}; }

torch::Tensor local_rows(const torch::Tensor& global) {
  const auto s = batch_shard();
  if (s.count == 1) return global;
  VQAD_CHECK(global.dim() >= 1 && global.size(0) % s.count == 0, "batch draw: global batch of ",
             global.dim() ? global.size(0) : 0, " rows is not a multiple of the data-parallel degree ", s.count);
  return global.slice(0, s.index, global.size(0), s.count).contiguous();
}

torch::Tensor randn_batch(at::IntArrayRef local_sizes, torch::Generator& gen, torch::TensorOptions options) {
  const auto s = batch_shard();
  if (s.count == 1) return at::randn(local_sizes, gen, options);
  return local_rows(at::randn(global_sizes(local_sizes, s.count), gen, options));
}

torch::Tensor rand_batch(at::IntArrayRef local_sizes, torch::Generator& gen, torch::TensorOptions options) {
  const auto s = batch_shard();
  if (s.count == 1) return at::rand(local_sizes, gen, options);
  return local_rows(at::rand(global_sizes(local_sizes, s.count), gen, options));
}

torch::Tensor normal_batch(double mean, double std, at::IntArrayRef local_sizes, torch::Generator& gen,
                           torch::TensorOptions options) {
  const auto s = batch_shard();
  if (s.count == 1) return at::normal(mean, std, local_sizes, gen, options);
  return local_rows(at::normal(mean, std, global_sizes(local_sizes, s.count), gen, options));
}

}  // namespace vqad::dist
