// Elementwise CUDA kernels against the CPU backend: unary, scalar, binary (with broadcast views),
// where, swiglu forward/backward, and the Philox generators.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {
using namespace cuda_test;

class CudaElementwise : public ::testing::TestWithParam<DType> {};

TEST_P(CudaElementwise, Unary) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const UnaryOp ops[] = {UnaryOp::Neg,   UnaryOp::Exp,  UnaryOp::Log,     UnaryOp::Sqrt,
                         UnaryOp::Rsqrt, UnaryOp::Abs,  UnaryOp::Sigmoid, UnaryOp::Silu,
                         UnaryOp::Gelu,  UnaryOp::Tanh, UnaryOp::Square};
  for (UnaryOp op : ops) {
    const bool positive = op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt;
    Tensor x = random_tensor({3, 1031}, t, rng, positive ? 0.1 : -3.0, 3.0);
    Tensor want = cpu_out(x.shape(), t);
    cpu_backend().unary(op, want, x);
    Tensor got = poisoned(x.shape(), t);
    cuda_backend().unary(op, got, x.to(gpu()));
    expect_matches(got, want, t, "unary op " + std::to_string(int(op)), 2.0);
    // A strided (transposed) input takes the generic path.
    Tensor xt = x.as_strided({1031, 3}, {1, 1031}, 0);
    Tensor want_t = cpu_out({1031, 3}, t);
    cpu_backend().unary(op, want_t, xt);
    Tensor got_t = poisoned({1031, 3}, t);
    cuda_backend().unary(op, got_t, x.to(gpu()).as_strided({1031, 3}, {1, 1031}, 0));
    expect_matches(got_t, want_t, t, "strided unary op " + std::to_string(int(op)), 2.0);
  }
}

TEST_P(CudaElementwise, Scalar) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({4099}, t, rng, 0.1, 2.0);
  Tensor xg = x.to(gpu());
  struct Case {
    const char* name;
    void (Backend::*fn)(const Tensor&, const Tensor&, double);
    double s;
  } cases[] = {{"add", &Backend::add_scalar, 0.75},
               {"mul", &Backend::mul_scalar, -1.5},
               {"pow2", &Backend::pow_scalar, 2.0},
               {"pow", &Backend::pow_scalar, 1.7}};
  for (const Case& c : cases) {
    Tensor want = cpu_out(x.shape(), t);
    (cpu_backend().*c.fn)(want, x, c.s);
    Tensor got = poisoned(x.shape(), t);
    (cuda_backend().*c.fn)(got, xg, c.s);
    expect_matches(got, want, t, c.name, 2.0);
  }
}

TEST_P(CudaElementwise, BinaryWithBroadcast) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor a = random_tensor({8, 129}, t, rng, 0.5, 2.0);
  Tensor b_full = random_tensor({8, 129}, t, rng, 0.5, 2.0);
  Tensor b_row = random_tensor({1, 129}, t, rng, 0.5, 2.0);
  Tensor b_row_cpu = b_row.as_strided({8, 129}, {0, 1}, 0);
  Tensor b_row_gpu = b_row.to(gpu()).as_strided({8, 129}, {0, 1}, 0);
  const BinaryOp ops[] = {BinaryOp::Add,     BinaryOp::Sub,     BinaryOp::Mul,  BinaryOp::Div,
                          BinaryOp::Maximum, BinaryOp::Greater, BinaryOp::Equal};
  for (BinaryOp op : ops) {
    const bool cmp = op == BinaryOp::Greater || op == BinaryOp::Equal;
    const DType ot = cmp ? DType::Bool : t;
    for (int bcast = 0; bcast < 2; ++bcast) {
      Tensor bc = bcast ? b_row_cpu : b_full;
      Tensor bg = bcast ? b_row_gpu : b_full.to(gpu());
      Tensor want = cpu_out({8, 129}, ot);
      cpu_backend().binary(op, want, a, bc);
      Tensor got = poisoned({8, 129}, ot);
      cuda_backend().binary(op, got, a.to(gpu()), bg);
      expect_matches(got, want, t,
                     "binary op " + std::to_string(int(op)) + (bcast ? " broadcast" : ""));
    }
  }
}

// A single device element broadcast against a contiguous tensor, on either side (vectorized path;
// 8 x 129 elements also exercise the tail).
TEST_P(CudaElementwise, BinaryWithBroadcastScalar) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor a = random_tensor({8, 129}, t, rng, 0.5, 2.0);
  Tensor s = random_tensor({1}, t, rng, 0.5, 2.0);
  Tensor s_cpu = s.as_strided({8, 129}, {0, 0}, 0);
  Tensor s_gpu = s.to(gpu()).as_strided({8, 129}, {0, 0}, 0);
  Tensor ag = a.to(gpu());
  const BinaryOp ops[] = {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div,
                          BinaryOp::Maximum};
  for (BinaryOp op : ops) {
    for (int first = 0; first < 2; ++first) {
      Tensor want = cpu_out({8, 129}, t);
      Tensor got = poisoned({8, 129}, t);
      if (first) {
        cpu_backend().binary(op, want, s_cpu, a);
        cuda_backend().binary(op, got, s_gpu, ag);
      } else {
        cpu_backend().binary(op, want, a, s_cpu);
        cuda_backend().binary(op, got, ag, s_gpu);
      }
      expect_matches(
          got, want, t,
          "binary op " + std::to_string(int(op)) + (first ? " scalar first" : " scalar"));
    }
  }
}

TEST_P(CudaElementwise, Where) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor cond = random_ints({6, 50}, 0, 2, rng, DType::Bool);
  Tensor a = random_tensor({6, 50}, t, rng);
  Tensor b = random_tensor({1, 50}, t, rng);
  Tensor want = cpu_out({6, 50}, t);
  cpu_backend().where(want, cond, a, b.as_strided({6, 50}, {0, 1}, 0));
  Tensor got = poisoned({6, 50}, t);
  cuda_backend().where(got, cond.to(gpu()), a.to(gpu()),
                       b.to(gpu()).as_strided({6, 50}, {0, 1}, 0));
  expect_close(got, want, 0, 0, "where");
}

TEST_P(CudaElementwise, SwigluForwardBackward) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const Shape s{3, 7, 344};
  Tensor gate = random_tensor(s, t, rng, -4, 4), up = random_tensor(s, t, rng, -2, 2);
  Tensor dout = random_tensor(s, t, rng);
  Tensor want = cpu_out(s, t);
  cpu_backend().swiglu(want, gate, up);
  Tensor got = poisoned(s, t);
  cuda_backend().swiglu(got, gate.to(gpu()), up.to(gpu()));
  expect_matches(got, want, t, "swiglu");
  Tensor wg = cpu_out(s, t), wu = cpu_out(s, t);
  cpu_backend().swiglu_backward(wg, wu, dout, gate, up);
  Tensor gg = poisoned(s, t), gu = poisoned(s, t);
  cuda_backend().swiglu_backward(gg, gu, dout.to(gpu()), gate.to(gpu()), up.to(gpu()));
  expect_matches(gg, wg, t, "swiglu grad_gate");
  expect_matches(gu, wu, t, "swiglu grad_up");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaElementwise,
                         ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaElementwiseInt, IntegerBinaryAndNeg) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor a = random_ints({300}, -1000, 1000, rng), b = random_ints({300}, -1000, 1000, rng);
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Mul, BinaryOp::Maximum, BinaryOp::Equal}) {
    const DType ot = op == BinaryOp::Equal ? DType::Bool : DType::I64;
    Tensor want = cpu_out({300}, ot);
    cpu_backend().binary(op, want, a, b);
    Tensor got = poisoned({300}, ot);
    cuda_backend().binary(op, got, a.to(gpu()), b.to(gpu()));
    expect_close(got, want, 0, 0, "int binary " + std::to_string(int(op)));
  }
  Tensor want = cpu_out({300}, DType::I64);
  cpu_backend().unary(UnaryOp::Neg, want, a);
  Tensor got = poisoned({300}, DType::I64);
  cuda_backend().unary(UnaryOp::Neg, got, a.to(gpu()));
  expect_close(got, want, 0, 0, "int neg");
}

TEST(CudaRandom, SameStreamAsCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed(), offset = 12345;
  SCOPED_TRACE(seed_note(seed));
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor want = cpu_out({10007}, t);
    cpu_backend().rand_uniform(want, seed, offset, -2.0, 3.0);
    Tensor got = poisoned({10007}, t);
    cuda_backend().rand_uniform(got, seed, offset, -2.0, 3.0);
    expect_close(got, want, 0, 0, "rand_uniform is bit-identical");
    Tensor wn = cpu_out({10007}, t);
    cpu_backend().rand_normal(wn, seed, offset, 0.5, 0.02);
    Tensor gn = poisoned({10007}, t);
    cuda_backend().rand_normal(gn, seed, offset, 0.5, 0.02);
    // log/cos/sqrt of the device math library may differ from libm by an ulp or two.
    expect_close(gn, wn, t == DType::F32 ? 1e-5 : 1e-2, 0, "rand_normal");
  }
}

}  // namespace
}  // namespace accel
