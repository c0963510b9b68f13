// Who am I in the job: rank, world size and local rank from the launcher's environment, where
// rank 0's rendezvous store is, the per-job token and the timeouts. See docs/launch.md.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>

namespace accel {

using Environment = std::map<std::string, std::string>;
// A copy of this process's environment.
Environment current_environment();

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int num_nodes = 1;        // 0 when the launcher does not say
  std::string launcher;     // "Open MPI", "MVAPICH", "MPICH/Hydra PMI", "RANK/WORLD_SIZE", "Slurm",
                            // or "" when no launcher variables were found
  std::string master_addr;  // where rank 0 serves the store (empty when world_size == 1)
  int master_port = 0;
  // Rank 0 under the local launcher: the listening socket the launcher bound for the store
  // (ACCEL_STORE_FD), -1 otherwise. See StoreOptions::listen_fd.
  int store_listen_fd = -1;
  bool distributed() const { return world_size > 1; }
};

// Reads the launcher variables (in this order: Open MPI OMPI_COMM_WORLD_*, MVAPICH
// MV2_COMM_WORLD_*, MPICH/Hydra PMI_RANK/PMI_SIZE, torchrun-style RANK/WORLD_SIZE/LOCAL_RANK, Slurm
// SLURM_PROCID/...; PMIX_RANK is cross-checked). The first source describing more than one process
// wins; two sources that disagree are an error naming both. The store address is
// MASTER_ADDR/MASTER_PORT when set, else `main_process_ip`/`main_process_port` (the config's keys;
// "" / 0 when unset), else 127.0.0.1:29500 when every rank is on this machine. Throws
// std::invalid_argument with the variable's name for malformed values.
LaunchEnv detect_launch_env(const Environment& env, const std::string& main_process_ip = "",
                            int main_process_port = 0);
inline LaunchEnv detect_launch_env(const std::string& main_process_ip = "",
                                   int main_process_port = 0) {
  return detect_launch_env(current_environment(), main_process_ip, main_process_port);
}

// Where the local launcher has rank 0 serve the store: MASTER_ADDR, else main_process_ip, else
// 127.0.0.1; MASTER_PORT, else main_process_port, else 0 (the launcher binds a free port itself).
struct StoreAddress {
  std::string host;
  int port = 0;
  std::string port_source;  // which setting gave the port, for messages; "" when 0
};
StoreAddress local_store_address(const Environment& env, const std::string& main_process_ip,
                                 int main_process_port);

// Each rank's share of this machine's cores for OpenMP when `local_ranks` ranks share it:
// cores / local_ranks, at least 1; nothing when OMP_NUM_THREADS is set or there is one local rank.
std::optional<int> cpu_threads_per_rank(const Environment& env, int local_ranks, int cores);
// The cores this process may run on (its CPU affinity).
int available_cores();
// Under mpirun/srun/torchrun-style launches: sets this rank's OpenMP thread count to its share
// (cpu_threads_per_rank) and says so once, on rank 0. The local launcher sets OMP_NUM_THREADS for
// its ranks instead, so this does nothing there.
void share_cpu_cores(const LaunchEnv& launch);

// Throws std::invalid_argument saying both numbers when the launcher started a different number of
// processes than the config's num_processes.
void check_world_size(int launched, int configured);

struct JobToken {
  std::string token;
  std::string source;  // where it came from, for the startup log
};
// The per-job token every connection to the store and between ranks must present: ACCEL_JOB_TOKEN
// when set (the local launcher sets it to fresh random bytes), else derived from Open MPI's per-job
// random key. Anything else throws, saying how to set ACCEL_JOB_TOKEN.
JobToken resolve_job_token(const Environment& env);

struct Timeouts {
  std::chrono::milliseconds rendezvous{std::chrono::seconds(300)};  // store connect, get, barrier
  std::chrono::milliseconds collective{std::chrono::seconds(600)};  // one collective / p2p op
};
// `defaults` overridden by ACCEL_RENDEZVOUS_TIMEOUT and ACCEL_COLLECTIVE_TIMEOUT (seconds, from
// kMinUserTimeout to kMaxTimeout; others are refused naming the variable).
Timeouts timeouts_from_env(const Environment& env, Timeouts defaults = {});

}  // namespace accel
