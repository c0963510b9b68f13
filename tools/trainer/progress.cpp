#include "tools/trainer/progress.h"

#include <unistd.h>

#include <cstdio>

namespace accel {

std::string format_duration(double s) {
  if (s < 0 || s != s) return "?";
  long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  return buf;
}

Progress::Progress(ProgressMode mode, int64_t total_steps, int64_t first_step, bool enabled)
    : bar_(mode == ProgressMode::Bar || (mode == ProgressMode::Auto && isatty(STDERR_FILENO))),
      enabled_(enabled && mode != ProgressMode::None),
      total_(total_steps),
      first_(first_step),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(const StepReport& r) {
  if (!enabled_) return;
  double done = static_cast<double>(r.step - first_);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double eta = done > 0 ? secs / done * static_cast<double>(total_ - r.step) : -1;
  char mfu[16] = "-";
  if (r.mfu >= 0) std::snprintf(mfu, sizeof mfu, "%.1f%%", 100 * r.mfu);
  if (bar_) {
    const int width = 24;
    int filled = total_ > 0 ? static_cast<int>(width * r.step / total_) : width;
    std::string bar(filled, '#');
    bar += std::string(width - filled, '.');
    std::fprintf(stderr, "\r\033[K[%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s mfu %s mem %s eta %s",
                 bar.c_str(), static_cast<long long>(r.step), static_cast<long long>(total_),
                 r.loss, r.lr, r.tokens_per_s, mfu, format_bytes(r.peak_mem_bytes).c_str(),
                 format_duration(eta).c_str());
    std::fflush(stderr);
    bar_drawn_ = true;
  } else {
    std::fprintf(stderr,
                 "step %lld/%lld loss %.4f lr %.3e grad_norm %.3f tok/s %.0f mfu %s mem %s "
                 "elapsed %s eta %s\n",
                 static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, r.lr,
                 r.grad_norm, r.tokens_per_s, mfu, format_bytes(r.peak_mem_bytes).c_str(),
                 format_duration(r.elapsed_s).c_str(), format_duration(eta).c_str());
  }
}

void Progress::println(const std::string& line) {
  if (!enabled_) return;
  if (bar_drawn_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s\n", line.c_str());
}

void Progress::finish() {
  if (enabled_ && bar_drawn_) std::fprintf(stderr, "\n");
  bar_drawn_ = false;
}

}  // namespace accel
