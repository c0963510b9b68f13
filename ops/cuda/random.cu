// rand_uniform / rand_normal: counter-based Philox (runtime/random.h), the same values as the CPU
// backend for a (seed, offset).
#include "ops/cuda/common.cuh"
#include "runtime/random.h"

namespace accel {
namespace {
using namespace cuda;

constexpr int kThreads = 256;

__global__ void rand_kernel(void* out, DType t, int64_t n, uint64_t seed, uint64_t offset, double a,
                            double b, bool normal) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float r = normal ? philox::normal(seed, offset, i) : philox::uniform(seed, offset, i);
    if (t == DType::F64) {
      store_from_double(out, t, i, normal ? a + b * double(r) : a + (b - a) * double(r));
    } else {
      // In float like the CPU backend, without FMA contraction so the results are identical.
      const float lo = static_cast<float>(a), span = static_cast<float>(normal ? b : b - a);
      store_f(out, t, i, __fadd_rn(lo, __fmul_rn(span, r)));
    }
  }
}

void launch_rand(const char* op, const Tensor& out, uint64_t seed, uint64_t offset, double a,
                 double b, bool normal) {
  require(out.is_contiguous(), op, "out must be contiguous");
  if (!is_floating(out.dtype())) unsupported_dtype(op, out.dtype());
  const int64_t n = out.numel();
  if (n == 0) return;
  OpScope sc(out);
  rand_kernel<<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(out.data_ptr(), out.dtype(), n,
                                                                 seed, offset, a, b, normal);
  check(cudaGetLastError(), op, __FILE__, __LINE__);
}
}  // namespace

void CudaBackend::rand_uniform(const Tensor& out, uint64_t seed, uint64_t offset, double low,
                               double high) {
  launch_rand("rand_uniform", out, seed, offset, low, high, false);
}
void CudaBackend::rand_normal(const Tensor& out, uint64_t seed, uint64_t offset, double mean,
                              double stddev) {
  launch_rand("rand_normal", out, seed, offset, mean, stddev, true);
}

}  // namespace accel
