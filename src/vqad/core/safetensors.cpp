#include "vqad/core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "vqad/core/error.h"

namespace vqad::st {

namespace {

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::F32, "F32", 4},     {DType::F16, "F16", 2},   {DType::BF16, "BF16", 2},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::U8, "U8", 1},       {DType::BOOL, "BOOL", 1}, {DType::F64, "F64", 8},
    {DType::I16, "I16", 2},     {DType::I8, "I8", 1},
};

const DTypeEntry& entry(DType d) {
  for (const auto& e : kDTypes)
    if (e.dtype == d) return e;
  fail("safetensors: invalid dtype enum value ", static_cast<int>(d));
}

// Largest header we accept; real headers are a few MB at most, and the bound
// keeps a corrupt length from turning into a huge allocation.
constexpr uint64_t kMaxHeaderBytes = uint64_t(256) << 20;

std::string errno_text() { return std::strerror(errno); }

}  // namespace

const char* dtype_name(DType d) { return entry(d).name; }
size_t dtype_size(DType d) { return entry(d).size; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

std::string dtype_choices() {
  std::string s;
  for (const auto& e : kDTypes) {
    if (!s.empty()) s += ", ";
    s += e.name;
  }
  return s;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------
// Mapping
// ---------------------------------------------------------------------------
Mapping::Mapping(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("safetensors file ", path, ": cannot open: ", errno_text());
  struct stat sb{};
  if (::fstat(fd, &sb) != 0) {
    std::string why = errno_text();
    ::close(fd);
    fail("safetensors file ", path, ": cannot stat: ", why);
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    fail("safetensors file ", path, ": not a regular file");
  }
  size_ = static_cast<size_t>(sb.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string why = errno_text();
      ::close(fd);
      fail("safetensors file ", path, ": mmap of ", size_, " bytes failed: ", why);
    }
    bytes_ = static_cast<uint8_t*>(p);
  }
  ::close(fd);
}

Mapping::~Mapping() {
  if (bytes_) ::munmap(bytes_, size_);
}

// ---------------------------------------------------------------------------
// File
// ---------------------------------------------------------------------------
File File::open(const std::string& path) {
  using nlohmann::json;
  File f;
  f.mapping_ = std::make_shared<Mapping>(path);
  const size_t file_size = f.mapping_->size();
  const uint8_t* bytes = f.mapping_->bytes();
  VQAD_CHECK(file_size >= 8, "safetensors file ", path, ": truncated: ", file_size,
             " bytes, expected at least the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  VQAD_CHECK(header_len <= file_size - 8, "safetensors file ", path, ": header length ",
             header_len, " is larger than the ", file_size - 8,
             " bytes that follow it (truncated or not a safetensors file)");
  VQAD_CHECK(header_len <= kMaxHeaderBytes, "safetensors file ", path, ": header length ",
             header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  f.buffer_start_ = 8 + static_cast<size_t>(header_len);
  const size_t buffer_size = file_size - f.buffer_start_;

  std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
  std::set<std::string> seen;
  std::string duplicate;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail("safetensors file ", path, ": malformed header JSON: ", e.what());
  }
  VQAD_CHECK(duplicate.empty(), "safetensors file ", path, ": duplicate tensor name '",
             duplicate, "' in header");
  VQAD_CHECK(header.is_object(), "safetensors file ", path,
             ": header JSON must be an object, found ", header.type_name());

  std::vector<TensorInfo> infos;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      VQAD_CHECK(v.is_object(), "safetensors file ", path,
                 ": __metadata__ must be an object of strings, found ", v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        VQAD_CHECK(m.value().is_string(), "safetensors file ", path, ": __metadata__ key '",
                   m.key(), "' must be a string, found ", m.value().type_name());
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto where = [&] { return "safetensors file " + path + ", tensor '" + name + "'"; };
    VQAD_CHECK(v.is_object(), where(), ": entry must be an object, found ", v.type_name());
    for (auto k = v.begin(); k != v.end(); ++k)
      VQAD_CHECK(k.key() == "dtype" || k.key() == "shape" || k.key() == "data_offsets", where(),
                 ": unknown field '", k.key(), "' (expected dtype, shape, data_offsets)");
    VQAD_CHECK(v.contains("dtype") && v["dtype"].is_string(), where(),
               ": missing or non-string 'dtype'");
    const std::string dname = v["dtype"].get<std::string>();
    auto dt = parse_dtype(dname);
    VQAD_CHECK(dt.has_value(), where(), ": unknown dtype '", dname, "' (supported: ",
               dtype_choices(), ")");
    VQAD_CHECK(v.contains("shape") && v["shape"].is_array(), where(),
               ": missing or non-array 'shape'");
    TensorInfo info;
    info.name = name;
    info.dtype = *dt;
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      VQAD_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, where(),
                 ": shape entries must be non-negative integers, found ", d.dump());
      uint64_t dim = d.get<uint64_t>();
      VQAD_CHECK(!__builtin_mul_overflow(numel, dim, &numel), where(), ": shape ",
                 v["shape"].dump(), " overflows");
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t expected_bytes = 0;
    VQAD_CHECK(!__builtin_mul_overflow(numel, uint64_t(dtype_size(*dt)), &expected_bytes), where(),
               ": shape ", v["shape"].dump(), " overflows");
    VQAD_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() &&
                   v["data_offsets"].size() == 2 && v["data_offsets"][0].is_number_unsigned() &&
                   v["data_offsets"][1].is_number_unsigned(),
               where(), ": 'data_offsets' must be [begin, end] with non-negative integers, found ",
               v.contains("data_offsets") ? v["data_offsets"].dump() : std::string("nothing"));
    uint64_t begin = v["data_offsets"][0].get<uint64_t>();
    uint64_t end = v["data_offsets"][1].get<uint64_t>();
    VQAD_CHECK(begin <= end, where(), ": data_offsets [", begin, ", ", end, "] are reversed");
    VQAD_CHECK(end <= buffer_size, where(), ": data_offsets [", begin, ", ", end,
               "] out of range: the data buffer has ", buffer_size, " bytes");
    VQAD_CHECK(end - begin == expected_bytes, where(), ": dtype ", dname, " and shape ",
               v["shape"].dump(), " need ", expected_bytes, " bytes, but data_offsets [", begin,
               ", ", end, "] span ", end - begin);
    info.offset = static_cast<size_t>(begin);
    info.nbytes = static_cast<size_t>(expected_bytes);
    infos.push_back(std::move(info));
  }

  // The buffer must be covered exactly once, in offset order.
  std::stable_sort(infos.begin(), infos.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  size_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& info : infos) {
    if (info.offset < cursor)
      fail("safetensors file ", path, ": tensor '", info.name, "' bytes [", info.offset, ", ",
           info.offset + info.nbytes, ") overlap tensor '", prev->name, "' bytes [",
           prev->offset, ", ", prev->offset + prev->nbytes, ")");
    if (info.offset > cursor)
      fail("safetensors file ", path, ": hole in data buffer: bytes [", cursor, ", ",
           info.offset, ") before tensor '", info.name, "' belong to no tensor");
    cursor = info.offset + info.nbytes;
    prev = &info;
  }
  VQAD_CHECK(cursor == buffer_size, "safetensors file ", path, ": data buffer has ",
             buffer_size, " bytes but the tensors cover only ", cursor,
             " (trailing bytes or wrong header)");
  for (auto& info : infos) {
    f.names_.push_back(info.name);
    f.infos_.emplace(info.name, std::move(info));
  }
  return f;
}

const TensorInfo& File::info(const std::string& name) const {
  auto it = infos_.find(name);
  if (it == infos_.end())
    fail("safetensors file ", path(), ": no tensor named '", name, "' (file has ",
         infos_.size(), " tensors)");
  return it->second;
}

const uint8_t* File::data(const std::string& name) const {
  const TensorInfo& i = info(name);
  return mapping_->bytes() + buffer_start_ + i.offset;
}

// ---------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------
void Writer::add_entry(Entry e) {
  VQAD_CHECK(!e.name.empty(), "safetensors writer: empty tensor name");
  VQAD_CHECK(e.name != "__metadata__", "safetensors writer: '__metadata__' is reserved");
  for (const auto& x : entries_)
    VQAD_CHECK(x.name != e.name, "safetensors writer: duplicate tensor name '", e.name, "'");
  uint64_t numel = 1;
  for (auto d : e.shape) {
    VQAD_CHECK(d >= 0, "safetensors writer: tensor '", e.name, "' has negative dim ", d);
    numel *= static_cast<uint64_t>(d);
  }
  VQAD_CHECK(numel * dtype_size(e.dtype) == e.nbytes, "safetensors writer: tensor '", e.name,
             "': dtype ", dtype_name(e.dtype), " with ", numel, " elements needs ",
             numel * dtype_size(e.dtype), " bytes, got ", e.nbytes);
  VQAD_CHECK(e.data != nullptr || e.nbytes == 0, "safetensors writer: tensor '", e.name,
             "': null data");
  entries_.push_back(std::move(e));
}

void Writer::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                 const void* data, size_t nbytes) {
  auto owned = std::make_shared<std::vector<uint8_t>>(nbytes);
  if (nbytes) std::memcpy(owned->data(), data, nbytes);
  add_entry(Entry{name, dtype, std::move(shape), owned->data(), nbytes, owned});
}

void Writer::add_view(const std::string& name, DType dtype, std::vector<int64_t> shape,
                      const void* data, size_t nbytes) {
  add_entry(Entry{name, dtype, std::move(shape), data, nbytes, nullptr});
}

size_t Writer::total_bytes() const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.nbytes;
  return n;
}

void Writer::write(const std::string& path) const {
  using nlohmann::json;
  // Larger elements first keeps every tensor aligned to its element size
  // (the buffer starts 8-byte aligned), as the reference implementation does.
  std::vector<const Entry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  size_t offset = 0;
  for (const Entry* e : order) {
    header[e->name] = {{"dtype", dtype_name(e->dtype)},
                       {"shape", e->shape},
                       {"data_offsets", {offset, offset + e->nbytes}}};
    offset += e->nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  std::vector<std::string_view> parts;
  parts.emplace_back(reinterpret_cast<const char*>(len_bytes), 8);
  parts.emplace_back(text);
  for (const Entry* e : order)
    parts.emplace_back(static_cast<const char*>(e->data), e->nbytes);
  write_file_atomic(path, parts);
}

void write_file_atomic(const std::string& path, const std::vector<std::string_view>& parts) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  std::random_device rd;
  std::string tmp = (dir / ("." + target.filename().string() + ".tmp." +
                            std::to_string(::getpid()) + "." + std::to_string(rd())))
                        .string();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("writing ", path, ": cannot create temporary file ", tmp, ": ", errno_text());
  auto abort_with = [&](const std::string& what) {
    std::string why = errno_text();
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("writing ", path, ": ", what, ": ", why);
  };
  for (auto part : parts) {
    const char* p = part.data();
    size_t left = part.size();
    while (left > 0) {
      ssize_t w = ::write(fd, p, std::min<size_t>(left, size_t(1) << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        abort_with("write failed");
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
  }
  if (::fsync(fd) != 0) abort_with("fsync failed");
  if (::close(fd) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    fail("writing ", path, ": close failed: ", why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    fail("writing ", path, ": rename from ", tmp, " failed: ", why);
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some filesystems refuse directory fsync
    ::close(dfd);
  }
}

}  // namespace vqad::st
