// `vqad dist check`: run every collective of vqad's process groups across the launched ranks
// and compare each result with what this rank computes from every rank's (seeded) inputs.
// Run it on a new machine or cluster before training (e.g. vqad launch --nproc 8 dist check
// --device cuda). Fault injection (--fault-rank, --fault) makes one rank die or hang at a
// chosen point so that the error path (every other rank names it) can be tested.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace vqad::dist {

class ProcessGroup;

struct CheckOptions {
  std::string device = "cpu";  // cpu (Gloo) | cuda (NCCL, device = LOCAL_RANK)
  double timeout_s = 60;
  int64_t elements = 4099;     // per-rank elements of the floating-point collectives
  int fault_rank = -1;         // the rank that misbehaves
  std::string fault = "none";  // none | exit | kill | hang | error
  bool verbose = false;
  // Checks of the layers above (the CLI adds Ulysses through the Wan model), run on the
  // world group after the collective checks; each returns how many checks it passed and
  // throws vqad::Error naming what failed.
  std::vector<std::function<int(ProcessGroup& world)>> extra;
};

// Returns 0 when every check passed on this rank; a failed comparison or collective is a
// vqad::Error naming the collective.
int run_collective_check(const CheckOptions& options);

}  // namespace vqad::dist
