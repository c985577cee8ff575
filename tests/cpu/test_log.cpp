#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "vqad/core/error.h"
#include "vqad/core/log.h"
#include "vqad/core/metrics.h"
#include "vqad/core/progress.h"

namespace fs = std::filesystem;

namespace {

fs::path temp_path(const std::string& stem) {
  std::random_device rd;
  return fs::temp_directory_path() /
         (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
}

std::string read_all(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
TEST(Log, LevelsFilterAndFormat) {
  std::vector<std::string> got;
  vqad::log::set_sink([&](std::string_view l) { got.emplace_back(l); });
  vqad::log::set_level(vqad::log::Level::kWarn);
  vqad::log::info("hidden ", 1);
  vqad::log::debug("hidden");
  vqad::log::warn("disk at ", 93, "%");
  vqad::log::error("boom");
  vqad::log::set_rank(3);
  vqad::log::set_level(vqad::log::Level::kDebug);
  vqad::log::debug("x=", 2.5);
  vqad::log::set_rank(-1);
  vqad::log::set_sink(nullptr);
  vqad::log::set_level(vqad::log::Level::kInfo);
  ASSERT_EQ(got.size(), 3u);
  // 2026-11-29T07:38:04.123Z W disk at 93%
  EXPECT_EQ(got[0].size(), std::string("2026-11-29T07:38:04.123Z W disk at 93%").size()) << got[0];
  EXPECT_EQ(got[0][10], 'T');
  EXPECT_EQ(got[0][23], 'Z');
  EXPECT_EQ(got[0].substr(24), " W disk at 93%");
  EXPECT_EQ(got[1].substr(24), " E boom");
  EXPECT_EQ(got[2].substr(24), " D [rank 3] x=2.5");
}

TEST(Log, ParseLevelAndEnv) {
  EXPECT_EQ(vqad::log::parse_level("DEBUG"), vqad::log::Level::kDebug);
  EXPECT_EQ(vqad::log::parse_level("warning"), vqad::log::Level::kWarn);
  EXPECT_FALSE(vqad::log::parse_level("verbose").has_value());
  ::setenv("VQAD_LOG", "error", 1);
  vqad::log::init_from_env();
  EXPECT_EQ(vqad::log::level(), vqad::log::Level::kError);
  ::setenv("VQAD_LOG", "loud", 1);
  try {
    vqad::log::init_from_env();
    FAIL();
  } catch (const vqad::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("VQAD_LOG"), std::string::npos);
    EXPECT_NE(m.find("loud"), std::string::npos);
    EXPECT_NE(m.find("debug"), std::string::npos);
  }
  ::unsetenv("VQAD_LOG");
  vqad::log::set_level(vqad::log::Level::kInfo);
}

// ---------------------------------------------------------------------------
TEST(Progress, FormatHelpers) {
  EXPECT_EQ(vqad::format_duration(45), "45s");
  EXPECT_EQ(vqad::format_duration(187), "3m07s");
  EXPECT_EQ(vqad::format_duration(7500), "2h05m");
  EXPECT_EQ(vqad::format_duration(3 * 86400 + 4 * 3600), "3d04h");
  EXPECT_EQ(vqad::format_duration(-1), "?");
  EXPECT_EQ(vqad::format_rate(2.5, "it"), "2.50 it/s");
  EXPECT_EQ(vqad::format_rate(0.125, "step"), "8.0 s/step");
}

TEST(Progress, NonTtyPrintsPlainPeriodicLines) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  double now = 100.0;
  vqad::Progress::Options opt;
  opt.out = f;
  opt.tty = false;
  opt.plain_interval_s = 10.0;
  opt.clock = [&] { return now; };
  {
    vqad::Progress p("train", 100, "step", opt);
    for (int i = 1; i <= 40; ++i) {
      now += 1.0;  // one step per second
      p.set_postfix("loss 0.5");
      p.update();
    }
  }  // destructor prints the final line
  auto lines = lines_of(read_all(f));
  std::fclose(f);
  // Lines at t = 10, 20, 30, 40 s plus the final one.
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0], "train 10/100 (10.0%) | 1.00 step/s | elapsed 10s | ETA 1m30s | loss 0.5");
  EXPECT_EQ(lines[3], "train 40/100 (40.0%) | 1.00 step/s | elapsed 40s | ETA 1m00s | loss 0.5");
  EXPECT_EQ(lines[4], lines[3]);
  for (const auto& l : lines) {
    EXPECT_EQ(l.find('\r'), std::string::npos);
    EXPECT_EQ(l.find('\033'), std::string::npos);
  }
}

TEST(Progress, TtyRedrawsInPlace) {
  std::FILE* f = std::tmpfile();
  double now = 0.0;
  vqad::Progress::Options opt;
  opt.out = f;
  opt.tty = true;
  opt.bar_width = 10;
  opt.clock = [&] { return now; };
  {
    vqad::Progress p("export", 4, "file", opt);
    for (int i = 0; i < 4; ++i) {
      now += 0.5;
      p.update();
    }
    p.finish();
    p.finish();  // idempotent
  }
  std::string s = read_all(f);
  std::fclose(f);
  EXPECT_NE(s.find("\r[##########] export 4/4 (100.0%) | 2.00 file/s | elapsed 2s | ETA 0s\033[K\n"),
            std::string::npos)
      << s;
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1);
}

TEST(Progress, UnknownTotal) {
  double now = 0.0;
  vqad::Progress::Options opt;
  opt.out = nullptr;
  opt.tty = false;
  opt.clock = [&] { return now; };
  vqad::Progress p("scan", 0, "row", opt);
  now = 4.0;
  p.set(8);
  EXPECT_EQ(p.status_line(), "scan 8 | 2.00 row/s | elapsed 4s");
}

// ---------------------------------------------------------------------------
TEST(Metrics, WritesOneFlushedObjectPerLine) {
  fs::path dir = temp_path("vqad_metrics");
  std::string path = (dir / "sub" / "metrics.jsonl").string();
  vqad::MetricsWriter w(path);
  w.log(1, {{"loss", 0.5}, {"lr", 1e-6}});
  // Visible before close (flushed): another reader sees it now.
  auto recs = vqad::read_metrics(path);
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0]["step"], 1);
  EXPECT_DOUBLE_EQ(recs[0]["loss"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(recs[0]["lr"].get<double>(), 1e-6);
  EXPECT_TRUE(recs[0].contains("time"));
  w.write({{"step", 2}, {"loss", std::numeric_limits<double>::quiet_NaN()}, {"grad_norm", {{"student", 1.5}}}});
  w.close();
  EXPECT_THROW(w.write({{"step", 3}}), vqad::Error);
  recs = vqad::read_metrics(path);
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_TRUE(recs[1]["loss"].is_null());  // NaN is not JSON
  EXPECT_DOUBLE_EQ(recs[1]["grad_norm"]["student"].get<double>(), 1.5);
  std::ifstream in(path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    EXPECT_EQ(line.front(), '{');
    EXPECT_EQ(line.back(), '}');
  }
  EXPECT_EQ(n, 2);
  fs::remove_all(dir);
}

TEST(Metrics, AppendsAndResumes) {
  fs::path dir = temp_path("vqad_metrics");
  std::string path = (dir / "m.jsonl").string();
  {
    vqad::MetricsWriter w(path);
    for (int s = 1; s <= 5; ++s) w.log(s, {{"loss", 1.0 / s}});
    w.write({{"event", "note"}});
  }
  {
    vqad::MetricsWriter w(path);  // append mode keeps earlier lines
    w.log(6, {{"loss", 0.1}});
  }
  EXPECT_EQ(vqad::read_metrics(path).size(), 7u);
  {
    // Resume from the step-3 checkpoint: steps 4..6 will run again.
    auto w = vqad::MetricsWriter::open_for_resume(path, 3);
    w.log(4, {{"loss", 0.2}});
  }
  auto recs = vqad::read_metrics(path);
  std::vector<int64_t> steps;
  for (const auto& r : recs)
    if (r.contains("step")) steps.push_back(r["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(recs.size(), 5u);  // the step-less note is kept
  {
    vqad::MetricsWriter w(path, /*append=*/false);
  }
  EXPECT_TRUE(vqad::read_metrics(path).empty());
  fs::remove_all(dir);
}

TEST(Metrics, TruncatedLastLineIsSkippedButCorruptMiddleIsAnError) {
  fs::path dir = temp_path("vqad_metrics");
  fs::create_directories(dir);
  std::string path = (dir / "m.jsonl").string();
  std::ofstream(path) << "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3, \"lo";
  EXPECT_EQ(vqad::read_metrics(path).size(), 2u);
  std::ofstream(path) << "{\"step\": 1}\ngarbage\n{\"step\": 3}\n";
  try {
    vqad::read_metrics(path);
    FAIL();
  } catch (const vqad::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos);
    EXPECT_NE(m.find("line 2"), std::string::npos);
  }
  fs::remove_all(dir);
}
