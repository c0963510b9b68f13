#include "tools/trainer/stop_signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

namespace accel {

namespace {
std::atomic<int64_t> g_completed{0};
std::atomic<bool> g_stop{false};

// Only async-signal-safe calls: the line is formatted by hand and written with write(2).
void append(char* buf, size_t& n, const char* s) {
  while (*s && n < 255) buf[n++] = *s++;
}

void say(const char* head, const char* tail) {
  char buf[256];
  size_t n = 0;
  append(buf, n, head);
  char digits[24];
  int d = 0;
  uint64_t v = static_cast<uint64_t>(g_completed.load());
  do {
    digits[d++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v && d < 23);
  while (d > 0 && n < 255) buf[n++] = digits[--d];
  append(buf, n, tail);
  ssize_t ignored = write(STDERR_FILENO, buf, n);
  (void)ignored;
}

// Die of the signal itself: the exit status is 128 + sig, and a launcher still sees which
// signal stopped the rank.
void die_of(int sig) {
  signal(sig, SIG_DFL);
  raise(sig);
}

void on_sigint(int sig) {
  say("accel-train: stopped by SIGINT after step ",
      " (no checkpoint written for it; --resume auto continues from the newest)\n");
  die_of(sig);
}

void on_sigterm(int sig) {
  if (g_stop.exchange(true)) {
    say("accel-train: second SIGTERM after step ", "; stopping now without a checkpoint\n");
    die_of(sig);
  }
  say("accel-train: got SIGTERM after step ",
      "; finishing the current step, then writing a checkpoint and stopping\n");
}

void install(int sig, void (*handler)(int)) {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = handler;
  sa.sa_flags = SA_RESTART;  // SIGTERM returns: interrupted reads and writes go on
  sigemptyset(&sa.sa_mask);
  sigaction(sig, &sa, nullptr);
}
}  // namespace

void install_stop_signal_handlers() {
  install(SIGINT, on_sigint);
  install(SIGTERM, on_sigterm);
}

void note_completed_steps(int64_t steps) { g_completed.store(steps); }

bool stop_requested() { return g_stop.load(); }

}  // namespace accel
