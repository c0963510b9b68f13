// The training loop over an assembled run (tools/trainer/run.h).
#pragma once

#include <string>

namespace accel {

struct Run;

// Resumes from `resume` (--resume: auto or a folder; "" for a fresh run), trains to
// training.max_steps with evaluation, checkpoints and logging, then evaluates, samples and writes
// the summary. Every rank calls it. Returns the exit code (0); errors throw.
int train(Run& run, const std::string& resume);

}  // namespace accel
