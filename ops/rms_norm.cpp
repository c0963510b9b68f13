// rms_norm and add_rms_norm (the residual add fused in): one fused backward (kernels
// cpu/rms_norm.cpp, cuda/rms_norm.cu).
#include <utility>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {
void check_rms_norm_args(const char* op, const Tensor& x, const Tensor& weight) {
  detail::check_floating(op, x);
  detail::check_same_device(op, x, weight);
  detail::check_same_dtype(op, x, weight);
  if (weight.dim() != 1 || x.dim() < 1 || x.size(-1) != weight.size(0))
    op_error(op, "weight " + shape_str(weight.shape()) + " does not match the last dim of " +
                     shape_str(x.shape()));
}

Tensor new_rstd(const Tensor& x, int64_t d) {
  const int64_t rows = d ? x.numel() / d : 0;
  return Tensor::empty({rows}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
}

// Records rms_norm's node on `out` (inputs xc, wc contiguous). Its backward folds the gradient
// that xc has accumulated so far (the residual stream's, in a Llama block) into the same kernel.
Tensor record_rms_norm(Tensor out, const Tensor& xc, const Tensor& wc, const Tensor& rstd) {
  return record_folding("rms_norm", std::move(out), {xc, wc}, 0,
                        [xc, wc, rstd](const Tensor& g, const Tensor& pending) {
                          Tensor gx = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
                          Tensor gw = Tensor::empty(wc.shape(), wc.dtype(), wc.device());
                          backend_for(xc.device())
                              .rms_norm_backward(gx, gw, contiguous(g), xc.detach(), wc.detach(),
                                                 rstd, pending);
                          return std::vector<Tensor>{gx, gw};
                        });
}
}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", x, weight);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = new_rstd(x, weight.size(0));
  Tensor wc = contiguous(weight);
  backend_for(x.device()).rms_norm(out, rstd, xc, wc, eps);
  return record_rms_norm(out, xc, wc, rstd);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& weight,
                                       double eps) {
  check_rms_norm_args("add_rms_norm", x, weight);
  detail::check_same_device("add_rms_norm", x, r);
  detail::check_same_dtype("add_rms_norm", x, r);
  if (x.shape() != r.shape())
    op_error("add_rms_norm", "x " + shape_str(x.shape()) + " and r " + shape_str(r.shape()) +
                                 " must have one shape (no broadcasting)");
  // Plain copies (not recorded): the add node's inputs are x and r themselves, as add's are.
  Tensor xc = x.is_contiguous() ? x : x.clone(), rc = r.is_contiguous() ? r : r.clone();
  Tensor sum = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = new_rstd(x, weight.size(0));
  Tensor wc = contiguous(weight);
  backend_for(x.device()).add_rms_norm(sum, out, rstd, xc, rc, wc, eps);
  // The same two nodes as add then rms_norm record, so the gradients are identical.
  sum = record("add", sum, {x, r}, [](const Tensor& g) { return std::vector<Tensor>{g, g}; });
  return {sum, record_rms_norm(out, sum, wc, rstd)};
}

}  // namespace accel
