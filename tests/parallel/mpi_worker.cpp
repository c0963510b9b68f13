// A small program that joins a job the way accel-train does (launcher environment, store, CPU
// process group) and runs a few collectives. Used by the mpirun and local-launcher tests:
//
//   mpirun -np 3 accel_parallel_worker --mode check --port P
//   accel_parallel_worker --spawn 3 --mode die --victim 1
//
// Modes: check (collectives, then "rank r of n OK"), die (rank --victim exits with --victim-code,
// default 3, after the first barrier, first closing its connections and lingering --linger-ms when
// given, as a rank with a slow exit does; the others run an all_reduce that must fail), sleep
// (write pid files to --pidfile-dir, then sleep until signalled), world (check_world_size against
// --expect), stall (rank --victim sleeps after the first barrier; the others run an all_reduce that
// times out), threads (print the OpenMP thread count and OMP_NUM_THREADS), port (before joining,
// check that MASTER_PORT cannot be bound: the local launcher holds it from the start; then check).
// --port: the store port (main_process_port) for mpirun runs and for the local launcher.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "parallel/launch_env.h"
#include "parallel/launcher.h"
#include "parallel/process_group.h"

using namespace accel;

namespace {

int check(ProcessGroup& pg, const LaunchEnv& env) {
  const int n = pg.size(), r = pg.rank();
  auto fail = [&](const char* what) {
    std::fprintf(stderr, "rank %d: %s is wrong\n", r, what);
    return 1;
  };
  for (DType d : {DType::F32, DType::BF16, DType::I64}) {
    Tensor t = Tensor::full({1000}, r + 1, d);
    pg.all_reduce(t)->wait();
    if (t.to_vector()[999] != n * (n + 1) / 2) return fail("all_reduce");
  }
  Tensor big = Tensor::full({300000}, r, DType::F32);  // ring path
  pg.all_reduce(big, ReduceOp::Max)->wait();
  if (big.to_vector()[0] != n - 1) return fail("ring all_reduce");
  Tensor in = Tensor::full({5}, r, DType::E4M3), out = Tensor::zeros({5 * n}, DType::E4M3);
  pg.all_gather(out, in)->wait();
  if (out.to_vector()[5 * (n - 1)] != n - 1) return fail("all_gather");
  Tensor rs_in = Tensor::full({3 * n}, 1, DType::I32), rs_out = Tensor::zeros({3}, DType::I32);
  pg.reduce_scatter(rs_out, rs_in)->wait();
  if (rs_out.to_vector()[2] != n) return fail("reduce_scatter");
  Tensor b = Tensor::full({7}, r == n - 1 ? 42 : 0, DType::U8);
  pg.broadcast(b, n - 1)->wait();
  if (b.to_vector()[6] != 42) return fail("broadcast");
  if (n > 1) {
    Tensor s = Tensor::full({4}, r), got = Tensor::zeros({4});
    auto ws = pg.send(s, (r + 1) % n);
    pg.recv(got, (r + n - 1) % n)->wait();
    ws->wait();
    if (got.to_vector()[0] != (r + n - 1) % n) return fail("send/recv");
  }
  pg.barrier()->wait();
  std::printf("rank %d of %d OK (launcher: %s, local rank %d of %d)\n", r, n,
              env.launcher.empty() ? "none" : env.launcher.c_str(), env.local_rank,
              env.local_world_size);
  std::fflush(stdout);
  return 0;
}

// True when binding host:port fails because the port is taken (SO_REUSEADDR, as a server would).
bool port_is_taken(const std::string& host, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  bool taken = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == EADDRINUSE;
  close(fd);
  return taken;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "check", pid_dir;
  int spawn = 0, victim = -1, victim_code = 3, port = 0, expect = 0, linger_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--mode")
      mode = v;
    else if (k == "--spawn")
      spawn = std::stoi(v);
    else if (k == "--victim")
      victim = std::stoi(v);
    else if (k == "--victim-code")
      victim_code = std::stoi(v);
    else if (k == "--linger-ms")
      linger_ms = std::stoi(v);
    else if (k == "--port")
      port = std::stoi(v);
    else if (k == "--pidfile-dir")
      pid_dir = v;
    else if (k == "--expect")
      expect = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 64;
    }
  }
  try {
    LaunchEnv env = detect_launch_env("", port);
    if (spawn > 1 && should_spawn_local_ranks(env.world_size, spawn, 1)) {
      LocalLaunchOptions lo = local_launch_options("", port);
      lo.grace = std::chrono::seconds(2);
      return run_local_ranks(spawn, argc, argv, lo);
    }
    if (mode == "world") {
      check_world_size(env.world_size, expect);
      return 0;
    }
    share_cpu_cores(env);
    if (mode == "threads") {
      const char* omp = std::getenv("OMP_NUM_THREADS");
#ifdef _OPENMP
      const int threads = omp_get_max_threads();
#else
      const int threads = 1;
#endif
      std::printf("rank %d threads %d OMP_NUM_THREADS=%s\n", env.rank, threads, omp ? omp : "");
      std::fflush(stdout);
      return 0;
    }
    if (mode == "port") {
      if (!port_is_taken(env.master_addr, env.master_port)) {
        std::fprintf(stderr, "rank %d: MASTER_PORT %d was free before the store started\n",
                     env.rank, env.master_port);
        return 1;
      }
      mode = "check";
    }
    Timeouts to = timeouts_from_env(current_environment(),
                                    {std::chrono::seconds(20), std::chrono::seconds(20)});
    StoreOptions so;
    so.host = env.master_addr;
    so.port = env.master_port;
    so.is_server = env.rank == 0;
    so.listen_fd = env.store_listen_fd;
    so.token = resolve_job_token(current_environment()).token;
    so.timeout = to.rendezvous;
    auto store = std::make_shared<TcpStore>(so);
    ProcessGroupOptions po;
    po.timeout = to.collective;
    auto pg = make_cpu_process_group(store, env.rank, env.world_size, po);
    pg->barrier()->wait();

    if (mode == "check") return check(*pg, env);
    if (mode == "die") {
      if (env.rank == victim) {
        if (linger_ms > 0) {
          pg.reset();
          std::this_thread::sleep_for(std::chrono::milliseconds(linger_ms));
        }
        return victim_code;
      }
      Tensor t = Tensor::ones({1 << 16});
      pg->all_reduce(t)->wait();
      std::fprintf(stderr, "rank %d: all_reduce succeeded without rank %d\n", env.rank, victim);
      return 0;
    }
    if (mode == "stall") {
      if (env.rank == victim) {
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      }
      Tensor t = Tensor::ones({16});
      pg->all_reduce(t)->wait();
      std::fprintf(stderr, "rank %d: all_reduce succeeded without rank %d\n", env.rank, victim);
      return 0;
    }
    if (mode == "sleep") {
      std::ofstream(pid_dir + "/pid." + std::to_string(env.rank)) << getpid() << "\n";
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 64;
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return kExitAfterPeerFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
}
