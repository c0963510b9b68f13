// Reductions, softmax, cross-entropy and gradient statistics against the CPU backend.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {
using namespace cuda_test;

class CudaReduce : public ::testing::TestWithParam<DType> {};

TEST_P(CudaReduce, ReduceOverDims) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({6, 5, 700}, t, rng);
  const std::vector<std::vector<int64_t>> dim_sets = {{2}, {0}, {1}, {0, 2}, {0, 1, 2}};
  for (ReduceKind op : {ReduceKind::Sum, ReduceKind::Max, ReduceKind::AbsMax})
    for (const auto& dims : dim_sets) {
      Shape os = x.shape();
      for (int64_t d : dims) os[d] = 1;
      Tensor want = cpu_out(os, t);
      cpu_backend().reduce(op, want, x, dims);
      Tensor got = poisoned(os, t);
      cuda_backend().reduce(op, got, x.to(gpu()), dims);
      // Sums of 21000 values: order differences scale with the magnitude of the inputs.
      expect_close(got, want, tol_for(t).rtol, op == ReduceKind::Sum ? 2e-4 * 30 : 0,
                   "reduce op " + std::to_string(int(op)) + " over " + std::to_string(dims.size()) +
                       " dims");
    }
}

TEST_P(CudaReduce, MaxBackward) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({4, 33, 9}, t, rng);
  Tensor mx = cpu_out({4, 1, 9}, t);
  cpu_backend().reduce(ReduceKind::Max, mx, x, {1});
  Tensor g = random_tensor({4, 1, 9}, t, rng);
  Tensor want = cpu_out(x.shape(), t);
  cpu_backend().max_backward(want, x, mx, g, 1);
  Tensor got = poisoned(x.shape(), t);
  cuda_backend().max_backward(got, x.to(gpu()), mx.to(gpu()), g.to(gpu()), 1);
  expect_close(got, want, 0, 0, "max_backward");
}

TEST_P(CudaReduce, SoftmaxAndLogSoftmax) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int64_t len : {17, 1000, 5003}) {
    Tensor x = random_tensor({7, len}, t, rng, -8, 8);
    for (bool log : {false, true}) {
      Tensor want = cpu_out(x.shape(), t);
      cpu_backend().softmax(want, x, log);
      Tensor got = poisoned(x.shape(), t);
      cuda_backend().softmax(got, x.to(gpu()), log);
      expect_matches(got, want, t, log ? "log_softmax" : "softmax", 2.0);
    }
  }
}

TEST_P(CudaReduce, CrossEntropyWithIgnoredRows) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int64_t v : {1000, 4099}) {
    const int64_t n = 37;
    Tensor logits = random_tensor({n, v}, t, rng, -6, 6);
    Tensor targets = random_ints({n}, 0, v, rng);
    std::vector<double> tv = targets.to_vector();
    std::vector<int64_t> ti(tv.begin(), tv.end());
    ti[3] = ti[20] = -100;
    targets = Tensor::from_vector(ti, {n});
    for (DType target_t : {DType::I64, DType::I32}) {
      Tensor tg = Tensor::empty({n}, target_t);
      tg.copy_(targets);
      Tensor wl = cpu_out({n}, DType::F32), wlse = cpu_out({n}, DType::F32);
      Tensor wg = cpu_out({n, v}, t);
      const Tensor scale = Tensor::full({1}, 0.75 / 35, DType::F32);
      cpu_backend().cross_entropy(wl, wlse, logits, tg, -100);
      cpu_backend().cross_entropy_backward(wg, logits, wlse, tg, -100, scale);
      Tensor gl = poisoned({n}, DType::F32), glse = poisoned({n}, DType::F32);
      Tensor gg = poisoned({n, v}, t);
      cuda_backend().cross_entropy(gl, glse, logits.to(gpu()), tg.to(gpu()), -100);
      expect_close(gl, wl, t == DType::F32 ? 1e-5 : 1e-3, 1e-5, "cross_entropy loss");
      expect_close(glse, wlse, 1e-5, 1e-5, "cross_entropy lse");
      cuda_backend().cross_entropy_backward(gg, logits.to(gpu()), glse, tg.to(gpu()), -100,
                                            scale.to(gpu()));
      expect_matches(gg, wg, t, "cross_entropy grad", 2.0);
      // Loss only (no lse buffer).
      Tensor gl2 = poisoned({n}, DType::F32);
      cuda_backend().cross_entropy(gl2, Tensor(), logits.to(gpu()), tg.to(gpu()), -100);
      expect_close(gl2, wl, t == DType::F32 ? 1e-5 : 1e-3, 1e-5, "cross_entropy loss only");
    }
  }
}

// cross_entropy_with_grad: the same numbers as the two kernels, bit for bit, into a separate
// buffer and over the logits themselves; rows with an ignored and with an out-of-range target;
// unaligned rows (V odd), and more rows than the kernel keeps in flight (grid-stride).
TEST_P(CudaReduce, CrossEntropyWithGradIsTheTwoKernels) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (auto [n, v] : {std::pair<int64_t, int64_t>{37, 4099}, {45, 1000}, {700, 40000}}) {
    SCOPED_TRACE("rows " + std::to_string(n) + ", V " + std::to_string(v));
    Tensor logits = random_tensor({n, v}, t, rng, -6, 6).to(gpu());
    std::vector<int64_t> ti(static_cast<size_t>(n));
    for (int64_t& x : ti) x = static_cast<int64_t>(rng() % static_cast<uint64_t>(v));
    ti[3] = -100;
    ti[20] = v;  // out of range: NaN loss and gradient on that row
    ti[static_cast<size_t>(n - 1)] = v - 1;
    const Tensor tg = Tensor::from_vector(ti, {n}, DType::I32, gpu());
    const Tensor scale = Tensor::full({1}, 0.75 / 35, DType::F32, gpu());
    Tensor wl = poisoned({n}, DType::F32).to(gpu()), wlse = poisoned({n}, DType::F32).to(gpu());
    Tensor wg = poisoned({n, v}, t).to(gpu());
    cuda_backend().cross_entropy(wl, wlse, logits, tg, -100);
    cuda_backend().cross_entropy_backward(wg, logits, wlse, tg, -100, scale);
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(in_place ? "in place" : "separate");
      Tensor x = logits.clone();
      Tensor g = in_place ? x : poisoned({n, v}, t).to(gpu());
      Tensor gl = poisoned({n}, DType::F32).to(gpu()), glse = poisoned({n}, DType::F32).to(gpu());
      cuda_backend().cross_entropy_with_grad(gl, glse, g, x, tg, -100, scale);
      auto same = [](const Tensor& a, const Tensor& b, const char* what) {
        const std::vector<double> av = a.to(Device::cpu()).to_vector(),
                                  bv = b.to(Device::cpu()).to_vector();
        ASSERT_EQ(av.size(), bv.size());
        size_t differ = 0;
        for (size_t i = 0; i < av.size(); ++i)
          if (!(av[i] == bv[i] || (std::isnan(av[i]) && std::isnan(bv[i])))) ++differ;
        EXPECT_EQ(differ, 0u) << what;
      };
      same(gl, wl, "loss");
      same(glse, wlse, "lse");
      same(g, wg, "gradient");
    }
    const std::vector<double> loss = wl.to(Device::cpu()).to_vector();
    EXPECT_EQ(loss[3], 0.0);
    EXPECT_TRUE(std::isnan(loss[20]));
  }
}

TEST_P(CudaReduce, SumOfSquaresAndNonFinite) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> cpu_xs, gpu_xs;
  for (int64_t n : {1, 1000, 77777}) {
    cpu_xs.push_back(random_tensor({n}, t, rng));
    gpu_xs.push_back(cpu_xs.back().to(gpu()));
  }
  // A strided one.
  Tensor m = random_tensor({30, 40}, t, rng);
  cpu_xs.push_back(m.as_strided({40, 30}, {1, 40}, 0));
  gpu_xs.push_back(m.to(gpu()).as_strided({40, 30}, {1, 40}, 0));
  const double want = cpu_backend().sum_of_squares(cpu_xs);
  const double got = cuda_backend().sum_of_squares(gpu_xs);
  EXPECT_NEAR(got, want, 1e-6 * want);
  EXPECT_FALSE(cuda_backend().has_non_finite(gpu_xs[2]));
  for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
    Tensor y = cpu_xs[2].clone();
    std::vector<double> v = y.to_vector();
    v[54321] = bad;
    Tensor yb = Tensor::from_vector(v, y.shape(), t).to(gpu());
    EXPECT_TRUE(cuda_backend().has_non_finite(yb));
  }
}

// The gradient-norm shape of a training step: many tensors of mixed dtypes in one call (more
// than one multi-tensor launch holds), sizes across the per-block chunk, views that are not
// 16-byte aligned (scalar path).
TEST(CudaReduceMulti, SumOfSquaresOverManyMixedTensors) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> cpu_xs, gpu_xs;
  const DType types[] = {DType::BF16, DType::F32, DType::F16};
  for (int i = 0; i < 300; ++i) {
    const DType t = types[i % 3];
    const int64_t n = i % 50 == 7 ? 2 * 65536 + 3 : (i % 7 == 0 ? 1 : 1 + (i * 977) % 5000);
    Tensor x = random_tensor({n + 1}, t, rng);
    const bool misaligned = i % 11 == 5;  // a view starting one element in
    cpu_xs.push_back(misaligned ? x.as_strided({n}, {1}, 1) : x.as_strided({n}, {1}, 0));
    Tensor xg = x.to(gpu());
    gpu_xs.push_back(misaligned ? xg.as_strided({n}, {1}, 1) : xg.as_strided({n}, {1}, 0));
  }
  const double want = cpu_backend().sum_of_squares(cpu_xs);
  const double got = cuda_backend().sum_of_squares(gpu_xs);
  EXPECT_NEAR(got, want, 1e-6 * want);
  // Dropping one tensor changes the sum by its share: every tensor is counted once.
  std::vector<Tensor> fewer(gpu_xs.begin() + 1, gpu_xs.end());
  const double first = cpu_backend().sum_of_squares({cpu_xs[0]});
  EXPECT_NEAR(cuda_backend().sum_of_squares(fewer), want - first, 1e-6 * want);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaReduce, ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace accel
