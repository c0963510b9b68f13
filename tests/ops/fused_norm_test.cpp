// The residual add fused into rms_norm (add_rms_norm) and rms_norm's backward folding the
// gradient its input has accumulated so far: both must give the unfused ops' numbers.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/backend.h"
#include "ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {
using test::randn;

void expect_same(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_EQ(a.to_vector(), b.to_vector()) << what;
}

const DType kDtypes[] = {DType::F64, DType::F32, DType::BF16, DType::F16};

TEST(AddRmsNorm, EqualsAddThenRmsNormBitForBit) {
  uint64_t seed = 1;
  for (DType t : kDtypes) {
    for (const Shape& s : {Shape{3, 5, 37}, Shape{4, 64}, Shape{1, 768}}) {
      const std::string what = std::string(dtype_name(t)) + " " + shape_str(s);
      Tensor x = randn(s, seed++, t, 2.0), r = randn(s, seed++, t);
      Tensor w = randn({s.back()}, seed++, t, 0.3, 1.0);
      auto [sum, normed] = add_rms_norm(x, r, w, 1e-5);
      Tensor h = add(x, r);
      expect_same(sum, h, "sum " + what);
      expect_same(normed, rms_norm(h, w, 1e-5), "normed " + what);
    }
  }
  // Non-contiguous inputs are copied first; same values.
  Tensor x = randn({6, 4}, 90, DType::F32), r = randn({4, 6}, 91, DType::F32);
  Tensor w = randn({4}, 92, DType::F32);
  auto [sum, normed] = add_rms_norm(x, transpose(r, 0, 1), w, 1e-5);
  Tensor h = add(x, transpose(r, 0, 1));
  expect_same(sum, h, "transposed r: sum");
  expect_same(normed, rms_norm(h, w, 1e-5), "transposed r: normed");
}

TEST(AddRmsNorm, ErrorsNameTheOp) {
  Tensor x = Tensor::ones({2, 4}), w = Tensor::ones({4});
  try {
    add_rms_norm(x, Tensor::ones({1, 4}), w, 1e-5);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[add_rms_norm]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(add_rms_norm(x, x, Tensor::ones({3}), 1e-5), std::invalid_argument);
  EXPECT_THROW(add_rms_norm(x, Tensor::ones({2, 4}, DType::F64), w, 1e-5), std::invalid_argument);
}

// Leaf gradients of a small block: h = x + r (r itself computed), y = norm(h), out = h + y * c,
// loss = sum(out * d); through add_rms_norm and through add + rms_norm.
std::vector<Tensor> block_grads(DType t, bool fused) {
  Tensor x = randn({5, 16}, 11, t), p = randn({5, 16}, 12, t), w = randn({16}, 13, t, 0.3, 1.0);
  Tensor c = randn({5, 16}, 14, t), d = randn({5, 16}, 15, t);
  for (Tensor* l : {&x, &p, &w}) l->set_requires_grad(true);
  Tensor r = mul(p, p);
  Tensor h, y;
  if (fused) {
    std::tie(h, y) = add_rms_norm(x, r, w, 1e-5);
  } else {
    h = add(x, r);
    y = rms_norm(h, w, 1e-5);
  }
  // The same two nodes either way; the norm's folds the gradient of its input (h).
  EXPECT_STREQ(h.grad_fn()->name, "add");
  EXPECT_STREQ(y.grad_fn()->name, "rms_norm");
  EXPECT_EQ(y.grad_fn()->fold_input, 0);
  EXPECT_EQ(y.grad_fn()->inputs[0].impl(), h.impl());
  sum(mul(add(h, mul(y, c)), d)).backward();
  return {x.grad(), p.grad(), w.grad()};
}

TEST(AddRmsNorm, GradientsEqualTheUnfusedOpsBitForBit) {
  for (DType t : {DType::F64, DType::F32, DType::BF16}) {
    std::vector<Tensor> a = block_grads(t, true), b = block_grads(t, false);
    for (size_t i = 0; i < a.size(); ++i)
      expect_same(a[i], b[i], std::string(dtype_name(t)) + " grad " + std::to_string(i));
  }
}

// A graph around rms_norm(a, w) where `a` has other consumers that run before and/or after the
// norm's node in backward. With fold = false the norm reads a copy m = a * 1 (exact), so nothing
// is pending at its node and the engine sums a's gradients the unfused way.
using Graph = std::function<Tensor(const Tensor& a, const std::function<Tensor(const Tensor&)>&)>;

std::vector<Tensor> graph_grads(DType t, const Graph& graph, bool fold, int passes, bool retain) {
  Tensor x = randn({3, 24}, 21, t), w = randn({24}, 22, t, 0.3, 1.0);
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  Tensor c = randn({3, 24}, 23, t);
  auto norm = [&](const Tensor& a) { return rms_norm(fold ? a : mul(a, 1.0), w, 1e-5); };
  if (retain) {
    Tensor loss = sum(mul(graph(mul(x, 0.75), norm), c));
    for (int i = 0; i < passes; ++i) loss.backward(Tensor(), /*retain_graph=*/i + 1 < passes);
  } else {
    for (int i = 0; i < passes; ++i) {
      sum(mul(graph(x, norm), c)).backward();  // x (a leaf) is the norm's input
      sum(mul(graph(mul(x, 0.75), norm), c)).backward();
    }
  }
  return {x.grad(), w.grad()};
}

TEST(RmsNormFold, EqualsTheUnfoldedSumForAnyConsumerOrder) {
  using N = std::function<Tensor(const Tensor&)>;
  // The backward runs a node after another when it comes earlier in the inputs of their common
  // consumer (depth-first order); the comments say which consumers of `a` run before the norm.
  const std::pair<const char*, Graph> graphs[] = {
      {"no other consumer", [](const Tensor& a, const N& norm) { return norm(a); }},
      {"one before", [](const Tensor& a, const N& norm) { return add(norm(a), a); }},
      {"one after", [](const Tensor& a, const N& norm) { return mul(exp(a), norm(a)); }},
      {"two before",
       [](const Tensor& a, const N& norm) { return add(add(norm(a), a), mul(a, a)); }},
      {"one before, one after",
       [](const Tensor& a, const N& norm) { return add(mul(tanh(a), norm(a)), a); }},
      {"two after", [](const Tensor& a, const N& norm) { return mul(add(exp(a), a), norm(a)); }},
      {"residual chain (Llama blocks)", [](const Tensor& a, const N& norm) {
         Tensor h = add(a, tanh(norm(a)));
         return add(h, tanh(norm(h)));
       }}};
  for (const auto& [name, graph] : graphs) {
    for (DType t : {DType::F64, DType::F32, DType::BF16}) {
      for (auto [passes, retain] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
        const std::string what = std::string(name) + ", " + dtype_name(t) + ", " +
                                 std::to_string(passes) + " pass(es)" +
                                 (retain ? ", retained graph" : "");
        std::vector<Tensor> got = graph_grads(t, graph, true, passes, retain);
        std::vector<Tensor> want = graph_grads(t, graph, false, passes, retain);
        for (size_t i = 0; i < got.size(); ++i) {
          if (t == DType::BF16) {
            // One rounding of (norm's gradient + pending) instead of two.
            test::expect_close(got[i], want[i], 2e-2, 2e-2, what);
          } else {
            // fp32/fp64: the fold adds in the dtype itself, exactly as the separate sum.
            expect_same(got[i], want[i], what + " grad " + std::to_string(i));
          }
        }
      }
    }
  }
}

TEST(RmsNormBackendFold, GradXAddEqualsBackwardThenAdd) {
  Backend& be = cpu_backend();
  for (DType t : kDtypes) {
    const std::string what = dtype_name(t);
    const int64_t rows = 7, d = 40;
    const DType rt = t == DType::F64 ? DType::F64 : DType::F32;
    Tensor x = randn({rows, d}, 31, t), w = randn({d}, 32, t, 0.3, 1.0);
    Tensor g = randn({rows, d}, 33, t), pend = randn({d, rows}, 34, t);  // transposed below
    Tensor out = Tensor::empty({rows, d}, t), rstd = Tensor::empty({rows}, rt);
    be.rms_norm(out, rstd, x, w, 1e-5);
    Tensor gx = Tensor::empty({rows, d}, t), gw = Tensor::empty({d}, t);
    be.rms_norm_backward(gx, gw, g, x, w, rstd, Tensor());
    Tensor pv = transpose(pend, 0, 1);  // a strided pending gradient
    Tensor fx = Tensor::empty({rows, d}, t), fw = Tensor::empty({d}, t);
    be.rms_norm_backward(fx, fw, g, x, w, rstd, pv);
    expect_same(fw, gw, what + " grad_weight unchanged by the fold");
    Tensor want = add(gx, pv);
    if (t == DType::F64 || t == DType::F32)
      expect_same(fx, want, what + " grad_x + grad_x_add");
    else
      test::expect_close(fx, want, 1e-2, 1e-2, what + " grad_x + grad_x_add");
    EXPECT_THROW(be.rms_norm_backward(Tensor(), gw, g, x, w, rstd, pv), std::logic_error);
  }
}

}  // namespace
}  // namespace accel
