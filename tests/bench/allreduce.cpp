// CPU process group all-reduce bandwidth on loopback (not a timed test).
//
//   bench_allreduce [--np 2,4] [--min-bytes 1024] [--max-bytes 268435456] [--dtype f32]
//
// Forks one process per rank; rank 0 prints, per message size, the time of one all_reduce and
// the bandwidths: algbw = bytes / time, busbw = algbw * 2(n-1)/n (the nccl-tests convention:
// what each link carries with a bandwidth-optimal ring).
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "parallel/store.h"
#include "runtime/format.h"
#include "tests/parallel/harness.h"

using namespace accel;
using Clock = std::chrono::steady_clock;

namespace {

int run_rank(int rank, int n, int port, int64_t min_bytes, int64_t max_bytes, DType dtype) {
  StoreOptions so;
  so.port = port;
  so.is_server = rank == 0;
  so.token = "bench";
  so.timeout = std::chrono::seconds(60);
  auto store = std::make_shared<TcpStore>(so);
  auto pg = make_cpu_process_group(store, rank, n);
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (rank == 0) {
    std::printf("\nall_reduce (sum, %s) over %d ranks on loopback\n", dtype_name(dtype), n);
    std::printf("%10s %8s %12s %12s %12s %14s\n", "size", "iters", "time (us)", "algbw GB/s",
                "busbw GB/s", "wire MiB/rank");
  }
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    Tensor t = Tensor::ones({bytes / es}, dtype);
    // The same iteration count on every rank: about 256 MiB of payload per size, 3..200 times.
    int iters =
        static_cast<int>(std::max<int64_t>(3, std::min<int64_t>(200, (256ll << 20) / bytes)));
    pg->all_reduce(t)->wait();  // warm-up (and connection buffers)
    pg->barrier()->wait();
    pg->reset_stats();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) pg->all_reduce(t)->wait();
    double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
    int64_t wire = pg->stats()[CommKind::AllReduce].wire_bytes / iters;
    pg->barrier()->wait();
    if (rank == 0) {
      double algbw = static_cast<double>(bytes) / (us * 1e3);
      double busbw = algbw * 2.0 * (n - 1) / n;
      std::printf("%10s %8d %12.1f %12.3f %12.3f %14.2f\n", format_bytes(bytes).c_str(), iters, us,
                  algbw, busbw, static_cast<double>(wire) / (1 << 20));
      std::fflush(stdout);
    }
  }
  return 0;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> worlds = {2, 4};
  int64_t min_bytes = 1 << 10, max_bytes = 256ll << 20;
  DType dtype = DType::F32;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--np") {
      worlds = parse_list(v);
    } else if (k == "--min-bytes") {
      min_bytes = std::stoll(v);
    } else if (k == "--max-bytes") {
      max_bytes = std::stoll(v);
    } else if (k == "--dtype") {
      dtype = dtype_from_name(v);
    } else {
      std::fprintf(stderr, "usage: %s [--np 2,4] [--min-bytes N] [--max-bytes N] [--dtype f32]\n",
                   argv[0]);
      return 64;
    }
  }
  int rc = 0;
  for (int n : worlds) {
    const int port = accel::testing::pick_free_port();
    std::fflush(stdout);
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
      pid_t pid = fork();
      if (pid == 0) {
        int code = 1;
        try {
          code = run_rank(r, n, port, min_bytes, max_bytes, dtype);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        }
        std::fflush(stdout);
        _exit(code);
      }
      pids.push_back(pid);
    }
    for (pid_t p : pids) {
      int status = 0;
      waitpid(p, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    }
  }
  return rc;
}
