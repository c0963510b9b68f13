// linear with a residual: residual + x @ w^T made by one GEMM (the residual its addend, the sum
// rounded once), with the gradients of the sum; the cases it cannot fold add after.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

// r + x.w^T where the product, 2^-8 - 2^-20, is not a bf16 number: rounded once the sum is
// 1 + 2^-7 (just below the halfway point to 1 + 2^-6); the product rounded first (to 2^-8)
// makes the sum the halfway point itself, which rounds to even: 1 + 2^-6.
TEST(LinearResidual, RoundsTheSumOnce) {
  const DType bf = DType::BF16;
  const Tensor x = Tensor::from_vector(std::vector<double>{1.0, 1.0}, {1, 2}, bf);
  const Tensor w = Tensor::from_vector(
      std::vector<double>{std::ldexp(1.0, -8), -std::ldexp(1.0, -20)}, {1, 2}, bf);
  const Tensor r = Tensor::from_vector(std::vector<double>{1.0 + std::ldexp(1.0, -7)}, {1, 1}, bf);
  EXPECT_EQ(linear(x, w, Tensor(), r).item(), 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(add(r, linear(x, w)).item(), 1.0 + std::ldexp(1.0, -6)) << "not a decisive case";
}

TEST(LinearResidual, GradientsAreTheSums) {
  const Tensor x0 = test::randn({2, 5, 12}, 1, DType::F64),
               w0 = test::randn({7, 12}, 2, DType::F64);
  const Tensor r0 = test::randn({2, 5, 7}, 3, DType::F64),
               gy = test::randn({2, 5, 7}, 4, DType::F64);
  std::vector<std::vector<double>> got[2];
  for (int way = 0; way < 2; ++way) {
    Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true),
           r = r0.clone().set_requires_grad(true);
    // x also feeds a second op, so the linear's input-gradient GEMM folds a pending gradient.
    Tensor y = way == 0 ? linear(x, w, Tensor(), r) : add(r, linear(x, w));
    y = add(y, sum(x, {2}, true));
    y.backward(gy);
    for (const Tensor& t : {y.detach(), x.grad(), w.grad(), r.grad()})
      got[way].push_back(t.to_vector());
  }
  test::expect_close(got[0][0], got[1][0], 1e-14, 1e-14, "output");
  test::expect_close(got[0][1], got[1][1], 1e-14, 1e-14, "grad x");
  test::expect_close(got[0][2], got[1][2], 1e-14, 1e-14, "grad w");
  EXPECT_EQ(got[0][3], got[1][3]) << "grad residual: the output's own";
}

// Not folded: with a bias (the product and bias come first) and with a strided input, both give
// add(residual, linear(...)) exactly. A residual of another shape or dtype is an error (before
// any work).
TEST(LinearResidual, OtherCasesAddAfterAndBadShapesAreErrors) {
  const Tensor x = test::randn({3, 8}, 5, DType::F32), w = test::randn({4, 8}, 6, DType::F32);
  const Tensor b = test::randn({4}, 7, DType::F32), r = test::randn({3, 4}, 8, DType::F32);
  EXPECT_EQ(linear(x, w, b, r).to_vector(), add(r, linear(x, w, b)).to_vector());
  const Tensor xt = transpose(test::randn({8, 3}, 9, DType::F32), 0, 1);
  ASSERT_FALSE(xt.is_contiguous());
  EXPECT_EQ(linear(xt, w, Tensor(), r).to_vector(), add(r, linear(xt, w)).to_vector());
  EXPECT_THROW(linear(x, w, Tensor(), cast(r, DType::F64)), std::invalid_argument);
  EXPECT_THROW(linear(x, w, Tensor(), test::randn({3, 5}, 10, DType::F32)), std::invalid_argument);
}

}  // namespace
}  // namespace accel
