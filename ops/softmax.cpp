// softmax and log_softmax: one autograd node each, kernels cpu/softmax.cpp, cuda/softmax.cu.
#include "ops/common.h"

namespace accel {

namespace {
// Moves `dim` last (copying when needed) so a backend can work on contiguous rows.
Tensor dim_last(const Tensor& x, int64_t dim) {
  return dim == x.dim() - 1 ? contiguous(x) : contiguous(transpose(x, dim, -1));
}
}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  detail::check_floating("softmax", x);
  dim = detail::normalize_dim("softmax", dim, x.dim());
  if (dim != x.dim() - 1) return transpose(softmax(dim_last(x, dim), -1), dim, -1);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).softmax(out, xc, false);
  Tensor y = out.detach();
  return record("softmax", out, {xc}, [y](const Tensor& g) {
    return std::vector<Tensor>{mul(y, sub(g, sum(mul(g, y), {-1}, true)))};
  });
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  detail::check_floating("log_softmax", x);
  dim = detail::normalize_dim("log_softmax", dim, x.dim());
  if (dim != x.dim() - 1) return transpose(log_softmax(dim_last(x, dim), -1), dim, -1);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).softmax(out, xc, true);
  Tensor y = out.detach();
  return record("log_softmax", out, {xc}, [y](const Tensor& g) {
    return std::vector<Tensor>{sub(g, mul(exp(y), sum(g, {-1}, true)))};
  });
}

}  // namespace accel
