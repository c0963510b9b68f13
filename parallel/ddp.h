// DDP (distributed_type MULTI_GPU or MULTI_CPU): every rank keeps the whole model and optimizer.
//
// - setup: the parameters are broadcast from rank 0 (so every rank starts from rank 0's weights)
//   and laid out in gradient buckets of at most distributed.ddp_bucket_cap_mb, in reverse
//   registration order (the order their gradients arrive in backward); each parameter's .grad is
//   a view of its bucket, so autograd accumulates in place (no copy into the bucket).
// - backward of the last micro-batch: a grad-ready hook marks each parameter; a complete bucket
//   is all-reduced (average) asynchronously while backward continues, buckets strictly in order;
//   end_micro_batch waits for them. Earlier micro-batches of the step only accumulate.
// - a parameter without a gradient is an error naming it, or with
//   distributed.find_unused_parameters its bucket slot (zeros) is reduced as is.
// - step: global norm (no communication: the gradients are replicated), clipping, AdamW on fp32
//   master weights, refresh of the 16-bit compute copies.
//
// It is stage 0 of the engine in parallel/zero.h, and so is the single process.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "parallel/zero.h"

namespace accel {

class DdpStrategy : public FlatDataParallel {
 public:
  // param_filter: DataParallelOptions::param_filter (expert parallelism's two engines).
  DdpStrategy(std::shared_ptr<ProcessGroup> pg, DType compute_dtype, double bucket_cap_mb = 25,
              bool find_unused_parameters = false,
              std::function<bool(const std::string&)> param_filter = {});
};

// distributed_type NO: the same engine at stage 0 over one rank (no process group, so every
// collective is skipped), with each parameter's own autograd gradient instead of flat buckets
// (DataParallelOptions::flat_grads): no gradient memory between steps and no zeroing pass. fp32
// master weights and optimizer state for every parameter; with a 16-bit compute dtype the model
// holds compute copies that the optimizer writes in its update. Checkpoints as before the engine
// took it over: optimizer state keyed by parameter names and no manifest.
class SingleProcessStrategy : public FlatDataParallel {
 public:
  explicit SingleProcessStrategy(DType compute_dtype);
  std::string name() const override { return "single"; }
  nlohmann::json checkpoint_manifest() const override;
};

}  // namespace accel
