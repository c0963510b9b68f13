// swiglu(gate, up) = silu(gate) * up and its backward, 16 bytes per access (silu_for and
// sigmoid_for: common.cuh); silu rounded to the activation dtype where Hugging Face's Llama
// rounds it.
#include "ops/cuda/common.cuh"
#include "ops/cuda/vec.cuh"

namespace accel {
namespace {
using namespace cuda;

constexpr int kThreads = 256;

template <class T>
__global__ void swiglu_kernel(T* __restrict__ out, const T* __restrict__ gate,
                              const T* __restrict__ up, int64_t n) {
  constexpr int N = Vec<T>::N;
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> g = load_vec(gate, i * N), u = load_vec(up, i * N), o;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float gv = to_f(g.v[k]);
      o.v[k] = from_f<T>(rnd<T>(silu_for<T>(gv)) * to_f(u.v[k]));
    }
    store_vec(out, i * N, o);
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float gv = to_f(gate[i]);
    out[i] = from_f<T>(rnd<T>(silu_for<T>(gv)) * to_f(up[i]));
  }
}

template <class T>
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, T& gg, T& gu) {
  float s = sigmoid_for<T>(g);
  gg = from_f<T>(d * u * s * (1.0f + g * (1.0f - s)));
  gu = from_f<T>(d * g * s);
}

template <class T>
__global__ void swiglu_backward_kernel(T* __restrict__ grad_gate, T* __restrict__ grad_up,
                                       const T* __restrict__ grad_out, const T* __restrict__ gate,
                                       const T* __restrict__ up, int64_t n) {
  constexpr int N = Vec<T>::N;
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> g = load_vec(gate, i * N), u = load_vec(up, i * N), d = load_vec(grad_out, i * N);
    Vec<T> gg, gu;
#pragma unroll
    for (int k = 0; k < N; ++k)
      swiglu_grad(to_f(g.v[k]), to_f(u.v[k]), to_f(d.v[k]), gg.v[k], gu.v[k]);
    store_vec(grad_gate, i * N, gg);
    store_vec(grad_up, i * N, gu);
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    swiglu_grad(to_f(gate[i]), to_f(up[i]), to_f(grad_out[i]), grad_gate[i], grad_up[i]);
}

void require_vec_ready(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    require_cuda(*t, op, "operand");
    require(t->is_contiguous() && aligned16(t->data_ptr()), op,
            [&] { return "operands must be contiguous and 16-byte aligned, got " + t->str(); });
  }
}

}  // namespace

void CudaBackend::swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) {
  require(gate.shape() == out.shape() && up.shape() == out.shape() && gate.dtype() == out.dtype() &&
              up.dtype() == out.dtype(),
          "swiglu", "gate, up and out must share shape and dtype");
  Tensor gc = gate.is_contiguous() && aligned16(gate.data_ptr()) ? gate : gate.clone();
  Tensor uc = up.is_contiguous() && aligned16(up.data_ptr()) ? up : up.clone();
  require_vec_ready("swiglu", {&out, &gc, &uc});
  const int64_t n = out.numel();
  if (n == 0) return;
  OpScope sc(out);
  dispatch_float(out.dtype(), "swiglu", [&](auto t) {
    using T = decltype(t);
    swiglu_kernel<T><<<grid_for(n / Vec<T>::N + 1, kThreads), kThreads, 0, sc.stream>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(gc.data_ptr()),
        static_cast<const T*>(uc.data_ptr()), n);
  });
  ACCEL_CUDA_CHECK_LAUNCH("swiglu");
}

void CudaBackend::swiglu_backward(const Tensor& grad_gate, const Tensor& grad_up,
                                  const Tensor& grad_out, const Tensor& gate, const Tensor& up) {
  require(grad_gate.shape() == gate.shape() && grad_up.shape() == gate.shape() &&
              grad_out.shape() == gate.shape() && up.shape() == gate.shape() &&
              grad_gate.dtype() == gate.dtype() && grad_up.dtype() == gate.dtype() &&
              grad_out.dtype() == gate.dtype() && up.dtype() == gate.dtype(),
          "swiglu",
          [&] { return "backward: shapes and dtypes must all match gate " + gate.str(); });
  auto ready = [](const Tensor& t) {
    return t.is_contiguous() && aligned16(t.data_ptr()) ? t : t.clone();
  };
  Tensor gc = ready(gate), uc = ready(up), dc = ready(grad_out);
  require_vec_ready("swiglu", {&grad_gate, &grad_up, &gc, &uc, &dc});
  const int64_t n = gate.numel();
  if (n == 0) return;
  OpScope sc(gate);
  dispatch_float(gate.dtype(), "swiglu", [&](auto t) {
    using T = decltype(t);
    swiglu_backward_kernel<T><<<grid_for(n / Vec<T>::N + 1, kThreads), kThreads, 0, sc.stream>>>(
        static_cast<T*>(grad_gate.data_ptr()), static_cast<T*>(grad_up.data_ptr()),
        static_cast<const T*>(dc.data_ptr()), static_cast<const T*>(gc.data_ptr()),
        static_cast<const T*>(uc.data_ptr()), n);
  });
  ACCEL_CUDA_CHECK_LAUNCH("swiglu_backward");
}

}  // namespace accel
