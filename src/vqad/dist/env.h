// Where this process sits in a distributed job, read from the launcher's environment.
//
// Sources, in order:
//  - torchrun / `vqad launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True: the launcher hosts the TCPStore, every
//    rank connects as a client);
//  - Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
//    SLURM_TASKS_PER_NODE, with MASTER_ADDR / MASTER_PORT from the environment (a job script
//    exports them; Slurm has no fixed rendezvous address);
//  - none of them: a single process (world 1).
// Torch-free.
#pragma once
#include <functional>
#include <string>

namespace vqad::dist {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;     // the launcher hosts the store (rank 0 is a client too)
  std::string source = "none";  // torchrun | slurm | none
  bool distributed() const { return world_size > 1; }
  // Started by a launcher (even as a world of one: `vqad launch --nproc 1 dist check` runs the
  // collectives through a one-rank group, which is how NCCL is exercised on a single GPU).
  bool launched() const { return source != "none"; }
};

// `get` returns the value of a variable or nullptr. Malformed or inconsistent values are a
// vqad::Error naming the variable, what was expected and what was found.
LaunchEnv launch_env_from(const std::function<const char*(const char*)>& get);
LaunchEnv launch_env();  // from this process's environment

// "rank 2/4 (local 2/4) via torchrun, store 127.0.0.1:29500"
std::string describe(const LaunchEnv& e);

}  // namespace vqad::dist
