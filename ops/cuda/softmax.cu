// softmax / log_softmax along the last dim: one block per row, the row statistics of softmax.cuh,
// then the outputs.
#include "ops/cuda/softmax.cuh"

namespace accel {
namespace {
using namespace cuda;

template <class T>
__global__ void softmax_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                               int64_t len, bool log) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * len;
    T* orow = out + r * len;
    MaxSum ms = row_max_sum(xr, len);
    const float lse = ms.m + logf(ms.s);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      float v = to_f(xr[i]);
      orow[i] = from_f<T>(log ? v - lse : expf(v - lse));
    }
  }
}

}  // namespace

void CudaBackend::softmax(const Tensor& out, const Tensor& x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require_cuda(x, op, "input");
  require(x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype(),
          op, "needs contiguous x and out of one shape and dtype");
  if (x.numel() == 0) return;
  const int64_t len = x.dim() == 0 ? 1 : x.shape().back();
  const int64_t rows = x.numel() / len;
  OpScope sc(x);
  dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    softmax_kernel<T><<<row_grid(rows), len >= 2048 ? 512 : 128, 0, sc.stream>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), rows, len, log);
  });
  ACCEL_CUDA_CHECK_LAUNCH("softmax");
}

}  // namespace accel
