// The CUDA backend object. Its methods live in the kernel files named after the ops.
#include "ops/cuda/cuda_backend.h"

namespace accel {

Backend& cuda_backend() {
  static CudaBackend backend;
  return backend;
}

}  // namespace accel
