#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"
#include "vqad/io/tensors.h"

namespace fs = std::filesystem;
using vqad::st::DType;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() /
           ("vqad_st_test_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Writes a raw safetensors file from a header string and a buffer.
void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& buf,
               std::optional<uint64_t> len_override = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = len_override.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
}

// Expects File::open to fail with a message containing every needle.
void expect_open_error(const std::string& path, std::vector<std::string> needles) {
  try {
    vqad::st::File::open(path);
    FAIL() << "expected vqad::Error opening " << path;
  } catch (const vqad::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

}  // namespace

TEST(Safetensors, RoundTripEveryDTypeBitExact) {
  TempDir dir;
  const DType all[] = {DType::F32, DType::F16,  DType::BF16, DType::F8_E4M3, DType::I64, DType::I32,
                       DType::U8,  DType::BOOL, DType::F64,  DType::I16,     DType::I8};
  vqad::st::Writer w;
  std::map<std::string, std::vector<uint8_t>> expect;
  uint32_t seed = 1;
  for (DType d : all) {
    std::vector<int64_t> shape = {3, 5, static_cast<int64_t>(seed % 4 + 1)};
    size_t n = 15 * shape[2] * vqad::st::dtype_size(d);
    auto bytes = random_bytes(n, seed++);
    if (d == DType::BOOL)
      for (auto& b : bytes) b &= 1;
    std::string name = std::string("t_") + vqad::st::dtype_name(d);
    w.add(name, d, shape, bytes.data(), bytes.size());
    expect[name] = bytes;
  }
  w.add("empty", DType::F32, {0, 4}, nullptr, 0);
  w.add("scalar", DType::I64, {}, random_bytes(8, 99).data(), 8);
  w.set_metadata({{"format", "pt"}, {"note", "vqad test"}});
  std::string path = dir.file("all.safetensors");
  w.write(path);

  auto f = vqad::st::File::open(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "vqad test");
  EXPECT_EQ(f.names().size(), expect.size() + 2);
  for (const auto& [name, bytes] : expect) {
    ASSERT_TRUE(f.contains(name));
    const auto& info = f.info(name);
    EXPECT_EQ(info.nbytes, bytes.size());
    EXPECT_EQ(0, std::memcmp(f.data(name), bytes.data(), bytes.size())) << name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data(name)) % vqad::st::dtype_size(info.dtype), 0u)
        << name << " misaligned";
  }
  EXPECT_EQ(f.info("empty").shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(f.info("scalar").shape.empty());
  // Header length is a multiple of 8 so the buffer stays 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t hl = 0;
  in.read(reinterpret_cast<char*>(&hl), 8);
  EXPECT_EQ(hl % 8, 0u);
}

TEST(Safetensors, TorchRoundTripAllDTypesAndStrides) {
  TempDir dir;
  torch::manual_seed(7);
  std::vector<std::pair<std::string, torch::Tensor>> ts = {
      {"f32", torch::randn({4, 7})},
      {"f16", torch::randn({3, 5}).to(torch::kFloat16)},
      {"bf16", torch::randn({6}).to(torch::kBFloat16)},
      {"f8", (torch::randn({2, 16}) * 50).to(torch::kFloat8_e4m3fn)},
      {"i64", torch::randint(-1000000, 1000000, {5}, torch::kInt64)},
      {"i32", torch::randint(-1000, 1000, {2, 3}, torch::kInt32)},
      {"u8", torch::randint(0, 256, {9}, torch::kUInt8)},
      {"bool", torch::randint(0, 2, {4, 4}).to(torch::kBool)},
      {"f64", torch::randn({3}, torch::kFloat64)},
      {"transposed", torch::randn({5, 3}).t()},  // non-contiguous input
      {"sliced", torch::randn({8, 8}).index({torch::indexing::Slice(1, 7, 2)})},
  };
  std::string path = dir.file("t.safetensors");
  vqad::io::save_safetensors(path, ts, {{"k", "v"}});
  std::map<std::string, std::string> meta;
  auto loaded = vqad::io::load_safetensors(path, &meta);
  EXPECT_EQ(meta.at("k"), "v");
  ASSERT_EQ(loaded.size(), ts.size());
  for (const auto& [name, t] : ts) {
    const auto& l = loaded.at(name);
    EXPECT_EQ(l.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(l.sizes(), t.sizes()) << name;
    auto tc = t.contiguous();
    ASSERT_EQ(l.nbytes(), tc.nbytes());
    EXPECT_EQ(0, std::memcmp(l.data_ptr(), tc.data_ptr(), tc.nbytes())) << name;
  }
}

TEST(Safetensors, LoadedTensorsAliasMappingAndOutliveIt) {
  TempDir dir;
  auto x = torch::arange(64, torch::kFloat32).reshape({8, 8});
  std::string path = dir.file("a.safetensors");
  vqad::io::save_safetensors(path, {{"x", x}});
  torch::Tensor t;
  {
    auto m = vqad::io::load_safetensors(path);
    t = m.at("x");
  }  // File and map gone; the tensor keeps the mapping alive.
  EXPECT_TRUE(torch::equal(t, x));
  // In-place writes go to private pages, never the file.
  t.add_(1);
  auto again = vqad::io::load_safetensors(path);
  EXPECT_TRUE(torch::equal(again.at("x"), x));
  EXPECT_TRUE(torch::equal(t, x + 1));
}

TEST(Safetensors, WriterRejectsBadInput) {
  vqad::st::Writer w;
  uint8_t b[8] = {};
  w.add("a", DType::F32, {2}, b, 8);
  EXPECT_THROW(w.add("a", DType::F32, {2}, b, 8), vqad::Error);
  EXPECT_THROW(w.add("c", DType::F32, {3}, b, 8), vqad::Error);
  EXPECT_THROW(w.add("__metadata__", DType::U8, {1}, b, 1), vqad::Error);
  auto t = torch::zeros({2}, torch::kComplexFloat);
  try {
    vqad::io::save_safetensors("/nonexistent_dir_vqad/x.safetensors", {{"cplx", t}});
    FAIL();
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cplx"), std::string::npos);
  }
}

TEST(Safetensors, AtomicWriteLeavesNoTempFiles) {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  vqad::io::save_safetensors(path, {{"a", torch::ones({3})}});
  vqad::io::save_safetensors(path, {{"a", torch::zeros({3})}});
  size_t count = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++count;
  EXPECT_EQ(count, 1u);
  EXPECT_TRUE(torch::equal(vqad::io::load_safetensors(path).at("a"), torch::zeros({3})));
}

// --- corrupt files --------------------------------------------------------
TEST(SafetensorsCorrupt, TruncatedFile) {
  TempDir dir;
  std::string p = dir.file("short.safetensors");
  std::ofstream(p, std::ios::binary) << "abc";
  expect_open_error(p, {"truncated"});
}

TEST(SafetensorsCorrupt, HeaderLongerThanFile) {
  TempDir dir;
  std::string p = dir.file("hl.safetensors");
  write_raw(p, "{}      ", {}, 1000);
  expect_open_error(p, {"header length 1000"});
}

TEST(SafetensorsCorrupt, TruncatedData) {
  TempDir dir;
  std::string p = dir.file("td.safetensors");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::vector<uint8_t>(10));
  expect_open_error(p, {"'w'", "out of range"});
}

TEST(SafetensorsCorrupt, MalformedJson) {
  TempDir dir;
  std::string p = dir.file("mj.safetensors");
  write_raw(p, R"({"w":{"dtype":"F32",)", {});
  expect_open_error(p, {"malformed header JSON"});
}

TEST(SafetensorsCorrupt, OffsetsOverlap) {
  TempDir dir;
  std::string p = dir.file("ov.safetensors");
  write_raw(p,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            std::vector<uint8_t>(12));
  expect_open_error(p, {"overlap", "'a'", "'b'"});
}

TEST(SafetensorsCorrupt, HoleInBuffer) {
  TempDir dir;
  std::string p = dir.file("hole.safetensors");
  write_raw(p,
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            std::vector<uint8_t>(12));
  expect_open_error(p, {"hole", "'b'"});
}

TEST(SafetensorsCorrupt, ShapeDoesNotMatchBytes) {
  TempDir dir;
  std::string p = dir.file("sh.safetensors");
  write_raw(p, R"({"w":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,16]}})",
            std::vector<uint8_t>(16));
  expect_open_error(p, {"'w'", "BF16", "need 18 bytes"});
}

TEST(SafetensorsCorrupt, DuplicateNames) {
  TempDir dir;
  std::string p = dir.file("dup.safetensors");
  write_raw(p,
            R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
            R"("w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
            std::vector<uint8_t>(4));
  expect_open_error(p, {"duplicate tensor name 'w'"});
}

TEST(SafetensorsCorrupt, UnknownDType) {
  TempDir dir;
  std::string p = dir.file("ud.safetensors");
  write_raw(p, R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,4]}})", std::vector<uint8_t>(4));
  expect_open_error(p, {"'w'", "unknown dtype 'F4'", "F8_E4M3"});
}

TEST(SafetensorsCorrupt, NegativeShapeAndBadMetadata) {
  TempDir dir;
  std::string p = dir.file("neg.safetensors");
  write_raw(p, R"({"w":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", std::vector<uint8_t>(4));
  expect_open_error(p, {"'w'", "non-negative"});
  std::string q = dir.file("meta.safetensors");
  write_raw(q, R"({"__metadata__":{"x":3}})", {});
  expect_open_error(q, {"__metadata__", "'x'"});
}

TEST(SafetensorsCorrupt, MissingFile) {
  expect_open_error("/nonexistent/vqad/missing.safetensors", {"cannot open"});
}

// --- sharded --------------------------------------------------------------
TEST(SafetensorsSharded, RoundTripWithIndex) {
  TempDir dir;
  torch::manual_seed(3);
  std::vector<std::pair<std::string, torch::Tensor>> ts;
  for (int i = 0; i < 7; ++i)
    ts.emplace_back("blocks." + std::to_string(i) + ".weight", torch::randn({16, 16}));  // 1 KiB each
  ts.emplace_back("big", torch::randn({1024}));  // 4 KiB: larger than a shard, gets its own
  std::string index = vqad::io::save_sharded(dir.path.string(), ts, 2500, "diffusion_pytorch_model",
                                             {{"format", "pt"}});
  EXPECT_EQ(fs::path(index).filename(), "diffusion_pytorch_model.safetensors.index.json");
  EXPECT_TRUE(fs::exists(dir.path / "diffusion_pytorch_model-00001-of-00005.safetensors"));
  EXPECT_TRUE(fs::exists(dir.path / "diffusion_pytorch_model-00005-of-00005.safetensors"));
  for (const std::string& src : {index, dir.path.string()}) {
    auto loaded = vqad::io::load_sharded(src);
    ASSERT_EQ(loaded.size(), ts.size());
    for (const auto& [name, t] : ts) EXPECT_TRUE(torch::equal(loaded.at(name), t)) << name;
  }
  auto layout = vqad::io::resolve_sharded(dir.path.string());
  EXPECT_EQ(layout.metadata.at("total_size"), std::to_string(7 * 1024 + 4096));
}

TEST(SafetensorsSharded, SingleShardAndSingleFileDirectory) {
  TempDir dir;
  auto t = torch::randn({4});
  std::string p = vqad::io::save_sharded(dir.path.string(), {{"a", t}}, 1 << 20);
  EXPECT_EQ(fs::path(p).filename(), "model.safetensors");
  EXPECT_TRUE(torch::equal(vqad::io::load_sharded(dir.path.string()).at("a"), t));
  EXPECT_TRUE(torch::equal(vqad::io::load_sharded(p).at("a"), t));
}

TEST(SafetensorsSharded, IndexNamingMissingShard) {
  TempDir dir;
  std::string index = dir.file("m.safetensors.index.json");
  std::ofstream(index) << R"({"metadata":{},"weight_map":{"w":"m-00001-of-00002.safetensors"}})";
  try {
    vqad::io::load_sharded(index);
    FAIL();
  } catch (const vqad::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("m-00001-of-00002.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  }
}

TEST(SafetensorsSharded, IndexNamingTensorMissingFromShard) {
  TempDir dir;
  vqad::io::save_safetensors(dir.file("s1.safetensors"), {{"a", torch::ones({2})}});
  std::string index = dir.file("m.safetensors.index.json");
  std::ofstream(index) << R"({"weight_map":{"a":"s1.safetensors","ghost":"s1.safetensors"}})";
  try {
    vqad::io::load_sharded(index);
    FAIL();
  } catch (const vqad::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'ghost'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("s1.safetensors"), std::string::npos) << msg;
  }
}

TEST(SafetensorsSharded, AmbiguousDirectory) {
  TempDir dir;
  vqad::io::save_safetensors(dir.file("a.safetensors"), {{"a", torch::ones({2})}});
  vqad::io::save_safetensors(dir.file("b.safetensors"), {{"b", torch::ones({2})}});
  try {
    vqad::io::load_sharded(dir.path.string());
    FAIL();
  } catch (const vqad::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a.safetensors"), std::string::npos) << e.what();
  }
}

// --- the shared NVFP4 golden file (spec/nvfp4.md "Golden vectors") ---------
TEST(Safetensors, ReadsNvfp4GoldenFile) {
  std::string path = std::string(VQAD_GOLDEN_FILE);
  auto f = vqad::st::File::open(path);
  EXPECT_EQ(f.metadata().at("rows_per_global_tensor"), "64");
  const int64_t n = f.info("x").shape.at(0);
  const int64_t m = f.info("g_x").shape.at(0);
  struct Want {
    const char* name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const Want want[] = {
      {"x", DType::F32, {n, 16}},        {"scale_bits", DType::U8, {n}},
      {"codes", DType::U8, {n, 16}},     {"y", DType::F32, {n, 16}},
      {"g_x", DType::F32, {m, 16}},      {"g_tensor_amax", DType::F32, {m}},
      {"g_scale_bits", DType::U8, {m}},  {"g_codes", DType::U8, {m, 16}},
      {"g_y", DType::F32, {m, 16}},
  };
  EXPECT_GT(n, 0);
  EXPECT_EQ(m % 64, 0);
  for (const auto& w : want) {
    ASSERT_TRUE(f.contains(w.name)) << w.name;
    EXPECT_EQ(f.info(w.name).dtype, w.dtype) << w.name;
    EXPECT_EQ(f.info(w.name).shape, w.shape) << w.name;
  }
  auto t = vqad::io::load_safetensors(path);
  EXPECT_EQ(t.at("codes").max().item<int>() <= 15, true);  // E2M1 codes are 4-bit
  EXPECT_TRUE(torch::isfinite(t.at("x")).all().item<bool>());
}
