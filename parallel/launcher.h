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
// A rank stopped by SIGTERM after it wrote a checkpoint of its last step exits with this code
// (tools/trainer/checkpointing.h); the launcher exits with it too when every rank did.
constexpr int kExitPreempted = 3;

struct LocalLaunchOptions {
  std::string master_addr = "127.0.0.1";  // where rank 0 will serve the store
  int master_port = 0;                    // 0: a free port on master_addr
  std::string port_source;                // the setting master_port came from, for messages
  // After a rank fails or a signal arrives the others get SIGTERM, then SIGKILL after this long.
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  // After a SIGTERM from outside (preemption) the ranks finish their step and write a checkpoint
  // first: SIGKILL only after this long (or at a second signal).
  std::chrono::milliseconds preempt_grace{std::chrono::minutes(10)};
  std::string executable = "/proc/self/exe";  // what each rank runs (with this process's argv)
};

// The store address for the local launcher from the environment and the config's
// main_process_ip/main_process_port (local_store_address in launch_env.h).
LocalLaunchOptions local_launch_options(const std::string& main_process_ip, int main_process_port);

// Starts `nprocs` ranks of `executable` with the same argv and the environment plus RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and ACCEL_JOB_TOKEN (kept when
// already set, else fresh random bytes), and OMP_NUM_THREADS = each rank's share of the cores
// unless it is set. The launcher binds and listens on the store's port itself (master_port, or a
// free one) before starting the ranks and hands the socket to rank 0 (ACCEL_STORE_FD), so no other
// process can take the port in between. Forwards SIGINT/SIGTERM/SIGHUP to the ranks. When a rank
// exits non-zero or is killed, stops the others and reports which rank it was on stderr (a rank
// that failed on its own rather than one that exited with kExitAfterPeerFailure). Each
// rank dies with the launcher (PR_SET_PDEATHSIG), so none is left orphaned. When every rank that
// exited stopped because of another and some are still running 2 s later, those are named as
// probably stalled.
// Returns the exit code for the launcher: 0 when every rank exited 0, the failed rank's code
// (128 + signal when killed) otherwise (kExitAfterPeerFailure for a stall), 128 + signal when the
// launcher itself was signalled.
int run_local_ranks(int nprocs, int argc, char** argv, const LocalLaunchOptions& options = {});

// Whether accel-train should call run_local_ranks: no launcher started this process as part of
// a bigger world, and the config asks for several processes on one machine.
bool should_spawn_local_ranks(int launched_world_size, int num_processes, int num_machines);

}  // namespace accel
