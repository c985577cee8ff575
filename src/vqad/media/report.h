// `vqad report RUN_DIR`: one self-contained HTML page (images and videos embedded as
// data URIs, no external files or scripts) with what a person needs to judge a run:
// the resolved config, the lineage of the newest checkpoint, loss / grad-norm / lr curves,
// validation contact sheets and videos per step, throughput and memory.
#pragma once
#include <string>

namespace vqad::media {

// Writes `out_html` atomically; returns a one-line summary of what it holds. Errors name
// the run directory and what is missing (a directory without metrics.jsonl is not a run).
std::string write_run_report(const std::string& run_dir, const std::string& out_html);

// RFC 4648 base64 (for data URIs).
std::string base64(const std::string& bytes);

}  // namespace vqad::media
