// Single-node launcher: without mpirun/srun/torchrun, `num_processes > 1` on one machine starts the
// ranks as child processes of this one. See docs/launch.md.
#pragma once

#include <chrono>
#include <string>

namespace accel {

// A rank exits with this code when it stops because another rank failed (a DistributedError:
// a peer closed its connection, a collective timed out). The launcher then keeps looking for the
// rank whose own failure came first, since exits race: a follower can be reaped before its cause.
constexpr int kExitAfterPeerFailure = 75;

struct LocalLaunchOptions {
  std::string master_addr = "127.0.0.1";  // where rank 0 will serve the store
  int master_port = 0;                    // 0: a free port on master_addr
  // After a rank fails or a signal arrives the others get SIGTERM, then SIGKILL after this long.
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  std::string executable = "/proc/self/exe";  // what each rank runs (with this process's argv)
};

// Starts `nprocs` ranks of `executable` with the same argv and the environment plus RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and ACCEL_JOB_TOKEN (kept when
// already set, else fresh random bytes). Forwards SIGINT/SIGTERM/SIGHUP to the ranks. When a rank
// exits non-zero or is killed, stops the others and reports which rank it was on stderr (a rank
// that failed on its own rather than one that exited with kExitAfterPeerFailure). Each
// rank dies with the launcher (PR_SET_PDEATHSIG), so none is left orphaned.
// Returns the exit code for the launcher: 0 when every rank exited 0, the failed rank's code
// (128 + signal when killed) otherwise, 128 + signal when the launcher itself was signalled.
int run_local_ranks(int nprocs, int argc, char** argv, const LocalLaunchOptions& options = {});

// Whether accel-train should call run_local_ranks: no launcher started this process as part of
// a bigger world, and the config asks for several processes on one machine.
bool should_spawn_local_ranks(int launched_world_size, int num_processes, int num_machines);

}  // namespace accel
