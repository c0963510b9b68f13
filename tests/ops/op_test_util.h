// Helpers for the op tests: random tensors, closeness checks, and a central finite-difference
// gradient check over any function of tensors.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "runtime/autograd.h"

namespace accel::test {

// Normal(0, 1) values (times `scale`, plus `shift`) from a fixed seed, rounded to dtype.
inline Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::F64, double scale = 1.0,
                    double shift = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (double& x : v) x = shift + scale * dist(gen);
  return Tensor::from_vector(v, shape, dtype);
}

inline Tensor ids_tensor(const std::vector<int64_t>& ids, const Shape& shape,
                         DType dtype = DType::I64) {
  return Tensor::from_vector(ids, shape, dtype);
}

// |a - b| <= atol + rtol * |b| elementwise, with the first few mismatches reported.
inline void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rtol,
                         double atol, const std::string& what = "") {
  ASSERT_EQ(a.size(), b.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool both_nan = std::isnan(a[i]) && std::isnan(b[i]);
    if (both_nan || std::abs(a[i] - b[i]) <= atol + rtol * std::abs(b[i])) continue;
    if (reported++ < 5)
      ADD_FAILURE() << what << " element " << i << ": got " << a[i] << ", expected " << b[i];
  }
}

inline void expect_close(const Tensor& a, const std::vector<double>& b, double rtol, double atol,
                         const std::string& what = "") {
  expect_close(a.to_vector(), b, rtol, atol, what);
}

inline void expect_close(const Tensor& a, const Tensor& b, double rtol, double atol,
                         const std::string& what = "") {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  expect_close(a.to_vector(), b.to_vector(), rtol, atol, what);
}

using TensorFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Checks the gradients autograd gives for every f64 input of fn against central finite
// differences of L = sum(fn(inputs) * W) for a fixed random W, with step h. Inputs must be
// contiguous f64 leaves; fn may take views of them (transposes, expands) before calling ops.
inline void grad_check(const std::string& what, const TensorFn& fn, std::vector<Tensor> inputs,
                       double tol = 1e-6, double h = 1e-6) {
  SCOPED_TRACE(what);
  for (Tensor& x : inputs) {
    ASSERT_EQ(x.dtype(), DType::F64);
    ASSERT_TRUE(x.is_contiguous());
    x.zero_grad();
    x.set_requires_grad(true);
  }
  Tensor out = fn(inputs);
  ASSERT_TRUE(out.requires_grad()) << "output has no autograd history";
  Tensor w = randn(out.shape(), 4242);
  const std::vector<double> wv = w.to_vector();
  sum(mul(out, w)).backward();

  auto loss_at = [&]() {
    NoGradGuard no_grad;
    std::vector<double> o = fn(inputs).to_vector();
    double s = 0.0;
    for (size_t i = 0; i < o.size(); ++i) s += o[i] * wv[i];
    return s;
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& x = inputs[k];
    const int64_t n = x.numel();
    Tensor g = x.grad();
    std::vector<double> analytic = g.defined() ? g.to_vector() : std::vector<double>(n, 0.0);
    ASSERT_EQ(static_cast<int64_t>(analytic.size()), n) << "input " << k;
    double* p = x.data<double>();
    for (int64_t i = 0; i < n; ++i) {
      const double orig = p[i];
      p[i] = orig + h;
      const double up = loss_at();
      p[i] = orig - h;
      const double down = loss_at();
      p[i] = orig;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(analytic[i], numeric, tol * std::max(1.0, std::abs(numeric)))
          << "input " << k << " element " << i;
    }
  }
}

}  // namespace accel::test
