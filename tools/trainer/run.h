// The composition root of a training run: assemble_run builds every part in one fixed order,
// and Run holds them for the training loop (tools/trainer/train.cpp).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "parallel/expert_parallel.h"
#include "parallel/launch_env.h"
#include "parallel/strategy.h"
#include "runtime/config.h"
#include "runtime/data/loader.h"
#include "runtime/data/tokenizer.h"
#include "tools/trainer/precision.h"

namespace accel {

class ProcessGroup;
class TcpStore;

// A user's mistake that the config validation could not see (exit code 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// This rank's place in the job and its process group (none on one process).
struct Distributed {
  LaunchEnv env;
  std::shared_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;  // null on one process

  int rank() const { return env.rank; }
  int world() const { return env.world_size; }
  void barrier() const;
  // The mean of `v` over the ranks (v itself on one process).
  double mean_across_ranks(double v, Device device) const;
  // Every rank's `values` (all the same length), rank after rank.
  std::vector<double> all_gather(const std::vector<double>& values, Device device) const;
};

// Every part of a run. Members are declared in the order they are built, so that they are
// destroyed in reverse: the strategy before the precision state its fp8 layers point into,
// both before the model.
struct Run {
  Config cfg;
  std::string config_yaml;  // the effective config, as written to <output_dir>/config.yaml
  bool resuming = false;    // --resume was given
  std::chrono::steady_clock::time_point start_time;
  Device device = Device::cpu();
  Distributed dist;
  // distributed.expert_parallel_size > 1: the mesh the MoE layers and the strategy share (null
  // otherwise).
  std::shared_ptr<const ExpertParallelContext> expert_parallel;
  DecoderConfig model_config;
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<Precision> precision;
  std::unique_ptr<Strategy> strategy;
  DataSources data;
  std::unique_ptr<Tokenizer> tokenizer;  // null for synthetic data

  bool main_rank() const { return dist.rank() == 0; }
  const std::string& output_dir() const { return cfg.training.output_dir; }
  int64_t tokens_per_step() const;
};

// Builds a run from a validated config and the launch environment, in this order:
//   1. device and the distributed init (process group, rendezvous)
//   2. the output folder and its config.yaml
//   3. the model: built from model.* or model.init_from's config.json, initialized (seeded),
//      init_from weights loaded, activation checkpointing set
//   4. precision conversion (fp8 linear layers)
//   5. the strategy (precision attaches what it needs, then setup: master weights, compute
//      copies, shards)
//   6. data: training and evaluation sources, the tokenizer
// `print_config`: the effective config goes to stderr too (it is always written to config.yaml).
Run assemble_run(Config cfg, const LaunchEnv& env, bool resuming, bool print_config = false);

}  // namespace accel
