// The training loop over an assembled run (tools/trainer/run.h).
#pragma once

#include <string>

namespace accel {

struct Run;
struct ResumeRequest;

// Resumes as `resume` asks (a fresh run when its spec is empty), trains to
// training.max_steps with evaluation, checkpoints and logging, then evaluates, samples and writes
// the summary. Every rank calls it. Returns the exit code (0); errors throw.
int train(Run& run, const ResumeRequest& resume);

}  // namespace accel
