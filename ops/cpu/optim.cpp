// Optimizer kernels. AdamW and SGD follow torch.optim's single-tensor
// code path operation by operation (each torch op rounds to the parameter dtype, and so do we).
// bf16 master weights take the element math of ops/optim_math.h instead, shared with the CUDA
// kernels (this file is compiled with -ffp-contract=off for it) and stochastically rounded.
#include <cmath>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"
#include "ops/optim_math.h"

namespace accel {
namespace {
using namespace cpu;

// Calls f(param traits, grad traits): param f32 or f64; grad the param's dtype or, for an f32
// param, bf16/f16.
template <class F>
void dispatch_param_grad(const char* op, const Tensor& param, const Tensor& grad, F&& f) {
  auto with_grad = [&](auto tr_p) {
    using TrP = decltype(tr_p);
    switch (grad.dtype()) {
      case DType::F32:
        if constexpr (std::is_same_v<typename TrP::C, float>) return f(tr_p, Traits<DType::F32>{});
        break;
      case DType::F64:
        if constexpr (std::is_same_v<typename TrP::C, double>) return f(tr_p, Traits<DType::F64>{});
        break;
      case DType::BF16:
        if constexpr (std::is_same_v<typename TrP::C, float>) return f(tr_p, Traits<DType::BF16>{});
        break;
      case DType::F16:
        if constexpr (std::is_same_v<typename TrP::C, float>) return f(tr_p, Traits<DType::F16>{});
        break;
      default:
        break;
    }
    throw std::invalid_argument(std::string("[") + op + "] gradient " + grad.str() +
                                " does not fit parameter " + param.str() +
                                " (f32 params take f32/bf16/f16 gradients, f64 params f64)");
  };
  if (param.dtype() == DType::F32)
    with_grad(Traits<DType::F32>{});
  else if (param.dtype() == DType::F64)
    with_grad(Traits<DType::F64>{});
  else
    throw std::invalid_argument(std::string("[") + op + "] parameter " + param.str() +
                                " must be f32 or f64 (keep fp32 master weights)");
}

void check_state(const char* op, const Tensor& param, const Tensor& grad, const Tensor& state) {
  if (!state.defined()) return;
  const bool dtype_ok = state.dtype() == param.dtype() ||
                        (state.dtype() == DType::BF16 && param.dtype() == DType::F32) ||
                        (state.dtype() == DType::F32 && param.dtype() == DType::BF16);
  if (!dtype_ok || state.shape() != param.shape() || !state.is_contiguous() ||
      !param.is_contiguous() || !grad.is_contiguous() || grad.shape() != param.shape())
    throw std::invalid_argument(std::string("[") + op + "] param " + param.str() + ", grad " +
                                grad.str() + " and state " + state.str() +
                                " must be contiguous with one shape (state in the param dtype, "
                                "bf16 beside an f32 param or f32 beside a bf16 param)");
}

// bf16 master weights: calls f(grad traits, state traits) for a bf16 or f32 grad and an f32 or
// bf16 state (f32 when `state` is undefined: SGD without momentum).
template <class F>
void dispatch_bf16_master(const char* op, const Tensor& grad, const Tensor& state, F&& f) {
  auto with_state = [&](auto tr_g) {
    if (state.defined() && state.dtype() == DType::BF16) return f(tr_g, Traits<DType::BF16>{});
    f(tr_g, Traits<DType::F32>{});
  };
  if (grad.dtype() == DType::BF16) return with_state(Traits<DType::BF16>{});
  if (grad.dtype() == DType::F32) return with_state(Traits<DType::F32>{});
  throw std::invalid_argument(std::string("[") + op + "] gradient " + grad.str() +
                              " does not fit a bf16 master weight (bf16 or f32 gradients)");
}

void adamw_bf16_master(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const AdamWParams& p, double grad_scale, const StochasticRounding& r) {
  const optim_math::AdamScalars s = optim_math::adam_scalars(p, grad_scale);
  dispatch_bf16_master("adamw_step", grad, m, [&](auto tr_g, auto tr_s) {
    using TrG = decltype(tr_g);
    using TrS = decltype(tr_s);
    using TrP = Traits<DType::BF16>;
    auto* pp = ptr<TrP>(param);
    const auto* gp = ptr<TrG>(grad);
    auto* mp = ptr<TrS>(m);
    auto* vp = ptr<TrS>(v);
    parallel_for(param.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float mi = TrS::load(mp[i]), vi = TrS::load(vp[i]);
        const float pi = optim_math::adamw_element(TrG::load(gp[i]), TrP::load(pp[i]), mi, vi, s);
        pp[i] = optim_math::stochastic_bf16(pi, r, i);
        mp[i] = TrS::store(mi);
        vp[i] = TrS::store(vi);
      }
    });
  });
}

void sgd_bf16_master(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                     double momentum, double weight_decay, double grad_scale,
                     const StochasticRounding& r) {
  const bool use_mom = momentum != 0.0;
  dispatch_bf16_master("sgd_step", grad, use_mom ? buf : Tensor(), [&](auto tr_g, auto tr_s) {
    using TrG = decltype(tr_g);
    using TrS = decltype(tr_s);
    using TrP = Traits<DType::BF16>;
    auto* pp = ptr<TrP>(param);
    const auto* gp = ptr<TrG>(grad);
    auto* bp = use_mom ? ptr<TrS>(buf) : nullptr;
    const float lr_f = static_cast<float>(lr), mom = static_cast<float>(momentum),
                wd = static_cast<float>(weight_decay), gs = static_cast<float>(grad_scale);
    parallel_for(param.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float bi = use_mom ? TrS::load(bp[i]) : 0.f;
        const float pi =
            optim_math::sgd_element(TrG::load(gp[i]), TrP::load(pp[i]), bi, lr_f, mom, wd, gs);
        pp[i] = optim_math::stochastic_bf16(pi, r, i);
        if (use_mom) bp[i] = TrS::store(bi);
      }
    });
  });
}

// Calls f(state traits): the param's own traits, or bf16's for bf16 state beside an f32 param.
template <class TrP, class F>
void dispatch_state(const Tensor& state, F&& f) {
  if constexpr (std::is_same_v<typename TrP::C, float>)
    if (state.defined() && state.dtype() == DType::BF16) return f(Traits<DType::BF16>{});
  f(TrP{});
}

}  // namespace

void CpuBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                            const Tensor& v, const AdamWParams& p, double grad_scale,
                            const StochasticRounding* rounding) {
  if (!m.defined() || !v.defined())
    throw std::invalid_argument("[adamw_step] moment tensors must be defined");
  check_state("adamw_step", param, grad, m);
  check_state("adamw_step", param, grad, v);
  if (p.step < 1)
    throw std::invalid_argument("[adamw_step] step is 1-based, got " + std::to_string(p.step));
  if (m.dtype() != v.dtype())
    throw std::invalid_argument("[adamw_step] exp_avg " + m.str() + " and exp_avg_sq " + v.str() +
                                " must have one dtype");
  if (param.dtype() == DType::BF16) {
    if (!rounding) throw std::invalid_argument("[adamw_step] a bf16 param needs its rounding");
    return adamw_bf16_master(param, grad, m, v, p, grad_scale, *rounding);
  }
  dispatch_param_grad("adamw_step", param, grad, [&](auto tr_p, auto tr_g) {
    using TrP = decltype(tr_p);
    using TrG = decltype(tr_g);
    using T = typename TrP::C;
    // Scalars as torch computes them in Python (double), then used as the tensor's dtype.
    const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
    const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
    const T decay = static_cast<T>(1.0 - p.lr * p.weight_decay);
    const T w1 = static_cast<T>(1.0 - p.beta1);
    const T b2 = static_cast<T>(p.beta2);
    const T w2 = static_cast<T>(1.0 - p.beta2);
    const T neg_step = static_cast<T>(-(p.lr / bc1));
    const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
    const T eps = static_cast<T>(p.eps);
    const T gs = static_cast<T>(grad_scale);
    const bool scale_grad = grad_scale != 1.0;
    T* pp = ptr<TrP>(param);
    const auto* gp = ptr<TrG>(grad);
    dispatch_state<TrP>(m, [&](auto tr_s) {
      using TrS = decltype(tr_s);
      // State in the param dtype: the stores are exact and this is torch's op-by-op rounding.
      // bf16 state: the moments are computed in T (fp32), used unrounded for this step's update
      // and stored rounded to nearest even.
      auto* mp = ptr<TrS>(m);
      auto* vp = ptr<TrS>(v);
      parallel_for(param.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          T g = static_cast<T>(TrG::load(gp[i]));
          if (scale_grad) g *= gs;
          T mi = static_cast<T>(TrS::load(mp[i])), vi = static_cast<T>(TrS::load(vp[i]));
          pp[i] *= decay;  // param.mul_(1 - lr * weight_decay)
          // exp_avg.lerp_(grad, 1 - beta1), torch's lerp formula for weight < 0.5
          mi = w1 < T(0.5) ? mi + w1 * (g - mi) : g - (g - mi) * (T(1) - w1);
          vi *= b2;          // exp_avg_sq.mul_(beta2)
          vi += w2 * g * g;  // .addcmul_(grad, grad, value=1 - beta2)
          const T denom = std::sqrt(vi) / bc2_sqrt + eps;
          pp[i] += neg_step * mi / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
          mp[i] = TrS::store(mi);
          vp[i] = TrS::store(vi);
        }
      });
    });
  });
}

void CpuBackend::adamw_step_multi(const std::vector<Tensor>& params,
                                  const std::vector<Tensor>& grads, const std::vector<Tensor>& ms,
                                  const std::vector<Tensor>& vs,
                                  const std::vector<Tensor>& compute_copies, const AdamWParams& p,
                                  double grad_scale,
                                  const std::vector<StochasticRounding>& rounding) {
  // The per-tensor kernel, then copy_'s rounding: the same numbers as the two separate passes.
  for (size_t i = 0; i < params.size(); ++i) {
    adamw_step(params[i], grads[i], ms[i], vs[i], p, grad_scale,
               rounding.empty() ? nullptr : &rounding[i]);
    if (!compute_copies.empty()) compute_copies[i].copy_(params[i]);
  }
}

void CpuBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                          double momentum, double weight_decay, double grad_scale,
                          const StochasticRounding* rounding) {
  check_state("sgd_step", param, grad, buf);
  if (momentum != 0.0 && !buf.defined())
    throw std::invalid_argument("[sgd_step] momentum " + std::to_string(momentum) +
                                " needs a (zero-initialised) momentum buffer");
  if (param.dtype() == DType::BF16) {
    if (!rounding) throw std::invalid_argument("[sgd_step] a bf16 param needs its rounding");
    return sgd_bf16_master(param, grad, buf, lr, momentum, weight_decay, grad_scale, *rounding);
  }
  dispatch_param_grad("sgd_step", param, grad, [&](auto tr_p, auto tr_g) {
    using TrP = decltype(tr_p);
    using TrG = decltype(tr_g);
    using T = typename TrP::C;
    const T wd = static_cast<T>(weight_decay), mom = static_cast<T>(momentum);
    const T neg_lr = static_cast<T>(-lr), gs = static_cast<T>(grad_scale);
    const bool use_wd = weight_decay != 0.0, use_mom = momentum != 0.0,
               scale_grad = grad_scale != 1.0;
    T* pp = ptr<TrP>(param);
    const auto* gp = ptr<TrG>(grad);
    dispatch_state<TrP>(buf, [&](auto tr_s) {
      using TrS = decltype(tr_s);
      auto* bp = use_mom ? ptr<TrS>(buf) : nullptr;
      parallel_for(param.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          T d = static_cast<T>(TrG::load(gp[i]));
          if (scale_grad) d *= gs;
          if (use_wd) d += wd * pp[i];  // grad.add(param, alpha=weight_decay)
          if (use_mom) {
            // buf.mul_(momentum).add_(d); a zero buffer gives torch's first step (buf = grad).
            // bf16 buffer: the update uses the fp32 value, the buffer keeps it rounded.
            d = static_cast<T>(TrS::load(bp[i])) * mom + d;
            bp[i] = TrS::store(d);
          }
          pp[i] += neg_lr * d;  // param.add_(d_p, alpha=-lr)
        }
      });
    });
  });
}

}  // namespace accel
