// FSDP (distributed_type FSDP, fsdp_config.fsdp_version 2) on the shared data-parallel core:
// parameters, gradients and optimizer state sharded over the ranks; each unit (by
// fsdp_auto_wrap_policy) is all-gathered in one collective before its forward and again for its
// backward (the next unit prefetched), released after use when fsdp_reshard_after_forward, and its
// gradients reduce-scattered (in fp32 when computing in 16 bits) as soon as they are complete.
//
// The engine is FlatDataParallel at stage 3 (parallel/zero.h); what FSDP adds is the unit choice,
// the reshard/reduce-dtype/offload options and its state dict types. The layout is the shared
// FlatLayout (one contiguous chunk per rank of each unit's flat buffer), not FSDP2's per-parameter
// dim-0 chunks; docs/parallel.md ("## FSDP2") says why and what differs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "parallel/zero.h"

namespace accel {

struct Config;

struct FsdpOptions {
  DType compute_dtype = DType::F32;
  std::string auto_wrap_policy = "TRANSFORMER_BASED_WRAP";  // | SIZE_BASED_WRAP | NO_WRAP
  std::vector<std::string> layer_cls_to_wrap = {"LlamaDecoderLayer"};
  int64_t min_num_params = 100000000;
  bool reshard_after_forward = true;
  bool offload_params = false;  // sharded params, master weights and Adam state on the host
  std::string state_dict_type = "SHARDED_STATE_DICT";  // | FULL_STATE_DICT
  bool find_unused_parameters = false;

  // From fsdp_config (and mixed_precision); bad values throw naming the key.
  static FsdpOptions from_config(const Config& cfg, DType compute_dtype);
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

class FsdpStrategy : public FlatDataParallel {
 public:
  FsdpStrategy(std::shared_ptr<ProcessGroup> pg, FsdpOptions options);
  std::string name() const override { return "fsdp"; }
  // FULL_STATE_DICT: the fp32 weights gathered (every rank calls; the trainer writes rank 0's as
  // Hugging Face model.safetensors). SHARDED_STATE_DICT: none; the checkpoint is the per-rank
  // shards (optimizer.rank<R>.safetensors: group<i>.master/.exp_avg/.exp_avg_sq) plus the
  // manifest, which accel-checkpoint consolidate turns into full weights.
  std::vector<std::pair<std::string, Tensor>> full_state_dict() override;
  nlohmann::json checkpoint_manifest() const override;
  const FsdpOptions& fsdp_options() const { return fsdp_; }

 private:
  FsdpOptions fsdp_;
};

// fp8 all-gather (fp8_config.enable_fsdp_float8_all_gather; torchao's tensorwise dynamic
// scaling, ALGORITHMS.md 3.7) for the fp8 weights [out, in] of a set of units, each unit's weights
// laid out by a FlatLayout over the ranks (rank r holds the contiguous chunk r of it, in the
// weights' high-precision dtype).
//   precompute_scales(shards)  after each optimizer step: every weight's max|w| over this rank's
//                              chunks -> one f32 vector for ALL weights of all units -> ONE MAX
//                              all-reduce -> scale_i = 448 / amax_i (fp8_scale_for_amax)
//   gather(u, shard)           casts unit u's chunk to e4m3 with those global scales, all-gathers
//                              the fp8 bytes (1 byte per element on the wire), and returns each
//                              weight as an Fp8Tensor (row-major data padded to multiples of 16)
//                              that the fp8 linear uses as is (Fp8LinearContext::weight_provider)
// The cast is elementwise with a scale that every rank shares, so the result is bit-identical to
// all-gathering the high-precision weight and casting it with fp8_cast_dynamic.
class Fp8AllGather {
 public:
  Fp8AllGather(const std::vector<std::vector<Parameter*>>& unit_weights, int world);
  int num_units() const { return static_cast<int>(layouts_.size()); }
  const FlatLayout& layout(int unit) const { return layouts_.at(unit); }
  // shards[u]: this rank's chunk [shard_numel] of unit u (any float dtype).
  void precompute_scales(const std::vector<Tensor>& shards, const Comm& comm);
  // scale of weight `slot` of unit u (f32 [1]); valid after precompute_scales.
  Tensor scale(int unit, int slot) const;
  std::vector<Fp8Tensor> gather(int unit, const Tensor& shard, const Comm& comm) const;

 private:
  std::vector<FlatLayout> layouts_;
  std::vector<int64_t> first_;  // index of unit u's first weight in scales_
  Tensor scales_;               // f32 [total weights], host
};

}  // namespace accel
