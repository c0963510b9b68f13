// Every differentiable op against central finite differences in f64, including broadcasting,
// non-contiguous (transposed, narrowed) inputs and empty dimensions.
#include <gtest/gtest.h>

#include "op_test_util.h"

namespace accel {
namespace {
using test::grad_check;
using test::randn;

using V = std::vector<Tensor>;

TEST(GradCheck, BinaryWithBroadcasting) {
  Tensor a = randn({3, 4}, 1), b = randn({4}, 2), c = randn({3, 1}, 3);
  grad_check("add", [](const V& x) { return add(x[0], x[1]); }, {a, b});
  grad_check("sub", [](const V& x) { return sub(x[0], x[1]); }, {a, c});
  grad_check("mul", [](const V& x) { return mul(x[0], x[1]); }, {c, b});
  Tensor pos = randn({4}, 4, DType::F64, 0.3, 2.0);
  grad_check("div", [](const V& x) { return div(x[0], x[1]); }, {a, pos});
  grad_check("maximum", [](const V& x) { return maximum(x[0], x[1]); }, {a, b});
  // Leading broadcast dims and a 0-d operand.
  Tensor s = randn({}, 5);
  grad_check("mul 0-d", [](const V& x) { return mul(x[0], x[1]); }, {randn({2, 3, 4}, 6), s});
}

TEST(GradCheck, ScalarForms) {
  Tensor a = randn({2, 5}, 7);
  grad_check("add scalar", [](const V& x) { return add(x[0], 1.5); }, {a});
  grad_check("mul scalar", [](const V& x) { return mul(x[0], -2.5); }, {a});
  Tensor pos = randn({2, 5}, 8, DType::F64, 0.2, 1.5);
  grad_check("pow 3", [](const V& x) { return pow(x[0], 3.0); }, {a});
  grad_check("pow -0.7", [](const V& x) { return pow(x[0], -0.7); }, {pos});
}

TEST(GradCheck, Unary) {
  Tensor a = randn({3, 5}, 9);
  Tensor pos = randn({3, 5}, 10, DType::F64, 0.3, 2.0);
  grad_check("neg", [](const V& x) { return neg(x[0]); }, {a});
  grad_check("exp", [](const V& x) { return exp(x[0]); }, {a});
  grad_check("log", [](const V& x) { return log(x[0]); }, {pos});
  grad_check("sqrt", [](const V& x) { return sqrt(x[0]); }, {pos});
  grad_check("rsqrt", [](const V& x) { return rsqrt(x[0]); }, {pos});
  grad_check("abs", [](const V& x) { return abs(x[0]); }, {a});
  grad_check("sigmoid", [](const V& x) { return sigmoid(x[0]); }, {a});
  grad_check("silu", [](const V& x) { return silu(x[0]); }, {a});
  grad_check("gelu", [](const V& x) { return gelu(x[0]); }, {randn({3, 5}, 11, DType::F64, 2.0)});
  grad_check("tanh", [](const V& x) { return tanh(x[0]); }, {a});
}

TEST(GradCheck, NonContiguousInputs) {
  Tensor a = randn({4, 3}, 12), b = randn({3, 4}, 13);
  // Transposed views go through the strided paths of the elementwise kernels.
  grad_check("gelu(x^T)", [](const V& x) { return gelu(transpose(x[0], 0, 1)); }, {a});
  grad_check("x^T * y", [](const V& x) { return mul(transpose(x[0], 0, 1), x[1]); }, {a, b});
  grad_check("narrow + exp", [](const V& x) { return exp(narrow(transpose(x[0], 0, 1), 1, 1, 2)); },
             {a});
  grad_check("permute + sum",
             [](const V& x) {
               return sum(permute(x[0], {2, 0, 1}), {0, 2});
             },
             {randn({2, 3, 4}, 14)});
  grad_check("expand + mul",
             [](const V& x) {
               return mul(expand(x[0], {3, 4}), x[1]);
             },
             {randn({1, 4}, 15), b});
}

TEST(GradCheck, WhereAndMaskedFill) {
  Tensor a = randn({3, 4}, 16), b = randn({4}, 17);
  Tensor cond = greater(randn({3, 4}, 18), Tensor::zeros({}, DType::F64));
  grad_check("where", [cond](const V& x) { return where(cond, x[0], x[1]); }, {a, b});
  grad_check("masked_fill", [cond](const V& x) { return masked_fill(x[0], cond, -3.0); }, {a});
  Tensor row_cond = greater(randn({4}, 71), Tensor::zeros({}, DType::F64));  // broadcast condition
  grad_check("where broadcast cond", [row_cond](const V& x) { return where(row_cond, x[0], x[1]); },
             {a, randn({3, 1}, 72)});
}

TEST(GradCheck, Reductions) {
  Tensor a = randn({2, 3, 4}, 19);
  grad_check("sum all", [](const V& x) { return sum(x[0]); }, {a});
  grad_check("sum dims", [](const V& x) { return sum(x[0], {0, 2}); }, {a});
  grad_check("sum keepdim", [](const V& x) { return sum(x[0], {-1}, true); }, {a});
  grad_check("mean", [](const V& x) { return mean(x[0], {1}); }, {a});
  grad_check("max", [](const V& x) { return max(x[0], 1); }, {a});
  grad_check("max keepdim last", [](const V& x) { return max(x[0], -1, true); }, {a});
  grad_check("max of transposed", [](const V& x) { return max(transpose(x[0], 0, 2), 1); }, {a});
  grad_check("sum of expanded",
             [](const V& x) {
               return sum(expand(x[0], {3, 2, 4}), {0, 2});
             },
             {randn({2, 1}, 70)});
  grad_check("sum_to_shape", [](const V& x) { return sum_to_shape(x[0], {3, 1}); }, {a});
}

TEST(GradCheck, ViewsAndLayout) {
  Tensor a = randn({2, 3, 4}, 20), b = randn({2, 2, 4}, 21);
  grad_check("reshape", [](const V& x) { return reshape(x[0], {4, -1}); }, {a});
  grad_check("view", [](const V& x) { return view(x[0], {6, 4}); }, {a});
  grad_check("slice", [](const V& x) { return slice(x[0], 1, 1, 3); }, {a});
  grad_check("squeeze/unsqueeze", [](const V& x) { return squeeze(unsqueeze(x[0], 1), 1); }, {a});
  grad_check("contiguous", [](const V& x) { return contiguous(transpose(x[0], 0, 2)); }, {a});
  grad_check("cat", [](const V& x) { return cat({x[0], x[1]}, 1); }, {a, b});
  grad_check("split",
             [](const V& x) {
               auto parts = split(x[0], {1, 2}, 1);
               return mul(parts[0], sum(parts[1], {1}, true));
             },
             {a});
  grad_check("stack",
             [](const V& x) {
               return stack({x[0], x[1]}, 0);
             },
             {randn({3, 4}, 22), randn({3, 4}, 23)});
  grad_check("cast f64->f64", [](const V& x) { return cast(x[0], DType::F64); }, {a});
}

TEST(GradCheck, MatmulAndLinear) {
  grad_check("matmul 2d", [](const V& x) { return matmul(x[0], x[1]); },
             {randn({3, 4}, 24), randn({4, 5}, 25)});
  grad_check("matmul batched + broadcast", [](const V& x) { return matmul(x[0], x[1]); },
             {randn({2, 3, 4}, 26), randn({4, 2}, 27)});
  grad_check("matmul broadcast batch dims", [](const V& x) { return matmul(x[0], x[1]); },
             {randn({2, 1, 3, 4}, 28), randn({3, 4, 2}, 29)});
  grad_check("matmul transposed operands",
             [](const V& x) { return matmul(transpose(x[0], -1, -2), transpose(x[1], -1, -2)); },
             {randn({2, 4, 3}, 30), randn({2, 5, 4}, 31)});
  grad_check("linear", [](const V& x) { return linear(x[0], x[1], x[2]); },
             {randn({2, 3, 4}, 32), randn({5, 4}, 33), randn({5}, 34)});
  // Each linear's input-gradient GEMM adds what the shared input already has (folding).
  grad_check("linears sharing their input",
             [](const V& x) {
               return add(add(linear(x[0], x[1]), mul(linear(x[0], x[2]), 2.0)),
                          linear(x[0], x[3]));
             },
             {randn({2, 3, 4}, 70), randn({5, 4}, 71), randn({5, 4}, 72), randn({5, 4}, 73)});
  grad_check("linear of a transposed input",
             [](const V& x) { return linear(transpose(x[0], -1, -2), x[1]); },
             {randn({2, 4, 3}, 74), randn({5, 4}, 75)});
}

TEST(GradCheck, SoftmaxFamily) {
  Tensor a = randn({3, 5}, 35, DType::F64, 2.0);
  grad_check("softmax", [](const V& x) { return softmax(x[0], -1); }, {a});
  grad_check("softmax dim 0", [](const V& x) { return softmax(x[0], 0); }, {a});
  grad_check("log_softmax", [](const V& x) { return log_softmax(x[0], 1); }, {a});
  grad_check("log_softmax of transposed",
             [](const V& x) { return log_softmax(transpose(x[0], 0, 1), -1); }, {a});
}

TEST(GradCheck, CrossEntropy) {
  Tensor logits = randn({5, 7}, 36, DType::F64, 2.0);
  Tensor targets = test::ids_tensor({3, -100, 0, 6, 2}, {5});
  grad_check("cross_entropy", [targets](const V& x) { return cross_entropy(x[0], targets, -100); },
             {logits});
  Tensor t32 = test::ids_tensor({1, 1, 4, 5, 6}, {5}, DType::I32);
  grad_check("cross_entropy i32 targets, no ignore",
             [t32](const V& x) { return cross_entropy(mul(x[0], 0.5), t32); }, {logits});
}

TEST(GradCheck, Embedding) {
  Tensor ids = test::ids_tensor({1, 3, 1, 0, 3, 3}, {2, 3});  // repeated ids accumulate
  grad_check("embedding", [ids](const V& x) { return embedding(x[0], ids); }, {randn({5, 4}, 37)});
}

TEST(GradCheck, RmsNorm) {
  grad_check("rms_norm", [](const V& x) { return rms_norm(x[0], x[1], 1e-5); },
             {randn({2, 3, 8}, 38), randn({8}, 39, DType::F64, 0.5, 1.0)});
  grad_check("rms_norm of transposed",
             [](const V& x) { return rms_norm(transpose(x[0], 0, 1), x[1], 1e-6); },
             {randn({6, 3}, 40), randn({6}, 41)});
}

TEST(GradCheck, Rope) {
  grad_check("rope", [](const V& x) { return rope(x[0], default_rope_frequencies(10000.0, 8)); },
             {randn({2, 3, 2, 8}, 42)});
  grad_check("rope offset",
             [](const V& x) { return rope(x[0], default_rope_frequencies(500.0, 4), 17); },
             {randn({1, 4, 3, 4}, 43)});
  // Scaled cos/sin and per-token positions (packed documents).
  RopeFrequencies f = default_rope_frequencies(500.0, 4);
  f.attention_scaling = 1.25;
  Tensor ids =
      Tensor::from_vector(std::vector<int64_t>{0, 1, 0, 1, 2, 3, 9, 4}, {2, 4}, DType::I64);
  grad_check("rope position_ids", [&](const V& x) { return rope(x[0], f, 0, ids); },
             {randn({2, 4, 3, 4}, 44)});
}

TEST(GradCheck, Swiglu) {
  grad_check("swiglu", [](const V& x) { return swiglu(x[0], x[1]); },
             {randn({3, 6}, 44, DType::F64, 2.0), randn({3, 6}, 45)});
  grad_check("swiglu transposed", [](const V& x) { return swiglu(transpose(x[0], 0, 1), x[1]); },
             {randn({6, 3}, 46), randn({3, 6}, 47)});
}

TEST(GradCheck, Attention) {
  // Grouped KV heads: 4 query heads share 2 KV heads.
  Tensor q = randn({2, 5, 4, 3}, 48), k = randn({2, 5, 2, 3}, 49), v = randn({2, 5, 2, 3}, 50);
  grad_check("attention causal gqa", [](const V& x) { return attention(x[0], x[1], x[2]); },
             {q, k, v});
  grad_check("attention non-causal, scale",
             [](const V& x) {
               return attention(x[0], x[1], x[2], AttentionMask{false, 0, {}}, 0.7);
             },
             {q, k, v});
  grad_check("attention window 2",
             [](const V& x) {
               return attention(x[0], x[1], x[2], AttentionMask{true, 2, {}});
             },
             {q, k, v});
  grad_check("attention window 1",
             [](const V& x) {
               return attention(x[0], x[1], x[2], AttentionMask{true, 1, {}});
             },
             {q, k, v});
  // Documents of 2, 1 and 2 positions in row 0; row 1 is one document with a window.
  const Tensor seg = test::ids_tensor({4, 4, 0, 1, 1, 3, 3, 3, 3, 3}, {2, 5}, DType::I32);
  grad_check("attention segments",
             [seg](const V& x) {
               return attention(x[0], x[1], x[2], AttentionMask{true, 0, seg});
             },
             {q, k, v});
  grad_check("attention segments + window 2",
             [seg](const V& x) {
               return attention(x[0], x[1], x[2], AttentionMask{true, 2, seg});
             },
             {q, k, v});
  grad_check("attention from transposed q",
             [](const V& x) { return attention(transpose(x[0], 1, 2), x[1], x[2]); },
             {randn({1, 2, 4, 3}, 51), randn({1, 4, 1, 3}, 52), randn({1, 4, 1, 3}, 53)});
}

TEST(GradCheck, EmptyDimensions) {
  // Size-0 dims must run forward and backward without crashing and give empty gradients.
  Tensor e = randn({0, 4}, 54), b = randn({4}, 55);
  grad_check("add empty", [](const V& x) { return add(x[0], x[1]); }, {e, b});
  grad_check("gelu empty", [](const V& x) { return gelu(x[0]); }, {e});
  grad_check("sum over empty", [](const V& x) { return sum(x[0], {0}); }, {e});
  grad_check("matmul empty M", [](const V& x) { return matmul(x[0], x[1]); },
             {e, randn({4, 3}, 56)});
  grad_check("matmul empty K", [](const V& x) { return matmul(x[0], x[1]); },
             {randn({3, 0}, 57), randn({0, 2}, 58)});
  grad_check("linear no rows", [](const V& x) { return linear(x[0], x[1]); },
             {randn({0, 4}, 76), randn({3, 4}, 77)});
  // No input features: the output is zeros (an empty sum), not uninitialised memory.
  grad_check("linear no in_features", [](const V& x) { return linear(x[0], x[1]); },
             {randn({2, 3, 0}, 78), randn({5, 0}, 79)});
  EXPECT_EQ(linear(randn({2, 0}, 80), randn({3, 0}, 81)).to_vector(), std::vector<double>(6, 0.0));
  grad_check("softmax empty rows", [](const V& x) { return softmax(x[0], -1); }, {e});
  grad_check("rms_norm no rows", [](const V& x) { return rms_norm(x[0], x[1], 1e-5); },
             {e, randn({4}, 59)});
  grad_check("rope empty seq",
             [](const V& x) { return rope(x[0], default_rope_frequencies(10000.0, 4)); },
             {randn({1, 0, 2, 4}, 60)});
  grad_check("swiglu empty", [](const V& x) { return swiglu(x[0], x[1]); },
             {randn({2, 0}, 61), randn({2, 0}, 62)});
  grad_check("attention empty seq", [](const V& x) { return attention(x[0], x[1], x[2]); },
             {randn({1, 0, 2, 3}, 63), randn({1, 0, 1, 3}, 64), randn({1, 0, 1, 3}, 65)});
  Tensor no_ids = test::ids_tensor({}, {0});
  grad_check("embedding no ids", [no_ids](const V& x) { return embedding(x[0], no_ids); },
             {randn({3, 2}, 66)});
  grad_check("cat with empty",
             [](const V& x) {
               return cat({x[0], x[1]}, 0);
             },
             {e, randn({2, 4}, 67)});
}

}  // namespace
}  // namespace accel
