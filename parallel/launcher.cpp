#include "parallel/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/launch_env.h"
#include "parallel/store.h"

extern char** environ;

namespace accel {
namespace {

std::string random_token() {
  unsigned char b[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::read(fd, b, sizeof b) != static_cast<ssize_t>(sizeof b)) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("local launcher: cannot read /dev/urandom for the job token");
  }
  ::close(fd);
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", b[i]);
  return hex;
}

struct Listener {
  int fd = -1;
  int port = 0;
};

// Binds and listens on addr:port (port 0: any free one), as the store server would.
Listener listen_on(const std::string& addr, const LocalLaunchOptions& o) {
  const std::string where =
      addr + ":" + (o.master_port > 0 ? std::to_string(o.master_port) : std::string("0"));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(o.master_port);
  if (getaddrinfo(addr.c_str(), service.c_str(), &hints, &res) != 0 || !res)
    throw std::invalid_argument("local launcher: cannot resolve the store address '" + addr +
                                "' (main_process_ip or MASTER_ADDR)");
  Listener l;
  l.fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  bool ok = l.fd >= 0 && setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
            bind(l.fd, res->ai_addr, res->ai_addrlen) == 0 && listen(l.fd, SOMAXCONN) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (ok) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    getsockname(l.fd, reinterpret_cast<sockaddr*>(&ss), &len);
    l.port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return l;
  }
  if (l.fd >= 0) ::close(l.fd);
  std::string advice =
      o.master_port > 0
          ? "; choose a free port for " + o.port_source + ", or leave it unset for a free one"
          : "; main_process_ip (or MASTER_ADDR) must be an address of this machine";
  throw std::invalid_argument("local launcher: cannot listen on " + where +
                              " for the store: " + std::strerror(err) + advice);
}

bool is_launch_var(const char* kv) {
  static const char* names[] = {
      "RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",      "LOCAL_WORLD_SIZE=",
      "MASTER_ADDR=", "MASTER_PORT=", "ACCEL_JOB_TOKEN=", "ACCEL_STORE_FD="};
  for (const char* n : names)
    if (std::strncmp(kv, n, std::strlen(n)) == 0) return true;
  return false;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

const char* sigabbrev(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
  }
  return "a signal";
}

// How long a rank's failure caused by another rank waits for that rank's own exit to be reaped.
constexpr std::chrono::seconds kFollowerWait{2};

bool is_follower(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == kExitAfterPeerFailure;
}

timespec to_timespec(std::chrono::milliseconds d) {
  if (d.count() < 0) d = std::chrono::milliseconds(0);
  timespec ts;
  ts.tv_sec = static_cast<time_t>(d.count() / 1000);
  ts.tv_nsec = static_cast<long>((d.count() % 1000) * 1000000);
  return ts;
}

}  // namespace

LocalLaunchOptions local_launch_options(const std::string& main_process_ip, int main_process_port) {
  StoreAddress a = local_store_address(current_environment(), main_process_ip, main_process_port);
  LocalLaunchOptions o;
  o.master_addr = a.host;
  o.master_port = a.port;
  o.port_source = a.port_source;
  return o;
}

bool should_spawn_local_ranks(int launched_world_size, int num_processes, int num_machines) {
  return launched_world_size <= 1 && num_processes > 1 && num_machines <= 1;
}

int run_local_ranks(int nprocs, int argc, char** argv, const LocalLaunchOptions& options) {
  using Clock = std::chrono::steady_clock;
  if (nprocs < 1)
    throw std::invalid_argument("local launcher: num_processes must be at least 1, got " +
                                std::to_string(nprocs));
  const char* existing = std::getenv("ACCEL_JOB_TOKEN");
  const std::string token = existing && *existing ? existing : random_token();
  const std::string prog = argc > 0 ? argv[0] : "accel-train";
  // Bound here and inherited by rank 0 only: the port stays ours from now on.
  const Listener store_socket = listen_on(options.master_addr, options);
  const int port = store_socket.port;
  const int cores = available_cores();
  const std::optional<int> threads = cpu_threads_per_rank(current_environment(), nprocs, cores);
  if (threads)
    std::fprintf(stderr,
                 "%s: local launcher: OMP_NUM_THREADS=%d for each of %d ranks (%d cores); set "
                 "OMP_NUM_THREADS to choose\n",
                 prog.c_str(), *threads, nprocs, cores);

  // Everything the children need is built before fork(): after it only async-signal-safe calls.
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e)
    if (!is_launch_var(*e)) base_env.emplace_back(*e);
  std::vector<std::vector<std::string>> env_strings(nprocs);
  std::vector<std::vector<char*>> envps(nprocs);
  for (int r = 0; r < nprocs; ++r) {
    auto& s = env_strings[r];
    s = base_env;
    s.push_back("RANK=" + std::to_string(r));
    s.push_back("WORLD_SIZE=" + std::to_string(nprocs));
    s.push_back("LOCAL_RANK=" + std::to_string(r));
    s.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nprocs));
    s.push_back("MASTER_ADDR=" + options.master_addr);
    s.push_back("MASTER_PORT=" + std::to_string(port));
    s.push_back("ACCEL_JOB_TOKEN=" + token);
    if (r == 0) s.push_back("ACCEL_STORE_FD=" + std::to_string(store_socket.fd));
    if (threads) s.push_back("OMP_NUM_THREADS=" + std::to_string(*threads));
    for (auto& x : s) envps[r].push_back(x.data());
    envps[r].push_back(nullptr);
  }
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  const char* exe = options.executable.c_str();

  // The signals we act on are blocked and read with sigtimedwait; the children get the old mask.
  sigset_t handled, old_mask;
  sigemptyset(&handled);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&handled, s);
  sigprocmask(SIG_BLOCK, &handled, &old_mask);

  const pid_t parent = getpid();
  std::vector<pid_t> pids(nprocs, -1);
  std::vector<bool> alive(nprocs, false);
  int num_alive = 0;
  bool stopping = false;
  int failed_rank = -1, failed_status = 0, got_signal = 0, preempted = 0;
  std::vector<int> stalled;  // alive when the follower wait ran out
  Clock::time_point kill_at{};
  std::chrono::milliseconds kill_wait = options.grace;  // from stopping to SIGKILL
  pid_t first_exit_pid = 0;
  Clock::time_point follower_deadline{};

  auto signal_all = [&](int sig) {
    for (int r = 0; r < nprocs; ++r)
      if (alive[r]) kill(pids[r], sig);
  };
  auto start_stopping = [&] {
    if (stopping) return;
    stopping = true;
    signal_all(SIGTERM);
    kill_at = Clock::now() + options.grace;
  };

  for (int r = 0; r < nprocs; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "%s: local launcher: fork failed for rank %d: %s\n", prog.c_str(), r,
                   std::strerror(errno));
      failed_rank = r;
      failed_status = 1 << 8;
      start_stopping();
      break;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);   // never outlive the launcher
      if (getppid() != parent) _exit(1);  // it died before prctl took effect
      setpgid(0, 0);                      // terminal signals reach us once, through the launcher
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      if (r == 0) fcntl(store_socket.fd, F_SETFD, 0);  // rank 0 serves the store on it
      execve(exe, args.data(), envps[r].data());
      const char msg[] = "local launcher: execve failed\n";
      ssize_t ignored = write(2, msg, sizeof msg - 1);
      (void)ignored;
      _exit(127);
    }
    pids[r] = pid;
    alive[r] = true;
    ++num_alive;
  }
  // Rank 0 holds the socket now; with our copy closed, rank 0's exit closes the port.
  ::close(store_socket.fd);

  while (num_alive > 0) {
    // Reap whoever has exited, starting with the child whose death woke us: when several ranks
    // are gone by now, that one died first (the others usually followed because of it).
    for (int i = -1; i < nprocs; ++i) {
      int r = i;
      if (i < 0) {
        r = -1;
        for (int k = 0; k < nprocs; ++k)
          if (pids[k] == first_exit_pid) r = k;
        first_exit_pid = 0;
        if (r < 0) continue;
      }
      if (!alive[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      alive[r] = false;
      --num_alive;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (WIFEXITED(status) && WEXITSTATUS(status) == kExitPreempted) ++preempted;
      if (ok || got_signal != 0) continue;
      bool follower = is_follower(status);
      bool stopped_by_us = stopping && WIFSIGNALED(status) &&
                           (WTERMSIG(status) == SIGTERM || WTERMSIG(status) == SIGKILL);
      if (failed_rank < 0 && follower) {
        // Its cause is probably still exiting: give it a moment before stopping everyone.
        failed_rank = r;
        failed_status = status;
        follower_deadline = Clock::now() + kFollowerWait;
        std::fprintf(stderr, "%s: rank %d (pid %d) %s after another rank failed\n", prog.c_str(), r,
                     static_cast<int>(pids[r]), describe_status(status).c_str());
      } else if ((failed_rank < 0 || is_follower(failed_status)) && !follower && !stopped_by_us &&
                 stalled.empty()) {
        std::string followed =
            failed_rank < 0 ? "" : " (rank " + std::to_string(failed_rank) + " followed it)";
        failed_rank = r;
        failed_status = status;
        std::fprintf(stderr, "%s: rank %d (pid %d) %s%s%s\n", prog.c_str(), r,
                     static_cast<int>(pids[r]), describe_status(status).c_str(), followed.c_str(),
                     stopping ? "" : "; stopping the other ranks");
        start_stopping();
      }
    }
    if (failed_rank >= 0 && !stopping && Clock::now() >= follower_deadline) {
      // Nobody failed on its own: the ranks still running are what the others gave up on (a
      // stalled rank never exits by itself), so name them rather than a follower.
      stalled.clear();
      for (int r = 0; r < nprocs; ++r)
        if (alive[r]) stalled.push_back(r);
      if (!stalled.empty())
        std::fprintf(stderr,
                     "%s: %s still running %lld s after rank %d stopped because another rank "
                     "failed: probably stalled (the other ranks' messages above say what they "
                     "waited for); stopping the ranks\n",
                     prog.c_str(), describe_ranks(stalled).c_str(),
                     static_cast<long long>(kFollowerWait.count()), failed_rank);
      start_stopping();
    }
    if (num_alive == 0) break;
    if (stopping && Clock::now() >= kill_at) {
      std::fprintf(stderr, "%s: ranks still running %lld ms after SIGTERM; sending SIGKILL\n",
                   prog.c_str(), static_cast<long long>(kill_wait.count()));
      signal_all(SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(24);
    }
    auto wait_for =
        stopping ? std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - Clock::now())
                 : std::chrono::milliseconds(1000);
    if (failed_rank >= 0 && !stopping)
      wait_for =
          std::chrono::duration_cast<std::chrono::milliseconds>(follower_deadline - Clock::now());
    wait_for = std::min(wait_for, std::chrono::milliseconds(1000));
    timespec ts = to_timespec(wait_for);
    siginfo_t info;
    int sig = sigtimedwait(&handled, &info, &ts);
    if (sig == SIGCHLD) first_exit_pid = info.si_pid;  // merged SIGCHLDs keep the first's info
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (got_signal && sig == SIGINT) {
        std::fprintf(stderr, "%s: local launcher: second SIGINT; killing the ranks (SIGKILL)\n",
                     prog.c_str());
        signal_all(SIGKILL);  // a second Ctrl-C: no more waiting
      } else {
        // SIGTERM from outside (preemption): the ranks write a checkpoint before they stop.
        if (!stopping && sig == SIGTERM) kill_wait = options.preempt_grace;
        if (!got_signal)
          std::fprintf(stderr,
                       "%s: local launcher: got %s; forwarding it to the %d running rank%s "
                       "(SIGKILL after %lld ms%s)\n",
                       prog.c_str(), sigabbrev(sig), num_alive, num_alive == 1 ? "" : "s",
                       static_cast<long long>(kill_wait.count()),
                       sig == SIGINT ? " or a second Ctrl-C" : "");
        signal_all(sig);
      }
      if (!got_signal) got_signal = sig;
      if (!stopping) {
        stopping = true;
        kill_at = Clock::now() + kill_wait;
      }
    }
  }
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);

  if (failed_rank >= 0 && !stalled.empty()) {
    std::fprintf(stderr, "%s: failed: %s of %d stalled (rank %d %s after another rank failed)\n",
                 prog.c_str(), describe_ranks(stalled).c_str(), nprocs, failed_rank,
                 describe_status(failed_status).c_str());
    return kExitAfterPeerFailure;
  }
  if (failed_rank >= 0) {
    std::fprintf(stderr, "%s: failed: rank %d of %d %s\n", prog.c_str(), failed_rank, nprocs,
                 describe_status(failed_status).c_str());
    if (WIFSIGNALED(failed_status)) return 128 + WTERMSIG(failed_status);
    return WEXITSTATUS(failed_status) ? WEXITSTATUS(failed_status) : 1;
  }
  if (got_signal) {
    std::fprintf(stderr, "%s: local launcher: every rank has stopped after %s\n", prog.c_str(),
                 sigabbrev(got_signal));
    if (got_signal == SIGTERM && preempted == nprocs) return kExitPreempted;  // all checkpointed
    return 128 + got_signal;
  }
  return 0;
}

}  // namespace accel
