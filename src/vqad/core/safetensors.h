// safetensors reader and writer, torch-free.
//
// Format: 8-byte little-endian header length N, N bytes of JSON (padded with
// spaces to a multiple of 8), then the byte buffer. The JSON maps tensor names
// to {dtype, shape, data_offsets:[begin,end]} (offsets relative to the buffer)
// plus an optional "__metadata__" string->string map. The buffer must be fully
// covered by the tensors, without holes or overlaps.
//
// The reader maps the file copy-on-write (MAP_PRIVATE): data pointers alias the
// file with no copy, and a caller that writes through them (e.g. an in-place
// op on a tensor aliasing the mapping) changes only its private pages, never
// the file. The mapping lives as long as any File copy or mapping() handle.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vqad::st {

enum class DType { F32, F16, BF16, F8_E4M3, I64, I32, U8, BOOL, F64, I16, I8 };

const char* dtype_name(DType d);                       // "F32", "F8_E4M3", ...
std::optional<DType> parse_dtype(std::string_view name);
size_t dtype_size(DType d);                            // bytes per element
std::string dtype_choices();                           // "F32, F16, ..." for errors

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  size_t nbytes = 0;
  size_t offset = 0;  // from the start of the byte buffer
  int64_t numel() const;
};

// An open, validated file mapping. Shared so that aliasing views (torch
// tensors) can keep it alive after the File is gone.
class Mapping {
 public:
  Mapping(const std::string& path);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* bytes() const { return bytes_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  uint8_t* bytes_ = nullptr;
  size_t size_ = 0;
};

class File {
 public:
  // Maps and validates the whole header; throws vqad::Error naming the file
  // (and tensor) on any inconsistency.
  static File open(const std::string& path);

  const std::string& path() const { return mapping_->path(); }
  // Names in file (byte-offset) order.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return infos_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  const uint8_t* data(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::shared_ptr<Mapping> mapping() const { return mapping_; }

 private:
  std::shared_ptr<Mapping> mapping_;
  size_t buffer_start_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
};

class Writer {
 public:
  // Copies the bytes; the caller may free `data` right after.
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  // Does not copy: `data` must stay valid until write() returns.
  void add_view(const std::string& name, DType dtype, std::vector<int64_t> shape,
                const void* data, size_t nbytes);
  void set_metadata(std::map<std::string, std::string> metadata) { metadata_ = std::move(metadata); }
  // Atomic: writes a temporary file in the same directory, fsyncs it, renames
  // it over `path` and fsyncs the directory.
  void write(const std::string& path) const;
  size_t size() const { return entries_.size(); }
  size_t total_bytes() const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t nbytes;
    std::shared_ptr<std::vector<uint8_t>> owned;
  };
  void add_entry(Entry e);
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes `bytes` to `path` atomically (temp file in the same directory, fsync,
// rename, directory fsync). Used by the writer and by index files.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& parts);

}  // namespace vqad::st
