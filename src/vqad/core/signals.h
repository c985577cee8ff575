// Process signals a long run must handle: SIGTERM / SIGINT (a batch system or a user
// stopping the run) set a flag that the training loop polls between steps, so the run
// can write its final checkpoint and exit cleanly; a second one ends the process at
// once. SIGXFSZ is ignored so that exceeding the file size limit is a write error
// (EFBIG) with a clear message instead of a core dump.
#pragma once

namespace vqad {

void install_run_signal_handlers();
// The signal that asked the run to stop (SIGTERM, SIGINT), 0 when none.
int stop_signal();
// For tests: forget a recorded signal.
void clear_stop_signal();
const char* signal_name(int sig);

}  // namespace vqad
