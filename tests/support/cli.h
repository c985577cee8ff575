// Running the vqad binary from the CPU tests (VQAD_BINARY, a compile definition of
// vqad_tests): its exit status and everything it printed.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace vqad::test {

struct CliResult {
  int rc;
  std::string output;  // stdout and stderr together
};

// A fresh directory for one test of this process: temp/vqad_test_<name>_<pid>.
inline std::filesystem::path cli_temp_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("vqad_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// `vqad ARGS` with its output captured in DIR/cli.log.
inline CliResult run_vqad(const std::string& args, const std::filesystem::path& dir) {
  const std::filesystem::path log = dir / "cli.log";
  const std::string cmd = std::string(VQAD_BINARY) + " " + args + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WEXITSTATUS(status), ss.str()};
}

// The same in a scratch directory that is removed afterwards (commands that write nothing
// the test reads).
inline CliResult run_vqad_scratch(const std::string& args, const std::string& name) {
  const std::filesystem::path dir = cli_temp_dir(name);
  CliResult r = run_vqad(args, dir);
  std::filesystem::remove_all(dir);
  return r;
}

inline bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

}  // namespace vqad::test
