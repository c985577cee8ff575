// Trainer checkpoints off the critical path.
//
// save() waits for the previous save (the next save waits for the previous one, so one
// set of host buffers is reused), checks that every tensor it is about to save is finite,
// copies the weights and AdamW moments into reused host buffers (pinned memory and
// asynchronous device->host copies ordered on the current stream when the model is on a
// GPU), and returns: a background thread then waits for the copies, writes each file with
// large sequential writes and one fsync (hashing it from memory on the side), writes the
// signed metadata and publishes checkpoint-<step> atomically (checkpoint_dir.h), then
// applies retention. A failure of the writer reaches the main thread as a vqad::Error at
// the next save() or wait(), naming the checkpoint and the last good one.
//
// Layout of a checkpoint: <role>/transformer/{config.json,diffusion_pytorch_model.safetensors}
// (the Diffusers layout, fp32), <role>/optimizer.safetensors ("<param>.exp_avg",
// "<param>.exp_avg_sq", "<param>.step" per trainable parameter), trainer_state.json,
// resolved.yaml, metadata.json (files + metadata_sha256), CHECKPOINT_COMPLETE. Either
// tensor file is sharded (index + shards) when larger than the writer's shard size.
//
// Sharded data parallelism (save_sharded, with set_parts): the ranks of the first shard
// group write the checkpoint together, nobody holds the whole model. Each rank writes the
// units it is assigned (FullyShardedModel::unit_writers) as its own files,
// <role>/transformer/diffusion_pytorch_model-part-<r+1>-of-<S>.safetensors and
// <role>/optimizer-part-<r+1>-of-<S>.safetensors (a rank with nothing of a kind writes no
// such file), into a directory of its own (.parts-checkpoint-<step>-r<r>), fsyncs them and
// reports them (names, sha256, tensors) to rank 0 through the rendezvous store. Rank 0's
// writer thread adopts the reported files into its temporary checkpoint directory (a rename
// on the same file system), writes the two index.json files (tensor -> file, the Diffusers
// layout every reader of vqad and Diffusers accepts) and publishes the checkpoint with one
// metadata.json over all files. A rank that fails reports its error and rank 0 publishes
// nothing; any mesh (or one process) resumes the checkpoint through the index files.
#pragma once
#include <torch/torch.h>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "vqad/dist/fully_sharded.h"
#include "vqad/dist/process_group.h"
#include "vqad/train/integrity.h"
#include "vqad/train/optimizer.h"
#include "vqad/train/roles.h"

namespace vqad::train {

// One file of a snapshot: bytes, or host tensors written as a safetensors file.
struct SnapshotFile {
  std::string rel;
  std::string bytes;
  bool safetensors = false;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // host, contiguous
  std::map<std::string, std::string> st_metadata;
  std::string index;  // the index.json (rel) that lists this file's tensors, written by the publisher ("" none)
};

// The ranks that write one checkpoint together (sharded data parallelism): `part` 0 publishes.
struct CheckpointParts {
  dist::ProcessGroup* messages = nullptr;  // post()/await() between the writers
  int part = 0;
  int parts = 1;
  std::chrono::milliseconds timeout{600000};
};

// Host copies of tensors, reused from one save to the next (same key, shape and dtype).
// The buffers are carved out of 1 GiB chunks (pinned when the source is on a GPU), so
// pinned memory is allocated in a few large, exactly sized blocks; prepare() allocates
// them on a background thread ahead of the first save (pinning ~17 GB takes ~15 s).
class HostStaging {
 public:
  struct Spec {
    std::string key;
    std::vector<int64_t> sizes;
    torch::ScalarType dtype;
    torch::Device device;
  };
  ~HostStaging();
  void prepare(std::vector<Spec> specs);  // returns at once; stage() waits for it
  void wait_prepared();                   // rethrows an allocation failure
  // A host tensor holding src's values once synchronize() returns.
  torch::Tensor stage(const std::string& key, const torch::Tensor& src);
  void record();       // main thread, after the last stage(): marks the end of the copies
  void synchronize();  // writer thread: waits for the copies
  size_t bytes();
  size_t allocated_bytes();  // of buffers made by stage() or prepare() since construction

 private:
  void join_prepare();
  torch::Tensor buffer(const std::vector<int64_t>& sizes, torch::ScalarType dtype, bool pinned);
  std::map<std::string, torch::Tensor> buffers_;
  struct Chunk {
    torch::Tensor bytes;  // uint8 [kChunkBytes] (or larger for one big tensor)
    size_t used = 0;
  };
  std::vector<Chunk> chunks_[2];  // [pinned]
  std::thread prepare_thread_;
  std::exception_ptr prepare_error_;
  std::vector<torch::Device> devices_;
  size_t allocated_ = 0;
  struct Pending;
  std::shared_ptr<Pending> pending_;
};

// The safetensors bytes of `tensors` (the layout st::Writer writes: header, then larger
// elements first, by name): header bytes go to *header, the parts reference it and the tensors.
std::vector<std::string_view> safetensors_parts(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                                const std::map<std::string, std::string>& metadata,
                                                std::string* header);

// Where the time of one save went (seconds; `bench checkpoint` prints it).
struct SaveTimings {
  // On the training thread:
  double wait_previous_s = 0;  // waiting for the save before it
  double finite_scan_s = 0;    // non-finite check of every saved tensor
  double stage_s = 0;          // host buffers (allocation) and enqueueing the device->host copies
  double new_host_bytes = 0;   // bytes of host buffers allocated by this save (0 when all were reused)
  // On the writer thread:
  double copy_wait_s = 0;  // waiting for the device->host copies
  double files_s = 0;      // writing + fsyncing + hashing the files
  double publish_s = 0;    // metadata, marker, rename, retention
};

class CheckpointWriter {
 public:
  // Tensor files larger than `shard_bytes` are split into Diffusers/Hugging Face style
  // shards (<prefix>-00001-of-0000N.safetensors + <prefix>.safetensors.index.json), which
  // are written and hashed in parallel (one SHA-256 stream runs at ~1 GB/s).
  static constexpr size_t kDefaultShardBytes = size_t(2) << 30;
  CheckpointWriter(std::string output_dir, int retention_limit, bool async = true,
                   size_t shard_bytes = kDefaultShardBytes);
  ~CheckpointWriter();  // waits for a save in flight (its error is logged)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // A trainer checkpoint of the roles named in `checkpointed` (weights and AdamW state).
  // Returns the seconds the caller was blocked.
  double save(long step, const RoleMap& roles, const std::vector<std::string>& checkpointed,
              const RoleOptimizers& optimizers, nlohmann::json trainer_state, const std::string& resolved_yaml,
              nlohmann::json metadata, const std::string& source_yaml = "");  // "" = no source.yaml
  // Sharded data parallelism: this rank's part of checkpoint-<step> (see the file comment);
  // collective over the shard group of `models` (every rank of the group calls it, also those
  // of other replicate groups do not). trainer_state, resolved_yaml, metadata and source_yaml
  // are used by part 0. Requires set_parts.
  double save_sharded(long step, const RoleMap& roles, const std::vector<std::string>& checkpointed,
                      const std::map<std::string, dist::FullyShardedModel*>& models, const RoleOptimizers& optimizers,
                      nlohmann::json trainer_state, const std::string& resolved_yaml, nlohmann::json metadata,
                      const std::string& source_yaml = "");
  void set_parts(CheckpointParts parts) { parts_ = parts; }
  // The host buffers of this rank's part (save_sharded), allocated in the background.
  void prepare_sharded(const std::vector<std::string>& checkpointed,
                       const std::map<std::string, dist::FullyShardedModel*>& models,
                       const RoleOptimizers& optimizers);
  // Allocates the host buffers of these roles' checkpoints (weights and AdamW moments) in
  // the background, so that the first save does not wait for them.
  void prepare(const RoleMap& roles, const std::vector<std::string>& checkpointed, const RoleOptimizers& optimizers);
  void wait_prepared() { staging_.wait_prepared(); }
  // Any set of files (benchmarks, tests): build() stages tensors and lists the files.
  double save_files(long step, const std::function<void(HostStaging&, std::vector<SnapshotFile>&)>& build,
                    nlohmann::json metadata);
  // Waits for the save in flight; rethrows its failure.
  void wait();
  // Newest checkpoint known complete and good: published by this writer, or the one set
  // with set_last_good (the checkpoint a run resumed from). "" when none.
  std::string last_good() const;
  void set_last_good(std::string path);
  std::vector<std::string> written() const;
  bool busy() const { return worker_.joinable(); }
  double last_write_seconds() const { return last_write_s_; }
  size_t last_bytes() const { return last_bytes_; }
  SaveTimings last_timings() const;

 private:
  double save_files_timed(long step, const std::function<void(HostStaging&, std::vector<SnapshotFile>&)>& build,
                          nlohmann::json metadata, double waited, double scan);
  void run_write(long step, std::vector<SnapshotFile> files, nlohmann::json metadata);
  void write_peer_part(long step, const std::vector<SnapshotFile>& files);
  size_t adopt_parts(long step, const std::string& dir, const std::vector<SnapshotFile>& own,
                     std::map<std::string, std::string>& known);
  CheckpointParts parts_;
  long part_seq_ = 0;        // saves of this writer (the same count on every rank)
  long in_flight_seq_ = -1;  // the save being written: its messages' keys
  std::string output_dir_;
  int retention_ = 0;
  bool async_ = true;
  size_t shard_bytes_ = kDefaultShardBytes;
  HostStaging staging_;
  std::thread worker_;
  std::exception_ptr error_;
  long in_flight_step_ = -1;
  mutable std::mutex mu_;
  std::string last_good_;
  std::vector<std::string> written_;
  double last_write_s_ = 0;
  size_t last_bytes_ = 0;
  SaveTimings timings_;
};

// Verifies dir (metadata hashes), loads the weights and AdamW state of the roles named in
// `checkpointed` and returns trainer_state.json (validated: step, data, generator_state,
// optimizer_updates). Every failure is one vqad::Error naming the file. With
// `optimizer_state_on_host` the AdamW moments stay host views of the files (a sharded run
// then moves only its slices to the device: FullyShardedModel::shard_adamw_state).
struct LoadTimings {
  double verify_s = 0, weights_s = 0, optimizer_s = 0;
};
nlohmann::json load_checkpoint_state(const std::string& dir, RoleMap& roles,
                                     const std::vector<std::string>& checkpointed, RoleOptimizers& optimizers,
                                     LoadTimings* timings = nullptr, bool optimizer_state_on_host = false);

}  // namespace vqad::train
