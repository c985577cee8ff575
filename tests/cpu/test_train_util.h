// Shared pieces of the trainer-level tests: a fresh per-test directory, tiny synthetic
// datasets for the tiny Wan model, quiet trainer options.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "vqad/data/synthetic.h"
#include "vqad/model/wan/config.h"
#include "vqad/train/trainer.h"

namespace vqad::test_train {

// <tmp>/<prefix>_<pid>_<test name>, emptied.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  auto dir = std::filesystem::temp_directory_path() /
             (prefix + "_" + std::to_string(::getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  return dir;
}

// `rows` synthetic rows with latents [16, 2, 4, 4] and the tiny model's text width.
inline void write_tiny_dataset(const std::filesystem::path& dir, int64_t rows, int64_t seed,
                               data::DataKind kind = data::DataKind::T2V) {
  data::SynthOptions so;
  so.kind = kind;
  so.latent_t = 2;
  so.latent_h = 4;
  so.latent_w = 4;
  so.text_dim = model::WanConfig::tiny().text_dim;
  so.seed = seed;
  data::write_synthetic_dataset(dir.string(), rows, so, data::WriterOptions{});
}

inline train::TrainerOptions quiet() {
  train::TrainerOptions o;
  o.progress = false;
  return o;
}

}  // namespace vqad::test_train
