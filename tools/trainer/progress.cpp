#include "tools/trainer/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

int terminal_columns() {
  winsize ws{};
  if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    const int n = std::atoi(c);
    if (n > 0) return n;
  }
  return 80;
}

namespace {

std::string format(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string format_rate(double tokens_per_s) {
  if (tokens_per_s >= 1e6) return format("%.2fM tok/s", tokens_per_s / 1e6);
  if (tokens_per_s >= 1e4) return format("%.1fk tok/s", tokens_per_s / 1e3);
  return format("%.0f tok/s", tokens_per_s);
}

}  // namespace

Progress::Progress(ProgressMode mode, int64_t total_steps, int64_t first_step, bool enabled)
    : bar_(mode == ProgressMode::Bar || (mode == ProgressMode::Auto && isatty(STDERR_FILENO))),
      enabled_(enabled && mode != ProgressMode::None),
      total_(total_steps),
      first_(first_step),
      last_step_(first_step),
      start_(std::chrono::steady_clock::now()) {}

double Progress::eta(int64_t step) const {
  const double done = static_cast<double>(step - first_);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  return done > 0 ? secs / done * static_cast<double>(total_ - step) : -1;
}

std::string Progress::bar_line(const StepReport& r, bool have_numbers, int64_t total, double eta_s,
                               int columns) {
  const int limit = std::max(columns - 1, 1);  // the last column would make some terminals wrap
  const std::string counter = std::to_string(r.step) + "/" + std::to_string(total);
  // Fields after the counter, most useful first; each is kept only if it still fits.
  std::vector<std::string> fields;
  if (have_numbers) fields.push_back(format("loss %.4f", r.loss));
  fields.push_back("eta " + format_duration(eta_s));
  if (have_numbers) {
    fields.push_back(format_rate(r.tokens_per_s));
    fields.push_back(format("lr %.2e", r.lr));
    if (r.mfu >= 0) fields.push_back(format("mfu %.1f%%", 100 * r.mfu));
    fields.push_back("mem " + format_bytes(r.peak_mem_bytes));
  }
  const int min_bar = 10, max_bar = 30;
  std::string tail = " " + counter;
  if (static_cast<int>(tail.size()) + min_bar + 2 > limit)  // too narrow for a bar
    return counter.substr(0, static_cast<size_t>(limit));
  for (const std::string& f : fields)
    if (static_cast<int>(tail.size() + 3 + f.size()) + min_bar + 2 <= limit) tail += " | " + f;
  const int width = std::min(max_bar, limit - 2 - static_cast<int>(tail.size()));
  const int filled =
      total > 0 ? static_cast<int>(static_cast<int64_t>(width) * std::min(r.step, total) / total)
                : width;
  return "[" + std::string(static_cast<size_t>(filled), '#') +
         std::string(static_cast<size_t>(width - filled), '.') + "]" + tail;
}

void Progress::draw(int64_t step) {
  StepReport r = last_;
  r.step = step;
  const std::string line = bar_line(r, have_numbers_, total_, eta(step), terminal_columns());
  std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
  bar_drawn_ = true;
  last_draw_ = std::chrono::steady_clock::now();
}

void Progress::tick(int64_t step) {
  last_step_ = step;
  if (!enabled_ || !bar_) return;
  const auto now = std::chrono::steady_clock::now();
  if (step == total_ || !bar_drawn_ || now - last_draw_ >= std::chrono::milliseconds(100))
    draw(step);
}

void Progress::update(const StepReport& r) {
  if (!enabled_) return;
  last_ = r;
  have_numbers_ = true;
  last_step_ = r.step;
  if (bar_) {
    draw(r.step);
    return;
  }
  char mfu[16] = "-";
  if (r.mfu >= 0) std::snprintf(mfu, sizeof mfu, "%.1f%%", 100 * r.mfu);
  std::fprintf(stderr,
               "step %lld/%lld loss %.4f lr %.3e grad_norm %.3f tok/s %.0f mfu %s mem %s "
               "elapsed %s eta %s\n",
               static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, r.lr,
               r.grad_norm, r.tokens_per_s, mfu, format_bytes(r.peak_mem_bytes).c_str(),
               format_duration(r.elapsed_s).c_str(), format_duration(eta(r.step)).c_str());
}

void Progress::println(const std::string& line) {
  if (!enabled_) return;
  if (bar_drawn_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s\n", line.c_str());
  if (bar_drawn_) draw(last_step_);  // the bar stays the last line
}

void Progress::finish() {
  if (enabled_ && bar_drawn_) std::fprintf(stderr, "\n");
  bar_drawn_ = false;
}

}  // namespace accel
