// Chunk-free cross-entropy: one pass for the row statistics (softmax.cuh), one for the gradient;
// never an fp32 copy of the logits.
#include <string>

#include "ops/cuda/softmax.cuh"

namespace accel {
namespace {
using namespace cuda;

// One block per row: an online max/sum pass; loss = lse - x[target], lse kept for the backward.
// A target outside [0, V) that is not ignore_index gives a NaN loss (no host sync for a check).
template <class T, class I>
__global__ void cross_entropy_kernel(float* __restrict__ loss, float* __restrict__ lse_out,
                                     const T* __restrict__ logits, const I* __restrict__ targets,
                                     int64_t rows, int64_t len, int64_t ignore_index) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * len;
    const int64_t t = static_cast<int64_t>(targets[r]);
    if (t == ignore_index) {
      if (threadIdx.x == 0) {
        loss[r] = 0.0f;
        if (lse_out) lse_out[r] = 0.0f;
      }
      continue;
    }
    const bool bad = t < 0 || t >= len;
    MaxSum ms = row_max_sum(xr, len);
    const float lse = ms.m + logf(ms.s);
    if (threadIdx.x == 0) {
      loss[r] = bad ? NAN : lse - to_f(xr[t]);
      if (lse_out) lse_out[r] = lse;
    }
  }
}

// grad = (exp(x - lse) - onehot) * scale[0]; 0 on ignored rows, NaN on rows with a bad target.
template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                              const float* __restrict__ lse_in,
                                              const I* __restrict__ targets,
                                              const float* __restrict__ scale, int64_t rows,
                                              int64_t len, int64_t ignore_index) {
  constexpr int N = 16 / sizeof(T);
  const float k = *scale;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * len;
    T* gr = grad + r * len;
    const int64_t t = static_cast<int64_t>(targets[r]);
    const bool ignored = t == ignore_index, bad = !ignored && (t < 0 || t >= len);
    const float lse = lse_in[r];
    auto value = [&](float x, int64_t i) {
      if (ignored) return 0.0f;
      float p = exp_for<T>(x - lse);
      if (i == t) p -= 1.0f;
      return bad ? NAN : p * k;
    };
    const bool vec =
        ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(gr)) & 15) == 0;
    int64_t done = 0;
    if (vec) {
      const int64_t nv = len / N;
      for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        T buf[N];
        *reinterpret_cast<uint4*>(buf) = reinterpret_cast<const uint4*>(xr)[i];
#pragma unroll
        for (int e = 0; e < N; ++e) buf[e] = from_f<T>(value(to_f(buf[e]), i * N + e));
        reinterpret_cast<uint4*>(gr)[i] = *reinterpret_cast<uint4*>(buf);
      }
      done = nv * N;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x)
      gr[i] = from_f<T>(value(to_f(xr[i]), i));
  }
}

}  // namespace

namespace {
void check_ce_rows(const Tensor& logits, const Tensor& targets, const Tensor& per_row,
                   const char* what) {
  require_cuda(logits, "cross_entropy", "logits");
  require_cuda(targets, "cross_entropy", "targets");
  require(logits.dim() == 2 && logits.is_contiguous(), "cross_entropy",
          [&] { return "logits must be contiguous [N, V], got " + logits.str(); });
  const int64_t n = logits.shape()[0];
  require(targets.numel() == n && targets.is_contiguous() && per_row.numel() == n &&
              per_row.is_contiguous() && per_row.dtype() == DType::F32,
          "cross_entropy", [&] {
            return std::string("targets must be contiguous [N] and ") + what +
                   " contiguous f32 [N]";
          });
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    unsupported_dtype("cross_entropy targets", targets.dtype());
}

int ce_threads(int64_t v) { return v >= 4096 ? 512 : 128; }
}  // namespace

void CudaBackend::cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                                const Tensor& targets, int64_t ignore_index) {
  check_ce_rows(logits, targets, loss_per_row, "loss");
  if (lse.defined())
    require(lse.numel() == loss_per_row.numel() && lse.is_contiguous() && lse.dtype() == DType::F32,
            "cross_entropy", "lse must be contiguous f32 [N]");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto t) {
    using T = decltype(t);
    float* loss = static_cast<float*>(loss_per_row.data_ptr());
    float* lse_out = lse.defined() ? static_cast<float*>(lse.data_ptr()) : nullptr;
    const T* x = static_cast<const T*>(logits.data_ptr());
    if (targets.dtype() == DType::I64)
      cross_entropy_kernel<T, int64_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          loss, lse_out, x, static_cast<const int64_t*>(targets.data_ptr()), n, v, ignore_index);
    else
      cross_entropy_kernel<T, int32_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          loss, lse_out, x, static_cast<const int32_t*>(targets.data_ptr()), n, v, ignore_index);
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy");
}

void CudaBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits,
                                         const Tensor& lse, const Tensor& targets,
                                         int64_t ignore_index, const Tensor& scale) {
  check_ce_rows(logits, targets, lse, "lse");
  require(grad_logits.shape() == logits.shape() && grad_logits.is_contiguous() &&
              grad_logits.dtype() == logits.dtype(),
          "cross_entropy", "grad_logits must be contiguous and match logits");
  require(scale.numel() == 1 && scale.dtype() == DType::F32 && scale.device() == logits.device(),
          "cross_entropy", "backward: scale must be one f32 element on the logits' device");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto t) {
    using T = decltype(t);
    T* g = static_cast<T*>(grad_logits.data_ptr());
    const T* x = static_cast<const T*>(logits.data_ptr());
    const float* l = static_cast<const float*>(lse.data_ptr());
    const float* k = static_cast<const float*>(scale.data_ptr());
    if (targets.dtype() == DType::I64)
      cross_entropy_backward_kernel<T, int64_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          g, x, l, static_cast<const int64_t*>(targets.data_ptr()), k, n, v, ignore_index);
    else
      cross_entropy_backward_kernel<T, int32_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          g, x, l, static_cast<const int32_t*>(targets.data_ptr()), k, n, v, ignore_index);
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy_backward");
}

}  // namespace accel
