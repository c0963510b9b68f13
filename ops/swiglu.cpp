// swiglu(gate, up) = silu(gate) * up, one node with a fused backward (kernels cpu/swiglu.cpp,
// cuda/swiglu.cu).
#include "ops/common.h"

namespace accel {
using detail::op_error;

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  detail::check_floating("swiglu", gate);
  detail::check_same_device("swiglu", gate, up);
  detail::check_same_dtype("swiglu", gate, up);
  if (gate.shape() != up.shape())
    op_error("swiglu",
             "gate " + shape_str(gate.shape()) + " and up " + shape_str(up.shape()) + " differ");
  Tensor gc = contiguous(gate), uc = contiguous(up);
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  backend_for(gate.device()).swiglu(out, gc, uc);
  return record("swiglu", out, {gc, uc}, [gc, uc](const Tensor& g) {
    Tensor gg = Tensor::empty(gc.shape(), gc.dtype(), gc.device());
    Tensor gu = Tensor::empty(uc.shape(), uc.dtype(), uc.device());
    backend_for(gc.device()).swiglu_backward(gg, gu, contiguous(g), gc.detach(), uc.detach());
    return std::vector<Tensor>{gg, gu};
  });
}

}  // namespace accel
