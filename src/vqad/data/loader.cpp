#include "vqad/data/loader.h"

#include "vqad/core/error.h"

namespace vqad::data {

PrefetchLoader::PrefetchLoader(std::shared_ptr<const Dataset> dataset, DpSpBatchSampler sampler,
                               size_t prefetch_depth)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), depth_(prefetch_depth) {
  VQAD_CHECK(dataset_ != nullptr, "data loader: no dataset");
  VQAD_CHECK(sampler_.options().dataset_size == dataset_->size(), "data loader: the sampler covers ",
             sampler_.options().dataset_size, " rows but the dataset (", dataset_->description(), ") has ",
             dataset_->size());
  consumer_pos_ = sampler_.position();
  start();
}

PrefetchLoader::~PrefetchLoader() { stop(); }

void PrefetchLoader::start() {
  if (depth_ == 0) return;
  stopping_ = false;
  thread_ = std::thread([this] { run(); });
}

void PrefetchLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PrefetchLoader::run() {
  for (;;) {
    std::vector<int64_t> indices;
    SamplerPosition after;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || (queue_.size() < depth_ && !error_); });
      if (stopping_) return;
      indices = sampler_.next();
      after = sampler_.position();
    }
    try {
      Batch b = dataset_->get_batch(indices);
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({after, std::move(b)});
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

Batch PrefetchLoader::next() {
  if (depth_ == 0) {
    Batch b = dataset_->get_batch(sampler_.next());
    consumer_pos_ = sampler_.position();
    return b;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  if (queue_.empty() && error_) std::rethrow_exception(error_);
  Item item = std::move(queue_.front());
  queue_.pop_front();
  consumer_pos_ = item.after;
  lock.unlock();
  cv_.notify_all();
  return std::move(item.batch);
}

SamplerPosition PrefetchLoader::position() const {
  std::lock_guard<std::mutex> lock(mu_);
  return consumer_pos_;
}

nlohmann::json PrefetchLoader::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json s = sampler_.state();
  s["epoch"] = consumer_pos_.epoch;
  s["batch"] = consumer_pos_.batch;
  s["dataset_root"] = dataset_->root();
  return s;
}

void PrefetchLoader::load_state(const nlohmann::json& state) {
  stop();
  nlohmann::json s = state;
  s.erase("dataset_root");
  try {
    sampler_.load_state(s);
  } catch (...) {
    start();
    throw;
  }
  consumer_pos_ = sampler_.position();
  queue_.clear();
  error_ = nullptr;
  start();
}

}  // namespace vqad::data
