// The run's precision: the one reader of mixed_precision, fp8_config and the non-finite policy.
// It decides the compute dtype, converts the model's linear layers for fp8, hands FSDP the fp8
// layers it gathers itself, scales the loss (fp16), does what follows each optimizer step (fp8
// scale updates, the loss scale, the nan_policy), switches evaluation to its own mode and owns
// its checkpoint state (the fp8 delayed-scaling file, the loss scale).
//
//   Precision p(cfg);                 // before the strategy: p.compute_dtype()
//   p.convert(model, device);         // after the model's weights are final
//   p.attach(strategy);               // after make_strategy, before setup
//   loss * p.loss_scale() ... strategy.step(lr, clip, 1 / p.loss_scale());
//   p.after_optimizer_step(group);    // inside the step
//   p.after_step(result, loss, step)  // once the step's loss is known
//   { Precision::EvalScope e(p); evaluate(); }
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/config.h"
#include "runtime/module.h"

namespace accel {

class Fp8Training;
class Fp8EvalScope;
class ProcessGroup;
class Strategy;
struct StepResult;
struct LoadedCheckpoint;

class Precision {
 public:
  explicit Precision(const Config& cfg);
  ~Precision();
  Precision(const Precision&) = delete;
  Precision& operator=(const Precision&) = delete;

  DType compute_dtype() const { return compute_dtype_; }
  // "fp32", "fp16", "bf16" or "fp8": the run's name for its precision (charts).
  std::string name() const;
  // The mixed_precision value as configured ("no", "fp16", ...).
  const char* mixed_precision() const { return name_of(mode_); }
  // A few lines for the start of a run ("" when there is nothing to say beyond name()).
  std::string describe() const;

  // fp8: converts the model's linear layers (after its weights are initialized or loaded).
  void convert(Module& model, Device device);
  // fp8 with fp8_config.enable_fsdp_float8_all_gather: gives a strategy that gathers fp8
  // weights itself (Fp8WeightGathering, FSDP) the converted layers. Before strategy.setup().
  void attach(Strategy& strategy);

  // What the loss is multiplied by before backward; the gradients are divided by it again in
  // the step (1 unless fp16's dynamic loss scaling).
  double loss_scale() const { return loss_scale_; }
  // Once per optimizer step, right after it: fp8 delayed scaling's amax all-reduce over `group`
  // (null on one process) and its new scales.
  void after_optimizer_step(ProcessGroup* group);
  // Once the step's mean loss is known: fp16 backs off or grows the loss scale; a non-finite
  // step (skipped by the strategy, or a non-finite loss) throws under nan_policy stop and
  // returns a warning line under skip ("" otherwise; fp16 expects overflows and says nothing).
  std::string after_step(const StepResult& r, double loss, int64_t step);
  int64_t skipped_steps() const { return skipped_steps_; }
  // Entries of a logged step's metrics line (fp16: loss_scale); null when none.
  nlohmann::json metrics() const;

  // For its lifetime, the model evaluates in precision's evaluation mode (fp8 layers in bf16
  // unless use_autocast_during_eval; they never record amaxes).
  class EvalScope {
   public:
    explicit EvalScope(Precision& p);
    ~EvalScope();
    EvalScope(const EvalScope&) = delete;
    EvalScope& operator=(const EvalScope&) = delete;

   private:
    std::unique_ptr<Fp8EvalScope> fp8_;
  };

  // Checkpoints. save_state: every rank calls it with the folder being written (fp8 delayed
  // scaling: checks that every rank of `group` holds the same state, rank 0 writes the file);
  // returns the entries for trainer_state.json. restore_state: every rank, after the strategy's
  // state is loaded; returns a note for the log ("" when none). Throws when the checkpoint's
  // state does not fit this run, saying what differs.
  nlohmann::json save_state(const std::string& dir, int rank, ProcessGroup* group);
  std::string restore_state(const LoadedCheckpoint& ck);

 private:
  MixedPrecision mode_;
  Fp8Config fp8_config_;
  NanPolicy nan_policy_;
  int64_t loss_scale_window_;
  DType compute_dtype_;
  double loss_scale_ = 1.0;
  int64_t good_steps_ = 0, skipped_steps_ = 0;
  std::unique_ptr<Fp8Training> fp8_;  // after convert() in fp8 training
};

}  // namespace accel
