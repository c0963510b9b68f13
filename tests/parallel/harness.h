// Multi-process test harness: fork() one child per rank, run a body in each, collect exit codes.
// Children never return into GoogleTest: they _exit() with the body's code (100 for an uncaught
// exception, after printing it).
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "parallel/process_group.h"
#include "parallel/store.h"

namespace accel::testing {

// A free port for a test's store, chosen below the kernel's ephemeral range (32768+ on Linux), so
// that no connection or ephemeral listener of a concurrently running test can take it between
// this call and rank 0's bind. Random, and checked by binding it.
inline int pick_free_port() {
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 1000; ++attempt) {
    int port = 20000 + static_cast<int>(rng() % 12000);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (ok) return port;
  }
  return 0;
}

struct RankExit {
  int code = -1;   // exit code, or -1
  int signal = 0;  // killing signal, or 0
  bool killed_by_harness = false;
  std::string str() const {
    if (killed_by_harness) return "still running at the harness deadline";
    if (signal) return "killed by signal " + std::to_string(signal);
    return "exit " + std::to_string(code);
  }
};

// Runs body(rank) in `n` forked children; kills stragglers after `limit`.
inline std::vector<RankExit> run_ranks(int n, const std::function<int(int)>& body,
                                       std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(n);
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
#ifdef _OPENMP
      // A forked child inherits no OpenMP worker threads; if the parent already ran a parallel
      // region (a whole test binary run without ctest's OMP_NUM_THREADS=1), the child's next
      // one would wait for them forever. One thread per rank.
      omp_set_num_threads(1);
#endif
      int code = 100;
      try {
        code = body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] uncaught exception: %s\n", r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[r] = pid;
  }
  std::vector<RankExit> out(n);
  std::vector<bool> done(n, false);
  auto deadline = std::chrono::steady_clock::now() + limit;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        if (WIFEXITED(status)) out[r].code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) out[r].signal = WTERMSIG(status);
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r) {
        if (done[r]) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        out[r].killed_by_harness = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return out;
}

inline void expect_all_ok(const std::vector<RankExit>& exits) {
  for (size_t r = 0; r < exits.size(); ++r)
    EXPECT_TRUE(exits[r].code == 0 && !exits[r].signal && !exits[r].killed_by_harness)
        << "rank " << r << ": " << exits[r].str();
}

// A world of `n` ranks on loopback: rank 0 serves the store on `port`.
struct World {
  std::shared_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
};
inline World make_world(int rank, int n, int port, ProcessGroupOptions options = {},
                        std::chrono::milliseconds rendezvous = std::chrono::seconds(20),
                        const std::string& token = "test-token") {
  StoreOptions so;
  so.host = "127.0.0.1";
  so.port = port;
  so.is_server = rank == 0;
  so.token = token;
  so.timeout = rendezvous;
  World w;
  w.store = std::make_shared<TcpStore>(so);
  w.pg = make_cpu_process_group(w.store, rank, n, options);
  return w;
}

// In a child: print and fail unless cond.
#define RANK_CHECK(cond, ...)                                                       \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                   \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

}  // namespace accel::testing
