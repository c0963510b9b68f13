// What a run reports while it trains: metrics.jsonl (one line per logged step, evaluations, the
// summary), the progress bar or log lines, <output_dir>/loss.svg, host timing and throughput.
// Rank 0 writes; on the other ranks everything but the collectives is a no-op.
//
// metrics.jsonl is checked after every line: a write that fails (disk full, an unwritable
// logging.metrics_file) stops the run with an error naming the file (docs/fault_tolerance.md).
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "parallel/process_group.h"  // CommStats
#include "parallel/strategy.h"       // StepResult
#include "runtime/device.h"          // host_wait_seconds
#include "tools/trainer/loss_chart.h"
#include "tools/trainer/progress.h"
#include "tools/trainer/tensorboard.h"

namespace accel {

struct Run;

// The input positions and the trained targets (labels that count in the loss) of one optimizer
// step on all ranks; the same for token streams, fewer trained for documents (masked prompts,
// padding).
struct StepTokens {
  int64_t positions = 0, trained = 0;
};

// Host time per phase of a step less the time blocked on the GPU inside it, summed until the
// next log line: a phase that takes about as long as the GPU's share of the step means the host
// (op dispatch, launches), not the GPU, sets the pace.
class HostTimes {
 public:
  enum Phase { kForward, kBackward, kOptimizer };
  template <class F>
  void time(Phase p, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    const double w0 = cuda::host_wait_seconds();
    f();
    busy_[p] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() -
                (cuda::host_wait_seconds() - w0);
  }
  // {"forward": ms, "backward": ms, "optimizer": ms} per step over `steps`; starts a new sum.
  nlohmann::json take_ms_per_step(int64_t steps);

 private:
  std::array<double, 3> busy_{};
};

// metrics.jsonl: opened for writing at construction (an error naming the file when it cannot
// be), every line flushed and checked; with a TensorBoard folder, each line's numbers are
// written there too (tools/trainer/tensorboard.h).
class MetricsFile {
 public:
  MetricsFile() = default;  // writes nothing (ranks other than 0)
  // `tensorboard_dir` empty: no event files. When appending (a resume), the folder's event files
  // are written anew from the metrics file, which then holds each step once.
  MetricsFile(const std::string& path, bool append, const std::string& tensorboard_dir);
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

// A resumed run re-runs the steps after its checkpoint: their lines (and any summary line) are
// dropped from the metrics file at `path` so that every step appears once; a torn last line
// goes too. Lines that are not JSON elsewhere are kept as they are. No file: nothing to do.
// The file is rewritten through a temporary file and a rename.
void truncate_metrics_after(const std::string& path, int64_t step);

// A mixture-of-experts step: the router's load-balancing loss (mean over micro-batches and
// ranks) and the slots routed to each expert ([layer][expert], all ranks and micro-batches;
// empty rows for dense layers).
struct MoeStepStats {
  double aux_loss = 0;
  std::vector<std::vector<double>> expert_tokens;
};

// min / max / mean tokens per expert over the sparse layers' experts, and max / mean (1 = even).
nlohmann::json expert_load_json(const std::vector<std::vector<double>>& expert_tokens);

class RunLog {
 public:
  // At the start of training, `first_step` being the step a resumed run continues from.
  RunLog(const Run& run, int64_t first_step);

  // A line that must stay visible (evaluations, warnings, saved checkpoints).
  void println(const std::string& line);
  HostTimes& host_times() { return host_; }

  // After each optimizer step (every rank: the evaluation result, when there is one, is the
  // same everywhere): the metrics line of a logged step, the evaluation's line, the chart.
  // tokens/s in the log counts trained tokens; trained_fraction = trained / positions.
  // `moe` (mixture-of-experts models): aux_loss and the expert load join the metrics line, and
  // the totals the summary.
  void step(int64_t step, double loss, double lr, const StepResult& r,
            std::optional<double> eval_loss, const StepTokens& tokens,
            const MoeStepStats* moe = nullptr);
  // After the last step, before the final checkpoint: the progress bar is done.
  void end_of_steps() { progress_.finish(); }
  // At the end: every rank's peak memory (all-gathered: every rank calls this), then `sample`
  // (the final greedy sample, "" for none; a collective under sharded parameters), then the
  // summary line, the "done" line and the final chart (rank 0). `final_eval` is NaN without
  // evaluation.
  void finish(int64_t step, double final_eval, const std::function<std::string()>& sample);

 private:
  bool logged_step(int64_t s) const;
  void write_chart();

  const Run& run_;
  bool main_;
  MetricsFile metrics_;
  Progress progress_;
  LossHistory loss_history_;
  std::string chart_title_;
  HostTimes host_;
  double flops_per_token_ = 0, peak_flops_ = -1;
  std::chrono::steady_clock::time_point train_start_, last_log_;
  int64_t last_log_step_ = 0;
  StepTokens since_log_, total_;  // since the last logged step; since the start of this process
  double last_loss_ = NAN;
  bool moe_ = false;
  double last_aux_loss_ = NAN;
  std::vector<std::vector<double>> expert_tokens_total_;  // since the start of this process
  CommStats last_comm_;
  double last_host_wait_ = 0;
};

}  // namespace accel
