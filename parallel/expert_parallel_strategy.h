// The strategy for expert parallelism (distributed.expert_parallel_size > 1): two engines of the
// kind the YAML names (DDP, ZeRO-1/2/3 or FSDP: FlatDataParallel, parallel/zero.h) over one
// model, each taking its share of the parameters:
//   dense    every parameter but the experts', over the whole world
//   experts  this rank's experts (is_expert: "...experts.<global index>..."), over the
//            expert-data-parallel group: the world / ep ranks holding the same experts
//
// Gradient scaling: a loss is the mean over each rank's own tokens and the dense engine averages
// over the W ranks, so a dense gradient is (1/W) sum_q grad(loss_q). An expert's gradient on its
// owner already sums the contributions of the tokens of all ep ranks of its EP group (the
// all-to-all's backward brought them back); the expert engine's average over its W/ep ranks
// gives (ep/W) sum_q grad(loss_q), so the expert gradients are multiplied by 1/ep in the norm and
// the update: every gradient is then what one process over the whole batch computes.
//
// Clipping and the non-finite check see both parts: norm^2 = dense (over the world) + experts
// (over the expert-data-parallel group, then summed over the EP group: each expert once). One
// step count (both engines step together). Checkpoints: param_state_slices of both parts (a
// replicated part's slices only from rank 0 of its group, so that slices never repeat), and
// full_state_dict gathers every expert from its owners (broadcast in the EP group); names held by
// other ranks (their experts) are accepted by the checkpoint checks (param_held_elsewhere).
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "parallel/expert_parallel.h"
#include "parallel/zero.h"

namespace accel {

using ParamFilter = std::function<bool(const std::string& name)>;
// Builds one engine over `pg` that takes the parameters `filter` accepts.
using EngineFactory = std::function<std::unique_ptr<FlatDataParallel>(
    std::shared_ptr<ProcessGroup> pg, ParamFilter filter)>;

class ExpertParallelStrategy : public Strategy {
 public:
  // `world`: every rank's group; `ctx` from make_expert_parallel over it.
  ExpertParallelStrategy(std::shared_ptr<ProcessGroup> world, ExpertParallelContext ctx,
                         const EngineFactory& make, ParamFilter is_expert = is_expert_param);
  std::string name() const override;  // "<engine>+ep<N>", e.g. "zero2+ep2"

  // Checks that the model holds only this rank's experts (global names), then sets up the dense
  // engine and the expert engine, in this order on every rank.
  void setup(Module& model, const OptimizerOptions& opts) override;
  void begin_micro_batch(bool last) override;
  void end_micro_batch() override;
  StepResult step(double lr, double max_grad_norm, double grad_scale) override;

  // The dense engine's, plus every expert of the model (all ranks' experts; gathered).
  std::vector<std::pair<std::string, Tensor>> full_state_dict() override;
  std::vector<StateDictEntry> full_state_dict_layout() const override;
  // The dense engine's, then the expert engine's under "experts/".
  std::vector<std::pair<std::string, Tensor>> optimizer_state() override;
  int64_t optimizer_steps() const override;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                  const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                  int64_t optimizer_steps) override;
  std::vector<ParamStateSlice> param_state_slices() override;
  bool state_is_replicated() const override;
  std::vector<std::string> state_kinds() const override;
  void import_param_state(const ParamStateReader& read, int64_t optimizer_steps) override;
  nlohmann::json checkpoint_manifest() const override;
  // The all-to-all runs in every MoE layer's forward: every rank must run every forward.
  bool forward_is_collective() const override {
    return ctx_.ep_size > 1 || dense_->forward_is_collective();
  }
  bool param_held_elsewhere(const std::string& name) const override;
  CommStats group_comm_stats() const override;
  // {"expert_parallel": {"size", "local_experts", "all_to_all_calls_per_step",
  //  "all_to_all_bytes_per_step", "all_to_all_wire_bytes_per_step",
  //  "expert_dp_wire_bytes_per_step"}} plus the dense engine's entries.
  nlohmann::json run_report() const override;
  std::string run_report_line() const override;

  const ExpertParallelContext& context() const { return ctx_; }
  FlatDataParallel& dense() { return *dense_; }
  FlatDataParallel& experts() { return *experts_; }

 private:
  std::shared_ptr<ProcessGroup> world_;
  ExpertParallelContext ctx_;
  ParamFilter is_expert_;
  std::unique_ptr<FlatDataParallel> dense_, experts_;
  Device device_;
  int64_t steps_ = 0;  // step() calls, for the per-step traffic
};

// `name` with its expert index replaced by `expert` ("...experts.3.w1" -> "...experts.7.w1").
std::string with_expert_index(const std::string& name, int64_t expert);

}  // namespace accel
