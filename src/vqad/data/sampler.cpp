#include "vqad/data/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "vqad/core/error.h"

namespace vqad::data {

SamplerOptions sampler_options_for_rank(int64_t dataset_size, int64_t batch_size, int64_t world_size,
                                        int64_t sp_size, int64_t rank, int64_t seed, bool drop_last) {
  VQAD_CHECK(world_size > 0 && sp_size > 0 && world_size % sp_size == 0,
             "data sampler: world size ", world_size, " is not a multiple of sp_size ", sp_size);
  VQAD_CHECK(rank >= 0 && rank < world_size, "data sampler: rank ", rank,
             " is outside the world of ", world_size);
  SamplerOptions o;
  o.dataset_size = dataset_size;
  o.batch_size = batch_size;
  o.num_sp_groups = world_size / sp_size;
  o.sp_group = rank / sp_size;
  o.seed = seed;
  o.drop_last = drop_last;
  return o;
}

DpSpBatchSampler::DpSpBatchSampler(SamplerOptions o) : options_(o) {
  VQAD_CHECK(o.dataset_size > 0, "data sampler: the dataset is empty");
  VQAD_CHECK(o.batch_size > 0, "data sampler: train_batch_size must be positive, found ", o.batch_size);
  VQAD_CHECK(o.num_sp_groups > 0 && o.sp_group >= 0 && o.sp_group < o.num_sp_groups,
             "data sampler: SP group ", o.sp_group, " is outside [0, ", o.num_sp_groups, ")");
  const int64_t global = o.num_sp_groups * o.batch_size;
  if (o.drop_last) {
    batches_per_epoch_ = (o.dataset_size / o.batch_size) / o.num_sp_groups;
    VQAD_CHECK(batches_per_epoch_ > 0, "data sampler: ", o.dataset_size,
               " rows are fewer than one global batch (", o.num_sp_groups, " SP groups x batch ",
               o.batch_size, " = ", global, ") with drop_last");
  } else {
    batches_per_epoch_ = (o.dataset_size + global - 1) / global;
  }
}

std::vector<int64_t> DpSpBatchSampler::permutation(int64_t epoch) const {
  const int64_t seed = options_.reshuffle_each_epoch ? options_.seed + epoch : options_.seed;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(seed));
  auto perm = torch::randperm(options_.dataset_size, gen, torch::TensorOptions().dtype(torch::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + options_.dataset_size);
}

const std::vector<int64_t>& DpSpBatchSampler::indices_for(int64_t epoch) const {
  const int64_t key = options_.reshuffle_each_epoch ? epoch : 0;
  if (cached_epoch_ != key) {
    std::vector<int64_t> perm = permutation(epoch);
    const int64_t G = options_.num_sp_groups, bs = options_.batch_size;
    const int64_t total = batches_per_epoch_ * G * bs;
    if (int64_t(perm.size()) > total) {
      perm.resize(size_t(total));
    } else {
      // Pad cyclically from the start of the permutation (FastVideo pads with perm[:pad]).
      for (int64_t i = 0; int64_t(perm.size()) < total; ++i) perm.push_back(perm[size_t(i)]);
    }
    std::vector<int64_t> mine;
    mine.reserve(size_t(batches_per_epoch_ * bs));
    for (int64_t i = options_.sp_group; i < total; i += G) mine.push_back(perm[size_t(i)]);
    cached_ = std::move(mine);
    cached_epoch_ = key;
  }
  return cached_;
}

std::vector<int64_t> DpSpBatchSampler::epoch_indices(int64_t epoch) const { return indices_for(epoch); }

std::vector<int64_t> DpSpBatchSampler::batch_at(SamplerPosition pos) const {
  VQAD_CHECK(pos.epoch >= 0 && pos.batch >= 0 && pos.batch < batches_per_epoch_,
             "data sampler: position (epoch ", pos.epoch, ", batch ", pos.batch,
             ") is outside an epoch of ", batches_per_epoch_, " batches");
  const auto& all = indices_for(pos.epoch);
  const int64_t bs = options_.batch_size;
  return std::vector<int64_t>(all.begin() + pos.batch * bs, all.begin() + (pos.batch + 1) * bs);
}

std::vector<int64_t> DpSpBatchSampler::next() {
  auto b = batch_at(pos_);
  if (++pos_.batch == batches_per_epoch_) {
    pos_.batch = 0;
    ++pos_.epoch;
  }
  return b;
}

void DpSpBatchSampler::set_position(SamplerPosition pos) {
  VQAD_CHECK(pos.epoch >= 0 && pos.batch >= 0 && pos.batch < batches_per_epoch_,
             "data sampler: position (epoch ", pos.epoch, ", batch ", pos.batch,
             ") is outside an epoch of ", batches_per_epoch_, " batches");
  pos_ = pos;
}

nlohmann::json DpSpBatchSampler::state() const {
  return {{"kind", "dp_sp_batch_sampler"},
          {"version", 1},
          {"dataset_size", options_.dataset_size},
          {"batch_size", options_.batch_size},
          {"num_sp_groups", options_.num_sp_groups},
          {"sp_group", options_.sp_group},
          {"global_batch_size", options_.batch_size * options_.num_sp_groups},
          {"seed", options_.seed},
          {"drop_last", options_.drop_last},
          {"reshuffle_each_epoch", options_.reshuffle_each_epoch},
          {"epoch", pos_.epoch},
          {"batch", pos_.batch}};
}

void DpSpBatchSampler::load_state(const nlohmann::json& s) {
  VQAD_CHECK(s.is_object() && s.value("kind", "") == "dp_sp_batch_sampler",
             "data sampler state: expected an object of kind 'dp_sp_batch_sampler', found ",
             s.dump());
  auto same = [&](const char* key, auto mine) {
    VQAD_CHECK(s.contains(key), "data sampler state: missing key '", key, "'");
    auto theirs = s.at(key).get<decltype(mine)>();
    VQAD_CHECK(theirs == mine, "data sampler state: '", key, "' is ", theirs,
               " in the saved state but ", mine,
               " now; resuming would continue a different data order");
  };
  same("dataset_size", options_.dataset_size);
  // The position counts global batches: it means the same rows on any number of SP groups
  // with the same global batch (group g takes rows g::G of each global batch), so a run
  // resumes on a different world size as long as the global batch is unchanged.
  VQAD_CHECK(s.contains("batch_size") && s.contains("num_sp_groups"),
             "data sampler state: missing key 'batch_size' or 'num_sp_groups'");
  const int64_t saved_bs = s.at("batch_size").get<int64_t>(), saved_groups = s.at("num_sp_groups").get<int64_t>();
  VQAD_CHECK(saved_bs * saved_groups == options_.batch_size * options_.num_sp_groups,
             "data sampler state: the global batch was ", saved_bs * saved_groups, " (", saved_groups,
             " data-parallel groups x batch ", saved_bs, ") in the saved state but is ",
             options_.batch_size * options_.num_sp_groups, " (", options_.num_sp_groups, " x ",
             options_.batch_size, ") now; resuming would continue a different data order (keep num_gpus / sp_size x "
             "train_batch_size constant)");
  same("seed", options_.seed);
  same("drop_last", options_.drop_last);
  same("reshuffle_each_epoch", options_.reshuffle_each_epoch);
  set_position({s.at("epoch").get<int64_t>(), s.at("batch").get<int64_t>()});
}

}  // namespace vqad::data
