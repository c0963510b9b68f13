// linear_cross_entropy on the GPU against the CPU twin of the two-op definition: the loss and both
// gradients, for 16-bit and f32 inputs, with chunks that split the rows unevenly. The weight's
// gradient in 16-bit is rounded once per chunk, so its bound grows with the chunk count.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ops/ops.h"
#include "runtime/autograd.h"
#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {
using namespace cuda_test;

TEST(CudaLinearCrossEntropy, MatchesCpuLinearThenCrossEntropy) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t N = 300, D = 64, V = 1000;
  Tensor x64 = random_tensor({N, D}, DType::F64, rng), w64 = random_tensor({V, D}, DType::F64, rng);
  std::vector<int64_t> ids;
  for (double id : random_ints({N}, 0, V, rng).to_vector()) ids.push_back(static_cast<int64_t>(id));
  for (int64_t i = 0; i < N; i += 7) ids[static_cast<size_t>(i)] = -100;
  Tensor t = Tensor::from_vector(ids, {N}, DType::I64);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t chunk : {0, 64, 77}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " chunk_rows " + std::to_string(chunk));
      // The reference: the two ops on the CPU in f64 from the same rounded inputs.
      Tensor xr = cast(cast(x64, dt), DType::F64), wr = cast(cast(w64, dt), DType::F64);
      xr.set_requires_grad(true);
      wr.set_requires_grad(true);
      Tensor want = cross_entropy(linear(xr, wr), t);
      want.backward();
      Tensor xg = cast(x64, dt).to(gpu()), wg = cast(w64, dt).to(gpu());
      xg.set_requires_grad(true);
      wg.set_requires_grad(true);
      Tensor got = linear_cross_entropy(xg, wg, t.to(gpu()), -100, chunk);
      got.backward();
      const bool f32 = dt == DType::F32;
      const double tol = f32 ? 1e-4 : (dt == DType::BF16 ? 2e-2 : 4e-3);
      EXPECT_NEAR(got.item(), want.item(), (f32 ? 1e-5 : 1e-3) * std::abs(want.item()));
      // Relative to the largest gradient element: near-zero elements carry the same absolute error.
      auto largest = [](const Tensor& g) { return amax(g).item(); };
      expect_close(cast(xg.grad().to(Device::cpu()), DType::F64), xr.grad(), tol,
                   tol * largest(xr.grad()), "grad x");
      expect_close(cast(wg.grad().to(Device::cpu()), DType::F64), wr.grad(), tol,
                   tol * largest(wr.grad()), "grad w");
    }
  }
}

}  // namespace
}  // namespace accel
