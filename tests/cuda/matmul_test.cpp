// cuBLASLt GEMMs against the CPU backend: transposes, batch broadcast, alpha/beta, dtypes.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cublaslt.h"
#include "ops/cuda/cuda_backend.h"
#endif

namespace accel {
namespace {
using namespace cuda_test;

class CudaMatmul : public ::testing::TestWithParam<DType> {};

TEST_P(CudaMatmul, AllTransposesAndBatchBroadcast) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t m = 67, n = 45, k = 130;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (int64_t ba : {1, 3})
        for (int64_t bb : {1, 3}) {
          const int64_t batch = std::max(ba, bb);
          Tensor a = random_tensor(ta ? Shape{ba, k, m} : Shape{ba, m, k}, t, rng);
          Tensor b = random_tensor(tb ? Shape{bb, n, k} : Shape{bb, k, n}, t, rng);
          Tensor c0 = random_tensor({batch, m, n}, t, rng);
          for (double beta : {0.0, 0.5}) {
            Tensor want = c0.clone();
            cpu_backend().matmul(want, a, b, ta, tb, 1.25, beta, Tensor());
            Tensor got = beta == 0.0 ? poisoned({batch, m, n}, t) : c0.to(gpu());
            cuda_backend().matmul(got, a.to(gpu()), b.to(gpu()), ta, tb, 1.25, beta, Tensor());
            // Sums of 130 products: relative to the output scale.
            expect_close(got, want, tol_for(t).rtol, (t == DType::F32 ? 1e-5 : 1e-2) * rms(want),
                         "matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                             " batch " + std::to_string(ba) + "x" + std::to_string(bb) + " beta " +
                             std::to_string(beta));
          }
        }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaMatmul, ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

#ifdef ACCEL_WITH_CUDA
TEST(CudaMatmulTf32, CloseToFp32WhenAllowed) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor a = random_tensor({1, 256, 512}, DType::F32, rng);
  Tensor b = random_tensor({1, 512, 128}, DType::F32, rng);
  Tensor want = cpu_out({1, 256, 128}, DType::F32);
  cpu_backend().matmul(want, a, b, false, false, 1.0, 0.0, Tensor());
  cuda::set_allow_tf32(true);
  Tensor got = poisoned({1, 256, 128}, DType::F32);
  cuda_backend().matmul(got, a.to(gpu()), b.to(gpu()), false, false, 1.0, 0.0, Tensor());
  cuda::set_allow_tf32(false);
  expect_close(got, want, 5e-3, 5e-3 * rms(want), "tf32 matmul");
}

// The first call of a problem times the heuristic's candidates, the second runs the cached
// algorithm. With beta != 0 the timing runs must not accumulate into the caller's output: both
// results must equal C0 * beta + alpha * A B exactly once.
// Sets GEMM tuning for a scope and restores the previous setting.
struct TuningSetting {
  bool was = cuda::lt::gemm_tuning();
  explicit TuningSetting(bool on) { cuda::lt::set_gemm_tuning(on); }
  ~TuningSetting() { cuda::lt::set_gemm_tuning(was); }
};

TEST(CudaMatmulTuning, AccumulateTunedThenCachedMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  TuningSetting tuning(true);
  // Shapes no other test uses, so the first call here is the plan's first.
  const int64_t batch = 2, m = 192, n = 320, k = 448;
  for (DType t : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor a = random_tensor({batch, m, k}, t, rng);
    Tensor b = random_tensor({batch, n, k}, t, rng);
    Tensor c0 = random_tensor({batch, m, n}, t, rng);
    Tensor want = c0.clone();
    cpu_backend().matmul(want, a, b, false, true, 0.75, 1.0, Tensor());
    Tensor ga = a.to(gpu()), gb = b.to(gpu());
    const double atol = (t == DType::F32 ? 1e-5 : 1e-2) * rms(want);
    const cuda::lt::TuningStats s0 = cuda::lt::tuning_stats();
    Tensor first = c0.to(gpu());
    cuda_backend().matmul(first, ga, gb, false, true, 0.75, 1.0, Tensor());
    const cuda::lt::TuningStats s1 = cuda::lt::tuning_stats();
    EXPECT_EQ(s1.tuned, s0.tuned + 1)
        << "the first call of a new problem should time the heuristic's candidates (heuristic_only "
        << s0.heuristic_only << " -> " << s1.heuristic_only
        << "; only one candidate offered makes this test unable to catch double accumulation)";
    expect_close(first, want, tol_for(t).rtol, atol, "tuned accumulating matmul");
    Tensor second = c0.to(gpu());
    cuda_backend().matmul(second, ga, gb, false, true, 0.75, 1.0, Tensor());
    const cuda::lt::TuningStats s2 = cuda::lt::tuning_stats();
    EXPECT_EQ(s2.tuned, s1.tuned);
    EXPECT_EQ(s2.heuristic_only, s1.heuristic_only);
    EXPECT_EQ(s2.cached_runs, s1.cached_runs + 1) << "the second call should reuse the plan";
    expect_close(second, want, tol_for(t).rtol, atol, "cached accumulating matmul");
    // beta = 0 (a different plan), tuned on the poisoned output itself, then cached.
    Tensor want0 = cpu_out({batch, m, n}, t);
    cpu_backend().matmul(want0, a, b, false, true, 0.75, 0.0, Tensor());
    for (int rep = 0; rep < 2; ++rep) {
      Tensor got = poisoned({batch, m, n}, t);
      cuda_backend().matmul(got, ga, gb, false, true, 0.75, 0.0, Tensor());
      expect_close(got, want0, tol_for(t).rtol, atol, "beta 0 matmul, call " + std::to_string(rep));
    }
  }
}

TEST(CudaMatmulTuning, HeuristicOnlyWhenTuningOff) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  TuningSetting tuning(false);
  Tensor a = random_tensor({1, 96, 160}, DType::BF16, rng);
  Tensor b = random_tensor({1, 160, 224}, DType::BF16, rng);
  Tensor c0 = random_tensor({1, 96, 224}, DType::BF16, rng);
  Tensor want = c0.clone();
  cpu_backend().matmul(want, a, b, false, false, 1.0, 0.5, Tensor());
  const cuda::lt::TuningStats s0 = cuda::lt::tuning_stats();
  Tensor got = c0.to(gpu());
  cuda_backend().matmul(got, a.to(gpu()), b.to(gpu()), false, false, 1.0, 0.5, Tensor());
  const cuda::lt::TuningStats s1 = cuda::lt::tuning_stats();
  EXPECT_EQ(s1.tuned, s0.tuned);
  EXPECT_EQ(s1.heuristic_only, s0.heuristic_only + 1);
  expect_close(got, want, 1e-2, 1e-2 * rms(want), "untuned matmul");
}
#endif

TEST(CudaMatmulOps, LinearThroughOpsLayer) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({2, 9, 64}, DType::F32, rng);
  Tensor w = random_tensor({48, 64}, DType::F32, rng);
  Tensor want = linear(x, w);
  Tensor got = linear(x.to(gpu()), w.to(gpu()));
  expect_matches(got, want, DType::F32, "linear", 4.0);
}

// The weight gradient comes back contiguous in the weight's [out, in] layout and matches the CPU.
TEST(CudaMatmulOps, LinearWeightGradient) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({2, 9, 64}, DType::F32, rng);
  Tensor w = random_tensor({48, 64}, DType::F32, rng);
  Tensor gy = random_tensor({2, 9, 48}, DType::F32, rng);
  Tensor wc = w.clone(), wg = w.to(gpu());
  wc.set_requires_grad(true);
  wg.set_requires_grad(true);
  sum(mul(linear(x, wc), gy)).backward();
  sum(mul(linear(x.to(gpu()), wg), gy.to(gpu()))).backward();
  ASSERT_TRUE(wg.grad().defined());
  EXPECT_TRUE(wg.grad().is_contiguous());
  EXPECT_EQ(wg.grad().shape(), w.shape());
  expect_matches(wg.grad(), wc.grad(), DType::F32, "linear weight grad", 8.0);
}

// C != D: out = a @ b^T + addend with the addend only read, bf16 rounded once as on the CPU; then
// three projections of one input through the ops layer, whose input gradients the GEMMs sum.
TEST(CudaMatmulOps, AddendIsReadNotWrittenAndSharedInputGradientsSum) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor a = random_tensor({1, 96, 160}, DType::BF16, rng);
  Tensor b = random_tensor({1, 224, 160}, DType::BF16, rng);
  Tensor c0 = random_tensor({1, 96, 224}, DType::BF16, rng);
  Tensor want = cpu_out({1, 96, 224}, DType::BF16);
  cpu_backend().matmul(want, a, b, false, true, 1.0, 1.0, c0);
  Tensor in_place = c0.clone();
  cpu_backend().matmul(in_place, a, b, false, true, 1.0, 1.0, Tensor());
  EXPECT_EQ(want.to_vector(), in_place.to_vector()) << "the CPU's addend and in-place forms differ";
  Tensor addend = c0.to(gpu());
  Tensor got = poisoned({1, 96, 224}, DType::BF16);
  cuda_backend().matmul(got, a.to(gpu()), b.to(gpu()), false, true, 1.0, 1.0, addend);
  EXPECT_EQ(addend.to_vector(), c0.to_vector()) << "the addend was written";
  expect_matches(got, want, DType::BF16, "matmul with an addend", 4.0);

  Tensor x = random_tensor({2, 9, 64}, DType::F32, rng);
  std::vector<Tensor> ws, gys;
  for (int64_t out : {48, 16, 16}) {
    ws.push_back(random_tensor({out, 64}, DType::F32, rng));
    gys.push_back(random_tensor({2, 9, out}, DType::F32, rng));
  }
  Tensor want_gx;
  for (size_t i = 0; i < ws.size(); ++i) {  // the unfused sum, from the CPU
    Tensor gi = matmul(reshape(gys[i], {18, -1}), ws[i]);
    want_gx = want_gx.defined() ? add(want_gx, gi) : gi;
  }
  Tensor xg = x.to(gpu());
  xg.set_requires_grad(true);
  Tensor loss;
  for (size_t i = 0; i < ws.size(); ++i) {
    Tensor term = sum(mul(linear(xg, ws[i].to(gpu())), gys[i].to(gpu())));
    loss = loss.defined() ? add(loss, term) : term;
  }
  loss.backward();
  expect_matches(reshape(xg.grad(), {18, 64}), want_gx, DType::F32, "summed input gradient", 8.0);
}

// linear with a residual on the GPU: the residual is the GEMM's addend (the sum rounded once, the
// decisive case of LinearResidual.RoundsTheSumOnce), bf16 against the CPU, and the residual's
// gradient is the output's.
TEST(CudaMatmulOps, LinearWithAResidualRoundsTheSumOnce) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType bf = DType::BF16;
  const Tensor x = Tensor::from_vector(std::vector<double>{1.0, 1.0}, {1, 2}, bf, gpu());
  const Tensor w = Tensor::from_vector(
      std::vector<double>{std::ldexp(1.0, -8), -std::ldexp(1.0, -20)}, {1, 2}, bf, gpu());
  const Tensor r =
      Tensor::from_vector(std::vector<double>{1.0 + std::ldexp(1.0, -7)}, {1, 1}, bf, gpu());
  EXPECT_EQ(linear(x, w, Tensor(), r).item(), 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(add(r, linear(x, w)).item(), 1.0 + std::ldexp(1.0, -6));

  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const Tensor xs = random_tensor({2, 40, 64}, bf, rng), ws = random_tensor({48, 64}, bf, rng);
  const Tensor rs = random_tensor({2, 40, 48}, bf, rng), gy = random_tensor({2, 40, 48}, bf, rng);
  const Tensor want = linear(xs, ws, Tensor(), rs);
  Tensor rg = rs.to(gpu());
  rg.set_requires_grad(true);
  Tensor got = linear(xs.to(gpu()), ws.to(gpu()), Tensor(), rg);
  expect_matches(got, want, bf, "linear with a residual", 2.0);
  got.backward(gy.to(gpu()));
  EXPECT_EQ(rg.grad().to(Device::cpu()).to_vector(), gy.to_vector());
}

}  // namespace
}  // namespace accel
