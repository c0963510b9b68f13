// Signals during training.
//   SIGTERM (what Slurm, Kubernetes and accel-train's launcher send): one line on stderr, the
//     current step finishes, a checkpoint of it is written and the run exits with
//     kExitPreempted (tools/trainer/checkpointing.h; every rank stops after the same step). A
//     second SIGTERM ends the process at once by the signal (exit status 143).
//   SIGINT (Ctrl-C): one line naming the signal and the step, then the process ends by the
//     signal (exit status 130). No checkpoint is written (the newest complete one stays;
//     --resume auto continues from it).
// metrics.jsonl holds every step logged so far either way.
#pragma once

#include <cstdint>

namespace accel {

// Installs the handlers (once per process).
void install_stop_signal_handlers();
// The number of optimizer steps completed, for the messages.
void note_completed_steps(int64_t steps);
// Whether SIGTERM arrived: the run saves and stops after the current step.
bool stop_requested();

}  // namespace accel
