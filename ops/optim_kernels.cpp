#include "ops/common.h"

namespace accel {

namespace {
void check_state(const char* op, const Tensor& param, const Tensor& grad, const Tensor& state) {
  if (grad.shape() != param.shape() || state.shape() != param.shape())
    detail::op_error(op, "param " + param.str() + ", grad " + grad.str() + " and state " +
                             state.str() + " must have the same shape");
  if (!param.is_contiguous() || !grad.is_contiguous() || !state.is_contiguous())
    detail::op_error(op, "param, grad and state must be contiguous");
  detail::check_same_device(op, param, grad);
  detail::check_same_device(op, param, state);
}
}  // namespace

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWParams& p, double grad_scale) {
  check_state("adamw_step", param, grad, m);
  check_state("adamw_step", param, grad, v);
  backend_for(param.device()).adamw_step(param, grad, m, v, p, grad_scale);
}

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
              double momentum, double weight_decay, double grad_scale) {
  check_state("sgd_step", param, grad, buf);
  backend_for(param.device()).sgd_step(param, grad, buf, lr, momentum, weight_decay, grad_scale);
}

double sum_of_squares(const std::vector<Tensor>& xs) {
  if (xs.empty()) return 0.0;
  return backend_for(xs[0].device()).sum_of_squares(xs);
}

bool has_non_finite(const Tensor& x) { return backend_for(x.device()).has_non_finite(x); }

}  // namespace accel
