// Optimizer kernels against torch.optim's formulas computed here in double, gradient statistics,
// and a small MLP that must learn a synthetic task with AdamW through the public ops.
#include <gtest/gtest.h>

#include <cmath>

#include "op_test_util.h"

namespace accel {
namespace {
using test::expect_close;
using test::randn;

// torch.optim.AdamW (single-tensor path) in double.
void adamw_reference(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                     const std::vector<double>& g, const AdamWParams& h) {
  const double bc1 = 1 - std::pow(h.beta1, h.step), bc2 = 1 - std::pow(h.beta2, h.step);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - h.lr * h.weight_decay;
    m[i] = h.beta1 * m[i] + (1 - h.beta1) * g[i];
    v[i] = h.beta2 * v[i] + (1 - h.beta2) * g[i] * g[i];
    const double mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= h.lr * mhat / (std::sqrt(vhat) + h.eps);
  }
}

TEST(AdamW, MatchesTorchFormulasOverSeveralSteps) {
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<double> p = {0.5, -1.25, 2.0, 0.0, 3e-3}, m(5, 0.0), v(5, 0.0);
    Tensor tp = Tensor::from_vector(p, {5}, dt), tm = Tensor::zeros({5}, dt),
           tv = Tensor::zeros({5}, dt);
    p = tp.to_vector();
    for (int64_t step = 1; step <= 4; ++step) {
      std::vector<double> g = {0.1 * step, -0.3, 1e-4, 2.0 / step, -5.0};
      AdamWParams h{1e-2, 0.9, 0.999, 1e-8, 0.1, step};
      adamw_reference(p, m, v, g, h);
      adamw_step(tp, Tensor::from_vector(g, {5}, dt), tm, tv, h);
    }
    const double tol = dt == DType::F64 ? 1e-14 : 2e-6;
    expect_close(tp, p, tol, tol, "param");
    expect_close(tm, m, tol, tol, "exp_avg");
    expect_close(tv, v, tol, tol, "exp_avg_sq");
  }
}

TEST(AdamW, FirstStepMovesEachWeightByLr) {
  // With bias correction, step 1 moves every weight by lr * sign(g) (eps aside), after decay.
  Tensor p = Tensor::from_vector(std::vector<double>{1.0, -2.0, 0.5}, {3}, DType::F64);
  Tensor g = Tensor::from_vector(std::vector<double>{3.0, -0.01, 7.0}, {3}, DType::F64);
  Tensor m = Tensor::zeros({3}, DType::F64), v = Tensor::zeros({3}, DType::F64);
  adamw_step(p, g, m, v, AdamWParams{0.1, 0.9, 0.95, 0.0, 0.5, 1});
  expect_close(p, {1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1, 0.5 * 0.95 - 0.1}, 1e-15, 1e-15);
}

TEST(AdamW, SixteenBitGradientsAndGradScale) {
  std::vector<double> g = {0.5, -0.25, 1.5, 3.0};
  std::vector<double> p = {1, 2, 3, 4}, m(4, 0.0), v(4, 0.0);
  Tensor tp = Tensor::from_vector(p, {4}), tm = Tensor::zeros({4}), tv = Tensor::zeros({4});
  AdamWParams h{1e-3, 0.9, 0.999, 1e-8, 0.01, 1};
  // bf16 gradients (exact here) scaled by 0.5, e.g. a clip coefficient.
  adamw_step(tp, Tensor::from_vector(g, {4}, DType::BF16), tm, tv, h, 0.5);
  std::vector<double> scaled;
  for (double x : g) scaled.push_back(0.5 * x);
  adamw_reference(p, m, v, scaled, h);
  expect_close(tp, p, 1e-6, 1e-7);
  expect_close(tm, m, 1e-6, 1e-9);
}

TEST(Sgd, MatchesTorchWithMomentumAndWeightDecay) {
  std::vector<double> p = {1.0, -0.5, 2.0}, buf(3, 0.0);
  Tensor tp = Tensor::from_vector(p, {3}, DType::F64), tb = Tensor::zeros({3}, DType::F64);
  const double lr = 0.1, mom = 0.9, wd = 0.01;
  for (int step = 0; step < 3; ++step) {
    std::vector<double> g = {0.3, -1.0 + step, 0.05 * step};
    for (int i = 0; i < 3; ++i) {
      double d = g[i] + wd * p[i];
      buf[i] = step == 0 ? d : mom * buf[i] + d;  // torch: first step buf = clone(d_p)
      p[i] -= lr * buf[i];
    }
    sgd_step(tp, Tensor::from_vector(g, {3}, DType::F64), tb, lr, mom, wd);
  }
  expect_close(tp, p, 1e-15, 1e-15, "param");
  expect_close(tb, buf, 1e-15, 1e-15, "momentum buffer");
}

TEST(GradStats, SumOfSquaresAndNonFinite) {
  Tensor a = Tensor::from_vector(std::vector<double>{1, 2, 3}, {3});
  Tensor b = Tensor::from_vector(std::vector<double>{0.5, -4}, {2}, DType::BF16);
  Tensor big = Tensor::full({100000}, 0.1, DType::F32);  // takes the threaded path
  EXPECT_DOUBLE_EQ(sum_of_squares({a, b}), 14.0 + 0.25 + 16.0);
  EXPECT_NEAR(sum_of_squares({big}), 100000 * double(0.1f) * double(0.1f), 1e-6);
  Tensor t = transpose(Tensor::from_vector(std::vector<double>{1, 2, 3, 4}, {2, 2}), 0, 1);
  EXPECT_DOUBLE_EQ(sum_of_squares({t}), 30.0);
  EXPECT_FALSE(has_non_finite(a));
  EXPECT_FALSE(has_non_finite(big));
  Tensor bad = big.clone();
  bad.data<float>()[77777] = INFINITY;
  EXPECT_TRUE(has_non_finite(bad));
  bad.data<float>()[77777] = NAN;
  EXPECT_TRUE(has_non_finite(bad));
  EXPECT_TRUE(has_non_finite(Tensor::full({2}, NAN, DType::BF16)));
  EXPECT_FALSE(has_non_finite(Tensor::zeros({0})));
}

TEST(Mlp, LearnsSyntheticClassificationWithAdamW) {
  // 4 classes on 2-d points given by the quadrant of a rotated plane; a 2-32-4 MLP with GELU.
  const int64_t n = 64;
  Tensor x = randn({n, 2}, 1, DType::F32);
  std::vector<int64_t> labels;
  auto xv = x.to_vector();
  for (int64_t i = 0; i < n; ++i) {
    double u = xv[2 * i] + 0.5 * xv[2 * i + 1], w = xv[2 * i + 1] - 0.5 * xv[2 * i];
    labels.push_back((u > 0 ? 1 : 0) + (w > 0 ? 2 : 0));
  }
  Tensor y = test::ids_tensor(labels, {n});
  std::vector<Tensor> params = {randn({32, 2}, 2, DType::F32, 0.7), Tensor::zeros({32}),
                                randn({4, 32}, 3, DType::F32, 0.17), Tensor::zeros({4})};
  std::vector<Tensor> m, v;
  for (Tensor& p : params) {
    p.set_requires_grad(true);
    m.push_back(Tensor::zeros(p.shape()));
    v.push_back(Tensor::zeros(p.shape()));
  }
  double first = 0, last = 0;
  for (int64_t step = 1; step <= 400; ++step) {
    Tensor h = gelu(linear(x, params[0], params[1]));
    Tensor loss = cross_entropy(linear(h, params[2], params[3]), y);
    if (step == 1) first = loss.item();
    last = loss.item();
    loss.backward();
    for (size_t i = 0; i < params.size(); ++i) {
      adamw_step(params[i], params[i].grad(), m[i], v[i],
                 AdamWParams{3e-2, 0.9, 0.999, 1e-8, 0.0, step});
      params[i].zero_grad();
    }
  }
  EXPECT_GT(first, 1.0);
  EXPECT_LT(last, 0.05) << "first loss " << first;
}

TEST(Mlp, RegressionWithSiluAndMse) {
  // y = sin(3x) on [-1, 1] with a 1-16-1 SiLU MLP and mean squared error.
  const int64_t n = 32;
  std::vector<double> xs, ys;
  for (int64_t i = 0; i < n; ++i) {
    xs.push_back(-1.0 + 2.0 * i / (n - 1));
    ys.push_back(std::sin(3.0 * xs.back()));
  }
  Tensor x = Tensor::from_vector(xs, {n, 1}), y = Tensor::from_vector(ys, {n, 1});
  std::vector<Tensor> params = {randn({16, 1}, 4, DType::F32, 1.5), randn({16}, 5, DType::F32, 0.5),
                                randn({1, 16}, 6, DType::F32, 0.25), Tensor::zeros({1})};
  std::vector<Tensor> m, v;
  for (Tensor& p : params) {
    p.set_requires_grad(true);
    m.push_back(Tensor::zeros(p.shape()));
    v.push_back(Tensor::zeros(p.shape()));
  }
  double last = 0;
  for (int64_t step = 1; step <= 600; ++step) {
    Tensor pred = linear(silu(linear(x, params[0], params[1])), params[2], params[3]);
    Tensor diff = sub(pred, y);
    Tensor loss = mean(mul(diff, diff));
    last = loss.item();
    loss.backward();
    for (size_t i = 0; i < params.size(); ++i) {
      adamw_step(params[i], params[i].grad(), m[i], v[i],
                 AdamWParams{2e-2, 0.9, 0.999, 1e-8, 0.0, step});
      params[i].zero_grad();
    }
  }
  EXPECT_LT(last, 2e-3);
}

}  // namespace
}  // namespace accel
