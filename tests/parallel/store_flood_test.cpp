// Connection floods. The rendezvous store of a running 3-rank accel-train job (issue 26,
// item 4): thousands of connections that never authenticate, some announcing 4 MiB frames, some
// sending garbage, from before the ranks start until the job ends. The job must finish with the
// losses of an undisturbed run, and rank 0's memory and descriptors must stay bounded (its
// descriptor limit is lowered below the flood's size, as a flood of ~18,000 connections once used
// up the real one and failed the next checkpoint save). And a rank's mesh listener while the CPU
// process group is being built.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/parallel/harness.h"
#include "tests/tools/run_tool.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kRankFdLimit = 1024;  // each rank's RLIMIT_NOFILE in this test

// Starts accel-train with its output in `log` and each rank's descriptor limit lowered.
pid_t start_job(const fs::path& cfg, const fs::path& out, const fs::path& log) {
  const std::string exe = std::string(ACCEL_BIN_DIR) + "/accel-train";
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    rlimit rl{kRankFdLimit, kRankFdLimit};
    setrlimit(RLIMIT_NOFILE, &rl);
    execl(exe.c_str(), exe.c_str(), "--config", cfg.c_str(), "--output-dir", out.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The child of `parent` whose environment says RANK=0, or -1.
pid_t rank0_of(pid_t parent) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::string n = e.path().filename().string();
    if (n.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    size_t close_paren = line.rfind(')');
    if (close_paren == std::string::npos) continue;
    std::istringstream rest(line.substr(close_paren + 2));
    char state;
    int ppid;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream env(e.path() / "environ", std::ios::binary);
    std::string var;
    while (std::getline(env, var, '\0'))
      if (var == "RANK=0") return std::stoi(n);
  }
  return -1;
}

// VmHWM (peak resident set) of `pid` in KiB, or -1 once it is gone.
long peak_rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

int open_fds(pid_t pid) {
  std::error_code ec;
  int n = 0;
  for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != fs::directory_iterator(); ++it)
    ++n;
  return n;
}

struct JobResult {
  int status = -1;
  std::string output;
  std::map<int64_t, double> losses;
  long rank0_peak_kib = -1;
  int rank0_max_fds = 0;
};

// Runs the job to the end, sampling rank 0's peak RSS and open descriptors.
JobResult run_job(const fs::path& dir, int port) {
  fs::create_directories(dir);
  fs::path cfg = accel::tool_test::write_config(
      dir,
      "model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,\n"
      "        num_key_value_heads: 2, intermediate_size: 64, vocab_size: 64,\n"
      "        max_position_embeddings: 64}\n"
      "optimizer: {lr: 0.01, warmup_steps: 2}\n"
      "data: {source: synthetic}\n"
      "distributed_type: MULTI_CPU\nnum_processes: 3\nmain_process_port: " +
          std::to_string(port) +
          "\ndistributed: {timeout_s: 60}\n"
          "training: {seed: 7, max_steps: 300, micro_batch_size: 2, seq_len: 16, log_every: 1,\n"
          "           progress: plain, device: cpu}\n"
          "checkpoint: {every_steps: 50, at_end: true}\n");
  JobResult r;
  pid_t launcher = start_job(cfg, dir / "out", dir / "job.log");
  pid_t rank0 = -1;
  auto deadline = Clock::now() + 120s;
  while (true) {
    int status = 0;
    if (waitpid(launcher, &status, WNOHANG) == launcher) {
      r.status = status;
      break;
    }
    if (Clock::now() > deadline) {
      kill(launcher, SIGKILL);
      waitpid(launcher, &status, 0);
      break;
    }
    if (rank0 < 0) rank0 = rank0_of(launcher);
    if (rank0 > 0) {
      long kib = peak_rss_kib(rank0);
      if (kib > 0) r.rank0_peak_kib = std::max(r.rank0_peak_kib, kib);
      r.rank0_max_fds = std::max(r.rank0_max_fds, open_fds(rank0));
    }
    std::this_thread::sleep_for(10ms);
  }
  r.output = read_file(dir / "job.log");
  if (fs::exists(dir / "out" / "metrics.jsonl"))
    for (const auto& j : accel::tool_test::read_metrics(dir / "out" / "metrics.jsonl"))
      if (j.contains("loss") && !j.contains("summary")) r.losses[j["step"]] = j["loss"];
  return r;
}

// Connects to 127.0.0.1:port without blocking for long; -1 when nobody listens (yet).
int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{0, 200000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Until `stop`: opens `hold` connections and keeps them for a while, then closes them and starts
// again. Every third announces a 4 MiB frame (the default frame limit, which the server used to
// allocate at once), every seventh sends a wrong hello or garbage, the rest say nothing.
struct Flood {
  int port;
  int hold;
  std::atomic<bool> stop{false};
  std::atomic<long> connected{0};
  std::thread thread;

  Flood(int p, int h) : port(p), hold(h) {
    thread = std::thread([this] { run(); });
  }
  ~Flood() { finish(); }
  void finish() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
  void run() {
    std::vector<int> fds;
    const std::string big_len("\x00\x00\x40\x00", 4);  // 4 MiB, little-endian
    const std::string bad_hello = std::string("\x10\x00\x00\x00", 4) + "ACCELKV1wrongtok";
    const std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    long i = 0;
    while (!stop) {
      int fd = connect_to(port);
      if (fd < 0) {
        std::this_thread::sleep_for(1ms);  // the launcher has not bound the port yet
        continue;
      }
      ++connected;
      const std::string* msg = i % 3 == 0   ? &big_len
                               : i % 7 == 0 ? &bad_hello
                               : i % 7 == 1 ? &garbage
                                            : nullptr;
      if (msg) {
        ssize_t n = send(fd, msg->data(), msg->size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)n;
      }
      ++i;
      fds.push_back(fd);
      if (static_cast<int>(fds.size()) >= hold) {
        for (int k = 0; k < 50 && !stop; ++k) std::this_thread::sleep_for(10ms);
        for (int f : fds) close(f);
        fds.clear();
      }
    }
    for (int f : fds) close(f);
  }
};

TEST(StoreFlood, AJobUnderAConnectionFloodKeepsItsLossesAndBoundedMemory) {
  // This process holds the flood's connections: stay well under its own descriptor limit.
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  const int hold = static_cast<int>(std::min<rlim_t>(2 * kRankFdLimit, rl.rlim_cur - 256));
  if (hold <= kRankFdLimit)
    GTEST_SKIP() << "descriptor limit " << rl.rlim_cur << " too low to outnumber the ranks' "
                 << kRankFdLimit;

  fs::path base = accel::tool_test::fresh_temp_dir("accel_flood", "job");
  JobResult quiet = run_job(base / "quiet", accel::testing::pick_free_port());
  ASSERT_TRUE(WIFEXITED(quiet.status) && WEXITSTATUS(quiet.status) == 0) << quiet.output;
  ASSERT_EQ(quiet.losses.size(), 300u) << quiet.output;

  const int port = accel::testing::pick_free_port();
  Flood flood(port, hold);  // starts before the job: the ranks must rendezvous through it
  auto t0 = Clock::now();
  JobResult flooded = run_job(base / "flooded", port);
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  flood.finish();
  ASSERT_TRUE(WIFEXITED(flooded.status) && WEXITSTATUS(flooded.status) == 0) << flooded.output;
  // The flood reached the store (the launcher honours main_process_port): thousands of
  // connections, more than rank 0 has descriptors.
  EXPECT_GT(flood.connected.load(), kRankFdLimit) << flooded.output;
  EXPECT_EQ(flooded.losses, quiet.losses) << flooded.output;
  EXPECT_TRUE(
      fs::exists(base / "flooded" / "out" / "checkpoints" / "step_300" / "trainer_state.json"));
  // The connections waiting to authenticate need well under 1 MiB (at most 64, each with a
  // hello-sized buffer); the margin is for the sampling, which can miss up to ~32 MiB of the last
  // moments of a run. The unfixed server took 4 MiB per connection: +1 GiB here.
  EXPECT_LT(flooded.rank0_peak_kib, quiet.rank0_peak_kib + 128 * 1024)
      << "rank 0 peak RSS " << flooded.rank0_peak_kib << " KiB under the flood, "
      << quiet.rank0_peak_kib << " KiB without";
  EXPECT_LT(flooded.rank0_max_fds, quiet.rank0_max_fds + 100)
      << "rank 0 held " << flooded.rank0_max_fds << " descriptors under the flood, "
      << quiet.rank0_max_fds << " without";
  std::printf(
      "flood: %ld connections in %.1f s; rank 0 peak RSS %ld KiB (quiet run %ld KiB), at most %d "
      "descriptors (quiet run %d)\n",
      flood.connected.load(), took, flooded.rank0_peak_kib, quiet.rank0_peak_kib,
      flooded.rank0_max_fds, quiet.rank0_max_fds);
  fs::remove_all(base);
}

// Strangers connecting to rank 0's mesh listener while it waits for rank 1: at most a fixed
// number of their handshakes is kept, and rank 1 still joins.
TEST(MeshFlood, IdleStrangersOnAMeshListenerAreCapped) {
  const int port = accel::testing::pick_free_port();
  auto exits = accel::testing::run_ranks(2, [&](int rank) {
    if (rank == 0) {
      auto w = accel::testing::make_world(0, 2, port);
      accel::Tensor t = accel::Tensor::ones({8});
      w.pg->all_reduce(t)->wait();
      RANK_CHECK(t.to_vector()[7] == 2, "all_reduce");
      return 0;
    }
    accel::StoreOptions so;
    so.port = port;
    so.token = "test-token";
    so.timeout = 20s;
    accel::TcpStore store(so);
    // Rank 0's listener, as it registered it ("cpu<N>/addr/0", N counts groups per process).
    std::string addr;
    for (auto deadline = Clock::now() + 20s; addr.empty() && Clock::now() < deadline;) {
      for (int n = 0; n < 100 && addr.empty(); ++n)
        addr = store.try_get("cpu" + std::to_string(n) + "/addr/0").value_or("");
      if (addr.empty()) std::this_thread::sleep_for(10ms);
    }
    RANK_CHECK(!addr.empty(), "rank 0 never registered its listener");
    const int mesh_port = std::stoi(addr.substr(addr.find(' ') + 1));
    const int n = 1000;
    std::vector<int> fds;
    for (int i = 0; i < n; ++i) fds.push_back(connect_to(mesh_port));
    // Count the ones rank 0 still keeps; the unfixed listener kept every one.
    int open = n;
    std::vector<bool> closed(n, false);
    for (auto deadline = Clock::now() + 3s; open > 64 && Clock::now() < deadline;
         std::this_thread::sleep_for(20ms)) {
      open = 0;
      for (int i = 0; i < n; ++i) {
        if (!closed[i] && fds[i] >= 0) {
          pollfd p{fds[i], POLLIN, 0};
          char c;
          closed[i] = poll(&p, 1, 0) > 0 && recv(fds[i], &c, 1, 0) <= 0;
        }
        open += fds[i] >= 0 && !closed[i];
      }
    }
    RANK_CHECK(open <= 64, "%d of %d strangers still connected", open, n);
    auto w = accel::testing::make_world(1, 2, port);
    accel::Tensor t = accel::Tensor::ones({8});
    w.pg->all_reduce(t)->wait();
    RANK_CHECK(t.to_vector()[7] == 2, "all_reduce");
    for (int fd : fds)
      if (fd >= 0) close(fd);
    return 0;
  });
  accel::testing::expect_all_ok(exits);
}

}  // namespace
