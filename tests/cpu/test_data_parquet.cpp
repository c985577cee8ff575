// FastVideo parquet reader/writer: pyarrow-written fixtures read by vqad, vqad-written
// files read by pyarrow, padding/cropping, normalization, dropout and every error case.
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <gtest/gtest.h>
#include <parquet/arrow/writer.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>

#include "tests/support/errors.h"
#include "test_data_util.h"
#include "vqad/core/error.h"
#include "vqad/data/latent_norm.h"
#include "vqad/data/parquet_dataset.h"
#include "vqad/data/parquet_writer.h"
#include "vqad/data/py_random.h"
#include "vqad/data/synthetic.h"

namespace fs = std::filesystem;
using namespace vqad::data;
using namespace vqad::test_data;

namespace {

DatasetOptions raw_options(DataKind kind = DataKind::T2V) {
  DatasetOptions o;
  o.kind = kind;
  o.normalize_latents = false;
  return o;
}

const int64_t kFixtureTokens[5] = {3, 5, 7, 4, 9};

using vqad::test::error_of;

// Fixture-formula rows written by vqad.
ParquetRecord formula_record(int64_t g, int64_t tokens, DataKind kind) {
  ParquetRecord r;
  r.id = "clip_" + std::string(g < 10 ? "00" : "0") + std::to_string(g);
  r.caption = "caption " + std::to_string(g);
  auto text = torch::empty({tokens, 4096});
  auto* t = text.data_ptr<float>();
  for (int64_t i = 0; i < text.numel(); ++i) t[i] = fixture_text(g, i);
  r.text = text;
  if (kind == DataKind::T2V) {
    auto lat = torch::empty({16, 3, 4, 6});
    auto* p = lat.data_ptr<float>();
    for (int64_t i = 0; i < lat.numel(); ++i) p[i] = fixture_latent(g, i);
    r.latent = lat;
    r.file_name = "clip.mp4";
    r.width = 48;
    r.height = 32;
    r.num_frames = 3;
    r.fps = 16.0;
    r.duration_sec = 1.5;
  }
  return r;
}

// A t2v file whose one row has the given latent bytes and declared shape (for the
// mismatch cases the vqad writer cannot produce).
void write_raw_latent_file(const std::string& path, const std::vector<uint8_t>& latent_bytes,
                           const std::vector<int64_t>& latent_shape) {
  arrow::StringBuilder id, caption, dtype;
  arrow::BinaryBuilder lb, tb;
  arrow::ListBuilder ls(arrow::default_memory_pool(), std::make_shared<arrow::Int64Builder>());
  arrow::ListBuilder ts(arrow::default_memory_pool(), std::make_shared<arrow::Int64Builder>());
  ASSERT_TRUE(id.Append("bad").ok());
  ASSERT_TRUE(caption.Append("bad row").ok());
  ASSERT_TRUE(dtype.Append("float32").ok());
  ASSERT_TRUE(lb.Append(latent_bytes.data(), int64_t(latent_bytes.size())).ok());
  ASSERT_TRUE(ls.Append().ok());
  for (auto d : latent_shape) ASSERT_TRUE(static_cast<arrow::Int64Builder*>(ls.value_builder())->Append(d).ok());
  std::vector<float> text(2 * 4096, 1.0f);
  ASSERT_TRUE(tb.Append(reinterpret_cast<const uint8_t*>(text.data()), int64_t(text.size() * 4)).ok());
  ASSERT_TRUE(ts.Append().ok());
  ASSERT_TRUE(static_cast<arrow::Int64Builder*>(ts.value_builder())->Append(2).ok());
  ASSERT_TRUE(static_cast<arrow::Int64Builder*>(ts.value_builder())->Append(4096).ok());
  std::shared_ptr<arrow::Array> a_id, a_cap, a_dt, a_lb, a_ls, a_tb, a_ts;
  ASSERT_TRUE(id.Finish(&a_id).ok());
  ASSERT_TRUE(caption.Finish(&a_cap).ok());
  ASSERT_TRUE(dtype.Finish(&a_dt).ok());
  ASSERT_TRUE(lb.Finish(&a_lb).ok());
  ASSERT_TRUE(ls.Finish(&a_ls).ok());
  ASSERT_TRUE(tb.Finish(&a_tb).ok());
  ASSERT_TRUE(ts.Finish(&a_ts).ok());
  auto schema = arrow::schema({arrow::field("id", arrow::utf8()), arrow::field("caption", arrow::utf8()),
                               arrow::field("vae_latent_bytes", arrow::binary()),
                               arrow::field("vae_latent_shape", arrow::list(arrow::int64())),
                               arrow::field("vae_latent_dtype", arrow::utf8()),
                               arrow::field("text_embedding_bytes", arrow::binary()),
                               arrow::field("text_embedding_shape", arrow::list(arrow::int64()))});
  auto table = arrow::Table::Make(schema, {a_id, a_cap, a_lb, a_ls, a_dt, a_tb, a_ts});
  auto out = arrow::io::FileOutputStream::Open(path).ValueOrDie();
  ASSERT_TRUE(parquet::arrow::WriteTable(*table, arrow::default_memory_pool(), out, 8).ok());
  ASSERT_TRUE(out->Close().ok());
}

}  // namespace

TEST(DataPyRandom, MatchesCPythonKnownValues) {
  // random.Random(0).random() and random.Random(42).random() in CPython.
  EXPECT_DOUBLE_EQ(PyRandom(0).random(), 0.8444218515250481);
  EXPECT_DOUBLE_EQ(PyRandom(42).random(), 0.6394267984578837);
}

TEST(DataPyRandom, MatchesCPythonAcrossSeedWidths) {
  const std::string py = python_exe();
  ASSERT_FALSE(py.empty()) << "VQAD_PYTHON_EXE is not defined for the tests";
  const std::vector<int64_t> seeds = {1, 1000 ^ 3, 4294967295LL, 4294967296LL, (1LL << 40) + 12345, -7};
  std::string list;
  for (auto s : seeds) list += (list.empty() ? "" : ",") + std::to_string(s);
  auto r = run_command(py + " -c \"import random; print(' '.join(repr(random.Random(s).random()) for s in [" +
                       list + "]))\"");
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream is(r.output);
  for (auto s : seeds) {
    double expect = 0;
    is >> expect;
    EXPECT_DOUBLE_EQ(PyRandom(s).random(), expect) << "seed " << s;
  }
}

TEST(DataParquet, FindsFilesRecursivelyInPathOrder) {
  auto files = find_parquet_files(fixture_root() + "/t2v");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_NE(files[0].find("worker_0/data_chunk_0.parquet"), std::string::npos);
  EXPECT_NE(files[1].find("worker_1/data_chunk_0.parquet"), std::string::npos);
}

TEST(DataParquet, ReadsPyarrowT2VFixture) {
  auto ds = ParquetDataset::open(fixture_root() + "/t2v", raw_options());
  ASSERT_EQ(ds->size(), 5);
  ASSERT_EQ(ds->files().size(), 2u);
  EXPECT_EQ(ds->files()[0].row_groups.size(), 2u);  // written with row_group_size=2
  auto loc = ds->locate(2);
  EXPECT_EQ(loc.file, 0u);
  EXPECT_EQ(loc.row_group, 1);
  EXPECT_EQ(loc.row_in_group, 0);
  loc = ds->locate(4);
  EXPECT_EQ(loc.file, 1u);
  EXPECT_EQ(loc.row_in_file, 1);
  for (int64_t g = 4; g >= 0; --g) {  // reverse order: no reliance on sequential reads
    Sample s = ds->get(g);
    EXPECT_EQ(s.index, g);
    EXPECT_EQ(s.id, "clip_00" + std::to_string(g));
    EXPECT_EQ(s.caption, "caption " + std::to_string(g));
    EXPECT_EQ(s.info.file_name, "clip_00" + std::to_string(g) + ".mp4");
    EXPECT_EQ(s.info.media_type, "video");
    EXPECT_EQ(s.info.width, 48);
    EXPECT_EQ(s.info.height, 32);
    EXPECT_EQ(s.info.num_frames, 3);
    EXPECT_DOUBLE_EQ(s.info.fps, 16.0);
    EXPECT_DOUBLE_EQ(s.info.duration_sec, 1.5 + double(g));
    ASSERT_EQ(s.latent.sizes(), (std::vector<int64_t>{16, 3, 4, 6}));
    const float* p = s.latent.data_ptr<float>();
    for (int64_t i = 0; i < s.latent.numel(); ++i) ASSERT_EQ(p[i], fixture_latent(g, i)) << "row " << g << " i " << i;
    const int64_t L = kFixtureTokens[g];
    EXPECT_EQ(s.text_tokens, L);
    ASSERT_EQ(s.text.sizes(), (std::vector<int64_t>{512, 4096}));
    const float* t = s.text.data_ptr<float>();
    for (int64_t i = 0; i < L * 4096; ++i) ASSERT_EQ(t[i], fixture_text(g, i)) << "row " << g << " i " << i;
    EXPECT_EQ(s.text.narrow(0, L, 512 - L).abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(s.text_mask.narrow(0, 0, L).sum().item<float>(), float(L));
    EXPECT_EQ(s.text_mask.narrow(0, L, 512 - L).sum().item<float>(), 0.0f);
    EXPECT_FALSE(s.text_dropped);
  }
}

TEST(DataParquet, ReadsPyarrowTextOnlyFixture) {
  auto ds = ParquetDataset::open(fixture_root() + "/text_only", raw_options(DataKind::TextOnly));
  ASSERT_EQ(ds->size(), 3);
  auto b = ds->get_batch({2, 0});
  EXPECT_FALSE(b.latent.defined());
  ASSERT_EQ(b.text.sizes(), (std::vector<int64_t>{2, 512, 4096}));
  EXPECT_EQ(b.ids, (std::vector<std::string>{"clip_002", "clip_000"}));
  // text_only stores the 512-padded embedding, so the mask covers all 512 rows.
  EXPECT_EQ(b.text_mask.sum().item<float>(), 1024.0f);
  for (int k = 0; k < 2; ++k) {
    const int64_t g = b.indices[size_t(k)], real = (2 + g) * 4096;
    const float* t = b.text[k].data_ptr<float>();
    for (int64_t i = 0; i < 512 * 4096; ++i) ASSERT_EQ(t[i], i < real ? fixture_text(g, i) : 0.0f);
  }
}

TEST(DataParquet, NormalizesPerChannelAndSlicesFrames) {
  DatasetOptions o;
  o.num_latent_t = 2;
  auto ds = ParquetDataset::open(fixture_root() + "/t2v", o);
  Sample s = ds->get(3);
  ASSERT_EQ(s.latent.sizes(), (std::vector<int64_t>{16, 2, 4, 6}));
  auto acc = s.latent.accessor<float, 4>();
  for (int64_t c = 0; c < 16; ++c)
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t w = 0; w < 6; ++w) {
          const int64_t i = ((c * 3 + t) * 4 + h) * 6 + w;
          const float expect = (fixture_latent(3, i) - kWanLatentMean[size_t(c)]) / kWanLatentStd[size_t(c)];
          ASSERT_EQ(acc[c][t][h][w], expect);
        }
  // FastVideo's bf16 order: cast, normalize in fp32, store bf16.
  o.bf16_latents = true;
  auto ds16 = ParquetDataset::open(fixture_root() + "/t2v", o);
  Sample s16 = ds16->get(3);
  ASSERT_EQ(s16.latent.scalar_type(), torch::kBFloat16);
  auto raw = ParquetDataset::open(fixture_root() + "/t2v", raw_options())->get(3).latent.narrow(1, 0, 2);
  auto mean = torch::tensor(std::vector<float>(kWanLatentMean.begin(), kWanLatentMean.end())).view({16, 1, 1, 1});
  auto sd = torch::tensor(std::vector<float>(kWanLatentStd.begin(), kWanLatentStd.end())).view({16, 1, 1, 1});
  auto expect16 = ((raw.to(torch::kBFloat16).to(torch::kFloat32) - mean) / sd).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(s16.latent, expect16));
  // Round trip through denormalization.
  EXPECT_TRUE(torch::allclose(denormalize_wan_latents(s.latent), raw, 1e-4, 1e-3));
}

TEST(DataParquet, CfgDropoutIsAFunctionOfSeedAndRowAndMatchesPython) {
  DatasetOptions o = raw_options();
  o.cfg_rate = 0.5;
  o.seed = 1000;
  auto ds = ParquetDataset::open(fixture_root() + "/t2v", o);
  const std::string py = python_exe();
  ASSERT_FALSE(py.empty());
  auto r = run_command(py + " -c \"import random; print(' '.join(str(int(random.Random(1000 ^ g).random() < 0.5)) for g in range(5)))\"");
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream is(r.output);
  int dropped_count = 0;
  for (int64_t g = 0; g < 5; ++g) {
    int expect = -1;
    is >> expect;
    Sample s = ds->get(g);
    EXPECT_EQ(int(s.text_dropped), expect) << "row " << g;
    EXPECT_EQ(s.text_dropped, cfg_drop(1000, g, 0.5));
    // A dropped row has zero text but keeps the mask of its real tokens.
    EXPECT_EQ(s.text_mask.sum().item<float>(), float(kFixtureTokens[g]));
    if (s.text_dropped) {
      ++dropped_count;
      EXPECT_EQ(s.text.abs().sum().item<float>(), 0.0f);
    } else {
      EXPECT_GT(s.text.abs().sum().item<float>(), 0.0f);
    }
    // Same decision on a fresh dataset (restart) and on a re-read.
    EXPECT_EQ(ParquetDataset::open(fixture_root() + "/t2v", o)->get(g).text_dropped, s.text_dropped);
  }
  // Over many rows the rate is respected.
  int hits = 0;
  for (int64_t g = 0; g < 20000; ++g) hits += cfg_drop(7, g, 0.1);
  EXPECT_NEAR(hits / 20000.0, 0.1, 0.01);
  EXPECT_FALSE(cfg_drop(7, 3, 0.0));
}

TEST(DataParquet, VqadWrittenFilesAreReadByPyarrowAndVqad) {
  const std::string py = python_exe();
  ASSERT_FALSE(py.empty());
  auto dir = fresh_dir("written");
  const std::string script = std::string(VQAD_SOURCE_DIR) + "/scripts/make_parquet_fixture.py";
  for (DataKind kind : {DataKind::T2V, DataKind::TextOnly}) {
    std::vector<ParquetRecord> rows;
    for (int64_t g = 0; g < 5; ++g) rows.push_back(formula_record(g, kFixtureTokens[g], kind));
    WriterOptions w;
    w.kind = kind;
    w.row_group_rows = 2;
    const std::string path = (dir / (to_string(kind) + "/part.parquet")).string();
    fs::create_directories(fs::path(path).parent_path());
    write_parquet_file(path, rows, w);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    auto r = run_command(py + " " + script + " verify " + to_string(kind) + " " + path);
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("OK " + to_string(kind) + " 5 rows 3 row groups"), std::string::npos) << r.output;
    auto ds = ParquetDataset::open(path, raw_options(kind));
    ASSERT_EQ(ds->size(), 5);
    for (int64_t g = 0; g < 5; ++g) {
      Sample s = ds->get(g);
      EXPECT_TRUE(torch::equal(s.text.narrow(0, 0, kFixtureTokens[g]), rows[size_t(g)].text));
      if (kind == DataKind::T2V) EXPECT_TRUE(torch::equal(s.latent, rows[size_t(g)].latent));
    }
  }
  fs::remove_all(dir);
}

TEST(DataParquet, DatasetWriterSplitsFilesAndTextIsCroppedOrPadded) {
  auto dir = fresh_dir("crop");
  WriterOptions w;
  w.kind = DataKind::TextOnly;
  w.rows_per_file = 2;
  ParquetDatasetWriter writer(dir.string(), w);
  const std::vector<int64_t> tokens = {520, 3, 512};
  for (size_t g = 0; g < tokens.size(); ++g) {
    ParquetRecord r;
    r.id = "r" + std::to_string(g);
    r.caption = "c";
    r.text = torch::arange(tokens[g] * 8, torch::kFloat32).view({tokens[g], 8}) + float(g);
    writer.add(r);
  }
  auto files = writer.close();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(writer.rows_written(), 3);
  DatasetOptions o = raw_options(DataKind::TextOnly);
  o.text_dim = 8;
  auto ds = ParquetDataset::open(dir.string(), o);
  ASSERT_EQ(ds->size(), 3);
  for (int64_t g = 0; g < 3; ++g) {
    Sample s = ds->get(g);
    const int64_t keep = std::min<int64_t>(tokens[size_t(g)], 512);
    auto full = torch::arange(tokens[size_t(g)] * 8, torch::kFloat32).view({tokens[size_t(g)], 8}) + float(g);
    ASSERT_EQ(s.text.sizes(), (std::vector<int64_t>{512, 8}));
    EXPECT_TRUE(torch::equal(s.text.narrow(0, 0, keep), full.narrow(0, 0, keep)));
    EXPECT_EQ(s.text_mask.sum().item<float>(), float(keep));
    EXPECT_EQ(s.text_tokens, tokens[size_t(g)]);
  }
  // A smaller text_len crops further.
  o.text_len = 2;
  EXPECT_EQ(ParquetDataset::open(dir.string(), o)->get(0).text.size(0), 2);
  fs::remove_all(dir);
}

TEST(DataParquetErrors, EmptyRootAndMissingRoot) {
  auto dir = fresh_dir("empty");
  fs::create_directories(dir / "sub");
  std::ofstream(dir / "sub" / "notes.txt") << "x";
  auto msg = error_of([&] { ParquetDataset::open(dir.string(), DatasetOptions{}); });
  EXPECT_NE(msg.find("no *.parquet files"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
  msg = error_of([&] { ParquetDataset::open((dir / "absent").string(), DatasetOptions{}); });
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataParquetErrors, MissingColumnNamesFileAndColumn) {
  // A text_only file opened as t2v lacks the latent columns.
  auto msg = error_of([&] { ParquetDataset::open(fixture_root() + "/text_only", DatasetOptions{}); });
  EXPECT_NE(msg.find("no column 'vae_latent_bytes'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("text_only/data_chunk_0.parquet"), std::string::npos) << msg;
  EXPECT_NE(msg.find("columns present"), std::string::npos) << msg;
}

TEST(DataParquetErrors, ShapeAndByteCountMismatchNameFileRowAndColumn) {
  auto dir = fresh_dir("mismatch");
  // 100 bytes cannot be [16, 1, 2, 2] float32 (256 bytes).
  write_raw_latent_file((dir / "a.parquet").string(), std::vector<uint8_t>(100, 0), {16, 1, 2, 2});
  auto ds = ParquetDataset::open(dir.string(), raw_options());
  auto msg = error_of([&] { ds->get(0); });
  EXPECT_NE(msg.find("a.parquet"), std::string::npos) << msg;
  EXPECT_NE(msg.find("row 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("vae_latent_bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs 256 bytes, found 100"), std::string::npos) << msg;
  fs::remove(dir / "a.parquet");
  // 128 bytes = 2-byte elements for the shape: named as such.
  write_raw_latent_file((dir / "b.parquet").string(), std::vector<uint8_t>(128, 0), {16, 1, 2, 2});
  msg = error_of([&] { ParquetDataset::open(dir.string(), raw_options())->get(0); });
  EXPECT_NE(msg.find("2-byte elements"), std::string::npos) << msg;
  fs::remove(dir / "b.parquet");
  // A consistent row, but the latent has fewer frames than num_latent_t.
  write_raw_latent_file((dir / "c.parquet").string(), std::vector<uint8_t>(256, 0), {16, 1, 2, 2});
  DatasetOptions o = raw_options();
  o.num_latent_t = 4;
  msg = error_of([&] { ParquetDataset::open(dir.string(), o)->get(0); });
  EXPECT_NE(msg.find("num_latent_t = 4 exceeds the stored 1"), std::string::npos) << msg;
  // Wrong text width.
  o = raw_options();
  o.text_dim = 1024;
  msg = error_of([&] { ParquetDataset::open(dir.string(), o)->get(0); });
  EXPECT_NE(msg.find("expected width 1024"), std::string::npos) << msg;
  // A 3-D latent is not a video latent.
  fs::remove(dir / "c.parquet");
  write_raw_latent_file((dir / "d.parquet").string(), std::vector<uint8_t>(256, 0), {16, 2, 2});
  msg = error_of([&] { ParquetDataset::open(dir.string(), raw_options())->get(0); });
  EXPECT_NE(msg.find("[C, T, H, W]"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataParquetErrors, CorruptFilesNameTheFile) {
  auto dir = fresh_dir("corrupt");
  std::ofstream(dir / "garbage.parquet") << "this is not parquet at all, not even close";
  auto msg = error_of([&] { ParquetDataset::open(dir.string(), DatasetOptions{}); });
  EXPECT_NE(msg.find("garbage.parquet"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a readable parquet file"), std::string::npos) << msg;
  fs::remove(dir / "garbage.parquet");

  // Truncated: the footer is gone.
  const std::string src = fixture_root() + "/t2v/worker_1/data_chunk_0.parquet";
  std::string bytes;
  {
    std::ifstream f(src, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::ofstream(dir / "truncated.parquet", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  msg = error_of([&] { ParquetDataset::open(dir.string(), DatasetOptions{}); });
  EXPECT_NE(msg.find("truncated.parquet"), std::string::npos) << msg;
  fs::remove(dir / "truncated.parquet");

  // Intact footer, destroyed data pages: fails on reading, naming file and row.
  std::ofstream(dir / "pages.parquet", std::ios::binary) << bytes;
  corrupt_data_pages(dir / "pages.parquet", 400);
  auto ds = ParquetDataset::open(dir.string(), raw_options());
  msg = error_of([&] { ds->get(1); });
  EXPECT_NE(msg.find("pages.parquet"), std::string::npos) << msg;
  EXPECT_NE(msg.find("requested row 1"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(DataParquetErrors, BadOptionsAndRows) {
  DatasetOptions o;
  o.cfg_rate = 1.5;
  auto msg = error_of([&] { ParquetDataset::open(fixture_root() + "/t2v", o); });
  EXPECT_NE(msg.find("training_cfg_rate"), std::string::npos) << msg;
  auto ds = ParquetDataset::open(fixture_root() + "/t2v", raw_options());
  msg = error_of([&] { ds->get(5); });
  EXPECT_NE(msg.find("out of range"), std::string::npos) << msg;
  msg = error_of([&] { parse_data_kind("i2v"); });
  EXPECT_NE(msg.find("t2v, text_only"), std::string::npos) << msg;
  // Rows of different latent shapes cannot be batched.
  std::vector<Sample> samples(2);
  samples[0].latent = torch::zeros({16, 2, 2, 2});
  samples[1].latent = torch::zeros({16, 3, 2, 2});
  samples[0].text = samples[1].text = torch::zeros({4, 4});
  samples[0].text_mask = samples[1].text_mask = torch::zeros({4});
  msg = error_of([&] { collate(samples); });
  EXPECT_NE(msg.find("different latent shapes"), std::string::npos) << msg;
}

// FastVideo's "a:2,b" data_path: one row space over the sources, a repeated once per copy.
TEST(DataParquet, SeveralSourcesWithRepeatCounts) {
  const auto dir = fs::temp_directory_path() / ("vqad_sources_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  vqad::data::SynthOptions so;
  so.kind = vqad::data::DataKind::TextOnly;
  so.text_dim = 8;
  so.seed = 1;
  vqad::data::write_synthetic_dataset((dir / "a").string(), 3, so, vqad::data::WriterOptions{});
  so.seed = 2;
  vqad::data::write_synthetic_dataset((dir / "b").string(), 2, so, vqad::data::WriterOptions{});
  vqad::data::DatasetOptions o;
  o.kind = vqad::data::DataKind::TextOnly;
  o.text_dim = 8;
  o.text_len = 16;
  auto ds = vqad::data::ParquetDataset::open_sources({{(dir / "a").string(), 2}, {(dir / "b").string(), 1}}, o);
  ASSERT_EQ(ds->size(), 3 * 2 + 2);
  auto a = vqad::data::ParquetDataset::open((dir / "a").string(), o);
  auto b = vqad::data::ParquetDataset::open((dir / "b").string(), o);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ds->get(i).caption, a->get(i).caption);
    EXPECT_EQ(ds->get(3 + i).caption, a->get(i).caption);
    EXPECT_TRUE(torch::equal(ds->get(3 + i).text, a->get(i).text));
  }
  for (int64_t i = 0; i < 2; ++i) EXPECT_EQ(ds->get(6 + i).caption, b->get(i).caption);
  EXPECT_THROW(vqad::data::ParquetDataset::open_sources({{(dir / "a").string(), 0}}, o), vqad::Error);
  fs::remove_all(dir);
}
