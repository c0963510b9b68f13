#include "tools/trainer/stop_signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

namespace accel {

namespace {
std::atomic<int64_t> g_completed{0};

// Only async-signal-safe calls: the line is formatted by hand and written with write(2).
void append(char* buf, size_t& n, const char* s) {
  while (*s && n < 255) buf[n++] = *s++;
}

void on_stop_signal(int sig) {
  char buf[256];
  size_t n = 0;
  append(buf, n, "accel-train: stopped by ");
  append(buf, n, sig == SIGINT ? "SIGINT" : "SIGTERM");
  append(buf, n, " after step ");
  char digits[24];
  int d = 0;
  uint64_t v = static_cast<uint64_t>(g_completed.load());
  do {
    digits[d++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v && d < 23);
  while (d > 0 && n < 255) buf[n++] = digits[--d];
  append(buf, n, " (no checkpoint written for it; --resume auto continues from the newest)\n");
  ssize_t ignored = write(STDERR_FILENO, buf, n);
  (void)ignored;
  // Die of the signal itself: the exit status is 128 + sig, and a launcher still sees which
  // signal stopped the rank.
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

void note_completed_steps(int64_t steps) { g_completed.store(steps); }

}  // namespace accel
