#include "vqad/core/signals.h"

#include <signal.h>

#include <atomic>
#include <cstring>

namespace vqad {
namespace {
std::atomic<int> g_stop{0};

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (!g_stop.compare_exchange_strong(expected, sig)) {
    // Second request: stop now, with the default action of the signal.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}
}  // namespace

void install_run_signal_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGXFSZ, SIG_IGN);
}

int stop_signal() { return g_stop.load(); }
void clear_stop_signal() { g_stop.store(0); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "a signal";
  }
}

}  // namespace vqad
