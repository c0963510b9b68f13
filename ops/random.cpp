#include "ops/common.h"

namespace accel {

Tensor rand_uniform(const Shape& shape, uint64_t seed, uint64_t offset, DType dtype, Device device,
                    double low, double high) {
  if (!is_floating(dtype)) detail::op_error("rand_uniform", "needs a floating dtype");
  Tensor out = Tensor::empty(shape, dtype, device);
  backend_for(device).rand_uniform(out, seed, offset, low, high);
  return out;
}

Tensor rand_normal(const Shape& shape, uint64_t seed, uint64_t offset, DType dtype, Device device,
                   double mean, double stddev) {
  if (!is_floating(dtype)) detail::op_error("rand_normal", "needs a floating dtype");
  Tensor out = Tensor::empty(shape, dtype, device);
  backend_for(device).rand_normal(out, seed, offset, mean, stddev);
  return out;
}

}  // namespace accel
