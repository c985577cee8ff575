// JSONL metrics: one JSON object per line, flushed after every record so a
// crash loses at most the line being written. Appends by default so that a
// resumed run continues the same file; open_for_resume() first drops records
// newer than the checkpoint the run resumes from (those steps are re-run).
#pragma once
#include <cstdint>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace vqad {

class MetricsWriter {
 public:
  // Creates parent directories. append=false truncates.
  explicit MetricsWriter(const std::string& path, bool append = true);
  // Keeps only records whose "step" is <= resume_step (records without a step
  // are kept), rewrites the file atomically, then opens it for appending.
  static MetricsWriter open_for_resume(const std::string& path, int64_t resume_step);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&&) = delete;
  MetricsWriter(const MetricsWriter&) = delete;

  // Writes `record` as one line. Non-finite numbers become null (JSON has no NaN).
  void write(const nlohmann::json& record);
  // {"step": step, "time": <unix seconds>, key: value...}
  void log(int64_t step, const std::map<std::string, double>& values);
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// Reads a JSONL file. A malformed final line (a write cut short by a crash) is
// skipped; a malformed line elsewhere is an error naming the file and line.
std::vector<nlohmann::json> read_metrics(const std::string& path);

}  // namespace vqad
