#include "vqad/core/metrics.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "vqad/core/error.h"
#include "vqad/core/safetensors.h"  // write_file_atomic

namespace vqad {

namespace fs = std::filesystem;

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    VQAD_CHECK(!ec, "metrics file ", path, ": cannot create directory ", parent.string(), ": ",
               ec.message());
  }
  f_ = std::fopen(path.c_str(), append ? "ab" : "wb");
  VQAD_CHECK(f_ != nullptr, "metrics file ", path, ": cannot open for writing: ",
             std::strerror(errno));
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : path_(std::move(other.path_)), f_(other.f_) {
  other.f_ = nullptr;
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::close() {
  if (f_) {
    int rc = std::fclose(f_);
    f_ = nullptr;
    VQAD_CHECK(rc == 0, "metrics file ", path_, ": close failed: ", std::strerror(errno));
  }
}

namespace {
nlohmann::json sanitize(const nlohmann::json& j) {
  if (j.is_number_float() && !std::isfinite(j.get<double>())) return nullptr;
  if (j.is_object()) {
    nlohmann::json out = nlohmann::json::object();
    for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = sanitize(it.value());
    return out;
  }
  if (j.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& v : j) out.push_back(sanitize(v));
    return out;
  }
  return j;
}
}  // namespace

void MetricsWriter::write(const nlohmann::json& record) {
  VQAD_CHECK(f_ != nullptr, "metrics file ", path_, ": write after close");
  VQAD_CHECK(record.is_object(), "metrics file ", path_, ": a record must be a JSON object, got ",
             record.type_name());
  std::string line = sanitize(record).dump();
  line += '\n';
  size_t w = std::fwrite(line.data(), 1, line.size(), f_);
  VQAD_CHECK(w == line.size() && std::fflush(f_) == 0, "metrics file ", path_,
             ": write failed: ", std::strerror(errno));
}

void MetricsWriter::log(int64_t step, const std::map<std::string, double>& values) {
  nlohmann::json rec = nlohmann::json::object();
  rec["step"] = step;
  rec["time"] = std::chrono::duration<double>(
                    std::chrono::system_clock::now().time_since_epoch())
                    .count();
  for (const auto& [k, v] : values) rec[k] = v;
  write(rec);
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  VQAD_CHECK(in.good(), "metrics file ", path, ": cannot open");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(line);
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < lines.size(); ++i) {
    try {
      out.push_back(nlohmann::json::parse(lines[i]));
    } catch (const nlohmann::json::exception& e) {
      if (i + 1 == lines.size()) break;  // cut short by a crash
      fail("metrics file ", path, ": line ", i + 1, " is not valid JSON: ", e.what());
    }
  }
  return out;
}

MetricsWriter MetricsWriter::open_for_resume(const std::string& path, int64_t resume_step) {
  if (fs::exists(path)) {
    std::string kept;
    for (const auto& rec : read_metrics(path)) {
      if (rec.is_object() && rec.contains("step") && rec["step"].is_number() &&
          rec["step"].get<double>() > static_cast<double>(resume_step))
        continue;
      kept += rec.dump();
      kept += '\n';
    }
    st::write_file_atomic(path, {std::string_view(kept)});
  }
  return MetricsWriter(path, true);
}

}  // namespace vqad
