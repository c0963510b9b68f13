// Bad input: exceptions of the right type whose message starts with "[op]" and names the
// offending shapes or dtypes. Never a crash or a silent wrong answer.
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "op_test_util.h"
#include "ops/backend.h"

namespace accel {
namespace {

template <class E>
void expect_error(const std::function<void()>& fn, const std::string& prefix,
                  const std::vector<std::string>& mentions) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(prefix, 0), 0u) << "message does not start with " << prefix << ": " << msg;
    for (const std::string& m : mentions)
      EXPECT_NE(msg.find(m), std::string::npos) << "message does not mention " << m << ": " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type for " << prefix << ": " << e.what();
    return;
  }
  ADD_FAILURE() << "no exception for " << prefix;
}

using IA = std::invalid_argument;

TEST(OpErrors, ShapeMismatches) {
  Tensor a = Tensor::zeros({2, 3}), b = Tensor::zeros({4});
  expect_error<IA>([&] { add(a, b); }, "[add]", {"[2, 3]", "[4]"});
  expect_error<IA>([&] { mul(a, Tensor::zeros({3, 2})); }, "[mul]", {"[2, 3]", "[3, 2]"});
  expect_error<IA>([&] { matmul(a, Tensor::zeros({4, 5})); }, "[matmul]", {"[2, 3]", "[4, 5]"});
  expect_error<IA>([&] { linear(a, Tensor::zeros({5, 4})); }, "[linear]", {"[2, 3]", "[5, 4]"});
  expect_error<IA>([&] { rms_norm(a, Tensor::ones({4}), 1e-5); }, "[rms_norm]", {"[4]", "[2, 3]"});
  expect_error<IA>([&] { swiglu(a, Tensor::zeros({3, 2})); }, "[swiglu]", {"[2, 3]", "[3, 2]"});
  expect_error<IA>([&] { cat({a, Tensor::zeros({2, 4})}, 0); }, "[cat]", {"[2, 3]", "[2, 4]"});
  expect_error<IA>([&] { reshape(a, {5}); }, "[reshape]", {"[5]"});
  expect_error<IA>(
      [&] {
        rope(Tensor::zeros({1, 2, 3, 5}), default_rope_frequencies(1e4, 4));
      },
      "[rope]", {"[1, 2, 3, 5]"});
  expect_error<IA>(
      [&] {
        rope(Tensor::zeros({1, 2, 3, 8}), default_rope_frequencies(1e4, 4));
      },
      "[rope]", {"D/2 = 4", "got 2"});
  expect_error<IA>(
      [&] {
        rope(Tensor::zeros({1, 2, 3, 4}), default_rope_frequencies(1e4, 4), 0,
             Tensor::zeros({1, 3}, DType::I64));
      },
      "[rope]", {"position_ids", "[1, 2]"});
  expect_error<IA>(
      [&] {
        rope(Tensor::zeros({1, 2, 3, 4}), default_rope_frequencies(1e4, 4), 0,
             Tensor::zeros({1, 2}, DType::F32));
      },
      "[rope]", {"I64 or I32"});
  expect_error<IA>(
      [&] {
        attention(Tensor::zeros({1, 4, 3, 8}), Tensor::zeros({1, 4, 2, 8}),
                  Tensor::zeros({1, 4, 2, 8}));
      },
      "[attention]", {"[1, 4, 3, 8]", "[1, 4, 2, 8]"});
  {
    const Tensor q = Tensor::zeros({2, 4, 2, 8}), kv = Tensor::zeros({2, 4, 1, 8});
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{false, 3, {}});
        },
        "[attention]", {"causal"});
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{true, -1, {}});
        },
        "[attention]", {"window", "-1"});
    const Tensor seg = Tensor::zeros({2, 4}, DType::I32);
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{false, 0, seg});
        },
        "[attention]", {"causal"});
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{true, 0, Tensor::zeros({2, 5}, DType::I32)});
        },
        "[attention]", {"segment_ids", "[2, 4]", "[2, 5]"});
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{true, 0, Tensor::zeros({2, 4}, DType::I64)});
        },
        "[attention]", {"segment_ids", "int32", "i64"});
    expect_error<IA>(
        [&] {
          attention(q, kv, kv, AttentionMask{true, 0, Tensor::zeros({8}, DType::I32)});
        },
        "[attention]", {"segment_ids", "[8]"});
  }
  expect_error<IA>(
      [&] {
        cross_entropy(Tensor::zeros({3, 5}), Tensor::zeros({2}, DType::I64));
      },
      "[cross_entropy]", {"[2]"});
  expect_error<IA>([&] { max(Tensor::zeros({2, 0}), 1); }, "[max]", {"[2, 0]"});
  expect_error<IA>([&] { sum(a, {2}); }, "[sum]", {"2"});
}

TEST(OpErrors, DtypeMismatches) {
  Tensor f = Tensor::zeros({2}), d = Tensor::zeros({2}, DType::F64);
  expect_error<IA>([&] { add(f, d); }, "[add]", {"f32", "f64"});
  expect_error<IA>(
      [&] {
        matmul(Tensor::zeros({2, 2}), Tensor::zeros({2, 2}, DType::BF16));
      },
      "[matmul]", {"f32", "bf16"});
  expect_error<IA>([&] { where(f, f, f); }, "[where]", {"bool"});
  expect_error<IA>([&] { exp(Tensor::zeros({2}, DType::I64)); }, "[exp]", {"i64"});
  expect_error<IA>(
      [&] {
        embedding(Tensor::zeros({4, 2}), Tensor::zeros({2}));
      },
      "[embedding]", {"f32"});
  Tensor i = Tensor::zeros({2}, DType::I32);
  expect_error<IA>([&] { div(i, i); }, "[div]", {"i32"});
  // Optimizer kernels: bf16 master weights without their stochastic rounding, and mismatched
  // state, are refused.
  Tensor pb = Tensor::zeros({3}, DType::BF16);
  expect_error<IA>(
      [&] {
        adamw_step(pb, pb, Tensor::zeros({3}, DType::BF16), Tensor::zeros({3}, DType::BF16),
                   AdamWParams{1e-3, 0.9, 0.999, 1e-8, 0.0, 1});
      },
      "[adamw_step]", {"bf16"});
  expect_error<IA>(
      [&] {
        adamw_step(Tensor::zeros({3}), Tensor::zeros({4}), Tensor::zeros({3}), Tensor::zeros({3}),
                   AdamWParams{1e-3, 0.9, 0.999, 1e-8, 0.0, 1});
      },
      "[adamw_step]", {"[3]", "[4]"});
}

TEST(OpErrors, OutOfRangeIndices) {
  Tensor w = Tensor::zeros({5, 3});
  expect_error<std::out_of_range>(
      [&] {
        embedding(w, test::ids_tensor({1, 5}, {2}));
      },
      "[embedding]", {"id 5", "[0, 5)", "[5, 3]"});
  expect_error<std::out_of_range>([&] { embedding(w, test::ids_tensor({-1}, {1}, DType::I32)); },
                                  "[embedding]", {"id -1"});
  expect_error<std::out_of_range>(
      [&] {
        cross_entropy(Tensor::zeros({2, 4}), test::ids_tensor({0, 4}, {2}));
      },
      "[cross_entropy]", {"target 4", "[2, 4]"});
  // ignore_index itself is fine even though it is out of range.
  EXPECT_NO_THROW(cross_entropy(Tensor::zeros({2, 4}), test::ids_tensor({0, -100}, {2})));
  expect_error<IA>([&] { narrow(w, 0, 3, 4); }, "[narrow]", {"[5, 3]"});
  expect_error<IA>([&] { transpose(w, 0, 2); }, "[transpose]", {"2"});
}

TEST(OpErrors, DeviceMismatchOrMissingCuda) {
#ifdef ACCEL_WITH_CUDA
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  Tensor c = Tensor::zeros({2}, DType::F32, Device::cuda(0));
  expect_error<IA>([&] { add(Tensor::zeros({2}), c); }, "[add]", {"cpu", "cuda:0"});
  expect_error<IA>(
      [&] {
        matmul(Tensor::zeros({2, 2}), Tensor::zeros({2, 2}, DType::F32, Device::cuda(0)));
      },
      "[matmul]", {"cpu", "cuda:0"});
#else
  expect_error<std::runtime_error>([] { cuda_backend(); }, "[cuda_backend]", {"no CUDA backend"});
  expect_error<std::runtime_error>([] { backend_for(Device::cuda(0)); }, "[cuda_backend]",
                                   {"no CUDA backend"});
#endif
}

}  // namespace
}  // namespace accel
