// The run's side of checkpoints (the file format is tools/trainer/checkpoint.h): what a save
// collects from the parts of a run, when it saves (every_steps, at the end, on SIGTERM), in the
// background with checkpoint.async, and where a resume puts the state back.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "parallel/launcher.h"  // kExitPreempted

namespace accel {

struct Run;
struct CheckpointConfig;
class RunLog;
class CheckpointSaver;

// Whether a run reserves its snapshot block at setup (RunCheckpoints): with background saves
// (checkpoint.async) that are periodic (checkpoint.every_steps > 0) and of which at least one
// falls between `first_step` (0, or the step a resume continues from) and max_steps (a save at
// max_steps itself is checkpoint.at_end's). Synchronous runs, at_end-only runs and runs whose
// every_steps reaches no step allocate the block at their first save, as a save always did
// (docs/checkpoints.md, "Snapshot memory").
bool reserves_snapshot_at_setup(const CheckpointConfig& c, int64_t first_step, int64_t max_steps);

// A run stopped by SIGTERM after it wrote a checkpoint of its last step exits with
// kExitPreempted (3, parallel/launcher.h; docs/checkpoints.md, "Preemption").

// The checkpoints of one run, on every rank.
class RunCheckpoints {
 public:
  // Every rank, before the first step (the run log's clock starts after it). Where
  // reserves_snapshot_at_setup says so, allocates the host block of this rank's snapshots now
  // (pinned for GPU state), sized from snapshot_layout (metadata only: no gather, no copy, no
  // collective), so that no save in the loop allocates or page-locks memory; rank 0 prints
  // `checkpoint: reserved X GiB of pinned host memory for background saves in S s`. A refused
  // pinned block stops the run here (std::runtime_error naming the size, the reason and what to
  // change), rather than at a save hours later or with a silently slower save.
  RunCheckpoints(Run& run, int64_t first_step);
  ~RunCheckpoints();
  // After step `step` was logged: reports a background save that completed (throws for one that
  // failed, naming the folder and the reason), saves when checkpoint.every_steps says so, and on
  // SIGTERM (on any rank) saves `step` and returns true: the caller stops with kExitPreempted.
  bool after_step(int64_t step, int64_t max_steps, RunLog& log);
  // After the last step: checkpoint.at_end's save, then waits for any save in flight.
  void at_end(int64_t step, RunLog& log);

 private:
  void save(int64_t step, RunLog& log);
  void report(const std::optional<std::string>& dir, int64_t step, RunLog& log);
  Run& run_;
  std::unique_ptr<CheckpointSaver> saver_;
  int64_t in_flight_step_ = -1;
  // Of the save in flight: the seconds the training loop spent in save() (sync: the whole
  // save), from its start to the queuing of the snapshot's copies, and whether they are pinned.
  double host_s_ = 0, before_copies_s_ = 0;
  // Of the save in flight: the seconds it first waited for the save before it to be written
  // (not in host_s_; 0 when that one was done).
  double waited_s_ = 0;
  bool pinned_ = false;
  int64_t last_saved_step_ = -1;
};

// What the command line asked of a resume.
struct ResumeRequest {
  std::string spec;                 // --resume: auto or a folder; "" for a fresh run
  bool move_newer_aside = false;    // --move-newer-checkpoints-aside
  bool allow_batch_change = false;  // --resume-allow-batch-change
};

// Every rank, for --resume `spec` (auto or a folder): checks that the checkpoint fits this run's
// model and optimizer and its global batch (refused when it differs, unless allow_batch_change),
// deals with newer checkpoints (handle_newer_checkpoints), restores the strategy's weights and
// optimizer state (each rank reads the ranges it holds, whatever world size and strategy wrote
// them), precision's state and the data position; returns the step to continue from (0 when
// `spec` is auto and there is no complete checkpoint yet).
int64_t resume_run(Run& run, const ResumeRequest& request);

}  // namespace accel
