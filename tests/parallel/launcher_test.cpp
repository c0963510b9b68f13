// The local launcher and real mpirun, driven through tests/parallel/mpi_worker.cpp
// (bin/accel_parallel_worker).
#include "parallel/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "parallel/launch_env.h"
#include "tests/parallel/harness.h"

namespace accel {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kWorker = std::string(ACCEL_BIN_DIR) + "/accel_parallel_worker";

struct Child {
  pid_t pid = -1;
  std::string log;  // stdout + stderr go here
};

// Starts `args` with stdout/stderr in a temporary file; env entries "K=V" are added, "K=" removed.
Child start(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  Child c;
  char tmpl[] = "/tmp/accel_launch_XXXXXX";
  int fd = mkstemp(tmpl);
  c.log = tmpl;
  std::vector<std::string> envs;
  std::fflush(stdout);
  std::fflush(stderr);
  c.pid = fork();
  if (c.pid == 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    for (auto& e : env) {
      auto eq = e.find('=');
      if (eq + 1 == e.size())
        unsetenv(e.substr(0, eq).c_str());
      else
        setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  close(fd);
  return c;
}

// Waits up to `limit`; returns the wait status, or -1 (after SIGKILL) on timeout.
int finish(const Child& c, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  int status = 0;
  while (Clock::now() < deadline) {
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) return status;
    std::this_thread::sleep_for(5ms);
  }
  kill(c.pid, SIGKILL);
  waitpid(c.pid, &status, 0);
  return -1;
}

std::string output(const Child& c) {
  std::ifstream f(c.log);
  std::stringstream ss;
  ss << f.rdbuf();
  unlink(c.log.c_str());
  return ss.str();
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Gone, or a zombie waiting for a reaper that is not us.
bool process_gone(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string line;
  std::getline(f, line);
  auto close_paren = line.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < line.size() &&
         line[close_paren + 2] == 'Z';
}

std::vector<pid_t> read_pids(const std::string& dir, int n, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  std::vector<pid_t> pids;
  while (Clock::now() < deadline) {
    pids.clear();
    for (int r = 0; r < n; ++r) {
      std::ifstream f(dir + "/pid." + std::to_string(r));
      pid_t p = 0;
      if (f >> p) pids.push_back(p);
    }
    if (static_cast<int>(pids.size()) == n) return pids;
    std::this_thread::sleep_for(10ms);
  }
  return {};
}

std::string temp_dir() {
  char tmpl[] = "/tmp/accel_pids_XXXXXX";
  return mkdtemp(tmpl);
}

TEST(LocalLauncher, RunsEveryRank) {
  Child c = start({kWorker, "--spawn", "3", "--mode", "check"}, {"ACCEL_JOB_TOKEN="});
  int status = finish(c, 60s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(has(out, "rank " + std::to_string(r) +
                             " of 3 OK (launcher: RANK/WORLD_SIZE, local rank " +
                             std::to_string(r) + " of 3)"))
        << out;
}

TEST(LocalLauncher, OneRankDyingStopsTheOthersAndNamesIt) {
  auto t0 = Clock::now();
  Child c = start({kWorker, "--spawn", "4", "--mode", "die", "--victim", "2"});
  int status = finish(c, 60s);
  std::string out = output(c);
  EXPECT_LT(Clock::now() - t0, 20s);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 3) << out;
  // The survivors exit with kExitAfterPeerFailure; whichever is reaped first, rank 2 is named.
  EXPECT_TRUE(has(out, "rank 2 (pid")) << out;
  EXPECT_TRUE(has(out, "failed: rank 2 of 4 exited with status 3")) << out;
  EXPECT_TRUE(has(out, "exited with status " + std::to_string(accel::kExitAfterPeerFailure)) ||
              has(out, "exited with status 3; stopping the other ranks"))
      << out;
}

// The victim closes its connections, then takes 1 s to exit: the survivors are reaped first,
// yet the launcher names the victim and returns its code. (1 s of the launcher's 2 s wait for a
// cause: the survivors have as long to notice and exit on a loaded machine.)
TEST(LocalLauncher, NamesTheCauseWhenItsFollowersExitFirst) {
  Child c =
      start({kWorker, "--spawn", "3", "--mode", "die", "--victim", "1", "--linger-ms", "1000"});
  int status = finish(c, 60s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 3) << out;
  EXPECT_TRUE(has(out, "after another rank failed")) << out;
  EXPECT_TRUE(has(out, "followed it)")) << out;
  EXPECT_TRUE(has(out, "failed: rank 1 of 3 exited with status 3")) << out;
}

TEST(LocalLauncher, ForwardsSigtermAndLeavesNoRanksBehind) {
  std::string dir = temp_dir();
  Child c = start({kWorker, "--spawn", "3", "--mode", "sleep", "--pidfile-dir", dir});
  auto pids = read_pids(dir, 3, 30s);
  ASSERT_EQ(pids.size(), 3u) << output(c);
  kill(c.pid, SIGTERM);
  int status = finish(c, 20s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << out;
  // It says what it did with the signal.
  EXPECT_TRUE(has(out, "local launcher: got SIGTERM; forwarding it to the 3 running ranks")) << out;
  EXPECT_TRUE(has(out, "every rank has stopped after SIGTERM")) << out;
  for (pid_t p : pids) EXPECT_TRUE(process_gone(p)) << "rank pid " << p << " still running";
}

TEST(LocalLauncher, RanksDieWithAKilledLauncher) {
  std::string dir = temp_dir();
  Child c = start({kWorker, "--spawn", "2", "--mode", "sleep", "--pidfile-dir", dir});
  auto pids = read_pids(dir, 2, 30s);
  ASSERT_EQ(pids.size(), 2u) << output(c);
  kill(c.pid, SIGKILL);  // no chance to forward anything: PR_SET_PDEATHSIG must do it
  finish(c, 10s);
  output(c);
  auto deadline = Clock::now() + 5s;
  for (pid_t p : pids) {
    while (!process_gone(p) && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
    EXPECT_TRUE(process_gone(p)) << "orphaned rank pid " << p;
  }
}

// Rank 2 stalls (alive, silent): the others time out and exit as followers. The launcher must
// name the rank that was still running, not the follower it reaped first.
TEST(LocalLauncher, NamesAStalledRankNotAFollower) {
  // 3 s: the ranks' store connection and first barrier live under this timeout too.
  Child c = start({kWorker, "--spawn", "3", "--mode", "stall", "--victim", "2"},
                  {"ACCEL_COLLECTIVE_TIMEOUT=3"});
  int status = finish(c, 60s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), kExitAfterPeerFailure) << out;
  EXPECT_TRUE(has(out, "rank 2 still running 2 s after rank")) << out;
  EXPECT_TRUE(has(out, "failed: rank 2 of 3 stalled")) << out;
  EXPECT_FALSE(has(out, "failed: rank 0 of 3")) << out;
  EXPECT_FALSE(has(out, "failed: rank 1 of 3")) << out;
}

// Without OMP_NUM_THREADS every rank would start one OpenMP thread per core (2 ranks on 2 cores
// ran 17x slower); the launcher gives each its share and says so once.
TEST(LocalLauncher, GivesEachRankItsShareOfTheCores) {
  const int share = std::max(1, available_cores() / 2);
  Child c = start({kWorker, "--spawn", "2", "--mode", "threads"}, {"OMP_NUM_THREADS="});
  int status = finish(c, 60s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(has(out, "rank " + std::to_string(r) + " threads " + std::to_string(share) +
                             " OMP_NUM_THREADS=" + std::to_string(share) + "\n"))
        << out;
  EXPECT_TRUE(
      has(out, "local launcher: OMP_NUM_THREADS=" + std::to_string(share) + " for each of 2 ranks"))
      << out;
  // A value the user chose is kept, silently.
  c = start({kWorker, "--spawn", "2", "--mode", "threads"}, {"OMP_NUM_THREADS=3"});
  status = finish(c, 60s);
  out = output(c);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(has(out, "rank 1 threads 3 OMP_NUM_THREADS=3\n")) << out;
  EXPECT_FALSE(has(out, "for each of 2 ranks")) << out;
}

// The configured port is used, and it is held from before the first rank starts until rank 0
// serves it: no rank finds it free (bind-and-close left a window where anyone could take it).
TEST(LocalLauncher, HoldsTheStorePortFromTheStart) {
  const int port = testing::pick_free_port();
  Child c = start({kWorker, "--spawn", "3", "--mode", "port", "--port", std::to_string(port)},
                  {"MASTER_PORT=", "MASTER_ADDR="});
  int status = finish(c, 60s);
  std::string out = output(c);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(has(out, "rank 2 of 3 OK")) << out;
  // Automatic port: the same holds.
  c = start({kWorker, "--spawn", "2", "--mode", "port"}, {"MASTER_PORT=", "MASTER_ADDR="});
  status = finish(c, 60s);
  out = output(c);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(has(out, "rank 1 of 2 OK")) << out;
}

TEST(LocalLauncher, ATakenPortIsAnErrorNamingTheSetting) {
  const int port = testing::pick_free_port();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  Child c = start({kWorker, "--spawn", "2", "--mode", "check", "--port", std::to_string(port)},
                  {"MASTER_PORT=", "MASTER_ADDR="});
  int status = finish(c, 30s);
  std::string out = output(c);
  close(fd);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << out;
  EXPECT_TRUE(has(out, "cannot listen on 127.0.0.1:" + std::to_string(port))) << out;
  EXPECT_TRUE(has(out, "main_process_port")) << out;
}

TEST(LocalLauncher, WorldSizeMismatchSaysBothNumbers) {
  Child c = start({kWorker, "--spawn", "2", "--mode", "world", "--expect", "3"});
  int status = finish(c, 30s);
  std::string out = output(c);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_TRUE(has(out, "the launcher started 2 processes but the config says num_processes: 3"))
      << out;
}

std::string find_mpirun() {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string p = dir + "/mpirun";
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

class Mpirun : public ::testing::Test {
 protected:
  void SetUp() override {
    mpirun_ = find_mpirun();
    if (mpirun_.empty()) GTEST_SKIP() << "mpirun not found (apt-get install openmpi-bin)";
  }
  std::vector<std::string> cmd(int np) {
    return {mpirun_, "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(np)};
  }
  std::string mpirun_;
};

TEST_F(Mpirun, EveryCollectiveUnderOpenMpi) {
  for (int np : {2, 3}) {
    auto args = cmd(np);
    for (std::string a : {kWorker, std::string("--mode"), std::string("check"),
                          std::string("--port"), std::to_string(testing::pick_free_port())})
      args.push_back(a);
    // No ACCEL_JOB_TOKEN: the token comes from Open MPI's per-job key.
    Child c =
        start(args, {"ACCEL_JOB_TOKEN=", "RANK=", "WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="});
    int status = finish(c, 90s);
    std::string out = output(c);
    ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
    for (int r = 0; r < np; ++r)
      EXPECT_TRUE(has(out, "rank " + std::to_string(r) + " of " + std::to_string(np) +
                               " OK (launcher: Open MPI, local rank " + std::to_string(r)))
          << out;
  }
}

// mpirun does not bind ranks here (--bind-to none), so each would use every core: each rank
// takes its share itself.
TEST_F(Mpirun, EachRankTakesItsShareOfTheCores) {
  const int share = std::max(1, available_cores() / 2);
  auto args = cmd(2);
  for (std::string a : {std::string("--bind-to"), std::string("none"), kWorker,
                        std::string("--mode"), std::string("threads")})
    args.push_back(a);
  Child c = start(args, {"ACCEL_JOB_TOKEN=", "RANK=", "WORLD_SIZE=", "OMP_NUM_THREADS="});
  int status = finish(c, 90s);
  std::string out = output(c);
  ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(has(out, "rank " + std::to_string(r) + " threads " + std::to_string(share))) << out;
  EXPECT_TRUE(has(out, "launch: " + std::to_string(share) + " OpenMP thread")) << out;
}

TEST_F(Mpirun, DeadRankFailsTheJobNamingIt) {
  auto args = cmd(3);
  // The victim exits 0, so mpirun does not tear the job down itself: the survivors must notice.
  for (std::string a : {kWorker, std::string("--mode"), std::string("die"), std::string("--victim"),
                        std::string("1"), std::string("--victim-code"), std::string("0"),
                        std::string("--port"), std::to_string(testing::pick_free_port())})
    args.push_back(a);
  auto t0 = Clock::now();
  Child c = start(args, {"ACCEL_JOB_TOKEN=", "RANK=", "WORLD_SIZE="});
  int status = finish(c, 90s);
  std::string out = output(c);
  EXPECT_LT(Clock::now() - t0, 30s);
  ASSERT_NE(status, -1) << out;
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(has(out, "rank 1 closed its connection")) << out;
}

}  // namespace
}  // namespace accel
