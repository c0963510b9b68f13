// Compiled when the build has no CUDA: asking for the CUDA backend says so.
#include <stdexcept>

#include "ops/backend.h"
#include "ops/fp8_scaled_kernels.h"

namespace accel {

Backend& cuda_backend() {
  throw std::runtime_error(
      "[cuda_backend] this build has no CUDA backend: the tensor is on a CUDA device but "
      "accel-train was built without CUDA (rebuild with nvcc installed, or -DACCEL_CUDA=ON)");
}

Fp8ScaledKernels& cuda_fp8_scaled_kernels() {
  throw std::runtime_error(
      "[fp8_cast_scaled / fp8_gemm_scaled] this build has no CUDA backend: the tensor is on a CUDA "
      "device but accel-train was built without CUDA (rebuild with nvcc installed, or "
      "-DACCEL_CUDA=ON)");
}

}  // namespace accel
