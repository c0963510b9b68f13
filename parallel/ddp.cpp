#include "parallel/ddp.h"

#include <nlohmann/json.hpp>

namespace accel {

namespace {
DataParallelOptions ddp_options(DType compute_dtype, double bucket_cap_mb, bool find_unused) {
  DataParallelOptions o;
  o.zero_stage = 0;
  o.compute_dtype = compute_dtype;
  o.bucket_cap_mb = bucket_cap_mb;
  o.find_unused_parameters = find_unused;
  return o;
}

// Without collectives the buckets only cut the compute and master buffers; 25 MB bounds the
// fp32 copy setup holds besides the model's own fp32 weights to one bucket.
DataParallelOptions single_options(DType compute_dtype) {
  DataParallelOptions o = ddp_options(compute_dtype, 25, false);
  o.flat_grads = false;
  return o;
}
}  // namespace

DdpStrategy::DdpStrategy(std::shared_ptr<ProcessGroup> pg, DType compute_dtype,
                         double bucket_cap_mb, bool find_unused_parameters,
                         std::function<bool(const std::string&)> param_filter)
    : FlatDataParallel(std::move(pg), [&] {
        DataParallelOptions o = ddp_options(compute_dtype, bucket_cap_mb, find_unused_parameters);
        o.param_filter = std::move(param_filter);
        return o;
      }()) {}

SingleProcessStrategy::SingleProcessStrategy(DType compute_dtype)
    : FlatDataParallel(nullptr, single_options(compute_dtype)) {}

// None, as before the engine ran the single process: its state is keyed by parameter names, so
// there is no shard layout for a resume to check.
nlohmann::json SingleProcessStrategy::checkpoint_manifest() const {
  return Strategy::checkpoint_manifest();
}

}  // namespace accel
