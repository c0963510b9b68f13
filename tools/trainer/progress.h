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
  void update(const StepReport& r);
  // A line that must stay visible (eval results, warnings); keeps the bar intact below it.
  void println(const std::string& line);
  void finish();

 private:
  bool bar_ = false, enabled_ = true, bar_drawn_ = false;
  int64_t total_ = 0, first_ = 0;
  std::chrono::steady_clock::time_point start_;
};

std::string format_duration(double seconds);  // "1m05s"

}  // namespace accel
