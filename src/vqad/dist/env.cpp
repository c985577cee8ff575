#include "vqad/dist/env.h"

#include <cstdlib>

#include "vqad/core/error.h"

namespace vqad::dist {
namespace {

int parse_int(const char* name, const char* v, int lo, int hi) {
  std::string s(v);
  size_t pos = 0;
  long x = 0;
  try {
    x = std::stol(s, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  VQAD_CHECK(pos == s.size() && !s.empty(), "environment variable ", name, ": expected an integer, found '", s, "'");
  VQAD_CHECK(x >= lo && x <= hi, "environment variable ", name, ": expected a value in [", lo, ", ", hi, "], found ",
             x);
  return static_cast<int>(x);
}

// Slurm's SLURM_TASKS_PER_NODE: "4(x2),3" -> tasks on the first node (4).
int first_tasks_per_node(const char* v) {
  std::string s(v);
  size_t end = s.find_first_of("(,");
  return parse_int("SLURM_TASKS_PER_NODE", s.substr(0, end).c_str(), 1, 1 << 20);
}

}  // namespace

LaunchEnv launch_env_from(const std::function<const char*(const char*)>& get) {
  LaunchEnv e;
  auto has = [&](const char* k) { return get(k) != nullptr && *get(k) != '\0'; };
  if (has("RANK") || has("WORLD_SIZE")) {
    VQAD_CHECK(has("RANK") && has("WORLD_SIZE"), "environment: RANK and WORLD_SIZE must be set together (found only ",
               has("RANK") ? "RANK" : "WORLD_SIZE", ")");
    e.source = "torchrun";
    e.world_size = parse_int("WORLD_SIZE", get("WORLD_SIZE"), 1, 1 << 20);
    e.rank = parse_int("RANK", get("RANK"), 0, e.world_size - 1);
    e.local_rank = has("LOCAL_RANK") ? parse_int("LOCAL_RANK", get("LOCAL_RANK"), 0, 1 << 20) : e.rank;
    e.local_world_size =
        has("LOCAL_WORLD_SIZE") ? parse_int("LOCAL_WORLD_SIZE", get("LOCAL_WORLD_SIZE"), 1, 1 << 20) : e.world_size;
    if (e.world_size > 1) {
      VQAD_CHECK(has("MASTER_ADDR") && has("MASTER_PORT"), "environment: WORLD_SIZE is ", e.world_size,
                 " but MASTER_ADDR / MASTER_PORT are not set (torchrun and `vqad launch` set them)");
    }
    const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "true" || std::string(agent) == "1");
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    e.source = "slurm";
    e.world_size = parse_int("SLURM_NTASKS", get("SLURM_NTASKS"), 1, 1 << 20);
    e.rank = parse_int("SLURM_PROCID", get("SLURM_PROCID"), 0, e.world_size - 1);
    e.local_rank = has("SLURM_LOCALID") ? parse_int("SLURM_LOCALID", get("SLURM_LOCALID"), 0, 1 << 20) : 0;
    if (has("SLURM_NTASKS_PER_NODE"))
      e.local_world_size = parse_int("SLURM_NTASKS_PER_NODE", get("SLURM_NTASKS_PER_NODE"), 1, 1 << 20);
    else if (has("SLURM_TASKS_PER_NODE"))
      e.local_world_size = first_tasks_per_node(get("SLURM_TASKS_PER_NODE"));
    else
      e.local_world_size = e.world_size;
    const bool one_node = has("SLURM_JOB_NUM_NODES") &&
                          parse_int("SLURM_JOB_NUM_NODES", get("SLURM_JOB_NUM_NODES"), 1, 1 << 20) == 1;
    if (e.world_size > 1 && !has("MASTER_ADDR")) {
      VQAD_CHECK(one_node, "environment: Slurm job of ", e.world_size,
                 " tasks on several nodes but MASTER_ADDR is not set (export MASTER_ADDR=<first node's address> "
                 "and MASTER_PORT in the job script)");
    }
    if (!has("MASTER_PORT") && e.world_size > 1) {
      // A port derived from the job id, so that two jobs on one node do not collide.
      const char* job = get("SLURM_JOB_ID");
      e.master_port = 20000 + (job ? parse_int("SLURM_JOB_ID", job, 0, 1 << 30) % 20000 : 9500);
    }
  } else {
    return e;
  }
  VQAD_CHECK(e.local_rank < e.local_world_size, "environment: local rank ", e.local_rank,
             " is outside the local world of ", e.local_world_size);
  if (has("MASTER_ADDR")) e.master_addr = get("MASTER_ADDR");
  if (has("MASTER_PORT")) e.master_port = parse_int("MASTER_PORT", get("MASTER_PORT"), 1, 65535);
  return e;
}

LaunchEnv launch_env() {
  return launch_env_from([](const char* k) { return static_cast<const char*>(std::getenv(k)); });
}

std::string describe(const LaunchEnv& e) {
  return detail::concat("rank ", e.rank, "/", e.world_size, " (local ", e.local_rank, "/", e.local_world_size,
                        ") via ", e.source, ", store ", e.master_addr, ":", e.master_port,
                        e.agent_store ? " (hosted by the launcher)" : "");
}

}  // namespace vqad::dist
