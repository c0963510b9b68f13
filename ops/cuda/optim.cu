// Optimizer kernels: AdamW (torch.optim.AdamW semantics, decoupled weight decay, bias correction)
// and SGD with momentum. Per-element math in fp32; the step's scalars are computed on the host in
// double.
#include <cmath>

#include "ops/cuda/common.cuh"

namespace accel {
namespace {
using namespace cuda;

struct AdamScalars {
  float lr, beta1, beta2, eps, decay;  // decay = 1 - lr * weight_decay
  float step_size, inv_bias2_sqrt, grad_scale;
};

template <class TP, class TG>
__global__ void adamw_kernel(TP* __restrict__ p, const TG* __restrict__ g, TP* __restrict__ m,
                             TP* __restrict__ v, int64_t n, AdamScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float gr = to_f(g[i]) * s.grad_scale;
    float mi = to_f(m[i]), vi = to_f(v[i]), pi = to_f(p[i]);
    pi *= s.decay;
    mi += (1.0f - s.beta1) * (gr - mi);
    vi = s.beta2 * vi + (1.0f - s.beta2) * gr * gr;
    const float denom = sqrtf(vi) * s.inv_bias2_sqrt + s.eps;
    pi -= s.step_size * mi / denom;
    p[i] = from_f<TP>(pi);
    m[i] = from_f<TP>(mi);
    v[i] = from_f<TP>(vi);
  }
}

// Up to kMultiMax tensors per launch; blockIdx.y picks the tensor, blocks grid-stride over it.
constexpr int kMultiMax = 24;
template <class TP, class TG>
struct AdamMulti {
  TP* p[kMultiMax];
  const TG* g[kMultiMax];
  TP* m[kMultiMax];
  TP* v[kMultiMax];
  int64_t n[kMultiMax];
};

template <class TP, class TG>
__global__ void adamw_multi_kernel(AdamMulti<TP, TG> a, AdamScalars s) {
  const int t = blockIdx.y;
  TP* __restrict__ p = a.p[t];
  const TG* __restrict__ g = a.g[t];
  TP* __restrict__ m = a.m[t];
  TP* __restrict__ v = a.v[t];
  const int64_t n = a.n[t];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float gr = to_f(g[i]) * s.grad_scale;
    float mi = to_f(m[i]), vi = to_f(v[i]), pi = to_f(p[i]);
    pi *= s.decay;
    mi += (1.0f - s.beta1) * (gr - mi);
    vi = s.beta2 * vi + (1.0f - s.beta2) * gr * gr;
    const float denom = sqrtf(vi) * s.inv_bias2_sqrt + s.eps;
    pi -= s.step_size * mi / denom;
    p[i] = from_f<TP>(pi);
    m[i] = from_f<TP>(mi);
    v[i] = from_f<TP>(vi);
  }
}

template <class TP, class TG>
__global__ void sgd_kernel(TP* __restrict__ p, const TG* __restrict__ g, TP* __restrict__ buf,
                           int64_t n, float lr, float momentum, float wd, float grad_scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float pi = to_f(p[i]);
    float d = to_f(g[i]) * grad_scale;
    if (wd != 0.f) d += wd * pi;
    if (momentum != 0.f) {
      const float b = momentum * to_f(buf[i]) + d;
      buf[i] = from_f<TP>(b);
      d = b;
    }
    p[i] = from_f<TP>(pi - lr * d);
  }
}

// Calls f(TP{}, TG{}) for a param dtype and a gradient dtype that is the same or 16-bit under an
// fp32 param.
template <class F>
void dispatch_param_grad(DType tp, DType tg, const char* op, F&& f) {
  dispatch_float(tp, op, [&](auto p) {
    using TP = decltype(p);
    if (tg == tp) {
      f(p, p);
    } else if constexpr (std::is_same_v<TP, float>) {
      if (tg == DType::BF16)
        f(p, __nv_bfloat16{});
      else if (tg == DType::F16)
        f(p, __half{});
      else
        unsupported_dtype(op, tg);
    } else {
      unsupported_dtype(op, tg);
    }
  });
}

void check_state(const char* op, const Tensor& param, const Tensor& grad,
                 std::initializer_list<const Tensor*> state) {
  require_cuda(param, op, "param");
  require_cuda(grad, op, "grad");
  require(param.is_contiguous() && grad.is_contiguous() && grad.numel() == param.numel(), op,
          "param " + param.str() + " and grad " + grad.str() + " must be contiguous and match");
  for (const Tensor* t : state)
    require(t->is_contiguous() && t->numel() == param.numel() && t->dtype() == param.dtype(), op,
            "optimizer state " + t->str() + " must match param " + param.str());
}

AdamScalars adam_scalars(const AdamWParams& p, double grad_scale) {
  const double bias1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bias2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  AdamScalars s;
  s.lr = static_cast<float>(p.lr);
  s.beta1 = static_cast<float>(p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.eps = static_cast<float>(p.eps);
  s.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  s.step_size = static_cast<float>(p.lr / bias1);
  s.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(bias2));
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

void launch_adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamScalars& s, cudaStream_t stream) {
  const int64_t n = param.numel();
  if (n == 0) return;
  dispatch_param_grad(param.dtype(), grad.dtype(), "adamw_step", [&](auto tp, auto tg) {
    using TP = decltype(tp);
    using TG = decltype(tg);
    adamw_kernel<TP, TG><<<grid_for(n, 256, 4), 256, 0, stream>>>(
        static_cast<TP*>(param.data_ptr()), static_cast<const TG*>(grad.data_ptr()),
        static_cast<TP*>(m.data_ptr()), static_cast<TP*>(v.data_ptr()), n, s);
  });
  ACCEL_CUDA_CHECK_LAUNCH("adamw_step");
}

}  // namespace

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const AdamWParams& p, double grad_scale) {
  check_state("adamw_step", param, grad, {&m, &v});
  if (p.step < 1) throw std::invalid_argument("[adamw_step] step must be >= 1 (it is 1-based)");
  OpScope sc(param);
  launch_adamw(param, grad, m, v, adam_scalars(p, grad_scale), sc.stream);
}

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                           double momentum, double weight_decay, double grad_scale) {
  check_state("sgd_step", param, grad, {});
  if (momentum != 0.0)
    require(buf.defined() && buf.is_contiguous() && buf.numel() == param.numel() &&
                buf.dtype() == param.dtype(),
            "sgd_step", "momentum buffer must match param " + param.str());
  const int64_t n = param.numel();
  if (n == 0) return;
  OpScope sc(param);
  dispatch_param_grad(param.dtype(), grad.dtype(), "sgd_step", [&](auto tp, auto tg) {
    using TP = decltype(tp);
    using TG = decltype(tg);
    sgd_kernel<TP, TG><<<grid_for(n, 256, 4), 256, 0, sc.stream>>>(
        static_cast<TP*>(param.data_ptr()), static_cast<const TG*>(grad.data_ptr()),
        momentum != 0.0 ? static_cast<TP*>(buf.data_ptr()) : nullptr, n, static_cast<float>(lr),
        static_cast<float>(momentum), static_cast<float>(weight_decay),
        static_cast<float>(grad_scale));
  });
  ACCEL_CUDA_CHECK_LAUNCH("sgd_step");
}

namespace cuda {
void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                      const AdamWParams& p, double grad_scale) {
  if (grads.size() != params.size() || ms.size() != params.size() || vs.size() != params.size())
    throw std::invalid_argument("[adamw_step_multi] params, grads, m and v lists differ in length");
  if (params.empty()) return;
  if (p.step < 1) throw std::invalid_argument("[adamw_step] step must be >= 1 (it is 1-based)");
  OpScope sc(params[0]);
  const AdamScalars s = adam_scalars(p, grad_scale);
  for (size_t i = 0; i < params.size(); ++i) {
    check_state("adamw_step", params[i], grads[i], {&ms[i], &vs[i]});
    require(params[i].device() == params[0].device(), "adamw_step", "tensors on different devices");
  }
  // Group tensors by (param dtype, grad dtype); each group goes in launches of kMultiMax.
  std::vector<bool> done(params.size(), false);
  for (size_t first = 0; first < params.size(); ++first) {
    if (done[first]) continue;
    const DType tp = params[first].dtype(), tg = grads[first].dtype();
    std::vector<size_t> group;
    for (size_t i = first; i < params.size(); ++i)
      if (!done[i] && params[i].dtype() == tp && grads[i].dtype() == tg) {
        done[i] = true;
        if (params[i].numel() > 0) group.push_back(i);
      }
    dispatch_param_grad(tp, tg, "adamw_step", [&](auto tpv, auto tgv) {
      using TP = decltype(tpv);
      using TG = decltype(tgv);
      for (size_t b = 0; b < group.size(); b += kMultiMax) {
        AdamMulti<TP, TG> a{};
        int count = 0;
        int64_t largest = 0;
        for (size_t k = b; k < group.size() && count < kMultiMax; ++k, ++count) {
          const size_t i = group[k];
          a.p[count] = static_cast<TP*>(params[i].data_ptr());
          a.g[count] = static_cast<const TG*>(grads[i].data_ptr());
          a.m[count] = static_cast<TP*>(ms[i].data_ptr());
          a.v[count] = static_cast<TP*>(vs[i].data_ptr());
          a.n[count] = params[i].numel();
          largest = std::max(largest, a.n[count]);
        }
        const int bx = static_cast<int>(std::min<int64_t>((largest + 255) / 256, sm_count() * 8));
        adamw_multi_kernel<TP, TG><<<dim3(bx, count), 256, 0, sc.stream>>>(a, s);
        ACCEL_CUDA_CHECK_LAUNCH("adamw_step_multi");
      }
    });
  }
}
}  // namespace cuda

}  // namespace accel
