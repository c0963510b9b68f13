// Chunk-free cross-entropy: one pass for the row statistics (softmax.cuh), one for the gradient;
// never an fp32 copy of the logits.
#include <string>
#include <type_traits>

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

// One row's gradient, block-wide: grad = (exp(x - lse) - onehot(t)) * k, 0 on an ignored row,
// NaN on a row with a bad target. The row is walked from its end, so that after a statistics
// pass over it (cross_entropy_with_grad_kernel) the part read last, the likeliest still in L2,
// is read first. Each element is read and then written by one thread, so gr may be xr.
template <class T>
__device__ __forceinline__ void row_gradient(T* gr, const T* xr, int64_t len, float lse, int64_t t,
                                             bool ignored, bool bad, float k) {
  constexpr int N = 16 / sizeof(T);
  auto value = [&](float x, int64_t i) {
    if (ignored) return 0.0f;
    float p = exp_for<T>(x - lse);
    if (i == t) p -= 1.0f;
    return bad ? NAN : p * k;
  };
  const bool vec = ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(gr)) & 15) == 0;
  const int64_t nv = vec ? len / N : 0;
  for (int64_t i = len - 1 - threadIdx.x; i >= nv * N; i -= blockDim.x)
    gr[i] = from_f<T>(value(to_f(xr[i]), i));
  // kLoads chunks loaded before any is written (gr may alias xr, so the compiler cannot move a
  // load above an earlier store by itself).
  constexpr int kLoads = 4;
  const int64_t stride = blockDim.x;
  const uint4* in = reinterpret_cast<const uint4*>(xr);
  uint4* out = reinterpret_cast<uint4*>(gr);
  int64_t i = nv - 1 - threadIdx.x;
  for (; i - (kLoads - 1) * stride >= 0; i -= kLoads * stride) {
    uint4 raw[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) raw[u] = in[i - u * stride];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      T* buf = reinterpret_cast<T*>(&raw[u]);
#pragma unroll
      for (int e = 0; e < N; ++e) buf[e] = from_f<T>(value(to_f(buf[e]), (i - u * stride) * N + e));
      out[i - u * stride] = raw[u];
    }
  }
  for (; i >= 0; i -= stride) {
    uint4 raw = in[i];
    T* buf = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int e = 0; e < N; ++e) buf[e] = from_f<T>(value(to_f(buf[e]), i * N + e));
    out[i] = raw;
  }
}

// grad = (exp(x - lse) - onehot) * scale[0] from the forward's lse, one block per row.
template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                              const float* __restrict__ lse_in,
                                              const I* __restrict__ targets,
                                              const float* __restrict__ scale, int64_t rows,
                                              int64_t len, int64_t ignore_index) {
  const float k = *scale;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[r]);
    const bool ignored = t == ignore_index, bad = !ignored && (t < 0 || t >= len);
    row_gradient(grad + r * len, logits + r * len, len, lse_in[r], t, ignored, bad, k);
  }
}

// Both in one launch, a block per row at a time: the statistics (loss, lse) as
// cross_entropy_kernel, then the gradient as cross_entropy_backward_kernel, the row re-read from
// its end (the part read last is the likeliest still in L2). grad may be logits.
template <class T, class I>
__global__ void __launch_bounds__(512, 2)
    cross_entropy_with_grad_kernel(float* __restrict__ loss, float* __restrict__ lse_out, T* grad,
                                   const T* logits, const I* __restrict__ targets,
                                   const float* __restrict__ scale, int64_t rows, int64_t len,
                                   int64_t ignore_index) {
  const float k = *scale;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * len;
    const int64_t t = static_cast<int64_t>(targets[r]);
    const bool ignored = t == ignore_index, bad = !ignored && (t < 0 || t >= len);
    __shared__ float row_lse;
    if (!ignored) {
      const MaxSum ms = row_max_sum(xr, len);
      // Thread 0's statistics for every thread: the merges' rounding may differ between lanes,
      // and the gradient must use the lse stored for the row (as the backward kernel does).
      if (threadIdx.x == 0) row_lse = ms.m + logf(ms.s);
    } else if (threadIdx.x == 0) {
      row_lse = 0.0f;
    }
    __syncthreads();
    const float lse = row_lse;
    if (threadIdx.x == 0) {
      loss[r] = ignored ? 0.0f : bad ? NAN : lse - to_f(xr[t]);
      lse_out[r] = lse;
    }
    // Thread 0 reads xr[t] above, and row_lse is rewritten by the next row: no thread goes on
    // before all are past both.
    __syncthreads();
    row_gradient(grad + r * len, xr, len, lse, t, ignored, bad, k);
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

// The gradient's buffer and its factor, for cross_entropy_backward and cross_entropy_with_grad.
void check_ce_grad(const Tensor& grad_logits, const Tensor& logits, const Tensor& scale) {
  require(grad_logits.shape() == logits.shape() && grad_logits.is_contiguous() &&
              grad_logits.dtype() == logits.dtype(),
          "cross_entropy", "grad_logits must be contiguous and match logits");
  require(scale.numel() == 1 && scale.dtype() == DType::F32 && scale.device() == logits.device(),
          "cross_entropy", "the gradient's scale must be one f32 element on the logits' device");
}

// f(targets' data as const int64_t* or const int32_t*, as check_ce_rows accepted them).
template <class F>
void with_targets(const Tensor& targets, F&& f) {
  if (targets.dtype() == DType::I64)
    f(static_cast<const int64_t*>(targets.data_ptr()));
  else
    f(static_cast<const int32_t*>(targets.data_ptr()));
}

int ce_threads(int64_t v) { return v >= 4096 ? 512 : 128; }

// Blocks of cross_entropy_with_grad_kernel: what is resident at once (at most one per row). Fewer
// rows in flight, to keep each in L2 for its second read, measured slower on an H200 (session 15:
// the passes are then too few to hide the memory latency).
template <class K>
int rows_in_flight(K kernel, int threads, int64_t rows) {
  int per_sm = 0;  // asked per launch: the block size depends on the vocabulary
  ACCEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return static_cast<int>(std::min<int64_t>(rows, std::max(1, per_sm) * int64_t{sm_count()}));
}
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
    with_targets(targets, [&](auto* tg) {
      cross_entropy_kernel<<<row_grid(n), ce_threads(v), 0, sc.stream>>>(loss, lse_out, x, tg, n, v,
                                                                         ignore_index);
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy");
}

void CudaBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits,
                                         const Tensor& lse, const Tensor& targets,
                                         int64_t ignore_index, const Tensor& scale) {
  check_ce_rows(logits, targets, lse, "lse");
  check_ce_grad(grad_logits, logits, scale);
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto t) {
    using T = decltype(t);
    T* g = static_cast<T*>(grad_logits.data_ptr());
    const T* x = static_cast<const T*>(logits.data_ptr());
    const float* l = static_cast<const float*>(lse.data_ptr());
    const float* k = static_cast<const float*>(scale.data_ptr());
    with_targets(targets, [&](auto* tg) {
      cross_entropy_backward_kernel<<<row_grid(n), ce_threads(v), 0, sc.stream>>>(g, x, l, tg, k, n,
                                                                                  v, ignore_index);
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy_backward");
}

void CudaBackend::cross_entropy_with_grad(const Tensor& loss_per_row, const Tensor& lse,
                                          const Tensor& grad_logits, const Tensor& logits,
                                          const Tensor& targets, int64_t ignore_index,
                                          const Tensor& scale) {
  check_ce_rows(logits, targets, loss_per_row, "loss");
  require(lse.defined() && lse.numel() == loss_per_row.numel() && lse.is_contiguous() &&
              lse.dtype() == DType::F32,
          "cross_entropy", "lse must be contiguous f32 [N]");
  check_ce_grad(grad_logits, logits, scale);
  const char* g = static_cast<const char*>(grad_logits.data_ptr());
  const char* x = static_cast<const char*>(logits.data_ptr());
  const int64_t bytes = logits.nbytes();
  require(g == x || g + bytes <= x || x + bytes <= g, "cross_entropy",
          "grad_logits must be logits itself or not overlap it");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    with_targets(targets, [&](auto* tg) {
      using I = std::remove_const_t<std::remove_pointer_t<decltype(tg)>>;
      auto kernel = cross_entropy_with_grad_kernel<T, I>;
      const int threads = ce_threads(v);
      kernel<<<rows_in_flight(kernel, threads, n), threads, 0, sc.stream>>>(
          static_cast<float*>(loss_per_row.data_ptr()), static_cast<float*>(lse.data_ptr()),
          static_cast<T*>(grad_logits.data_ptr()), static_cast<const T*>(logits.data_ptr()), tg,
          static_cast<const float*>(scale.data_ptr()), n, v, ignore_index);
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy_with_grad");
}

}  // namespace accel
