// How a training step updates the model: master weights and compute copies, gradient
// communication, optimizer state placement. One interface for every distributed_type; the trainer
// never branches on it.
//
// The model is built with fp32 parameters on the compute device. setup() turns them into what the
// strategy needs: fp32 master weights (whole or sharded) plus compute copies in the compute dtype
// that the model's Parameter slots then hold, or with optimizer.master_weights bf16 the bf16
// compute weights alone, which are then the masters.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ops/optimizer.h"
#include "parallel/process_group.h"
#include "runtime/module.h"

namespace accel {

struct StepResult {
  double grad_norm = 0;  // global norm before clipping (over all ranks and shards)
  bool skipped = false;  // non-finite gradients: no update was applied
  // When skipped: the name of the first parameter (model order) whose gradient holds NaN or Inf
  // on any rank, for the nan_policy: stop message. Empty when every gradient is finite and only
  // their norm overflowed.
  std::string first_non_finite;
};

// One parameter's training state as this rank holds it, independent of the strategy's flat
// layout: elements [begin, end) of the flattened parameter (row-major, full shape `shape`).
// Checkpoints store these (tools/trainer/checkpoint.h), so any strategy at any world size can
// read what any other wrote.
struct ParamStateSlice {
  std::string name;  // Hugging Face parameter name
  Shape shape;       // the whole parameter's
  int64_t begin = 0, end = 0;
  // By state kind ("master": the fp32 master weights, then the optimizer's moments under their
  // suffixes, e.g. "exp_avg", "exp_avg_sq" or "momentum_buffer"): [end - begin] views of the
  // live state (copy them before training goes on), masters in the master dtype (fp32, or bf16
  // with optimizer.master_weights bf16), moments in the optimizer's state dtype (fp32 or bf16).
  std::vector<std::pair<std::string, Tensor>> tensors;
};

// One tensor that full_state_dict() returns, described without it: its name, shape, dtype and
// the device it is on. full_state_dict_layout() gives these without gathering anything, so that
// checkpoints can size their host snapshot block before the first save
// (tools/trainer/checkpoint.h, snapshot_layout).
struct StateDictEntry {
  std::string name;
  Shape shape;
  DType dtype = DType::F32;
  Device device = Device::cpu();
};

// Fills `dst` (fp32, contiguous, on the CPU) with elements [begin, begin + dst.numel()) of state
// `kind` of parameter `name` (bf16-stored masters and moments widened exactly); throws when the
// checkpoint cannot.
using ParamStateReader = std::function<void(const std::string& name, const std::string& kind,
                                            int64_t begin, const Tensor& dst)>;

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;

  virtual void setup(Module& model, const OptimizerOptions& opts) = 0;
  // Around each micro-batch's forward+backward; `last` marks the micro-batch after which the
  // step's gradient communication must happen (earlier ones only accumulate locally).
  virtual void begin_micro_batch(bool last) { (void)last; }
  virtual void end_micro_batch() {}
  // Finish gradient communication, multiply gradients by grad_scale (1/loss_scale), clip to
  // max_grad_norm (<= 0: off), update, refresh compute copies and clear gradients.
  virtual StepResult step(double lr, double max_grad_norm, double grad_scale) = 0;

  // Full weights by Hugging Face name for the checkpoint's model.safetensors (gathered where
  // sharded; every rank calls this): fp32 master weights, except ZeRO-3, which returns the
  // 16-bit compute weights with zero3_save_16bit_model and nothing otherwise (its checkpoints then
  // hold only shards; accel-checkpoint consolidate rebuilds the weights).
  virtual std::vector<std::pair<std::string, Tensor>> full_state_dict() = 0;
  // What full_state_dict() would return now (the same entries, in the same order, with the
  // shapes, dtypes and devices of its tensors), from the strategy's own bookkeeping: no gather,
  // no copy, no collective, so any rank may call it alone. The default throws: a strategy
  // without it cannot reserve its checkpoint snapshot memory ahead of the first save.
  virtual std::vector<StateDictEntry> full_state_dict_layout() const;
  // Optimizer state this rank holds, by "<param>.exp_avg" names, and the step count.
  virtual std::vector<std::pair<std::string, Tensor>> optimizer_state() = 0;
  virtual int64_t optimizer_steps() const = 0;
  // Restores weights (full, by name; may be empty where optimizer_state holds the weight
  // shards) and this rank's optimizer state.
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                          const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                          int64_t optimizer_steps) = 0;
  // Layout-independent state (ParamStateSlice) for checkpoints. param_state_slices: this rank's
  // slices in model order, every parameter whole where the state is replicated (then every rank
  // returns the same and one rank's copy is enough). state_kinds: "master" then the optimizer's
  // moment suffixes. import_param_state: every rank reads the elements it holds through `read`
  // (padding becomes zeros), sets the step count and refreshes the compute weights. The defaults
  // throw: a strategy without them cannot checkpoint this way.
  virtual std::vector<ParamStateSlice> param_state_slices();
  virtual bool state_is_replicated() const { return true; }
  virtual std::vector<std::string> state_kinds() const;
  virtual void import_param_state(const ParamStateReader& read, int64_t optimizer_steps);
  // What a checkpoint needs to interpret optimizer_state() of every rank (TrainerState.extra):
  // strategy, world size, shard layout. Null when the state is keyed by parameter names.
  virtual nlohmann::json checkpoint_manifest() const;
  // True when forward issues collectives (sharded parameters): every rank must run every forward
  // (evaluation and sampling included) together.
  virtual bool forward_is_collective() const { return false; }
  // At the end of a run: entries the strategy adds to metrics.jsonl's summary object and a line
  // for the log (null and "" when it has nothing to add). Local: no collectives.
  virtual nlohmann::json run_report() const;
  virtual std::string run_report_line() const { return ""; }
  // Whether `name` is a parameter of the whole model that this rank's model does not hold
  // (expert parallelism: other ranks' experts). Checkpoint checks accept such names.
  virtual bool param_held_elsewhere(const std::string& name) const {
    (void)name;
    return false;
  }
  // Traffic of the process groups the strategy made itself (expert parallelism's groups), which
  // the world group's stats() do not count; the run log adds it to the world's.
  virtual CommStats group_comm_stats() const { return {}; }
};

class ProcessGroup;
struct Config;

struct ExpertParallelContext;

// The strategy the config's distributed_type names, for this rank's process group (null on a
// single process) and the compute dtype. With distributed.expert_parallel_size > 1, `ep` is the
// mesh (make_expert_parallel over pg, which the model shares) and the strategy is
// ExpertParallelStrategy over engines of that type (parallel/expert_parallel_strategy.h).
std::unique_ptr<Strategy> make_strategy(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                        DType compute_dtype,
                                        const ExpertParallelContext* ep = nullptr);

}  // namespace accel
