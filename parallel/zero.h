// ZeRO stages 1-3 (distributed_type DEEPSPEED) and, as stage 0, DDP and the single process (one
// rank, per-parameter gradients; parallel/ddp.h): one engine over the shared core in
// parallel/sharding.h. What each stage keeps per rank (P parameters, N ranks, 16-bit
// compute with fp32 Adam; MemCategory in brackets):
//
//   stage 0 (DDP)  compute params 2P [Params], grads 2P [Grads], fp32 master + Adam 12P
//                  [OptimizerState]; gradient buckets all-reduced (average) during the backward
//                  of the last micro-batch
//   stage 1        as DDP but master + Adam only for the rank's chunk: 12P/N; the last
//                  micro-batch's backward reduce-scatters each bucket into its owner's chunk;
//                  after the update every bucket's compute params are all-gathered
//   stage 2        also gradients: each micro-batch's backward reduce-scatters each bucket as it
//                  completes and only the owned chunk (2P/N) is kept
//   stage 3        also parameters (2P/N): each unit (decoder layer; the root's remaining
//                  parameters form one more unit) is all-gathered before its forward and again
//                  for its backward, the next unit prefetched, and released after use
//
// With fp32 compute the master weights are the compute buffer (or its chunk) itself. With
// optimizer.state_dtype bf16 the Adam moments are bf16 (master + Adam 8P, or 8P/N sharded). With
// optimizer.master_weights bf16 (bf16 compute) there is no fp32 master: the bf16 compute buffer
// (its chunk, its shard) is the master, updated with stochastic rounding (master + Adam: 2P + 8P
// fp32 moments, or 2P + 4P bf16 ones, of which the 2P are the compute params).
// docs/parallel.md has the details (buckets, layouts, checkpoints).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "parallel/sharding.h"
#include "parallel/strategy.h"

namespace accel {

struct DataParallelOptions {
  int zero_stage = 0;  // 0 = DDP (replicated), 1, 2, 3
  DType compute_dtype = DType::F32;
  double bucket_cap_mb = 25;            // gradient buckets (stages 0-2)
  bool find_unused_parameters = false;  // reduce zeros for parameters without a gradient
  bool offload_optimizer = false;       // master weights, Adam state and the update on the host
  bool offload_params = false;          // stage 3: parameter shards on the host
  bool save_16bit_model = false;        // stage 3: full_state_dict gathers the compute weights
  // Stage 3 gather units: modules of these type_name()s (outermost ones).
  std::vector<std::string> unit_types = {"LlamaDecoderLayer"};
  // FSDP (parallel/fsdp.h) sets these; ZeRO keeps the defaults.
  // Stage 3: modules forming the gather units, in forward order (replaces unit_types when set).
  std::function<std::vector<Module*>(Module&)> select_units;
  bool reshard_after_forward = true;  // stage 3: release a unit after its forward
  bool reduce_in_fp32 = false;  // stages 2-3: reduce 16-bit gradients in fp32, keep shards fp32
  // Stage 3: how parameters are sharded (parallel/sharding.h). ZeRO: Contiguous (a rank's shard
  // is a chunk of the unit's flat buffer); FSDP: Dim0 (every parameter split on dim 0; gathers
  // go through a rank-major wire buffer with a copy-out, reductions through a copy-in).
  FlatLayout::Mode layout = FlatLayout::Mode::Contiguous;
  // Stage 0 over one rank only: false keeps each parameter's own autograd gradient (nothing to
  // all-reduce, so no flat bucket, no grad-ready hooks, no zeroing pass; dropped after every step,
  // so no gradient memory between steps; a parameter without one is skipped by the update). The
  // single process (SingleProcessStrategy, parallel/ddp.h) sets it.
  bool flat_grads = true;
  // The model parameters this engine takes, by name (empty: all of them). Expert parallelism
  // runs two engines over one model, the expert parameters over another group than the rest
  // (parallel/expert_parallel_strategy.h); stage 3's units then gather only their own share.
  std::function<bool(const std::string& name)> param_filter;
};

// The outermost modules below `root` whose type_name() is one of `types`, in pre-order (= forward
// order for models that run their children in registration order): ZeRO-3's gather units and
// FSDP's TRANSFORMER_BASED_WRAP units.
std::vector<Module*> find_units(Module& root, const std::vector<std::string>& types);

class FlatDataParallel : public Strategy {
 public:
  FlatDataParallel(std::shared_ptr<ProcessGroup> pg, DataParallelOptions options);
  ~FlatDataParallel() override;
  std::string name() const override;

  void setup(Module& model, const OptimizerOptions& opts) override;
  void begin_micro_batch(bool last) override;
  void end_micro_batch() override;
  StepResult step(double lr, double max_grad_norm, double grad_scale) override;

  // Stages 0-2: the master weights (fp32, or bf16 with optimizer.master_weights bf16). Stage 3:
  // compute-dtype weights with save_16bit_model, else none
  // (the weights are only in the shards; accel-checkpoint consolidate rebuilds them).
  std::vector<std::pair<std::string, Tensor>> full_state_dict() override;
  std::vector<StateDictEntry> full_state_dict_layout() const override;
  // Stage 0: "<param>.exp_avg" ... (the optimizer runs per parameter, in model order). Stages 1-3:
  // this rank's chunks as "group<i>.master", "group<i>.exp_avg", "group<i>.exp_avg_sq" (or
  // ".momentum_buffer"), laid out as checkpoint_manifest() describes.
  std::vector<std::pair<std::string, Tensor>> optimizer_state() override;
  int64_t optimizer_steps() const override;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                  const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                  int64_t optimizer_steps) override;
  nlohmann::json checkpoint_manifest() const override;
  // Stage 0 (DDP, single): every parameter whole, replicated. Stages 1-3: the range of each
  // parameter this rank's shard owns (FlatLayout::owned), views into the shard buffers.
  std::vector<ParamStateSlice> param_state_slices() override;
  bool state_is_replicated() const override { return options_.zero_stage == 0; }
  std::vector<std::string> state_kinds() const override;
  void import_param_state(const ParamStateReader& read, int64_t optimizer_steps) override;
  bool forward_is_collective() const override { return options_.zero_stage == 3; }

  // The master weights (fp32 or bf16), gathered (every rank calls this; for tests and tools).
  std::vector<std::pair<std::string, Tensor>> gather_master_weights();
  // What gather_master_weights() returns, described without gathering (full_state_dict_layout).
  std::vector<StateDictEntry> master_weights_layout() const;

  // step() in phases, for a strategy that composes engines (expert parallelism):
  //   finish_gradients()      waits for the step's reductions; this rank's gradients as the
  //                           optimizer takes them (undefined where a parameter has none)
  //   grad_sum_of_squares(g)  their squared L2 norm over this engine's group (each element
  //                           counted once: summed over the ranks when sharded); collective
  //                           when sharded
  //   first_non_finite(g)     the first parameter whose gradient holds NaN/Inf on any rank of
  //                           the group, or ""; collective
  //   apply_update(g, lr, m)  the optimizer step with the gradients times m (grad scale and
  //                           clipping), then the compute weights refreshed (collective at
  //                           stages 1-2)
  //   clear_gradients()       ready for the next step
  std::vector<Tensor> finish_gradients();
  double grad_sum_of_squares(const std::vector<Tensor>& grads);
  std::string first_non_finite(const std::vector<Tensor>& grads);
  virtual void apply_update(const std::vector<Tensor>& grads, double lr, double multiplier);
  void clear_gradients();
  // This engine's process group (null over one process without one).
  ProcessGroup* process_group() const { return comm_.group(); }
  const std::vector<std::string>& param_names() const { return model_names_; }  // model order

  const DataParallelOptions& options() const { return options_; }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  const FlatParamGroup& group(int i) const { return *groups_.at(i).flat; }

  // What each group's collectives moved since setup (or reset_group_comm()), counted as
  // ProcessGroup::stats() counts bytes: an all-gather's output, a reduce-scatter's input.
  // Stage 3: per gather unit (groups are in backward order: the last layer's unit first, the
  // root unit last).
  struct GroupComm {
    int64_t all_gathers = 0, all_gather_bytes = 0;
    int64_t reduce_scatters = 0, reduce_scatter_bytes = 0;
  };
  const std::vector<GroupComm>& group_comm() const { return group_comm_; }
  void reset_group_comm();

 protected:
  // Stage 3, by group index: issue the all-gather of group g's parameters (default: this rank's
  // compute-dtype shard into the group's flat buffer, or with the dim-0 layout into a rank-major
  // wire buffer), finish it once the collective completed (default: the dim-0 copy-out from the
  // wire into the flat buffer, else nothing), and release the gathered parameters (default: the
  // flat buffer's bytes).
  virtual WorkPtr start_group_gather(int g);
  virtual void finish_group_gather(int g);
  virtual void release_group(int g);
  // Stage 3 at world size 1: may a unit's shard be its flat buffer itself, never released, so
  // that gathers and releases do nothing? (FSDP's fp8 all-gather writes into the flat buffer.)
  virtual bool shard_may_alias_flat_buffer() const { return true; }
  const Comm& comm() const { return comm_; }
  Device device() const { return device_; }
  // Stage 3: this rank's compute-dtype chunk of group g (on the host with offload_params).
  const Tensor& group_shard(int g) const { return groups_.at(g).shard; }
  FlatParamGroup& flat_group(int g) { return *groups_.at(g).flat; }
  void count_gather(int g, int64_t bytes);
  // Stage 3: the group of scheduler unit `unit` (units in forward order, the root unit last).
  int group_of_unit(int unit) const;
  int num_layer_units() const { return num_layer_units_; }  // units other than the root unit

 private:
  struct Group {
    std::unique_ptr<FlatParamGroup> flat;
    // fp32 or bf16 (OptimizerOptions::master_dtype): [flat_numel] (stage 0) or this rank's
    // [shard_numel]
    Tensor master;
    bool master_is_compute =
        false;     // master aliases the compute buffer (same dtype, not offloaded)
    Tensor shard;  // stage 3: the compute-dtype chunk this rank keeps
    Tensor wire;   // stage 3, dim-0 layout: a gather in flight (rank-major)
    // Stages 2-3: this step's reduced gradient of this rank's chunk; undefined between steps. The
    // first micro-batch's reduction output becomes it (no zeroing, no accumulate); later ones are
    // added to it.
    Tensor shard_grad;
  };
  struct Pending {
    WorkPtr work;
    std::function<void()> done;
  };

  std::vector<Parameter*> own_params(Module& m) const;  // m's parameters this engine takes
  void build_groups(Module& model, std::vector<std::vector<Parameter*>>* group_params,
                    std::vector<Module*>* units, bool* root_unit);
  void launch_reduction(int g);
  Tensor gather_group_master(int g);
  void wait_pending(size_t keep);
  // The compute weights from the master weights (all-gathered at stages 1-2); after_update: the
  // optimizer already wrote this rank's part where optimizer_writes_compute_.
  void refresh_compute(bool after_update);
  // The gradients the optimizer's tensors take: stage 0 per parameter in model order (undefined
  // where a parameter has none), stages 1-3 this rank's chunk of every group.
  std::vector<Tensor> owned_grads() const;
  // The first parameter (model order) whose gradient holds NaN or Inf on any rank; collective.
  std::string first_non_finite_param(const std::vector<Tensor>& grads);
  int unit_of_group(int g) const;
  // The [begin, begin + size) elements of model parameter `index` this rank holds, and where
  // they start inside its master tensor and each optimizer state tensor (`state_key`'s prefix).
  struct HeldRange {
    const FlatSlot* slot = nullptr;
    int64_t begin = 0, size = 0, at = 0;
    const Tensor* master = nullptr;
    std::string state_prefix;  // "<param>." (stage 0) or "group<i>." (stages 1-3)
  };
  HeldRange held_range(size_t index) const;

  Comm comm_;
  DataParallelOptions options_;
  Device device_;
  std::vector<Group> groups_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradReadiness> readiness_;
  std::unique_ptr<UnitScheduler> scheduler_;
  int num_layer_units_ = 0;
  bool resident_ = false;  // stage 3, world 1: every shard is its flat buffer (see above)
  bool optimizer_writes_compute_ = false;  // the optimizer's update writes the compute copies
  std::deque<Pending> pending_;
  std::vector<GroupComm> group_comm_;
  std::unordered_map<std::string, int64_t> model_order_;  // parameter name -> model index
  std::vector<std::string> model_names_;                  // model index -> parameter name
  struct SlotRef {
    int group = 0;
    size_t slot = 0;
  };
  std::vector<SlotRef> model_slots_;  // model index -> where the parameter sits
};

// distributed_type DEEPSPEED.
class ZeroStrategy : public FlatDataParallel {
 public:
  ZeroStrategy(std::shared_ptr<ProcessGroup> pg, DataParallelOptions options)
      : FlatDataParallel(std::move(pg), std::move(options)) {}
};

}  // namespace accel
