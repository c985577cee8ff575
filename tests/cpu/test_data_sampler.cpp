// DP x SP batch sampler and the prefetching loader: order determinism, SP-group
// striding, resume from serialized state, error propagation from the reading thread.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <set>

#include "test_data_util.h"
#include "vqad/core/error.h"
#include "vqad/data/loader.h"
#include "vqad/data/parquet_writer.h"
#include "vqad/data/sampler.h"

namespace fs = std::filesystem;
using namespace vqad::data;
using namespace vqad::test_data;

namespace {

std::vector<std::vector<int64_t>> take(DpSpBatchSampler& s, int n) {
  std::vector<std::vector<int64_t>> out;
  for (int i = 0; i < n; ++i) out.push_back(s.next());
  return out;
}

// A small text_only dataset whose row g holds the value g everywhere.
std::string value_dataset(const fs::path& dir, int64_t rows) {
  WriterOptions w;
  w.kind = DataKind::TextOnly;
  w.rows_per_file = 4;
  w.row_group_rows = 2;
  ParquetDatasetWriter writer(dir.string(), w);
  for (int64_t g = 0; g < rows; ++g) {
    ParquetRecord r;
    r.id = std::to_string(g);
    r.caption = "row " + std::to_string(g);
    r.text = torch::full({1 + g % 3, 4}, float(g));
    writer.add(r);
  }
  writer.close();
  return dir.string();
}

DatasetOptions value_options() {
  DatasetOptions o;
  o.kind = DataKind::TextOnly;
  o.text_dim = 4;
  o.text_len = 8;
  o.cfg_rate = 0.3;
  o.seed = 1000;
  return o;
}

}  // namespace

TEST(DataSampler, PermutationIsSeededTorchRandperm) {
  SamplerOptions o;
  o.dataset_size = 37;
  o.seed = 1000;
  DpSpBatchSampler s(o);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000);
  auto perm = torch::randperm(37, gen, torch::kLong);
  auto idx = s.epoch_indices(0);
  ASSERT_EQ(idx.size(), 37u);
  for (int64_t i = 0; i < 37; ++i) EXPECT_EQ(idx[size_t(i)], perm[i].item<int64_t>());
  std::set<int64_t> uniq(idx.begin(), idx.end());
  EXPECT_EQ(uniq.size(), 37u);
  // Another seed gives another order; the same seed the same order.
  o.seed = 1001;
  EXPECT_NE(DpSpBatchSampler(o).epoch_indices(0), idx);
  o.seed = 1000;
  EXPECT_EQ(DpSpBatchSampler(o).epoch_indices(0), idx);
  // FastVideo repeats the order every epoch; reshuffle_each_epoch changes it.
  EXPECT_EQ(s.epoch_indices(3), idx);
  o.reshuffle_each_epoch = true;
  DpSpBatchSampler r(o);
  EXPECT_EQ(r.epoch_indices(0), idx);
  EXPECT_NE(r.epoch_indices(1), idx);
}

TEST(DataSampler, SpGroupStridingAndDropLast) {
  const int64_t N = 23, bs = 2, world = 8, sp = 4;  // 2 SP groups
  std::vector<std::vector<int64_t>> per_rank;
  for (int64_t rank = 0; rank < world; ++rank) {
    DpSpBatchSampler s(sampler_options_for_rank(N, bs, world, sp, rank, 42));
    // drop_last: floor(floor(23/2)/2) = 5 batches per group.
    ASSERT_EQ(s.batches_per_epoch(), 5);
    std::vector<int64_t> flat;
    for (int b = 0; b < 5; ++b) {
      auto batch = s.next();
      ASSERT_EQ(batch.size(), 2u);
      flat.insert(flat.end(), batch.begin(), batch.end());
    }
    per_rank.push_back(flat);
  }
  // Ranks of one SP group see identical batches.
  for (int r = 1; r < 4; ++r) EXPECT_EQ(per_rank[size_t(r)], per_rank[0]);
  for (int r = 5; r < 8; ++r) EXPECT_EQ(per_rank[size_t(r)], per_rank[4]);
  // Groups take perm[g::2] of the truncated permutation: disjoint, union = first 20.
  DpSpBatchSampler ref(SamplerOptions{N, 1, 1, 0, 42});
  auto perm = ref.epoch_indices(0);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(per_rank[0][i], perm[2 * i]);
    EXPECT_EQ(per_rank[4][i], perm[2 * i + 1]);
  }
  std::set<int64_t> all(per_rank[0].begin(), per_rank[0].end());
  all.insert(per_rank[4].begin(), per_rank[4].end());
  EXPECT_EQ(all.size(), 20u);
  // Without drop_last the epoch is padded cyclically from the permutation start.
  SamplerOptions o{N, bs, 2, 1, 42};
  o.drop_last = false;
  DpSpBatchSampler pad(o);
  EXPECT_EQ(pad.batches_per_epoch(), 6);
  auto idx = pad.epoch_indices(0);
  ASSERT_EQ(idx.size(), 12u);
  EXPECT_EQ(idx.back(), perm[0]);  // padded element 23 = perm[0], odd position -> group 1
}

TEST(DataSampler, InvalidConfigurationsAreErrors) {
  EXPECT_THROW(sampler_options_for_rank(10, 1, 6, 4, 0, 0), vqad::Error);  // 6 % 4 != 0
  EXPECT_THROW(sampler_options_for_rank(10, 1, 4, 4, 4, 0), vqad::Error);  // rank outside
  EXPECT_THROW(DpSpBatchSampler(SamplerOptions{3, 2, 2, 0, 0}), vqad::Error);  // < one global batch
  EXPECT_THROW(DpSpBatchSampler(SamplerOptions{0, 1, 1, 0, 0}), vqad::Error);
}

TEST(DataSampler, ResumeFromJsonStateContinuesTheSameOrder) {
  SamplerOptions o{11, 3, 1, 0, 7};
  DpSpBatchSampler full(o);
  auto expect = take(full, 9);  // 3 batches per epoch: crosses two epoch boundaries
  DpSpBatchSampler first(o);
  take(first, 4);
  const std::string saved = first.state().dump();
  DpSpBatchSampler resumed(o);
  resumed.load_state(nlohmann::json::parse(saved));
  EXPECT_EQ(resumed.position(), (SamplerPosition{1, 1}));
  auto rest = take(resumed, 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(rest[size_t(i)], expect[size_t(4 + i)]);
  // A state of another order is refused.
  SamplerOptions other = o;
  other.seed = 8;
  DpSpBatchSampler wrong(other);
  try {
    wrong.load_state(nlohmann::json::parse(saved));
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'seed'"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, PrefetchedBatchesEqualSynchronousReadsAndResume) {
  auto dir = fresh_dir("loader");
  auto root = value_dataset(dir, 13);
  auto ds = ParquetDataset::open(root, value_options());
  SamplerOptions so{ds->size(), 2, 1, 0, 99};
  std::vector<Batch> expect;
  {
    PrefetchLoader sync(ds, DpSpBatchSampler(so), 0);
    for (int i = 0; i < 15; ++i) expect.push_back(sync.next());
  }
  nlohmann::json saved;
  {
    PrefetchLoader loader(ds, DpSpBatchSampler(so), 3);
    for (int i = 0; i < 8; ++i) {
      Batch b = loader.next();
      ASSERT_EQ(b.indices, expect[size_t(i)].indices);
      EXPECT_TRUE(torch::equal(b.text, expect[size_t(i)].text));
      EXPECT_EQ(b.text_dropped, expect[size_t(i)].text_dropped);
      // Values identify the row; dropped rows are zero.
      for (size_t k = 0; k < b.indices.size(); ++k) {
        const float v = b.text_dropped[k] ? 0.0f : float(b.indices[k]);
        EXPECT_EQ(b.text[long(k)][0][0].item<float>(), v);
        EXPECT_EQ(b.captions[k], "row " + std::to_string(b.indices[k]));
      }
    }
    // The state is the consumer's position even though the thread has read ahead.
    saved = loader.state();
    EXPECT_EQ(saved["epoch"], 1);  // 6 batches per epoch
    EXPECT_EQ(saved["batch"], 2);
  }
  // A fresh process: new dataset, new loader, restored state.
  auto ds2 = ParquetDataset::open(root, value_options());
  PrefetchLoader resumed(ds2, DpSpBatchSampler(so), 2);
  resumed.load_state(nlohmann::json::parse(saved.dump()));
  for (int i = 8; i < 15; ++i) {
    Batch b = resumed.next();
    ASSERT_EQ(b.indices, expect[size_t(i)].indices) << "batch " << i;
    EXPECT_TRUE(torch::equal(b.text, expect[size_t(i)].text));
    EXPECT_TRUE(torch::equal(b.text_mask, expect[size_t(i)].text_mask));
    EXPECT_EQ(b.text_dropped, expect[size_t(i)].text_dropped);
  }
  fs::remove_all(dir);
}

TEST(DataLoader, ReadErrorsReachTheConsumerWithFileContext) {
  auto dir = fresh_dir("loader_err");
  auto root = value_dataset(dir, 8);
  // Destroy the data pages of the second file, keeping its footer.
  corrupt_data_pages(dir / "data_chunk_000001.parquet", 200);
  auto ds = ParquetDataset::open(root, value_options());
  PrefetchLoader loader(ds, DpSpBatchSampler(SamplerOptions{8, 8, 1, 0, 0}), 2);
  try {
    loader.next();
    FAIL() << "expected an error";
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("data_chunk_000001.parquet"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
