// The mixture-of-experts ops (topk, moe_routing, moe_permute, moe_unpermute, grouped_linear)
// against float64 references written here, their gradients against finite differences, and their
// argument checks.
#include <algorithm>
#include <numeric>

#include "tests/ops/op_test_util.h"

namespace accel {
namespace {
using test::expect_close;
using test::grad_check;
using test::randn;

// What torch.topk returns for one row: the k largest, ties in index order.
std::vector<int64_t> reference_topk(const std::vector<double>& row, int64_t k) {
  std::vector<int64_t> idx(row.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

std::vector<int64_t> as_i64(const Tensor& t) {
  std::vector<int64_t> out;
  for (double v : t.to_vector()) out.push_back(static_cast<int64_t>(v));
  return out;
}

template <class F>
void expect_op_error(F&& f, const std::string& op, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error from " << op;
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("[" + op + "]", 0), 0u) << m;
    EXPECT_NE(m.find(part), std::string::npos) << m;
  }
}

TEST(MoeTopk, MatchesReferenceInF64AndF32) {
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor x = randn({2, 3, 7}, 11, dt);
    for (int64_t k : {1, 3, 7}) {
      auto [values, indices] = topk(x, k);
      ASSERT_EQ(values.shape(), (Shape{2, 3, k}));
      ASSERT_EQ(indices.dtype(), DType::I64);
      const std::vector<double> xv = x.to_vector(), vv = values.to_vector();
      const std::vector<int64_t> iv = as_i64(indices);
      for (int64_t r = 0; r < 6; ++r) {
        std::vector<double> row(xv.begin() + r * 7, xv.begin() + r * 7 + 7);
        std::vector<int64_t> want = reference_topk(row, k);
        for (int64_t j = 0; j < k; ++j) {
          EXPECT_EQ(iv[r * k + j], want[j]) << "row " << r << " k " << k;
          EXPECT_EQ(vv[r * k + j], row[want[j]]);
        }
      }
    }
  }
}

TEST(MoeTopk, TiesKeepIndexOrderAndNanRanksFirst) {
  Tensor x = Tensor::from_vector(std::vector<double>{1, 3, 3, 2, 3}, {1, 5}, DType::F32);
  EXPECT_EQ(as_i64(topk(x, 2).second), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(as_i64(topk(x, 4).second), (std::vector<int64_t>{1, 2, 4, 3}));
  Tensor same = Tensor::full({1, 4}, 0.25);
  EXPECT_EQ(as_i64(topk(same, 3).second), (std::vector<int64_t>{0, 1, 2}));
  Tensor with_nan =
      Tensor::from_vector(std::vector<double>{1, std::nan(""), 5}, {1, 3}, DType::F64);
  EXPECT_EQ(as_i64(topk(with_nan, 2).second), (std::vector<int64_t>{1, 2}));
}

TEST(MoeTopk, GradientGoesToTheChosenEntries) {
  grad_check("topk k=2", [](const std::vector<Tensor>& in) { return topk(in[0], 2).first; },
             {randn({4, 6}, 3)});
  grad_check("topk k=1 3-d", [](const std::vector<Tensor>& in) { return topk(in[0], 1).first; },
             {randn({2, 2, 5}, 4)});
  // Entries not chosen get exactly zero.
  Tensor x = Tensor::from_vector(std::vector<double>{0.1, 0.9, 0.5}, {1, 3}, DType::F64);
  x.set_requires_grad(true);
  sum(topk(x, 2).first).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 1, 1}));
}

TEST(MoeTopk, RefusesBadArguments) {
  Tensor x = randn({3, 4}, 1, DType::F32);
  expect_op_error([&] { topk(x, 0); }, "topk", "k must be in [1, 4]");
  expect_op_error([&] { topk(x, 5); }, "topk", "got 5");
  expect_op_error([&] { topk(Tensor::zeros({3, 4}, DType::I64), 1); }, "topk", "");
}

TEST(MoeRouting, StableCountingSortWithAnEmptyExpert) {
  for (DType dt : {DType::I64, DType::I32}) {
    Tensor ids = Tensor::from_vector(std::vector<int64_t>{2, 0, 0, 1, 2, 0}, {3, 2}, dt);
    MoeRouting r = moe_routing(ids, 4);
    EXPECT_EQ(r.num_tokens, 3);
    EXPECT_EQ(r.top_k, 2);
    EXPECT_EQ(r.expert_counts, (std::vector<int64_t>{3, 1, 2, 0}));
    // Expert 0's slots 1, 2, 5 in slot order, then expert 1's slot 3, then expert 2's 0, 4.
    EXPECT_EQ(as_i64(r.order), (std::vector<int64_t>{1, 2, 5, 3, 0, 4}));
    const std::vector<int64_t> order = as_i64(r.order), inverse = as_i64(r.inverse);
    for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(inverse[order[i]], (int64_t)i);
  }
  // k = 1 and no tokens.
  MoeRouting one = moe_routing(Tensor::from_vector(std::vector<int64_t>{1, 1, 0}, {3, 1}), 2);
  EXPECT_EQ(one.expert_counts, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(as_i64(one.order), (std::vector<int64_t>{2, 0, 1}));
  MoeRouting none = moe_routing(Tensor::zeros({0, 2}, DType::I64), 3);
  EXPECT_EQ(none.expert_counts, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(none.order.numel(), 0);
}

TEST(MoeRouting, RefusesBadArguments) {
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{0, 3, 1, 0}, {2, 2});
  expect_op_error([&] { moe_routing(ids, 3); }, "moe_routing", "expert_ids[0, 1] = 3");
  expect_op_error(
      [&] {
        moe_routing(Tensor::from_vector(std::vector<int64_t>{-1}, {1, 1}), 2);
      },
      "moe_routing", "is not in [0, 2)");
  expect_op_error([&] { moe_routing(ids, 0); }, "moe_routing", "num_experts must be positive");
  expect_op_error([&] { moe_routing(Tensor::zeros({4}, DType::I64), 4); }, "moe_routing",
                  "[num_tokens, top_k]");
  expect_op_error([&] { moe_routing(Tensor::zeros({2, 2}), 4); }, "moe_routing", "i32 or i64");
}

// Expert ids for N tokens, k distinct experts each, from a fixed seed; some expert left empty.
Tensor some_expert_ids(int64_t N, int64_t k, int64_t E, uint64_t seed) {
  std::vector<int64_t> ids;
  uint64_t s = seed;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<int64_t> pick;
    while (static_cast<int64_t>(pick.size()) < k) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      const int64_t e =
          static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(E - 1));  // E-1 empty
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    ids.insert(ids.end(), pick.begin(), pick.end());
  }
  return Tensor::from_vector(ids, {N, k});
}

TEST(MoePermute, CopiesEachTokenToItsSlotsAndSumsThemBack) {
  for (int64_t k : {1, 2, 3}) {
    MoeRouting r = moe_routing(some_expert_ids(5, k, 4, 7 + k), 4);
    Tensor x = randn({5, 3}, 21);
    Tensor p = moe_permute(x, r);
    ASSERT_EQ(p.shape(), (Shape{5 * k, 3}));
    const std::vector<double> xv = x.to_vector(), pv = p.to_vector();
    const std::vector<int64_t> order = as_i64(r.order);
    for (int64_t i = 0; i < 5 * k; ++i)
      for (int64_t h = 0; h < 3; ++h) EXPECT_EQ(pv[i * 3 + h], xv[(order[i] / k) * 3 + h]);
    grad_check("moe_permute k=" + std::to_string(k),
               [&r](const std::vector<Tensor>& in) { return moe_permute(in[0], r); },
               {randn({5, 3}, 22)});
  }
  // f32: the backward's sum of a token's k rows against a float64 sum.
  MoeRouting r = moe_routing(some_expert_ids(6, 2, 5, 3), 5);
  Tensor x = randn({6, 4}, 5, DType::F32);
  x.set_requires_grad(true);
  Tensor g = randn({12, 4}, 6, DType::F32);
  sum(mul(moe_permute(x, r), g)).backward();
  const std::vector<double> gv = g.to_vector();
  const std::vector<int64_t> inverse = as_i64(r.inverse);
  std::vector<double> want(24, 0.0);
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t h = 0; h < 4; ++h) want[t * 4 + h] += gv[inverse[t * 2 + j] * 4 + h];
  expect_close(x.grad(), want, 1e-6, 1e-6, "moe_permute f32 backward");
}

TEST(MoeUnpermute, WeightedSumOfEachTokensRows) {
  for (int64_t k : {1, 2}) {
    MoeRouting r = moe_routing(some_expert_ids(4, k, 3, 9 + k), 3);
    Tensor y = randn({4 * k, 5}, 31), w = randn({4, k}, 32);
    Tensor out = moe_unpermute(y, w, r);
    ASSERT_EQ(out.shape(), (Shape{4, 5}));
    const std::vector<double> yv = y.to_vector(), wv = w.to_vector();
    const std::vector<int64_t> inverse = as_i64(r.inverse);
    std::vector<double> want(20, 0.0);
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t h = 0; h < 5; ++h)
          want[t * 5 + h] += wv[t * k + j] * yv[inverse[t * k + j] * 5 + h];
    expect_close(out, want, 1e-12, 1e-12, "moe_unpermute");
    grad_check("moe_unpermute k=" + std::to_string(k),
               [&r](const std::vector<Tensor>& in) { return moe_unpermute(in[0], in[1], r); },
               {randn({4 * k, 5}, 33), randn({4, k}, 34)});
  }
}

TEST(MoeUnpermute, RefusesBadArguments) {
  MoeRouting r = moe_routing(some_expert_ids(4, 2, 3, 1), 3);
  Tensor y = randn({8, 5}, 1, DType::F32), w = randn({4, 2}, 2, DType::F32);
  expect_op_error(
      [&] {
        moe_unpermute(y, randn({4, 3}, 2, DType::F32), r);
      },
      "moe_unpermute", "weights must be [num_tokens, top_k] = [4, 2]");
  expect_op_error(
      [&] {
        moe_unpermute(randn({7, 5}, 1, DType::F32), w, r);
      },
      "moe_unpermute", "y must be [num_tokens * top_k = 8");
  expect_op_error([&] { moe_unpermute(y, randn({4, 2}, 2, DType::F64), r); }, "moe_unpermute", "");
  MoeRouting empty;
  expect_op_error(
      [&] {
        moe_permute(randn({0, 5}, 1, DType::F32), empty);
      },
      "moe_permute", "build it with moe_routing");
  expect_op_error(
      [&] {
        moe_permute(randn({3, 5}, 1, DType::F32), r);
      },
      "moe_permute", "x has 3 rows, but the routing is for 4 tokens");
}

TEST(MoeGroupedLinear, EachGroupTimesItsWeightWithEmptyGroups) {
  const std::vector<int64_t> sizes{2, 0, 3, 1};
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor x = randn({6, 4}, 41, dt);
    std::vector<Tensor> ws;
    for (int g = 0; g < 4; ++g) ws.push_back(randn({3, 4}, 50 + g, dt));
    Tensor out = grouped_linear(x, ws, sizes);
    ASSERT_EQ(out.shape(), (Shape{6, 3}));
    const std::vector<double> xv = x.to_vector();
    std::vector<double> want(18, 0.0);
    int64_t row = 0;
    for (int g = 0; g < 4; ++g) {
      const std::vector<double> wv = ws[g].to_vector();
      for (int64_t i = 0; i < sizes[g]; ++i, ++row)
        for (int64_t o = 0; o < 3; ++o)
          for (int64_t c = 0; c < 4; ++c) want[row * 3 + o] += xv[row * 4 + c] * wv[o * 4 + c];
    }
    expect_close(out, want, dt == DType::F64 ? 1e-12 : 1e-5, 1e-6, "grouped_linear");
  }
  grad_check("grouped_linear",
             [&sizes](const std::vector<Tensor>& in) {
               return grouped_linear(in[0], {in[1], in[2], in[3], in[4]}, sizes);
             },
             {randn({6, 4}, 61), randn({3, 4}, 62), randn({3, 4}, 63), randn({3, 4}, 64),
              randn({3, 4}, 65)});
  // The empty group's weight gets a zero gradient, not garbage.
  Tensor x = randn({6, 4}, 71);
  std::vector<Tensor> ws;
  for (int g = 0; g < 4; ++g) {
    ws.push_back(randn({3, 4}, 72 + g));
    ws.back().set_requires_grad(true);
  }
  sum(grouped_linear(x, ws, sizes)).backward();
  EXPECT_EQ(ws[1].grad().to_vector(), std::vector<double>(12, 0.0));
  // Every row in one group, and a group of zero rows only.
  expect_close(grouped_linear(x, {ws[0]}, {6}), linear(x, ws[0]), 1e-12, 1e-12, "one group");
  EXPECT_EQ(grouped_linear(Tensor::zeros({0, 4}, DType::F64), {ws[0], ws[1]}, {0, 0}).shape(),
            (Shape{0, 3}));
}

TEST(MoeGroupedLinear, RefusesBadArguments) {
  Tensor x = randn({5, 4}, 1, DType::F32);
  Tensor w = randn({3, 4}, 2, DType::F32);
  expect_op_error(
      [&] {
        grouped_linear(x, {w, w}, {2, 2});
      },
      "grouped_linear", "group sizes sum to 4, but x has 5 rows");
  expect_op_error(
      [&] {
        grouped_linear(x, {w, w}, {6, -1});
      },
      "grouped_linear", "group_sizes[1] = -1 is negative");
  expect_op_error([&] { grouped_linear(x, {w}, {2, 3}); }, "grouped_linear", "2 group sizes for 1");
  expect_op_error(
      [&] {
        grouped_linear(x, {w, randn({3, 5}, 3, DType::F32)}, {2, 3});
      },
      "grouped_linear", "weights[1]");
  expect_op_error(
      [&] {
        grouped_linear(x, {w, randn({2, 4}, 3, DType::F32)}, {2, 3});
      },
      "grouped_linear", "weights[1]");
  expect_op_error(
      [&] {
        grouped_linear(x, {randn({3, 4}, 3, DType::F64)}, {5});
      },
      "grouped_linear", "");
  expect_op_error([&] { grouped_linear(x, {}, {}); }, "grouped_linear", "at least one weight");
}

// The ops chained as a mixture-of-experts layer of linear experts (router softmax, top-k,
// permute, grouped GEMM, weighted unpermute) against a per-token loop in float64.
TEST(MoePipeline, MatchesAPerTokenLoop) {
  const int64_t N = 7, H = 4, O = 3, E = 4;
  for (int64_t k : {1, 2}) {
    auto layer = [k](const std::vector<Tensor>& in) {
      Tensor probs = softmax(matmul(in[0], transpose(in[1], 0, 1)), -1);
      auto [w, ids] = topk(probs, k);
      MoeRouting r = moe_routing(ids, E);
      std::vector<Tensor> experts{in[2], in[3], in[4], in[5]};
      return moe_unpermute(grouped_linear(moe_permute(in[0], r), experts, r.expert_counts), w, r);
    };
    std::vector<Tensor> in{randn({N, H}, 80), randn({E, H}, 81)};
    for (int e = 0; e < E; ++e) in.push_back(randn({O, H}, 90 + e));
    Tensor out = layer(in);
    const std::vector<double> xv = in[0].to_vector(), gv = in[1].to_vector();
    std::vector<double> want(N * O, 0.0);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> logit(E), prob(E);
      double mx = -1e300, z = 0;
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t c = 0; c < H; ++c) logit[e] += xv[t * H + c] * gv[e * H + c];
        mx = std::max(mx, logit[e]);
      }
      for (int64_t e = 0; e < E; ++e) z += prob[e] = std::exp(logit[e] - mx);
      for (double& p : prob) p /= z;
      for (int64_t e : reference_topk(prob, k)) {
        const std::vector<double> wv = in[2 + e].to_vector();
        for (int64_t o = 0; o < O; ++o)
          for (int64_t c = 0; c < H; ++c)
            want[t * O + o] += prob[e] * wv[o * H + c] * xv[t * H + c];
      }
    }
    expect_close(out, want, 1e-12, 1e-12, "moe layer k=" + std::to_string(k));
    grad_check("moe layer k=" + std::to_string(k), layer, in, 1e-5);
  }
}

}  // namespace
}  // namespace accel
