// linear_cross_entropy against its definition, cross_entropy(linear(x, w), t): value and both
// gradients, in f64 and f32, for chunkings that split the rows unevenly, ignored rows, an upstream
// factor (expected by grad_scale or not), and no-grad use.
#include <gtest/gtest.h>

#include <vector>

#include "ops/ops.h"
#include "runtime/autograd.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {
using test::expect_close;
using test::randn;

struct Result {
  double loss;
  Tensor gx, gw;
};

// loss * factor backpropagated; fused picks the op under test (chunk_rows, grad_scale) or the
// two-op definition; seeded backpropagates the loss with factor as a number (backward_with_seed,
// as the trainer does), which the fused op takes as is when it equals grad_scale.
Result run(const Tensor& x0, const Tensor& w0, const Tensor& t, bool fused, int64_t chunk_rows,
           double factor, double grad_scale = 1.0, bool seeded = false) {
  Tensor x = x0.clone(), w = w0.clone();
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  Tensor loss = fused ? linear_cross_entropy(x, w, t, -100, chunk_rows, grad_scale)
                      : cross_entropy(reshape(linear(x, w), {-1, w.size(0)}), reshape(t, {-1}));
  if (seeded)
    backward_with_seed(loss, factor);
  else
    mul(loss, factor).backward();
  return {loss.item(), x.grad(), w.grad()};
}

TEST(LinearCrossEntropy, EqualsLinearThenCrossEntropy) {
  const int64_t B = 3, S = 5, D = 7, V = 11;  // 15 rows
  Tensor x = randn({B, S, D}, 1), w = randn({V, D}, 2, DType::F64, 0.5);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B * S; ++i) ids.push_back(i % 4 == 3 ? -100 : (i * 7) % V);
  Tensor t = Tensor::from_vector(ids, {B, S}, DType::I64);
  for (DType dt : {DType::F64, DType::F32}) {
    const double tol = dt == DType::F64 ? 1e-12 : 2e-5;
    Result want = run(cast(x, dt), cast(w, dt), t, false, 0, 2.5);
    for (int64_t chunk : {0, 1, 4, 15, 100}) {
      // grad_scale 1: the factor applied in backward; 2.5: expected, made in forward (seeded with
      // 2.5 the gradients are taken as made, with 1 they are multiplied by 2.5).
      for (double grad_scale : {1.0, 2.5})
        for (bool seeded : {false, true}) {
          SCOPED_TRACE("chunk_rows " + std::to_string(chunk) + " " + dtype_name(dt) +
                       " grad_scale " + std::to_string(grad_scale) + (seeded ? " seeded" : ""));
          Result got = run(cast(x, dt), cast(w, dt), t, true, chunk, 2.5, grad_scale, seeded);
          EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss));
          ASSERT_EQ(got.gx.shape(), x.shape());
          expect_close(got.gx, want.gx, tol, tol, "grad x");
          expect_close(got.gw, want.gw, tol, tol, "grad w");
        }
    }
  }
}

TEST(LinearCrossEntropy, GradientsByFiniteDifferences) {
  Tensor x = randn({6, 4}, 3), w = randn({9, 4}, 4);
  Tensor t = Tensor::from_vector(std::vector<int64_t>{0, 8, -100, 3, 3, 5}, {6}, DType::I64);
  test::grad_check(
      "linear_cross_entropy chunk 4",
      [&](const std::vector<Tensor>& in) { return linear_cross_entropy(in[0], in[1], t, -100, 4); },
      {x, w});
}

TEST(LinearCrossEntropy, OnlyWhatNeedsAGradientGetsOne) {
  Tensor x = randn({4, 3}, 5), w = randn({6, 3}, 6);
  Tensor t = Tensor::from_vector(std::vector<int64_t>{1, 2, 3, 4}, {4}, DType::I64);
  w.set_requires_grad(true);
  linear_cross_entropy(x, w, t, -100, 3).backward();
  EXPECT_FALSE(x.grad().defined());
  EXPECT_TRUE(w.grad().defined());
  // Without gradients (evaluation): the value only, nothing recorded.
  NoGradGuard no_grad;
  Tensor loss = linear_cross_entropy(x, w, t, -100, 3);
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_NEAR(loss.item(), cross_entropy(linear(x, w), t).item(), 1e-12);
}

TEST(LinearCrossEntropy, AllIgnoredIsNaNAndBadShapesAreErrors) {
  Tensor x = randn({2, 3}, 7), w = randn({5, 3}, 8);
  Tensor none = Tensor::from_vector(std::vector<int64_t>{-100, -100}, {2}, DType::I64);
  EXPECT_TRUE(std::isnan(linear_cross_entropy(x, w, none).item()));
  Tensor t = Tensor::from_vector(std::vector<int64_t>{1, 2, 3}, {3}, DType::I64);
  EXPECT_THROW(linear_cross_entropy(x, w, t), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy(x, randn({5, 4}, 9), none), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy(x, w, none, -100, -1), std::invalid_argument);
}

}  // namespace
}  // namespace accel
