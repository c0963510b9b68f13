// rope: the backward is the inverse rotation (kernels cpu/rope.cpp, cuda/rope.cu).
#include "ops/common.h"

namespace accel {
using detail::op_error;

Tensor rope(const Tensor& x, double theta, int64_t position_offset) {
  detail::check_floating("rope", x);
  if (x.dim() != 4 || x.size(3) % 2 != 0)
    op_error("rope", "input must be [B, S, H, D] with D even, got " + x.str());
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).rope(out, xc, theta, position_offset, false);
  return record("rope", out, {xc}, [theta, position_offset](const Tensor& g) {
    Tensor gi = Tensor::empty(g.shape(), g.dtype(), g.device());
    backend_for(g.device()).rope(gi, contiguous(g), theta, position_offset, true);
    return std::vector<Tensor>{gi};
  });
}

}  // namespace accel
