#include "vqad/train/checkpoint_writer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <set>
#include <atomic>

#include "vqad/core/error.h"
#include "vqad/core/file_io.h"
#include "vqad/core/log.h"
#include "vqad/io/tensors.h"
#include "vqad/model/wan/weights.h"
#include "vqad/train/checkpoint_dir.h"
#include "vqad/train/finite_guard.h"
#include "vqad/train/metadata.h"

namespace fs = std::filesystem;

namespace vqad::train {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr const char* kWeightsPrefix = "diffusion_pytorch_model";
constexpr const char* kOptimizerPrefix = "optimizer";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kOptimizerIndex = "optimizer.safetensors.index.json";

std::string weight_key(const std::string& role, const std::string& param) { return role + "/w:" + param; }
std::string optimizer_key(const std::string& role, const std::string& name) { return role + "/o:" + name; }

// `tensors` as <dir>/<prefix>.safetensors, or, when larger than shard_bytes, as shards
// <prefix>-0000i-of-0000n.safetensors (filled in order) plus <prefix>.safetensors.index.json.
void add_tensor_files(std::vector<SnapshotFile>& files, const std::string& dir, const std::string& prefix,
                      std::vector<std::pair<std::string, torch::Tensor>> tensors,
                      const std::map<std::string, std::string>& st_metadata, size_t shard_bytes) {
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards(1);
  size_t current = 0, total = 0;
  for (auto& t : tensors) {
    const size_t n = t.second.nbytes();
    if (current + n > shard_bytes && !shards.back().empty()) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(std::move(t));
    current += n;
    total += n;
  }
  if (shards.size() == 1) {
    SnapshotFile f;
    f.rel = dir + "/" + prefix + ".safetensors";
    f.safetensors = true;
    f.st_metadata = st_metadata;
    f.tensors = std::move(shards[0]);
    files.push_back(std::move(f));
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    SnapshotFile f;
    f.rel = dir + "/" + prefix + name;
    f.safetensors = true;
    f.st_metadata = st_metadata;
    for (const auto& t : shards[i]) weight_map[t.first] = prefix + name;
    f.tensors = std::move(shards[i]);
    files.push_back(std::move(f));
  }
  SnapshotFile index;
  index.rel = dir + "/" + prefix + ".safetensors.index.json";
  index.bytes = nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n";
  files.push_back(std::move(index));
}

// trainer_state.json, resolved.yaml and (when given) source.yaml, the recipe file as the
// user wrote it.
void add_run_files(std::vector<SnapshotFile>& files, const nlohmann::json& trainer_state,
                   const std::string& resolved_yaml, const std::string& source_yaml) {
  for (const auto& [rel, bytes] : {std::pair<const char*, std::string>{"trainer_state.json", trainer_state.dump(2) + "\n"},
                                   {"resolved.yaml", resolved_yaml},
                                   {"source.yaml", source_yaml}}) {
    if (bytes.empty() && std::string(rel) == "source.yaml") continue;  // none given
    SnapshotFile f;
    f.rel = rel;
    f.bytes = bytes;
    files.push_back(std::move(f));
  }
}

// The tensors a role's checkpoint holds: weights (all parameters) and the AdamW state of
// the parameters its optimizer has updated. `opt_state` entries are (param name + ".exp_avg" ...).
struct RoleTensors {
  NamedTensors weights, opt_state;
  std::vector<std::pair<std::string, int64_t>> steps;
};

RoleTensors role_tensors(const Role& role, const torch::optim::AdamW& opt) {
  RoleTensors rt;
  for (const auto& item : role.model->named_parameters(true)) {
    rt.weights.emplace_back(item.key(), item.value().detach());
    auto it = opt.state().find(item.value().unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;  // never updated yet
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    rt.opt_state.emplace_back(item.key() + ".exp_avg", st.exp_avg());
    rt.opt_state.emplace_back(item.key() + ".exp_avg_sq", st.exp_avg_sq());
    if (st.max_exp_avg_sq().defined()) rt.opt_state.emplace_back(item.key() + ".max_exp_avg_sq", st.max_exp_avg_sq());
    rt.steps.emplace_back(item.key() + ".step", st.step());
  }
  return rt;
}

}  // namespace

// ---------------------------------------------------------------------------------------
struct HostStaging::Pending {
  std::vector<c10::Event> events;
};

namespace {
constexpr size_t kChunkBytes = size_t(1) << 30;  // a power of two: the pinned allocator rounds up to one
constexpr size_t kAlign = 256;
}  // namespace

HostStaging::~HostStaging() {
  if (prepare_thread_.joinable()) prepare_thread_.join();
}

void HostStaging::wait_prepared() { join_prepare(); }

void HostStaging::join_prepare() {
  if (prepare_thread_.joinable()) prepare_thread_.join();
  if (prepare_error_) {
    auto e = prepare_error_;
    prepare_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

torch::Tensor HostStaging::buffer(const std::vector<int64_t>& sizes, torch::ScalarType dtype, bool pinned) {
  const int64_t numel = std::accumulate(sizes.begin(), sizes.end(), int64_t(1), std::multiplies<int64_t>());
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto opts = torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU).pinned_memory(pinned);
  if (nbytes == 0) return torch::empty(sizes, torch::TensorOptions().dtype(dtype));
  allocated_ += nbytes;
  auto& chunks = chunks_[pinned ? 1 : 0];
  if (nbytes > kChunkBytes) {  // a tensor of its own block
    chunks.insert(chunks.begin(), Chunk{torch::empty({static_cast<int64_t>(nbytes)}, opts), nbytes});
    return chunks.front().bytes.view(dtype).view(sizes);
  }
  if (chunks.empty() || chunks.back().used + nbytes > static_cast<size_t>(chunks.back().bytes.numel()))
    chunks.push_back(Chunk{torch::empty({static_cast<int64_t>(kChunkBytes)}, opts), 0});
  auto& c = chunks.back();
  auto slice = c.bytes.narrow(0, static_cast<int64_t>(c.used), static_cast<int64_t>(nbytes));
  c.used = (c.used + nbytes + kAlign - 1) / kAlign * kAlign;
  return slice.view(dtype).view(sizes);
}

void HostStaging::prepare(std::vector<Spec> specs) {
  join_prepare();
  prepare_thread_ = std::thread([this, specs = std::move(specs)] {
    try {
      for (const auto& sp : specs) {
        auto it = buffers_.find(sp.key);
        if (it != buffers_.end() && it->second.sizes().vec() == sp.sizes && it->second.scalar_type() == sp.dtype)
          continue;
        buffers_[sp.key] = buffer(sp.sizes, sp.dtype, sp.device.is_cuda());
      }
    } catch (...) {
      prepare_error_ = std::current_exception();
    }
  });
}

torch::Tensor HostStaging::stage(const std::string& key, const torch::Tensor& src) {
  join_prepare();
  torch::NoGradGuard ng;
  const auto s = src.detach();
  auto it = buffers_.find(key);
  if (it == buffers_.end() || it->second.sizes() != s.sizes() || it->second.scalar_type() != s.scalar_type())
    buffers_[key] = buffer(s.sizes().vec(), s.scalar_type(), s.is_cuda());
  auto& buf = buffers_[key];
  buf.copy_(s, /*non_blocking=*/s.is_cuda());
  if (s.is_cuda() && std::find(devices_.begin(), devices_.end(), s.device()) == devices_.end())
    devices_.push_back(s.device());
  return buf;
}

void HostStaging::record() {
  pending_ = std::make_shared<Pending>();
  for (const auto& d : devices_) {
    c10::impl::VirtualGuardImpl impl(d.type());
    c10::Event ev(d.type());
    ev.record(impl.getStream(d));
    pending_->events.push_back(std::move(ev));
  }
  devices_.clear();
}

void HostStaging::synchronize() {
  if (!pending_) return;
  for (auto& e : pending_->events) e.synchronize();
  pending_.reset();
}

size_t HostStaging::allocated_bytes() {
  join_prepare();
  return allocated_;
}

size_t HostStaging::bytes() {
  join_prepare();
  size_t n = 0;
  for (const auto& [_, t] : buffers_) n += t.nbytes();
  return n;
}

std::vector<std::string_view> safetensors_parts(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                                const std::map<std::string, std::string>& metadata,
                                                std::string* header) {
  std::vector<const std::pair<std::string, torch::Tensor>*> order;
  for (const auto& t : tensors) {
    VQAD_CHECK(t.second.device().is_cpu() && t.second.is_contiguous(), "checkpoint: tensor '", t.first,
               "' is not a contiguous host tensor");
    order.push_back(&t);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    const size_t sa = a->second.element_size(), sb = b->second.element_size();
    return sa != sb ? sa > sb : a->first < b->first;
  });
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto* t : order) {
    const size_t n = t->second.nbytes();
    h[t->first] = {{"dtype", st::dtype_name(io::to_st_dtype(t->second.scalar_type(), t->first))},
                   {"shape", t->second.sizes().vec()},
                   {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  header->clear();
  for (int i = 0; i < 8; ++i) header->push_back(static_cast<char>(len >> (8 * i)));
  *header += text;
  std::vector<std::string_view> parts{*header};
  for (const auto* t : order)
    parts.emplace_back(static_cast<const char*>(t->second.data_ptr()), t->second.nbytes());
  return parts;
}

// ---------------------------------------------------------------------------------------
CheckpointWriter::CheckpointWriter(std::string output_dir, int retention_limit, bool async, size_t shard_bytes)
    : output_dir_(std::move(output_dir)), retention_(retention_limit), async_(async), shard_bytes_(shard_bytes) {
  VQAD_CHECK(shard_bytes_ > 0, "checkpoint writer: shard size must be positive");
}

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::error(e.what());
  }
}

std::string CheckpointWriter::last_good() const {
  std::lock_guard<std::mutex> g(mu_);
  return last_good_;
}
void CheckpointWriter::set_last_good(std::string path) {
  std::lock_guard<std::mutex> g(mu_);
  last_good_ = std::move(path);
}
std::vector<std::string> CheckpointWriter::written() const {
  std::lock_guard<std::mutex> g(mu_);
  return written_;
}

void CheckpointWriter::wait() {
  if (worker_.joinable()) worker_.join();
  if (!error_) return;
  auto err = error_;
  error_ = nullptr;
  const long step = in_flight_step_;
  try {
    std::rethrow_exception(err);
  } catch (const std::exception& e) {
    fail("checkpoint-", step, " was not written: ", e.what(), "; ", last_good_checkpoint_text(last_good(), output_dir_));
  }
}

SaveTimings CheckpointWriter::last_timings() const {
  std::lock_guard<std::mutex> g(mu_);
  return timings_;
}

namespace {
// Writes `f` as <dir>/<f.rel> (fsynced); returns its sha256, *bytes its size.
std::string write_snapshot_file(const std::string& dir, const SnapshotFile& f, size_t* bytes) {
  std::string header;
  const auto parts = f.safetensors ? safetensors_parts(f.tensors, f.st_metadata, &header)
                                   : std::vector<std::string_view>{f.bytes};
  const std::string sha = write_file_hashed((fs::path(dir) / f.rel).string(), parts);
  *bytes = 0;
  for (auto part : parts) *bytes += part.size();
  return sha;
}

std::string part_key(long seq, long step, int part) {
  return "checkpoint/" + std::to_string(seq) + "/" + std::to_string(step) + "/part" + std::to_string(part);
}
std::string first_line_of(const std::string& s) { return s.substr(0, s.find('\n')); }
}  // namespace

// A rank other than the publisher: its files into its own directory, then the report.
void CheckpointWriter::write_peer_part(long step, const std::vector<SnapshotFile>& files) {
  const std::string key = part_key(in_flight_seq_, step, parts_.part);
  const fs::path dir = checkpoint_parts_dir(output_dir_, step, parts_.part);
  nlohmann::json report;
  size_t bytes = 0;
  try {
    std::error_code ec;
    fs::remove_all(dir, ec);
    create_dir_or_fail(dir.string(), "checkpoint part");
    nlohmann::json list = nlohmann::json::array();
    for (const auto& f : files) {
      create_dir_or_fail((dir / f.rel).parent_path().string(), "checkpoint part");
      size_t n = 0;
      nlohmann::json entry{{"rel", f.rel}, {"sha256", write_snapshot_file(dir.string(), f, &n)}, {"index", f.index}};
      nlohmann::json tensors = nlohmann::json::object();
      for (const auto& [name, t] : f.tensors) tensors[name] = t.nbytes();
      entry["tensors"] = tensors;
      bytes += n;
      list.push_back(entry);
    }
    fsync_tree(dir.string());
    report = {{"dir", dir.string()}, {"files", list}};
  } catch (const std::exception& e) {
    parts_.messages->post(key, nlohmann::json{{"error", first_line_of(e.what())}}.dump());
    throw;
  }
  parts_.messages->post(key, report.dump());
  std::lock_guard<std::mutex> g(mu_);
  last_bytes_ = bytes;
  log::info("checkpoint-", step, ": part ", parts_.part, " of ", parts_.parts, " written (",
            static_cast<double>(bytes) / (1 << 20), " MiB), handed to rank 0");
}

// The publisher: every other part's files into `dir` (renamed from the part's directory),
// then the index files over all parts. Returns the bytes adopted and written.
size_t CheckpointWriter::adopt_parts(long step, const std::string& dir, const std::vector<SnapshotFile>& own,
                                     std::map<std::string, std::string>& known) {
  struct Index {
    nlohmann::json weight_map = nlohmann::json::object();
    uint64_t total = 0;
  };
  std::map<std::string, Index> indexes;
  auto add = [&](const std::string& index, const std::string& rel, const std::string& tensor, uint64_t n) {
    auto& ix = indexes[index];
    VQAD_CHECK(!ix.weight_map.contains(tensor), "checkpoint-", step, ": tensor '", tensor, "' is in two parts (",
               ix.weight_map.contains(tensor) ? ix.weight_map[tensor].get<std::string>() : "", " and ", rel, ")");
    ix.weight_map[tensor] = fs::path(rel).filename().string();
    ix.total += n;
  };
  for (const auto& f : own)
    if (!f.index.empty())
      for (const auto& [name, t] : f.tensors) add(f.index, f.rel, name, t.nbytes());
  size_t bytes = 0;
  for (int r = 1; r < parts_.parts; ++r) {
    const std::string what = "part " + std::to_string(r) + " of checkpoint-" + std::to_string(step) + " (rank " +
                             std::to_string(r) + " of the shard group)";
    nlohmann::json rep;
    try {
      rep = nlohmann::json::parse(parts_.messages->await(part_key(in_flight_seq_, step, r), what, parts_.timeout));
    } catch (const nlohmann::json::exception& e) {
      fail("checkpoint-", step, ": malformed report of ", what, ": ", e.what());
    }
    if (rep.contains("error"))
      fail("checkpoint-", step, ": rank ", r, " of the shard group could not write its part: ",
           rep["error"].get<std::string>());
    const fs::path from = rep.at("dir").get<std::string>();
    for (const auto& f : rep.at("files")) {
      const std::string rel = f.at("rel").get<std::string>();
      VQAD_CHECK(!known.count(rel), "checkpoint-", step, ": ", rel, " is written by two parts");
      create_dir_or_fail((fs::path(dir) / rel).parent_path().string(), "checkpoint");
      std::error_code ec;
      const auto n = fs::file_size(from / rel, ec);
      fs::rename(from / rel, fs::path(dir) / rel, ec);
      VQAD_CHECK(!ec, "checkpoint-", step, ": cannot move ", (from / rel).string(), " (", what, ") into ", dir, ": ",
                 ec.message());
      known[rel] = f.at("sha256").get<std::string>();
      bytes += n;
      const std::string index = f.value("index", "");
      if (!index.empty())
        for (const auto& [name, nb] : f.at("tensors").items()) add(index, rel, name, nb.get<uint64_t>());
    }
    std::error_code ec;
    fs::remove_all(from, ec);
  }
  for (const auto& [rel, ix] : indexes) {
    const std::string text =
        nlohmann::json{{"metadata", {{"total_size", ix.total}}}, {"weight_map", ix.weight_map}}.dump(2) + "\n";
    known[rel] = write_file_hashed((fs::path(dir) / rel).string(), {text});
    bytes += text.size();
  }
  return bytes;
}

void CheckpointWriter::run_write(long step, std::vector<SnapshotFile> files, nlohmann::json metadata) {
  const auto t0 = std::chrono::steady_clock::now();
  staging_.synchronize();
  const double copy_wait = seconds_since(t0);
  if (parts_.parts > 1 && parts_.part != 0) {
    write_peer_part(step, files);
    return;
  }
  double files_s = 0;
  std::map<std::string, std::string> known;
  size_t bytes = 0;
  const std::string path = write_checkpoint_dir(output_dir_, step, [&](const std::string& dir) {
    const auto tf = std::chrono::steady_clock::now();
    for (const auto& f : files) create_dir_or_fail((fs::path(dir) / f.rel).parent_path().string(), "checkpoint");
    // Files are written (and hashed) in parallel: large files are sharded, so several
    // SHA-256 streams keep up with the disk.
    std::mutex km;
    std::exception_ptr first_error;
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t i; (i = next.fetch_add(1)) < files.size();) {
        {
          std::lock_guard<std::mutex> g(km);
          if (first_error) return;
        }
        try {
          const auto& f = files[i];
          size_t n = 0;
          const std::string sha = write_snapshot_file(dir, f, &n);
          std::lock_guard<std::mutex> g(km);
          known[f.rel] = sha;
          bytes += n;
        } catch (...) {
          std::lock_guard<std::mutex> g(km);
          if (!first_error) first_error = std::current_exception();
        }
      }
    };
    const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2);
    const int nthreads = std::max(1, std::min<int>({8, hw, static_cast<int>(files.size())}));
    std::vector<std::thread> pool;
    for (int t = 1; t < nthreads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
    if (first_error) std::rethrow_exception(first_error);
    if (parts_.parts > 1) bytes += adopt_parts(step, dir, files, known);
    files_s = seconds_since(tf);
    write_metadata(dir, std::move(metadata), known);
  });
  apply_retention(output_dir_, retention_);
  if (parts_.parts > 1) remove_checkpoint_parts(output_dir_, step);
  std::lock_guard<std::mutex> g(mu_);
  timings_.copy_wait_s = copy_wait;
  timings_.files_s = files_s;
  timings_.publish_s = seconds_since(t0) - copy_wait - files_s;
  last_good_ = path;
  written_.push_back(path);
  last_write_s_ = seconds_since(t0);
  last_bytes_ = bytes;
  log::info("checkpoint ", path, " (", static_cast<double>(bytes) / (1 << 20), " MiB in ", last_write_s_, " s)");
}

double CheckpointWriter::save_files(long step,
                                    const std::function<void(HostStaging&, std::vector<SnapshotFile>&)>& build,
                                    nlohmann::json metadata) {
  return save_files_timed(step, build, std::move(metadata), 0, 0);
}

double CheckpointWriter::save_files_timed(long step,
                                          const std::function<void(HostStaging&, std::vector<SnapshotFile>&)>& build,
                                          nlohmann::json metadata, double waited, double scan) {
  const auto t0 = std::chrono::steady_clock::now();
  wait();
  const size_t allocated_before = staging_.allocated_bytes();
  const auto ts = std::chrono::steady_clock::now();
  std::vector<SnapshotFile> files;
  build(staging_, files);
  staging_.record();
  {
    std::lock_guard<std::mutex> g(mu_);
    timings_ = SaveTimings{};
    timings_.finite_scan_s = scan;
    timings_.wait_previous_s = waited + std::chrono::duration<double>(ts - t0).count();
    timings_.stage_s = seconds_since(ts);
    timings_.new_host_bytes = static_cast<double>(staging_.allocated_bytes() - allocated_before);
  }
  in_flight_step_ = step;
  in_flight_seq_ = part_seq_++;
  if (!async_) {
    try {
      run_write(step, std::move(files), std::move(metadata));
    } catch (...) {
      error_ = std::current_exception();
    }
    wait();
    return seconds_since(t0);
  }
  worker_ = std::thread([this, step, files = std::move(files), metadata = std::move(metadata)]() mutable {
    try {
      run_write(step, std::move(files), std::move(metadata));
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  return seconds_since(t0);
}

void CheckpointWriter::prepare(const RoleMap& roles, const std::vector<std::string>& checkpointed,
                               const RoleOptimizers& optimizers) {
  std::vector<HostStaging::Spec> specs;
  for (const auto& name : checkpointed) {
    if (!roles.count(name) || !optimizers.count(name)) continue;  // save() names the problem
    std::set<const c10::TensorImpl*> trained;
    for (const auto& p : optimizers.at(name).params) trained.insert(p.unsafeGetTensorImpl());
    for (const auto& item : roles.at(name)->model->named_parameters(true)) {
      const auto& p = item.value();
      specs.push_back({weight_key(name, item.key()), p.sizes().vec(), torch::kFloat32, p.device()});
      if (!trained.count(p.unsafeGetTensorImpl())) continue;
      for (const char* m : {".exp_avg", ".exp_avg_sq"})
        specs.push_back({optimizer_key(name, item.key() + m), p.sizes().vec(), p.scalar_type(), p.device()});
    }
  }
  staging_.prepare(std::move(specs));
}

double CheckpointWriter::save(long step, const RoleMap& roles, const std::vector<std::string>& checkpointed,
                              const RoleOptimizers& optimizers, nlohmann::json trainer_state,
                              const std::string& resolved_yaml, nlohmann::json metadata,
                              const std::string& source_yaml) {
  const auto t0 = std::chrono::steady_clock::now();
  wait();  // the last good checkpoint must be known before anything below can fail
  const auto tscan = std::chrono::steady_clock::now();
  std::map<std::string, RoleTensors> per_role;
  for (const auto& name : checkpointed) {
    VQAD_CHECK(roles.count(name) && optimizers.count(name), "checkpoint-", step, ": role '", name,
               "' is checkpointed but has no model or optimizer");
    per_role[name] = role_tensors(*roles.at(name), *optimizers.at(name).adamw);
    NamedTensors all = per_role[name].weights;
    all.insert(all.end(), per_role[name].opt_state.begin(), per_role[name].opt_state.end());
    size_t count = 0;
    auto bad = nonfinite_tensors(all, 4, &count);
    if (!bad.empty()) {
      std::string list;
      for (const auto& b : bad) list += (list.empty() ? "" : ", ") + b;
      fail("step ", step, ": not saving checkpoint-", step, ": role '", name, "' holds non-finite values in ", count,
           " tensor(s) (first: ", list, count > bad.size() ? ", ..." : "", "); ",
           last_good_checkpoint_text(last_good(), output_dir_));
    }
  }
  const double waited = std::chrono::duration<double>(tscan - t0).count(), scan = seconds_since(tscan);
  return waited + scan + save_files_timed(
      step,
      [&](HostStaging& staging, std::vector<SnapshotFile>& files) {
        for (const auto& [name, rt] : per_role) {
          const auto& role = *roles.at(name);
          std::vector<std::pair<std::string, torch::Tensor>> w, o;
          for (const auto& [k, t] : rt.weights) w.emplace_back(k, staging.stage(weight_key(name, k), t.to(torch::kFloat32)));
          add_tensor_files(files, name + "/transformer", kWeightsPrefix, std::move(w), {{"format", "pt"}}, shard_bytes_);
          SnapshotFile c;
          c.rel = name + "/transformer/config.json";
          c.bytes = role.model->config().to_json().dump(2) + "\n";
          files.push_back(std::move(c));
          for (const auto& [k, t] : rt.opt_state) o.emplace_back(k, staging.stage(optimizer_key(name, k), t));
          for (const auto& [k, v] : rt.steps) o.emplace_back(k, torch::tensor(v, torch::kInt64).reshape({}));
          add_tensor_files(files, name, kOptimizerPrefix, std::move(o), {{"format", "vqad.adamw"}}, shard_bytes_);
        }
        add_run_files(files, trainer_state, resolved_yaml, source_yaml);
      },
      std::move(metadata), waited, scan);
}

namespace {
std::string part_name(const std::string& prefix, int part, int parts) {
  char b[64];
  std::snprintf(b, sizeof b, "-part-%05d-of-%05d.safetensors", part + 1, parts);
  return prefix + b;
}
}  // namespace

void CheckpointWriter::prepare_sharded(const std::vector<std::string>& checkpointed,
                                       const std::map<std::string, dist::FullyShardedModel*>& models,
                                       const RoleOptimizers& optimizers) {
  std::vector<HostStaging::Spec> specs;
  for (const auto& name : checkpointed) {
    if (!models.count(name) || !optimizers.count(name)) continue;  // save_sharded names the problem
    const auto device = optimizers.at(name).params.empty() ? torch::Device(torch::kCPU)
                                                           : optimizers.at(name).params.front().device();
    for (const auto& [param, sizes, trainable] : models.at(name)->written_parameters()) {
      specs.push_back({weight_key(name, param), sizes, torch::kFloat32, device});
      if (!trainable) continue;
      for (const char* m : {".exp_avg", ".exp_avg_sq"})
        specs.push_back({optimizer_key(name, param + m), sizes, torch::kFloat32, device});
    }
  }
  staging_.prepare(std::move(specs));
}

double CheckpointWriter::save_sharded(long step, const RoleMap& roles, const std::vector<std::string>& checkpointed,
                                      const std::map<std::string, dist::FullyShardedModel*>& models,
                                      const RoleOptimizers& optimizers, nlohmann::json trainer_state,
                                      const std::string& resolved_yaml, nlohmann::json metadata,
                                      const std::string& source_yaml) {
  VQAD_CHECK(parts_.messages != nullptr && parts_.parts >= 1, "checkpoint-", step,
             ": a sharded checkpoint needs the writers' group (set_parts)");
  const auto t0 = std::chrono::steady_clock::now();
  wait();  // the last good checkpoint must be known before anything below can fail
  const double waited = seconds_since(t0);
  for (const auto& name : checkpointed)
    VQAD_CHECK(roles.count(name) && models.count(name) && optimizers.count(name), "checkpoint-", step, ": role '",
               name, "' is checkpointed but has no sharded model or optimizer");
  std::string bad;  // this rank's non-finite tensors (the first few)
  size_t bad_count = 0;
  return waited + save_files_timed(
      step,
      [&](HostStaging& staging, std::vector<SnapshotFile>& files) {
        for (const auto& name : checkpointed) {
          std::vector<std::pair<std::string, torch::Tensor>> w, o;
          auto check = [&](const std::string& what, const torch::Tensor& t) {
            if (torch::isfinite(t).all().item<bool>()) return;
            if (bad_count++ < 4) bad += (bad.empty() ? "" : ", ") + name + ":" + what;
          };
          models.at(name)->visit_written_state(
              optimizers.at(name).adamw.get(), [&](const dist::FullyShardedModel::FullParameter& p) {
                check(p.name, p.weight);
                w.emplace_back(p.name, staging.stage(weight_key(name, p.name), p.weight));
                if (p.step < 0) return;
                const std::pair<const char*, const torch::Tensor*> moments[] = {
                    {".exp_avg", &p.exp_avg}, {".exp_avg_sq", &p.exp_avg_sq}, {".max_exp_avg_sq", &p.max_exp_avg_sq}};
                for (const auto& [suffix, t] : moments) {
                  if (!t->defined()) continue;
                  check(p.name + suffix, *t);
                  o.emplace_back(p.name + suffix, staging.stage(optimizer_key(name, p.name + suffix), *t));
                }
                o.emplace_back(p.name + ".step", torch::tensor(p.step, torch::kInt64).reshape({}));
              });
          auto add = [&](const std::string& dir, const std::string& prefix,
                         std::vector<std::pair<std::string, torch::Tensor>> tensors, const char* format) {
            if (tensors.empty()) return;
            SnapshotFile f;
            f.rel = dir + "/" + part_name(prefix, parts_.part, parts_.parts);
            f.index = dir + "/" + prefix + ".safetensors.index.json";
            f.safetensors = true;
            f.st_metadata = {{"format", format}};
            f.tensors = std::move(tensors);
            files.push_back(std::move(f));
          };
          add(name + "/transformer", kWeightsPrefix, std::move(w), "pt");
          add(name, kOptimizerPrefix, std::move(o), "vqad.adamw");
          if (parts_.part == 0) {
            SnapshotFile c;
            c.rel = name + "/transformer/config.json";
            c.bytes = roles.at(name)->model->config().to_json().dump(2) + "\n";
            files.push_back(std::move(c));
          }
        }
        // Every writer refuses alike when any part holds non-finite values.
        std::string all;
        for (const auto& part : parts_.messages->all_gather_string(bad, "checkpoint-" + std::to_string(step) +
                                                                            " non-finite scan"))
          if (!part.empty()) all += (all.empty() ? "" : ", ") + part;
        if (!all.empty())
          fail("step ", step, ": not saving checkpoint-", step, ": non-finite values in ", all, "; ",
               last_good_checkpoint_text(last_good(), output_dir_));
        if (parts_.part != 0) return;
        add_run_files(files, trainer_state, resolved_yaml, source_yaml);
      },
      std::move(metadata), 0, 0);
}

// ---------------------------------------------------------------------------------------
static void load_adamw_state(const std::string& path, const Role& role, torch::optim::AdamW& opt, bool on_host) {
  auto state = path.ends_with(".index.json") ? io::load_sharded(path) : io::load_safetensors(path);
  std::set<std::string> used;
  torch::NoGradGuard ng;
  for (const auto& item : role.model->named_parameters(true)) {
    const auto& p = item.value();
    const std::string k = item.key();
    auto ea = state.find(k + ".exp_avg"), eq = state.find(k + ".exp_avg_sq"), st = state.find(k + ".step");
    if (ea == state.end() && eq == state.end() && st == state.end()) continue;  // never updated
    VQAD_CHECK(ea != state.end() && eq != state.end() && st != state.end(), path, ": parameter '", k,
               "' has an incomplete AdamW state (needs .exp_avg, .exp_avg_sq and .step)");
    VQAD_CHECK(ea->second.sizes() == p.sizes() && eq->second.sizes() == p.sizes(), path, ": AdamW state of '", k,
               "' has shape ", ea->second.sizes(), " but the parameter has ", p.sizes());
    VQAD_CHECK(st->second.scalar_type() == torch::kInt64 && st->second.numel() == 1, path, ": '", k,
               ".step' must be one int64");
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(st->second.item<int64_t>());
    // On the host the moments stay views of the file mapping (nothing is read until used).
    const torch::Device dev = on_host ? torch::Device(torch::kCPU) : p.device();
    s->exp_avg(ea->second.to(dev, p.scalar_type(), false, !on_host));
    s->exp_avg_sq(eq->second.to(dev, p.scalar_type(), false, !on_host));
    used.insert({ea->first, eq->first, st->first});
    if (auto mx = state.find(k + ".max_exp_avg_sq"); mx != state.end()) {
      s->max_exp_avg_sq(mx->second.to(dev, p.scalar_type(), false, !on_host));
      used.insert(mx->first);
    }
    opt.state()[p.unsafeGetTensorImpl()] = std::move(s);
  }
  for (const auto& [k, _] : state)
    VQAD_CHECK(used.count(k), path, ": tensor '", k, "' belongs to no parameter of role '", role.name,
               "' (checkpoint of a different model or trainable scope?)");
}

nlohmann::json load_checkpoint_state(const std::string& dir, RoleMap& roles,
                                     const std::vector<std::string>& checkpointed, RoleOptimizers& optimizers,
                                     LoadTimings* timings, bool optimizer_state_on_host) {
  LoadTimings lt;
  auto t0 = std::chrono::steady_clock::now();
  require_intact(dir, "resume_from_checkpoint");
  lt.verify_s = seconds_since(t0);
  for (const auto& name : checkpointed) {
    auto& role = roles.at(name);
    const fs::path rd = fs::path(dir) / name;
    VQAD_CHECK(fs::is_directory(rd), dir, ": no weights for role '", name, "'");
    t0 = std::chrono::steady_clock::now();
    model::load_weights(*role->model, model::read_weights(rd.string()));
    lt.weights_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    auto& opt = *optimizers.at(name).adamw;
    if (fs::is_regular_file(rd / kOptimizerFile)) {
      load_adamw_state((rd / kOptimizerFile).string(), *role, opt, optimizer_state_on_host);
    } else if (fs::is_regular_file(rd / kOptimizerIndex)) {
      load_adamw_state((rd / kOptimizerIndex).string(), *role, opt, optimizer_state_on_host);
    } else {
      const fs::path legacy = rd / "optimizer.pt";
      VQAD_CHECK(fs::is_regular_file(legacy), dir, ": no optimizer state for role '", name, "' (expected ",
                 (rd / kOptimizerFile).string(), ")");
      try {
        torch::load(opt, legacy.string());
      } catch (const c10::Error& e) {
        std::string msg = e.what_without_backtrace();
        msg = msg.substr(0, msg.find('\n'));
        fail(legacy.string(), ": not a readable torch optimizer archive: ", msg);
      }
    }
    lt.optimizer_s += seconds_since(t0);
  }
  if (timings) *timings = lt;
  const fs::path sp = fs::path(dir) / "trainer_state.json";
  std::ifstream f(sp);
  VQAD_CHECK(f.good(), dir, ": trainer_state.json missing");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail(sp.string(), ": malformed JSON: ", e.what());
  }
  VQAD_CHECK(state.is_object(), sp.string(), ": expected a JSON object");
  VQAD_CHECK(state.contains("step") && state["step"].is_number_integer(), sp.string(), ": 'step' must be an integer");
  VQAD_CHECK(state.contains("data") && state["data"].is_object(), sp.string(), ": 'data' must be an object");
  VQAD_CHECK(state.contains("generator_state") && state["generator_state"].is_string(), sp.string(),
             ": 'generator_state' must be a string");
  VQAD_CHECK(!state.contains("optimizer_updates") || state["optimizer_updates"].is_object(), sp.string(),
             ": 'optimizer_updates' must be an object");
  return state;
}

}  // namespace vqad::train
