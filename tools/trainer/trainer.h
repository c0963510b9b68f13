// The training loop behind accel-train (and the runs accel-bench launches).
#pragma once

#include <string>
#include <vector>

namespace accel {

struct TrainOptions {
  std::string config_path;             // may be empty: built-in defaults
  std::vector<std::string> overrides;  // --set key=value
  std::string training_args;           // --training-args FILE.json (Hugging Face TrainingArguments)
  std::string output_dir;              // --output-dir (overrides training.output_dir)
  std::string resume;                  // --resume auto|PATH ("" = fresh run)
  bool print_config = false;           // print the effective config and exit
  bool verbose = false;                // -v: also print the effective config at the start
  // --move-newer-checkpoints-aside: a resume from an older step renames the newer checkpoints
  // (tools/trainer/checkpoint.h, handle_newer_checkpoints) instead of refusing.
  bool move_newer_checkpoints_aside = false;
  // --resume-allow-batch-change: resume with another global batch than the checkpoint's.
  bool resume_allow_batch_change = false;
};

// Runs the whole job in this process (one rank). Returns the process exit code: 0 success,
// 2 configuration or usage error, 1 runtime failure, 3 stopped by SIGTERM after writing a
// checkpoint (kExitPreempted, tools/trainer/checkpointing.h). Messages go to stderr.
int run_training(const TrainOptions& options, int argc, char** argv);

}  // namespace accel
