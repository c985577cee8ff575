// Batch sampler for data x sequence parallel training (FastVideo's DP_SP_BatchSampler).
//
// One seeded CPU permutation of all rows (torch.randperm with a generator seeded by
// `seed`, so the order equals FastVideo's for the same LibTorch); it is cut (drop_last)
// or cyclically padded to a multiple of num_sp_groups * batch_size, and SP group g takes
// perm[g::num_sp_groups] in consecutive chunks of batch_size. All ranks of one SP group
// get the same batches; the data-parallel index is rank / sp_size. FastVideo repeats the
// same order every epoch; reshuffle_each_epoch draws epoch e's permutation from seed + e.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

namespace vqad::data {

struct SamplerOptions {
  int64_t dataset_size = 0;
  int64_t batch_size = 1;
  int64_t num_sp_groups = 1;  // = world_size / sp_size
  int64_t sp_group = 0;       // = rank / sp_size
  int64_t seed = 0;
  bool drop_last = true;
  bool reshuffle_each_epoch = false;
};

// Options for a rank of a torchrun world (validates world % sp == 0).
SamplerOptions sampler_options_for_rank(int64_t dataset_size, int64_t batch_size, int64_t world_size,
                                        int64_t sp_size, int64_t rank, int64_t seed,
                                        bool drop_last = true);

struct SamplerPosition {
  int64_t epoch = 0;
  int64_t batch = 0;  // next batch within the epoch
  bool operator==(const SamplerPosition&) const = default;
};

class DpSpBatchSampler {
 public:
  explicit DpSpBatchSampler(SamplerOptions options);

  const SamplerOptions& options() const { return options_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // This SP group's row indices for the whole epoch (batch b = [b*bs, (b+1)*bs)).
  std::vector<int64_t> epoch_indices(int64_t epoch) const;
  std::vector<int64_t> batch_at(SamplerPosition pos) const;

  // Returns the batch at position() and advances (rolling over to the next epoch).
  std::vector<int64_t> next();
  SamplerPosition position() const { return pos_; }
  void set_position(SamplerPosition pos);

  // Resumable state: the position plus the identity of the order, which load_state
  // checks so that a resume never silently continues a different order.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  std::vector<int64_t> permutation(int64_t epoch) const;
  const std::vector<int64_t>& indices_for(int64_t epoch) const;
  SamplerOptions options_;
  int64_t batches_per_epoch_ = 0;
  SamplerPosition pos_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_;
};

}  // namespace vqad::data
