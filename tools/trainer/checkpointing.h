// The run's side of checkpoints (the file format is tools/trainer/checkpoint.h): what a save
// collects from the parts of a run, and where a resume puts it back.
#pragma once

#include <cstdint>
#include <string>

namespace accel {

struct Run;
class RunLog;

// Every rank: writes checkpoints/step_<step>/ (weights, this rank's optimizer state, precision's
// state, the data position) and keeps the newest checkpoint.keep_last.
void save_run_checkpoint(Run& run, int64_t step, RunLog& log);

// What the command line asked of a resume.
struct ResumeRequest {
  std::string spec;               // --resume: auto or a folder; "" for a fresh run
  bool move_newer_aside = false;  // --move-newer-checkpoints-aside
};

// Every rank, for --resume `spec` (auto or a folder): checks that the checkpoint fits this run's
// model and strategy, deals with newer checkpoints (handle_newer_checkpoints), restores the
// strategy's weights and optimizer state, precision's state and the data position; returns the
// step to continue from (0 when `spec` is auto and there is no complete checkpoint yet).
int64_t resume_run(Run& run, const ResumeRequest& request);

}  // namespace accel
