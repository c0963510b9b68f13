#include "parallel/ddp.h"

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
}  // namespace

DdpStrategy::DdpStrategy(std::shared_ptr<ProcessGroup> pg, DType compute_dtype,
                         double bucket_cap_mb, bool find_unused_parameters)
    : FlatDataParallel(std::move(pg),
                       ddp_options(compute_dtype, bucket_cap_mb, find_unused_parameters)) {}

}  // namespace accel
