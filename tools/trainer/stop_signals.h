// SIGINT and SIGTERM during training: one line on stderr naming the signal and the step, then
// the process ends by that signal (exit status 128 + the signal number: 130, 143). No checkpoint is
// written (the newest complete one stays; --resume auto continues from it); metrics.jsonl holds
// every step logged so far.
#pragma once

#include <cstdint>

namespace accel {

// Installs the handlers (once per process).
void install_stop_signal_handlers();
// The number of optimizer steps completed, for the message.
void note_completed_steps(int64_t steps);

}  // namespace accel
