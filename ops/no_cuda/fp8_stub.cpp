// Compiled when the build has no CUDA: the fp8 kernels for CUDA tensors say so.
#include <stdexcept>

#include "ops/fp8_kernels.h"

namespace accel::fp8_kernels::cuda {
namespace {
[[noreturn]] void no_cuda(const char* op) {
  throw std::runtime_error(std::string("[") + op +
                           "] this build has no CUDA backend (rebuild with -DACCEL_CUDA=ON)");
}
}  // namespace

void cast(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
          const Tensor&) {
  no_cuda("fp8_cast");
}
void amax(const Tensor&, const Tensor&) { no_cuda("fp8_amax"); }
void scale_from_amax(const Tensor&, const Tensor&, const Tensor&, float, int) {
  no_cuda("fp8_cast_dynamic");
}
void gemm(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) {
  no_cuda("fp8_gemm");
}
void transpose(const Tensor&, const Tensor&) { no_cuda("fp8_with_transpose"); }
void delayed_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, int, bool) {
  no_cuda("fp8_delayed_scaling");
}
void mx_fake_quant(const Tensor&, const Tensor&, DType, int) { no_cuda("fp8_mx_fake_quant"); }
bool fused_cast_layout(const std::vector<const Tensor*>&, int64_t) { return false; }
void swiglu_cast(const Tensor&, const Tensor&, const CastTarget&) { no_cuda("fp8_swiglu_cast"); }
void swiglu_backward_cast(const Tensor&, const Tensor&, const Tensor&, const CastTarget&,
                          const CastTarget&) {
  no_cuda("fp8_swiglu_backward_cast");
}

}  // namespace accel::fp8_kernels::cuda
