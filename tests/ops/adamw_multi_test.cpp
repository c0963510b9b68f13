// The multi-tensor AdamW op (adamw_step_multi, optional compute copies) and the Optimizer's use of
// it: bit for bit the numbers of per-tensor adamw_step followed by copy_, on the CPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "ops/optimizer.h"
#include "runtime/tensor.h"

namespace accel {
namespace {

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, double lo = -1.0,
                     double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (double& x : v) x = dist(rng);
  return Tensor::from_vector(v, shape, dtype);
}

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  c.copy_(t);
  return c;
}

// Same dtype, shape and bytes.
void expect_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()), 0)
      << what << " differs from the per-tensor path";
}

// A mixed list: fp32 and bf16 grads, odd sizes, and (in the optimizer tests) one without a grad.
struct Case {
  std::vector<Tensor> p, g, m, v;
};
const std::vector<int64_t> kSizes = {1, 7, 4099, 64, 3, 1000};

Case make_case(std::mt19937_64& rng) {
  Case c;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const Shape shape = i == 3 ? Shape{8, 8} : Shape{kSizes[i]};
    c.p.push_back(random_tensor(shape, DType::F32, rng));
    c.g.push_back(random_tensor(shape, i % 2 ? DType::BF16 : DType::F32, rng));
    c.m.push_back(random_tensor(shape, DType::F32, rng, -0.1, 0.1));
    c.v.push_back(random_tensor(shape, DType::F32, rng, 0.0, 0.01));
  }
  return c;
}

Case clone_case(const Case& c) {
  Case d;
  for (size_t i = 0; i < c.p.size(); ++i) {
    d.p.push_back(copy_of(c.p[i]));
    d.g.push_back(copy_of(c.g[i]));
    d.m.push_back(copy_of(c.m[i]));
    d.v.push_back(copy_of(c.v[i]));
  }
  return d;
}

TEST(AdamWMulti, EqualsPerTensorStepThenCopyBitForBit) {
  std::mt19937_64 rng(11);
  Case a = make_case(rng);
  Case b = clone_case(a);
  std::vector<Tensor> copies, ref_copies;
  for (size_t i = 0; i < a.p.size(); ++i) {
    const DType cdt = i % 3 == 2 ? DType::F16 : DType::BF16;
    copies.push_back(Tensor::full(a.p[i].shape(), NAN, cdt));  // poisoned
    ref_copies.push_back(Tensor::empty(a.p[i].shape(), cdt));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    const AdamWParams h{1e-2, 0.9, 0.95, 1e-8, 0.1, step};
    adamw_step_multi(a.p, a.g, a.m, a.v, h, 0.37, copies);
    for (size_t i = 0; i < b.p.size(); ++i) {
      adamw_step(b.p[i], b.g[i], b.m[i], b.v[i], h, 0.37);
      ref_copies[i].copy_(b.p[i]);
    }
  }
  for (size_t i = 0; i < a.p.size(); ++i) {
    const std::string what = "tensor " + std::to_string(i);
    expect_bits(a.p[i], b.p[i], what + " param");
    expect_bits(a.m[i], b.m[i], what + " exp_avg");
    expect_bits(a.v[i], b.v[i], what + " exp_avg_sq");
    expect_bits(copies[i], ref_copies[i], what + " compute copy");
  }
}

TEST(AdamWMulti, WithoutCopiesAndEmptyLists) {
  std::mt19937_64 rng(12);
  Case a = make_case(rng);
  Case b = clone_case(a);
  const AdamWParams h{3e-3, 0.9, 0.999, 1e-8, 0.01, 1};
  adamw_step_multi(a.p, a.g, a.m, a.v, h);
  for (size_t i = 0; i < b.p.size(); ++i) adamw_step(b.p[i], b.g[i], b.m[i], b.v[i], h);
  for (size_t i = 0; i < a.p.size(); ++i) expect_bits(a.p[i], b.p[i], "param " + std::to_string(i));
  EXPECT_NO_THROW(adamw_step_multi({}, {}, {}, {}, h));
}

TEST(AdamWMulti, RejectsMismatchedLists) {
  std::mt19937_64 rng(13);
  Case a = make_case(rng);
  const AdamWParams h{1e-3, 0.9, 0.999, 1e-8, 0.0, 1};
  std::vector<Tensor> short_g(a.g.begin(), a.g.end() - 1);
  EXPECT_THROW(adamw_step_multi(a.p, short_g, a.m, a.v, h), std::invalid_argument);
  std::vector<Tensor> one_copy = {Tensor::empty(a.p[0].shape(), DType::BF16)};
  EXPECT_THROW(adamw_step_multi(a.p, a.g, a.m, a.v, h, 1.0, one_copy), std::invalid_argument);
  std::vector<Tensor> f32_copies;
  for (const Tensor& p : a.p) f32_copies.push_back(Tensor::empty(p.shape(), DType::F32));
  EXPECT_THROW(adamw_step_multi(a.p, a.g, a.m, a.v, h, 1.0, f32_copies), std::invalid_argument);
  std::vector<Tensor> wrong_shape;
  for (const Tensor& p : a.p) wrong_shape.push_back(Tensor::empty({p.numel() + 1}, DType::BF16));
  EXPECT_THROW(adamw_step_multi(a.p, a.g, a.m, a.v, h, 1.0, wrong_shape), std::invalid_argument);
}

// The Optimizer with compute copies against today's path: an Optimizer without them followed by a
// copy_ of every param; the param without a grad and its copy are left alone.
void optimizer_matches_step_then_copy(OptimizerName name) {
  SCOPED_TRACE(name_of(name));
  std::mt19937_64 rng(14);
  Case a = make_case(rng);
  Case b = clone_case(a);
  std::vector<std::string> names;
  std::vector<Tensor> copies, ref_copies;
  for (size_t i = 0; i < a.p.size(); ++i) {
    names.push_back("w" + std::to_string(i));
    copies.push_back(Tensor::empty(a.p[i].shape(), i == 4 ? DType::F16 : DType::BF16));
    copies.back().copy_(a.p[i]);
    ref_copies.push_back(copy_of(copies.back()));
  }
  OptimizerOptions opts;
  opts.name = name;
  Optimizer with(opts, a.p, names, copies);
  Optimizer without(opts, b.p, names);
  const size_t skipped = 2;
  std::vector<Tensor> ga = a.g, gb = b.g;
  ga[skipped] = Tensor();
  gb[skipped] = Tensor();
  const Tensor skipped_param = copy_of(a.p[skipped]);
  const Tensor skipped_copy = copy_of(copies[skipped]);
  for (int step = 0; step < 3; ++step) {
    with.step(ga, 1e-2 * (step + 1), 0.5);
    without.step(gb, 1e-2 * (step + 1), 0.5);
    for (size_t i = 0; i < b.p.size(); ++i)
      if (gb[i].defined()) ref_copies[i].copy_(b.p[i]);
  }
  EXPECT_EQ(with.step_count(), 3);
  for (size_t i = 0; i < a.p.size(); ++i) {
    const std::string what = names[i];
    expect_bits(a.p[i], b.p[i], what + " param");
    expect_bits(copies[i], ref_copies[i], what + " compute copy");
  }
  const auto sa = with.state_tensors(), sb = without.state_tensors();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) expect_bits(sa[i].second, sb[i].second, sa[i].first);
  expect_bits(a.p[skipped], skipped_param, "param without grad");
  expect_bits(copies[skipped], skipped_copy, "copy of the param without grad");
}

TEST(AdamWMulti, OptimizerWithCopiesEqualsStepThenCopy) {
  optimizer_matches_step_then_copy(OptimizerName::AdamW);
}
TEST(AdamWMulti, SgdOptimizerWithCopiesEqualsStepThenCopy) {
  optimizer_matches_step_then_copy(OptimizerName::Sgd);
}

TEST(AdamWMulti, OptimizerRejectsBadCopies) {
  OptimizerOptions opts;
  std::vector<Tensor> params = {Tensor::zeros({4}), Tensor::zeros({3})};
  std::vector<std::string> names = {"a", "b"};
  EXPECT_THROW(Optimizer(opts, params, names, {Tensor::zeros({4}, DType::BF16)}), std::logic_error);
  EXPECT_THROW(Optimizer(opts, params, names,
                         {Tensor::zeros({4}, DType::BF16), Tensor::zeros({4}, DType::BF16)}),
               std::logic_error);
  EXPECT_THROW(Optimizer(opts, params, names, {Tensor::zeros({4}, DType::F32), Tensor::zeros({3})}),
               std::logic_error);
  EXPECT_NO_THROW(Optimizer(opts, params, names,
                            {Tensor::zeros({4}, DType::BF16), Tensor::zeros({3}, DType::F16)}));
}

}  // namespace
}  // namespace accel
