// accel-bench's results: one row per (strategy, precision) combination, read from the metrics.jsonl
// of the accel-train run that measured it, and rendered as a table, JSON, markdown and an SVG
// chart.
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace accel {

struct BenchRow {
  std::string strategy, precision;
  std::string status = "ok";  // ok | skipped | failed
  std::string reason;         // why skipped or failed
  int world_size = 1;
  double tokens_per_s = 0, tokens_per_s_per_device = 0;
  double step_ms_median = 0, step_ms_p90 = 0;
  double mfu = -1;  // < 0: unknown
  double final_loss = 0;
  int64_t peak_bytes_max_rank = 0;                // the largest per-rank peak
  nlohmann::json peak_by_category;                // rank 0's peak bytes by category
  nlohmann::json peak_by_rank;                    // every rank's peak bytes by category
  int64_t expected_model_state_bytes = 0;         // ZeRO paper formula for this strategy
  std::string state_dtype = "fp32";               // optimizer.state_dtype of the run
  std::string master_weights = "fp32";            // optimizer.master_weights of the run
  std::string activation_checkpointing = "none";  // training.activation_checkpointing of the run
  int64_t peak_activation_bytes = 0;              // rank 0's peak of activation bytes
  nlohmann::json comm_bytes_per_step;             // wire bytes per step by collective (rank 0)
  // Of which expert parallelism's all-to-all (token dispatch and return), 0 without.
  int64_t all_to_all_bytes_per_step = 0;
  // Mixture of experts (null otherwise): tokens per expert over the run, {min, max, mean,
  // imbalance = max / mean}, and the final router aux loss.
  nlohmann::json expert_load;
  double final_aux_loss = NAN;
};

// Fills the measured fields of `row` from a run's metrics.jsonl, ignoring the first `warmup`
// steps. Throws std::runtime_error when the file lacks what is needed.
void read_bench_metrics(const std::string& metrics_path, int64_t warmup, double peak_flops,
                        BenchRow& row);

// Model-state bytes per rank by the ZeRO paper's formulas (docs/algorithms.md 4) for P parameters
// on N ranks: single/ddp 16P (fp32 or 16-bit compute: 4P weights + 4P/2P grads + 8P Adam),
// zero1 4P + 12P/N, zero2 2P + 14P/N, zero3/fsdp 16P/N, for 16-bit compute with fp32 Adam; with
// fp32 compute the 16-bit copies are absent. `moment_bytes` is the bytes of each Adam moment
// element: 4 (fp32 state), or 2 with optimizer.state_dtype bf16, which makes the 12 (fp32
// master + m + v) 8: single/ddp 12P, zero1 4P + 8P/N, zero2 2P + 10P/N, zero3/fsdp 12P/N.
// `master_bytes` is the bytes of the separate master copy per element: 4 (fp32), or 0 with
// optimizer.master_weights bf16, whose masters are the 16-bit weights themselves (sharded with
// them: counted in their 2P): with fp32 moments 12 becomes 8 (single/ddp 12P, zero1 4P + 8P/N,
// zero2 2P + 10P/N, zero3/fsdp 12P/N), with bf16 moments 4 (single/ddp 8P, zero1 4P + 4P/N,
// zero2 2P + 6P/N, zero3/fsdp 8P/N).
int64_t expected_model_state_bytes(const std::string& strategy, const std::string& precision,
                                   int64_t params, int world, int moment_bytes = 4,
                                   int master_bytes = 4);

std::string bench_table(const std::vector<BenchRow>& rows);     // aligned text for a terminal
std::string bench_markdown(const std::vector<BenchRow>& rows);  // a markdown table for the docs
nlohmann::json bench_json(const std::vector<BenchRow>& rows);
std::string bench_svg(const std::vector<BenchRow>& rows, const std::string& title);

}  // namespace accel
