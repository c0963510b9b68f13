// What the user sees while training: a progress bar on a terminal, plain log lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "runtime/config.h"  // ProgressMode
#include "runtime/format.h"  // format_bytes

namespace accel {

struct StepReport {
  int64_t step = 0;  // 1-based, after the update
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
  double mfu = -1;  // < 0: unknown
  int64_t peak_mem_bytes = 0;
};

class Progress {
 public:
  // Auto: a bar when stderr is a terminal, plain lines otherwise.
  Progress(ProgressMode mode, int64_t total_steps, int64_t first_step, bool enabled);
  // A logged step: a line in plain mode; the bar's numbers (loss, tok/s, ...) otherwise.
  void update(const StepReport& r);
  // Every step: redraws the bar with the step count and ETA (at most ten times a second, and
  // always at the last step). Nothing in plain mode.
  void tick(int64_t step);
  // A line that must stay visible (eval results, warnings); keeps the bar intact below it.
  void println(const std::string& line);
  void finish();

  // The bar's text for a terminal of `columns` columns: never longer than columns - 1, so the
  // terminal never wraps it (fields are dropped, least useful first, to make it fit).
  static std::string bar_line(const StepReport& r, bool have_numbers, int64_t total, double eta_s,
                              int columns);

 private:
  void draw(int64_t step);
  double eta(int64_t step) const;

  bool bar_ = false, enabled_ = true, bar_drawn_ = false, have_numbers_ = false;
  int64_t total_ = 0, first_ = 0, last_step_ = 0;
  StepReport last_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

std::string format_duration(double seconds);  // "1m05s"
// The width of the terminal on stderr: TIOCGWINSZ, else $COLUMNS, else 80.
int terminal_columns();

}  // namespace accel
