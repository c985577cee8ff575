#include "vqad/dist/data_parallel.h"

#include "vqad/core/error.h"
#include "vqad/core/sha256.h"

namespace vqad::dist {
namespace {
constexpr int64_t kBucketElements = int64_t(16) << 20;  // 64 MiB of fp32 per all-reduce
}

std::string executable_sha256() { return sha256_file("/proc/self/exe"); }

std::unique_ptr<DataParallel> DataParallel::create(const MeshSpec& mesh) {
  auto w = world();
  const int64_t world_size = w ? w->size() : 1;
  const std::string p = "training.distributed";
  VQAD_CHECK(mesh.num_gpus == world_size, p, ".num_gpus = ", mesh.num_gpus, " but this process is one of ",
             world_size, world_size == 1 ? " (a single process; start the ranks with `vqad launch --nproc " +
                                                   std::to_string(mesh.num_gpus) + " train ...` or torchrun, or "
                                                   "train on one device with --training.distributed.num_gpus 1 "
                                                   "--training.distributed.sp_size 1 "
                                                   "--training.distributed.hsdp_replicate_dim 1 "
                                                   "--training.distributed.hsdp_shard_dim 1)"
                                             : " launched ranks");
  if (world_size == 1) return nullptr;
  VQAD_CHECK(mesh.sp_size >= 1 && world_size % mesh.sp_size == 0, p, ".sp_size = ", mesh.sp_size,
             " does not divide the ", world_size, " launched ranks");
  VQAD_CHECK(mesh.hsdp_shard_dim >= 1 && mesh.hsdp_replicate_dim >= 1 &&
                 mesh.hsdp_replicate_dim * mesh.hsdp_shard_dim == world_size,
             p, ": hsdp_replicate_dim (", mesh.hsdp_replicate_dim, ") x hsdp_shard_dim (", mesh.hsdp_shard_dim,
             ") must equal the ", world_size, " launched ranks");
  return std::make_unique<DataParallel>(w, mesh);
}

DataParallel::DataParallel(std::shared_ptr<ProcessGroup> world, MeshSpec mesh)
    : world_(std::move(world)), mesh_(mesh) {
  if (mesh_.sp_size > 1) {
    const int first = static_cast<int>(world_->rank() / mesh_.sp_size * mesh_.sp_size);
    std::vector<int> ranks;
    for (int k = 0; k < mesh_.sp_size; ++k) ranks.push_back(world_->global_ranks()[first + k]);
    sp_ = world_->subgroup("sp" + std::to_string(first / mesh_.sp_size), ranks);
  }
  const int64_t S = mesh_.hsdp_shard_dim, R = mesh_.hsdp_replicate_dim;
  if (S > 1) {
    const int r = world_->rank();
    if (S == world_->size()) {
      shard_ = world_;
    } else {
      std::vector<int> ranks;
      for (int64_t k = 0; k < S; ++k) ranks.push_back(world_->global_ranks()[r / S * S + k]);
      shard_ = world_->subgroup("shard" + std::to_string(r / S), ranks);
    }
    if (R > 1) {
      std::vector<int> ranks;
      for (int64_t k = 0; k < R; ++k) ranks.push_back(world_->global_ranks()[r % S + k * S]);
      replicate_ = world_->subgroup("replicate" + std::to_string(r % S), ranks);
    }
  }
}

void DataParallel::check_same(const std::string& what, const std::string& value) {
  auto all = world_->all_gather_string(value, what);
  for (size_t k = 1; k < all.size(); ++k)
    VQAD_CHECK(all[k] == all[0], "distributed: ", what, " differs between ranks: rank 0 has ", all[0], ", rank ", k,
               " has ", all[k], " (every rank must run the same vqad build on the same resolved config)");
}

void DataParallel::broadcast_parameters(const std::vector<torch::Tensor>& params, const std::string& what) {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params.size(); ++i) {
    auto t = params[i].detach();
    world_->broadcast(t, 0, what + " #" + std::to_string(i));
  }
}

void DataParallel::average_gradients(const std::vector<torch::Tensor>& params, const std::string& what) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  size_t i = 0;
  int bucket = 0;
  while (i < grads.size()) {
    // One bucket: consecutive gradients up to kBucketElements (at least one).
    size_t j = i;
    int64_t n = 0;
    std::vector<torch::Tensor> flat;
    while (j < grads.size() && (j == i || n + grads[j].numel() <= kBucketElements)) {
      n += grads[j].numel();
      flat.push_back(grads[j].detach().reshape({-1}).to(torch::kFloat32));
      ++j;
    }
    auto buf = torch::cat(flat);
    // SUM then one division by the DP degree (with sp_size 1 the same bits as kAvg).
    world_->all_reduce(buf, ReduceOp::kSum, "grads " + what + " bucket " + std::to_string(bucket++));
    buf.div_(static_cast<double>(dp_size()));
    int64_t off = 0;
    for (size_t k = i; k < j; ++k) {
      const int64_t m = grads[k].numel();
      grads[k].copy_(buf.narrow(0, off, m).view(grads[k].sizes()));
      off += m;
    }
    i = j;
  }
}

void DataParallel::average_metrics(std::map<std::string, double>& values, const std::string& what) {
  if (values.empty()) return;
  auto t = torch::empty({static_cast<int64_t>(values.size())}, torch::kFloat64);
  auto* p = t.data_ptr<double>();
  size_t i = 0;
  for (const auto& [k, v] : values) p[i++] = v;
  auto d = t.to(world_->device());
  world_->all_reduce(d, ReduceOp::kAvg, what);
  t = d.cpu();
  p = t.data_ptr<double>();
  i = 0;
  for (auto& [k, v] : values) v = p[i++];
}

double DataParallel::sum(double local, const std::string& what) {
  auto t = torch::full({1}, local, torch::TensorOptions().dtype(torch::kFloat64).device(world_->device()));
  world_->all_reduce(t, ReduceOp::kSum, what);
  return t.item<double>();
}

nlohmann::json DataParallel::mesh_json() const {
  return {{"world_size", world_->size()},
          {"sp_size", mesh_.sp_size},
          {"hsdp_replicate_dim", mesh_.hsdp_replicate_dim},
          {"hsdp_shard_dim", mesh_.hsdp_shard_dim},
          {"dp_size", dp_size()}};
}

}  // namespace vqad::dist
