// What the CUDA micro-benchmarks share: event timing and random device tensors.
#pragma once

#ifdef ACCEL_WITH_CUDA
#include <functional>

#include "ops/backend.h"
#include "runtime/cuda/context.h"
#include "runtime/tensor.h"

namespace accel::bench {

inline int g_iters = 20;  // timed calls per measurement (--iters N)

// Mean milliseconds of one call of f over g_iters calls after 3 untimed ones (CUDA events on the
// current stream, so host overheads hidden behind queued work do not count).
inline double time_ms(const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  cuda::Event start, stop;
  start.record();
  for (int i = 0; i < g_iters; ++i) f();
  stop.record();
  stop.synchronize();
  return start.elapsed_ms(stop) / g_iters;
}

// A tensor of normal(0, std) values on GPU 0, the same values every run.
inline Tensor randn(const Shape& s, DType t, double std = 1.0) {
  Tensor x = Tensor::empty(s, t, Device::cuda(0));
  cuda_backend().rand_normal(x, 1234, 0, 0.0, std);
  return x;
}

}  // namespace accel::bench
#endif
