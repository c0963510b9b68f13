// adamw_step, adamw_step_multi, sgd_step: state checks, then the kernels (cpu/optim.cpp,
// cuda/optim.cu). The Optimizer class over them is optimizer.cpp.
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

// bf16 params are the master weights themselves: their update is stochastically rounded, and
// only theirs.
void check_rounding(const char* op, const Tensor& param, const StochasticRounding* rounding) {
  if (param.dtype() == DType::BF16 && !rounding)
    detail::op_error(op, "bf16 param " + param.str() +
                             " is a master weight: its update needs stochastic rounding (a seed)");
  if (param.dtype() != DType::BF16 && rounding)
    detail::op_error(op, "stochastic rounding is for bf16 params, not " + param.str());
}
}  // namespace

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWParams& p, double grad_scale, const StochasticRounding* rounding) {
  check_state("adamw_step", param, grad, m);
  check_state("adamw_step", param, grad, v);
  check_rounding("adamw_step", param, rounding);
  backend_for(param.device()).adamw_step(param, grad, m, v, p, grad_scale, rounding);
}

void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                      const AdamWParams& p, double grad_scale,
                      const std::vector<Tensor>& compute_copies,
                      const std::vector<StochasticRounding>& rounding) {
  const char* op = "adamw_step_multi";
  const size_t n = params.size();
  if (grads.size() != n || ms.size() != n || vs.size() != n ||
      (!compute_copies.empty() && compute_copies.size() != n) ||
      (!rounding.empty() && rounding.size() != n))
    detail::op_error(op, std::to_string(n) + " params, " + std::to_string(grads.size()) +
                             " grads, " + std::to_string(ms.size()) + " exp_avg, " +
                             std::to_string(vs.size()) + " exp_avg_sq, " +
                             std::to_string(compute_copies.size()) + " compute copies and " +
                             std::to_string(rounding.size()) +
                             " roundings: the lists must have one entry per param "
                             "(compute copies and roundings may be empty)");
  if (n == 0) return;
  for (size_t i = 0; i < n; ++i) {
    if (!params[i].defined() || !grads[i].defined() || !ms[i].defined() || !vs[i].defined())
      detail::op_error(op, "entry " + std::to_string(i) +
                               " has an undefined param, grad or moment (leave it out instead)");
    check_state(op, params[i], grads[i], ms[i]);
    check_state(op, params[i], grads[i], vs[i]);
    check_rounding(op, params[i],
                   !rounding.empty() && params[i].dtype() == DType::BF16 ? &rounding[i] : nullptr);
    detail::check_same_device(op, params[0], params[i]);
    if (compute_copies.empty()) continue;
    const Tensor& c = compute_copies[i];
    if (!c.defined() || c.shape() != params[i].shape() || !c.is_contiguous())
      detail::op_error(op, "compute copy " + (c.defined() ? c.str() : std::string("(undefined)")) +
                               " of param " + params[i].str() +
                               " must be defined, contiguous and of the param's shape");
    if (c.dtype() != DType::BF16 && c.dtype() != DType::F16)
      detail::op_error(op, "compute copy " + c.str() + " must be bf16 or f16");
    if (params[i].dtype() != DType::F32)
      detail::op_error(op, "compute copies need f32 params, not " + params[i].str());
    detail::check_same_device(op, params[i], c);
  }
  backend_for(params[0].device())
      .adamw_step_multi(params, grads, ms, vs, compute_copies, p, grad_scale, rounding);
}

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
              double momentum, double weight_decay, double grad_scale,
              const StochasticRounding* rounding) {
  check_state("sgd_step", param, grad, buf);
  check_rounding("sgd_step", param, rounding);
  backend_for(param.device())
      .sgd_step(param, grad, buf, lr, momentum, weight_decay, grad_scale, rounding);
}

}  // namespace accel
