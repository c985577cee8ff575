// Prefetching loader: a background thread reads the sampler's next batches into a
// bounded queue while the trainer computes. state() is the position of the next batch
// the *caller* will receive (not of what the thread has read ahead), so a checkpoint
// taken between steps resumes exactly where the consumer stopped.
#pragma once
#include <nlohmann/json.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "vqad/data/dataset.h"
#include "vqad/data/sampler.h"

namespace vqad::data {

class PrefetchLoader {
 public:
  // prefetch_depth >= 1 batches are read ahead; 0 reads synchronously in next().
  PrefetchLoader(std::shared_ptr<const Dataset> dataset, DpSpBatchSampler sampler,
                 size_t prefetch_depth = 2);
  ~PrefetchLoader();
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  // The next batch; rethrows an error of the reading thread (with its file/row context).
  Batch next();
  SamplerPosition position() const;
  nlohmann::json state() const;
  // Restarts reading from the saved position (discarding read-ahead batches).
  void load_state(const nlohmann::json& state);
  const DpSpBatchSampler& sampler() const { return sampler_; }

 private:
  void start();
  void stop();
  void run();

  std::shared_ptr<const Dataset> dataset_;
  DpSpBatchSampler sampler_;  // advanced by the reading thread
  size_t depth_;
  SamplerPosition consumer_pos_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Item {
    SamplerPosition after;
    Batch batch;
  };
  std::deque<Item> queue_;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace vqad::data
