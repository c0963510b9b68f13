// FSDP (distributed_type FSDP, fsdp_config.fsdp_version 2) on the shared data-parallel core:
// parameters, gradients and optimizer state sharded over the ranks; each unit (by
// fsdp_auto_wrap_policy) is all-gathered in one collective before its forward and again for its
// backward (the next unit prefetched), released after use when fsdp_reshard_after_forward, and its
// gradients reduce-scattered (in fp32 when computing in 16 bits) as soon as they are complete.
//
// The engine is FlatDataParallel at stage 3 (parallel/zero.h); what FSDP adds is the unit choice,
// the reshard/reduce-dtype/offload options, its state dict types and the layout: FSDP2's
// per-parameter dim-0 shards (FlatLayout::Mode::Dim0: rank r holds rows [r*c, (r+1)*c) of every
// parameter, c = ceil(d0 / N), zero-padded), gathered into a rank-major wire buffer and copied
// out into the unit's flat compute buffer; gradients copied in to rank-major order before the
// reduce-scatter. docs/parallel.md ("## FSDP2") has the details.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "parallel/zero.h"
#include "runtime/config.h"  // FsdpWrapPolicy, FsdpStateDictType

namespace accel {

struct Config;

struct FsdpOptions {
  DType compute_dtype = DType::F32;
  FsdpWrapPolicy auto_wrap_policy = FsdpWrapPolicy::TransformerBased;
  std::vector<std::string> layer_cls_to_wrap = {"LlamaDecoderLayer"};
  int64_t min_num_params = 100000000;
  bool reshard_after_forward = true;
  bool offload_params = false;  // sharded params, master weights and Adam state on the host
  FsdpStateDictType state_dict_type = FsdpStateDictType::Sharded;
  bool find_unused_parameters = false;
  // The parameters this strategy takes (DataParallelOptions::param_filter; empty: all).
  std::function<bool(const std::string& name)> param_filter;

  // From fsdp_config (validated by the config loader: the cross-key rules live there).
  static FsdpOptions from_config(const Config& cfg, DType compute_dtype);
};

// The narrow interface through which fp8 training hands a strategy the fp8 linear layers whose
// weights it gathers itself (FSDP's fp8 all-gather, fp8_config.enable_fsdp_float8_all_gather).
// The generic Strategy does not know fp8: the precision part (tools/trainer/precision.h) finds
// this interface with dynamic_cast and calls it once, before setup().
class Fp8WeightGathering {
 public:
  // The fp8 linear layers by module name ("model.layers.0.mlp.up_proj") with their contexts.
  using Fp8Layers = std::vector<std::pair<std::string, Fp8LinearContext*>>;
  virtual ~Fp8WeightGathering() = default;
  virtual void gather_fp8_weights(const Fp8Layers& layers) = 0;
};

// The gather units fsdp_auto_wrap_policy picks, in forward order (pre-order of the module tree;
// disjoint; the root's remaining parameters form the root unit):
//   TRANSFORMER_BASED_WRAP  outermost modules whose type_name() is in layer_cls_to_wrap
//   SIZE_BASED_WRAP         bottom-up as PyTorch's size policy: a module (other than the root)
//                           becomes a unit when the parameters it holds outside units already
//                           chosen below it reach min_num_params; here only modules none of whose
//                           descendants became a unit qualify (units stay disjoint), and leaf
//                           modules (Linear, Embedding, norms) and ModuleList never do (parallel
//                           siblings such as q/k/v projections cannot be prefetched in order)
//   NO_WRAP                 none (one unit: the root)
std::vector<Module*> fsdp_units(Module& root, const FsdpOptions& o);

class Fp8AllGather;

// Whether this rank reads model.init_from's weights itself. Every rank does, except with
// distributed_type FSDP and fsdp_config.fsdp_cpu_ram_efficient_loading, where only rank 0 opens
// the weight files: the other ranks build the model from config.json with their own random
// values, and setup() replaces every parameter with rank 0's value (each unit broadcast from rank
// 0 as fp32, then each rank keeps its shard).
bool reads_init_weights(const Config& cfg, int rank);

class FsdpStrategy : public FlatDataParallel, public Fp8WeightGathering {
 public:
  FsdpStrategy(std::shared_ptr<ProcessGroup> pg, FsdpOptions options);
  ~FsdpStrategy() override;
  std::string name() const override { return "fsdp"; }

  // Turns on the fp8 all-gather of these fp8 linear layers; call once before setup(). setup() then
  // gathers each unit as one byte buffer (per rank: its chunk's non-fp8 elements in the compute
  // dtype, then its fp8 weights' elements as e4m3 cast with the weights' global scales), hands
  // each layer its gathered weight through ctx->weight_provider, and recomputes the scales
  // (one MAX all-reduce of every fp8 weight's amax) at setup, after each step() that updated and
  // after load_state(). A unit is gathered this way while the layers' fp8 autocast is enabled;
  // with it disabled (evaluation in bf16: Fp8EvalScope) the unit is gathered in the compute
  // dtype as usual. The contexts must stay alive as long as the strategy is used.
  void gather_fp8_weights(const Fp8Layers& layers) override;

  void setup(Module& model, const OptimizerOptions& opts) override;
  void apply_update(const std::vector<Tensor>& grads, double lr, double multiplier) override;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                  const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                  int64_t optimizer_steps) override;
  void import_param_state(const ParamStateReader& read, int64_t optimizer_steps) override;

  // Traffic per unit since setup (or reset_group_comm()), units in forward order, the root unit
  // last: what each unit's all-gathers and reduce-scatters moved (bytes as ProcessGroup::stats()
  // counts them) and, for comparison, what one all-gather of the unit in the compute dtype moves.
  struct UnitComm {
    std::string name;       // first parameter's module path, e.g. "model.layers.0"
    int64_t numel = 0;      // parameters' elements (padding excluded)
    int64_t fp8_numel = 0;  // of which fp8 weights gathered as e4m3 (0 without fp8 all-gather)
    int64_t compute_gather_bytes = 0;  // one all-gather in the compute dtype (padded)
    GroupComm comm;
  };
  std::vector<UnitComm> unit_comm() const;
  // One line per unit: "unit model.layers.0: 9280 params (9216 fp8), 2 all-gathers 18.5 KiB (bf16
  // would be 37.1 KiB), 1 reduce-scatters 37.1 KiB".
  std::string describe_unit_comm() const;
  // With several ranks: {"fsdp_unit_comm": [{"unit", "params", "fp8_params", "all_gathers",
  // "all_gather_bytes", "compute_dtype_all_gather_bytes", "reduce_scatters",
  // "reduce_scatter_bytes"}, ...]} over the run, and a line with the totals.
  nlohmann::json run_report() const override;
  std::string run_report_line() const override;
  // The fp8 all-gather's units (null without fp8 all-gather or before setup), one per group in
  // group order (backward order, as FlatDataParallel::group()).
  const Fp8AllGather* fp8_all_gather() const;
  // FULL_STATE_DICT: the fp32 weights gathered (every rank calls; the trainer writes rank 0's as
  // Hugging Face model.safetensors). SHARDED_STATE_DICT: none; the checkpoint is the per-rank
  // shards (optimizer.rank<R>.safetensors: group<i>.master/.exp_avg/.exp_avg_sq) plus the
  // manifest, which accel-checkpoint consolidate turns into full weights.
  std::vector<std::pair<std::string, Tensor>> full_state_dict() override;
  std::vector<StateDictEntry> full_state_dict_layout() const override;
  nlohmann::json checkpoint_manifest() const override;
  const FsdpOptions& fsdp_options() const { return fsdp_; }

 protected:
  WorkPtr start_group_gather(int g) override;
  void finish_group_gather(int g) override;
  void release_group(int g) override;
  // The fp8 all-gather marks a unit's fp8 weights NaN in its flat buffer while gathered.
  bool shard_may_alias_flat_buffer() const override { return !fp8_all_gather_on_; }

 private:
  struct Fp8State;
  void precompute_fp8_scales();
  FsdpOptions fsdp_;
  std::vector<std::pair<std::string, Fp8LinearContext*>> fp8_layers_;
  bool fp8_all_gather_on_ = false;  // gather_fp8_weights was called
  bool setup_done_ = false;
  std::shared_ptr<Fp8State> fp8_;
};

// fp8 all-gather (fp8_config.enable_fsdp_float8_all_gather; torchao's tensorwise dynamic
// scaling, docs/algorithms.md section 12) of units laid out by FlatLayouts over the ranks (rank r
// holds its shard of each, in a high-precision dtype: the dim-0 rows of every parameter, or a
// contiguous chunk), some of whose slots are fp8 weights [out, in].
//   precompute_scales(shards)  after each optimizer step: every fp8 weight's max|w| over this
//                              rank's chunks -> one f32 vector for ALL fp8 weights of all units ->
//                              ONE MAX all-reduce -> scale_i = 448 / amax_i (fp8_scale_for_amax)
//   start(u, shard) / finish   packs this rank's chunk into a byte buffer: first the chunk's
//                              elements of the other slots in the shard's dtype, then its fp8
//                              weights' elements cast to e4m3 with those global scales (1 byte
//                              each); all-gathers the byte buffers (every rank's padded to the
//                              largest, a multiple of 16: packed_bytes_per_rank); finish() writes
//                              the other slots into the unit's flat buffer and returns each fp8
//                              weight as an Fp8Tensor (row-major data padded to multiples of 16)
//                              that the fp8 linear uses as is (Fp8LinearContext::weight_provider)
// The cast is elementwise with a scale that every rank shares, so the result is bit-identical to
// all-gathering the high-precision weight and casting it with fp8_cast_dynamic.
class Fp8AllGather {
 public:
  // Units made of fp8 weights only (each unit's layout is over exactly these weights).
  Fp8AllGather(const std::vector<std::vector<Parameter*>>& unit_weights, int world,
               FlatLayout::Mode mode = FlatLayout::Mode::Dim0);
  // Units with the given layouts; fp8[u][i]: slot i of unit u is an fp8 weight (2-d).
  Fp8AllGather(std::vector<FlatLayout> layouts, const std::vector<std::vector<bool>>& fp8);

  int num_units() const { return static_cast<int>(layouts_.size()); }
  const FlatLayout& layout(int unit) const { return layouts_.at(unit); }
  bool is_fp8(int unit, int slot) const { return index_.at(unit).at(slot) >= 0; }
  int64_t num_fp8_weights(int unit) const;
  int64_t fp8_numel(int unit) const;  // elements of the unit's fp8 weights
  // Bytes of one rank's part of unit u's all-gather buffer when the other slots travel with
  // `element_size` bytes per element: max over ranks of (other elements * element_size + fp8
  // elements), rounded up to a multiple of 16. The all-gather moves world times this.
  int64_t packed_bytes_per_rank(int unit, size_t element_size) const;

  // shards[u]: this rank's shard [shard_numel] of unit u (any float dtype; units without fp8
  // weights may pass an undefined tensor). The amaxes are all-reduced on `reduce_device` and the
  // scales kept on `device` (where start() is given the shards).
  void precompute_scales(const std::vector<Tensor>& shards, const Comm& comm);
  void precompute_scales(const std::vector<Tensor>& shards, const Comm& comm, Device device,
                         Device reduce_device);
  // Scale of slot `slot` of unit u (an fp8 weight; f32 [1]); valid after precompute_scales.
  Tensor scale(int unit, int slot) const;

  struct Pending {
    int unit = -1;
    Tensor wire;  // u8 [world * packed_bytes_per_rank]
    DType hp_dtype = DType::F32;
    WorkPtr work;
  };
  Pending start(int unit, const Tensor& shard, const Comm& comm) const;
  // After p.work completed: the other slots' elements into hp_full (the unit's flat buffer
  // [flat_numel] in the shard's dtype; the tail padding is zeroed, the fp8 slots' parts are
  // not written) and one Fp8Tensor per slot (empty for slots that are not fp8 weights).
  std::vector<Fp8Tensor> finish(const Pending& p, const Tensor& hp_full) const;
  // start + wait + finish; hp_full may be undefined when every slot is an fp8 weight.
  std::vector<Fp8Tensor> gather(int unit, const Tensor& shard, const Comm& comm,
                                const Tensor& hp_full = Tensor()) const;

 private:
  void init();
  std::vector<FlatLayout> layouts_;
  std::vector<std::vector<int64_t>> index_;  // [unit][slot]: index into the scales, or -1
  int64_t num_fp8_ = 0;
  Tensor scales_, scale_invs_;  // f32 [num_fp8_], on the data's device
};

}  // namespace accel
