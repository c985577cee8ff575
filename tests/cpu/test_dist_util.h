// Multi-process test helpers: run the vqad binary (or a shell line) and collect its exit
// status, output and wall time. Every rank runs with one intra-op thread (CI has 2 cores).
#pragma once
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "vqad/dist/backend.h"

// The multi-process tests run collectives on Gloo; a build without the libgloo-dev headers
// has none, and those tests skip saying so (the single-process ones still run).
#define VQAD_SKIP_WITHOUT_GLOO()                                                          \
  do {                                                                                    \
    if (!vqad::dist::gloo_available())                                                    \
      GTEST_SKIP() << "this vqad build has no Gloo (install libgloo-dev and rebuild)";   \
  } while (0)

namespace vqad::test_dist {

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout + stderr
  double seconds = 0;
};

inline RunResult run_shell(const std::string& line, const std::filesystem::path& log) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string cmd = "OMP_NUM_THREADS=1 " + line + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  return r;
}

inline RunResult run_vqad(const std::string& args, const std::filesystem::path& log) {
  return run_shell(std::string(VQAD_BINARY) + " " + args, log);
}

// A currently free loopback port (bound to 0, read back, released).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

inline bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace vqad::test_dist
