// The CUDA mixture-of-experts kernels (ops/cuda/moe.cu, ops/cuda/grouped_gemm.cpp), called through
// the backend directly, against float64 references computed here on the host from the same
// (rounded) inputs: topk with ties, permute / unpermute and their backwards with several top-k
// and unaligned row lengths, and grouped GEMMs with empty and K = 0 groups in every transpose.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {
using namespace cuda_test;

Backend& gpu_backend() { return backend_for(gpu()); }

std::string dt(DType t) { return dtype_name(t); }

// Twice the relative rounding error bound of the dtype (a result rounded once is within half).
double ulp_rel(DType t) {
  if (t == DType::BF16) return std::ldexp(1.0, -7);
  if (t == DType::F16) return std::ldexp(1.0, -10);
  return std::ldexp(1.0, -22);
}

// Host routing as MoeRouting defines it: slots t * k + j sorted stably by expert.
struct Routing {
  std::vector<int64_t> order, inverse, counts;
};
Routing make_routing(const std::vector<int64_t>& expert_ids, int64_t num_experts) {
  Routing r;
  const int64_t n = static_cast<int64_t>(expert_ids.size());
  r.order.resize(n);
  std::iota(r.order.begin(), r.order.end(), 0);
  std::stable_sort(r.order.begin(), r.order.end(),
                   [&](int64_t a, int64_t b) { return expert_ids[a] < expert_ids[b]; });
  r.inverse.resize(n);
  for (int64_t i = 0; i < n; ++i) r.inverse[r.order[i]] = i;
  r.counts.assign(num_experts, 0);
  for (int64_t e : expert_ids) ++r.counts[e];
  return r;
}
// Router choices: k distinct experts per token (as topk makes them).
std::vector<int64_t> random_choices(int64_t tokens, int64_t k, int64_t experts,
                                    std::mt19937_64& rng) {
  std::vector<int64_t> ids;
  std::vector<int64_t> perm(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    ids.insert(ids.end(), perm.begin(), perm.begin() + k);
  }
  return ids;
}

// |got - want| <= rtol * |want| + atol[i], elementwise, NaN nowhere. Rounded (rtol > 0) f16
// results may also be one f16 subnormal step (2^-24) off: below 2^-14 f16 rounds absolutely.
void expect_within(const Tensor& got, const std::vector<double>& want, double rtol,
                   const std::vector<double>& atol_in, const std::string& what) {
  std::vector<double> atol = atol_in;
  if (rtol > 0 && got.dtype() == DType::F16)
    for (double& a : atol) a += std::ldexp(1.0, -24);
  std::vector<double> g = got.to_vector();
  ASSERT_EQ(g.size(), want.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool ok =
        !std::isnan(g[i]) && std::fabs(g[i] - want[i]) <= rtol * std::fabs(want[i]) + atol[i];
    if (!ok && bad++ == 0)
      first = "element " + std::to_string(i) + ": cuda " + std::to_string(g[i]) + " vs reference " +
              std::to_string(want[i]);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements off; first "
                    << first;
}
void expect_equal(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  expect_within(got, want, 0.0, std::vector<double>(want.size(), 0.0), what);
}

const DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};

// ---- topk
// -----------------------------------------------------------------------------------------

// Reference: indices sorted by value descending, ties by index ascending.
void reference_topk(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t k,
                    std::vector<double>& values, std::vector<int64_t>& indices) {
  values.clear();
  indices.clear();
  std::vector<int64_t> idx(cols);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(idx.begin(), idx.end(), 0);
    const double* row = x.data() + r * cols;
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    for (int64_t j = 0; j < k; ++j) {
      indices.push_back(idx[j]);
      values.push_back(row[idx[j]]);
    }
  }
}

TEST(CudaMoe, TopkMatchesReferenceWithTies) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t rows, cols, k;
  };
  const Case cases[] = {{37, 8, 1}, {64, 60, 8}, {5, 256, 8}, {300, 128, 2},
                        {3, 33, 4}, {1, 1, 1},   {17, 8, 8},  {129, 200, 6}};
  for (DType t : kFloatTypes)
    for (const Case& c : cases)
      for (bool ties : {false, true}) {
        const std::string what = "topk " + dt(t) + " [" + std::to_string(c.rows) + ", " +
                                 std::to_string(c.cols) + "] k=" + std::to_string(c.k) +
                                 (ties ? " ties" : "");
        Tensor x;
        if (ties) {  // few distinct values (exact in every dtype): many ties, incl. -0 vs +0
          std::vector<double> v(c.rows * c.cols);
          std::uniform_int_distribution<int> d(-3, 3);
          for (double& e : v) e = d(rng) * 0.25;
          for (size_t i = 0; i < v.size(); i += 7)
            if (v[i] == 0.0) v[i] = -0.0;
          x = Tensor::from_vector(v, {c.rows, c.cols}, t);
        } else {
          x = random_tensor({c.rows, c.cols}, t, rng, -4.0, 4.0);
        }
        std::vector<double> want_v;
        std::vector<int64_t> want_i;
        reference_topk(x.to_vector(), c.rows, c.cols, c.k, want_v, want_i);
        Tensor values = poisoned({c.rows, c.k}, t), indices = poisoned({c.rows, c.k}, DType::I64);
        gpu_backend().topk(values, indices, x.to(gpu()), c.k);
        expect_equal(values, want_v, what + " values");
        expect_equal(indices, std::vector<double>(want_i.begin(), want_i.end()), what + " indices");
      }
}

TEST(CudaMoe, TopkBackwardScattersToIndices) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kFloatTypes)
    for (int64_t k : {1, 3, 8}) {
      const int64_t rows = 45, cols = 40;
      std::vector<int64_t> idx;
      std::vector<int64_t> perm(cols);
      for (int64_t r = 0; r < rows; ++r) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        idx.insert(idx.end(), perm.begin(), perm.begin() + k);
      }
      Tensor gv = random_tensor({rows, k}, t, rng);
      std::vector<double> g = gv.to_vector(), want(rows * cols, 0.0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < k; ++j) want[r * cols + idx[r * k + j]] = g[r * k + j];
      Tensor grad_x = Tensor::zeros({rows, cols}, t, gpu());
      gpu_backend().topk_backward(grad_x, gv.to(gpu()),
                                  Tensor::from_vector(idx, {rows, k}).to(gpu()));
      expect_equal(grad_x, want, "topk_backward " + dt(t) + " k=" + std::to_string(k));
    }
}

TEST(CudaMoe, TopkRejectsBadK) {
  ACCEL_SKIP_WITHOUT_CUDA();
  Tensor x = Tensor::zeros({4, 6}, DType::F32, gpu());
  Tensor v = Tensor::empty({4, 7}, DType::F32, gpu()), i = Tensor::empty({4, 7}, DType::I64, gpu());
  EXPECT_THROW(gpu_backend().topk(v, i, x, 7), std::exception);
}

// ---- permute / unpermute
// --------------------------------------------------------------------------

struct MoeCase {
  int64_t tokens, k, experts, h;
};
// Row lengths with and without 16-byte rows for every dtype (7, 13, 100 bytes apart), k = 1 and 8.
const MoeCase kMoeCases[] = {{33, 1, 4, 64}, {50, 2, 8, 7},     {19, 8, 16, 24}, {64, 8, 8, 13},
                             {1, 1, 1, 1},   {120, 4, 32, 264}, {7, 3, 5, 1030}, {0, 2, 4, 16}};

std::string case_name(const MoeCase& c, DType t) {
  return dt(t) + " N=" + std::to_string(c.tokens) + " k=" + std::to_string(c.k) +
         " E=" + std::to_string(c.experts) + " H=" + std::to_string(c.h);
}

Tensor index_tensor(const std::vector<int64_t>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(gpu());
}

TEST(CudaMoe, PermuteCopiesTokensToSlots) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kFloatTypes)
    for (const MoeCase& c : kMoeCases) {
      const Routing r = make_routing(random_choices(c.tokens, c.k, c.experts, rng), c.experts);
      Tensor x = random_tensor({c.tokens, c.h}, t, rng);
      const std::vector<double> xv = x.to_vector();
      std::vector<double> want;
      for (int64_t i = 0; i < c.tokens * c.k; ++i) {
        const int64_t tok = r.order[i] / c.k;
        want.insert(want.end(), xv.begin() + tok * c.h, xv.begin() + (tok + 1) * c.h);
      }
      Tensor out = poisoned({c.tokens * c.k, c.h}, t);
      gpu_backend().moe_permute(out, x.to(gpu()), index_tensor(r.order), c.k);
      expect_equal(out, want, "moe_permute " + case_name(c, t));
    }
}

TEST(CudaMoe, PermuteBackwardSumsEachTokensSlots) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kFloatTypes)
    for (const MoeCase& c : kMoeCases) {
      const Routing r = make_routing(random_choices(c.tokens, c.k, c.experts, rng), c.experts);
      Tensor g = random_tensor({c.tokens * c.k, c.h}, t, rng);
      const std::vector<double> gv = g.to_vector();
      std::vector<double> want(c.tokens * c.h, 0.0), atol(c.tokens * c.h, 0.0);
      for (int64_t tok = 0; tok < c.tokens; ++tok)
        for (int64_t j = 0; j < c.k; ++j)
          for (int64_t e = 0; e < c.h; ++e) {
            const double v = gv[r.inverse[tok * c.k + j] * c.h + e];
            want[tok * c.h + e] += v;
            atol[tok * c.h + e] += 1e-6 * std::fabs(v);  // fp32 sums, then one rounding
          }
      Tensor grad_x = poisoned({c.tokens, c.h}, t);
      gpu_backend().moe_permute_backward(grad_x, g.to(gpu()), index_tensor(r.inverse), c.k);
      expect_within(grad_x, want, ulp_rel(t), atol, "moe_permute_backward " + case_name(c, t));
    }
}

TEST(CudaMoe, UnpermuteWeightsAndSumsSlots) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kFloatTypes)
    for (DType wt : {DType::F32, t})
      for (const MoeCase& c : kMoeCases) {
        const Routing r = make_routing(random_choices(c.tokens, c.k, c.experts, rng), c.experts);
        Tensor y = random_tensor({c.tokens * c.k, c.h}, t, rng);
        Tensor w = random_tensor({c.tokens, c.k}, wt, rng, 0.0, 1.0);
        const std::vector<double> yv = y.to_vector(), wv = w.to_vector();
        std::vector<double> want(c.tokens * c.h, 0.0), atol(c.tokens * c.h, 0.0);
        for (int64_t tok = 0; tok < c.tokens; ++tok)
          for (int64_t j = 0; j < c.k; ++j)
            for (int64_t e = 0; e < c.h; ++e) {
              const double v = wv[tok * c.k + j] * yv[r.inverse[tok * c.k + j] * c.h + e];
              want[tok * c.h + e] += v;
              atol[tok * c.h + e] += 1e-6 * std::fabs(v);
            }
        Tensor out = poisoned({c.tokens, c.h}, t);
        gpu_backend().moe_unpermute(out, y.to(gpu()), w.to(gpu()), index_tensor(r.inverse));
        expect_within(out, want, ulp_rel(t), atol,
                      "moe_unpermute " + case_name(c, t) + " weights " + dt(wt));
      }
}

TEST(CudaMoe, UnpermuteBackwardGivesBothGradients) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : kFloatTypes)
    for (DType wt : {DType::F32, t})
      for (const MoeCase& c : kMoeCases) {
        const int64_t rows = c.tokens * c.k;
        const Routing r = make_routing(random_choices(c.tokens, c.k, c.experts, rng), c.experts);
        Tensor y = random_tensor({rows, c.h}, t, rng);
        Tensor w = random_tensor({c.tokens, c.k}, wt, rng, 0.0, 1.0);
        Tensor g = random_tensor({c.tokens, c.h}, t, rng);
        const std::vector<double> yv = y.to_vector(), wv = w.to_vector(), gv = g.to_vector();
        std::vector<double> want_gy(rows * c.h), want_gw(rows), atol_gw(rows);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t slot = r.order[i], tok = slot / c.k;
          double dot = 0, mag = 0;
          for (int64_t e = 0; e < c.h; ++e) {
            want_gy[i * c.h + e] = wv[slot] * gv[tok * c.h + e];
            dot += gv[tok * c.h + e] * yv[i * c.h + e];
            mag += std::fabs(gv[tok * c.h + e] * yv[i * c.h + e]);
          }
          want_gw[slot] = dot;
          atol_gw[slot] = 1e-6 * mag + 1e-30;  // fp32 dot product
        }
        const std::string what = case_name(c, t) + " weights " + dt(wt);
        Tensor y_d = y.to(gpu()), w_d = w.to(gpu()), g_d = g.to(gpu());
        Tensor order = index_tensor(r.order);
        Tensor gy = poisoned({rows, c.h}, t), gw = poisoned({c.tokens, c.k}, wt);
        gpu_backend().moe_unpermute_backward(gy, gw, g_d, y_d, w_d, order);
        expect_within(gy, want_gy, ulp_rel(t), std::vector<double>(want_gy.size(), 0.0),
                      "moe_unpermute_backward grad_y " + what);
        expect_within(gw, want_gw, ulp_rel(wt), atol_gw,
                      "moe_unpermute_backward grad_weights " + what);
        // Either gradient alone.
        Tensor gy2 = poisoned({rows, c.h}, t), gw2 = poisoned({c.tokens, c.k}, wt);
        gpu_backend().moe_unpermute_backward(gy2, Tensor(), g_d, y_d, w_d, order);
        gpu_backend().moe_unpermute_backward(Tensor(), gw2, g_d, y_d, w_d, order);
        expect_within(gy2, want_gy, ulp_rel(t), std::vector<double>(want_gy.size(), 0.0),
                      "grad_y only " + what);
        expect_within(gw2, want_gw, ulp_rel(wt), atol_gw, "grad_weights only " + what);
      }
}

TEST(CudaMoe, PermuteRejectsBadShapes) {
  ACCEL_SKIP_WITHOUT_CUDA();
  Tensor x = Tensor::zeros({4, 8}, DType::BF16, gpu());
  Tensor order = Tensor::arange(8).to(gpu());
  Tensor out = Tensor::empty({8, 9}, DType::BF16, gpu());
  EXPECT_THROW(gpu_backend().moe_permute(out, x, order, 2), std::exception);
  Tensor out2 = Tensor::empty({8, 8}, DType::BF16, gpu());
  EXPECT_THROW(gpu_backend().moe_permute(out2, x, order, 3), std::exception);
}

// ---- grouped GEMM
// ---------------------------------------------------------------------------------

struct Group {
  int64_t m, n, k;
};

// outs[g] = op(a[g]) @ op(b[g]) in double, and sum |a||b| per element for the tolerance.
void reference_gemm(const std::vector<double>& a, const std::vector<double>& b, const Group& s,
                    bool ta, bool tb, std::vector<double>& out, std::vector<double>& mag) {
  out.assign(s.m * s.n, 0.0);
  mag.assign(s.m * s.n, 0.0);
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j)
      for (int64_t p = 0; p < s.k; ++p) {
        const double av = ta ? a[p * s.m + i] : a[i * s.k + p];
        const double bv = tb ? b[j * s.k + p] : b[p * s.n + j];
        out[i * s.n + j] += av * bv;
        mag[i * s.n + j] += std::fabs(av * bv);
      }
}

void check_grouped(DType t, const std::vector<Group>& groups, bool ta, bool tb, double acc_tol,
                   std::mt19937_64& rng, const std::string& label) {
  std::vector<Tensor> as, bs, outs;
  std::vector<std::vector<double>> want(groups.size()), mag(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& s = groups[g];
    Tensor a = random_tensor(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, t, rng);
    Tensor b = random_tensor(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, t, rng);
    reference_gemm(a.to_vector(), b.to_vector(), s, ta, tb, want[g], mag[g]);
    as.push_back(a.to(gpu()));
    bs.push_back(b.to(gpu()));
    outs.push_back(poisoned({s.m, s.n}, t));
  }
  gpu_backend().grouped_matmul(outs, as, bs, ta, tb);
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& s = groups[g];
    std::vector<double> atol(mag[g].size());
    for (size_t i = 0; i < atol.size(); ++i) atol[i] = acc_tol * mag[g][i];
    expect_within(outs[g], want[g], ulp_rel(t), atol,
                  label + " " + dt(t) + (ta ? " a^T" : "") + (tb ? " b^T" : "") + " group " +
                      std::to_string(g) + " (M=" + std::to_string(s.m) +
                      " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k) + ")");
  }
}

TEST(CudaMoe, GroupedMatmulAllTransposesEmptyAndZeroKGroups) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  // Shared N, K with varying M (the forward), and every dim varying (incl. K = 0: the weight
  // gradient of an expert that got no tokens).
  const std::vector<Group> forward = {{37, 48, 72},  {0, 48, 72}, {1, 48, 72},
                                      {130, 48, 72}, {0, 48, 72}, {64, 48, 72}};
  const std::vector<Group> mixed = {{5, 7, 9},   {33, 1, 130}, {16, 24, 0}, {0, 3, 5},
                                    {70, 65, 1}, {3, 0, 4},    {9, 31, 17}, {1, 1, 1}};
  // Runs of equal shapes (balanced routing) around an empty group and a different one.
  const std::vector<Group> runs = {{16, 24, 40}, {16, 24, 40}, {16, 24, 40}, {0, 24, 40},
                                   {16, 24, 40}, {9, 24, 40},  {16, 24, 40}, {16, 24, 40}};
  for (DType t : kFloatTypes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        check_grouped(t, forward, ta, tb, 1e-5, rng, "forward-like");
        check_grouped(t, mixed, ta, tb, 1e-5, rng, "mixed");
        check_grouped(t, runs, ta, tb, 1e-5, rng, "equal runs");
      }
}

TEST(CudaMoe, GroupedMatmulAllGroupsEmptyOrZeroK) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  check_grouped(DType::BF16, {{0, 8, 8}, {4, 8, 0}, {0, 0, 0}}, false, true, 1e-5, rng,
                "degenerate");
}

TEST(CudaMoe, GroupedMatmulTf32WhenAllowed) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  set_allow_tf32(gpu(), true);
  // TF32 rounds the inputs to 10 mantissa bits: 2^-10 of the magnitude of each product.
  check_grouped(DType::F32, {{40, 24, 300}, {0, 24, 300}, {77, 24, 300}}, false, true, 2e-3, rng,
                "tf32");
  set_allow_tf32(gpu(), false);
}

TEST(CudaMoe, GroupedMatmulRejectsMismatches) {
  ACCEL_SKIP_WITHOUT_CUDA();
  Tensor a = Tensor::zeros({4, 8}, DType::BF16, gpu()),
         b = Tensor::zeros({8, 5}, DType::BF16, gpu());
  Tensor out = Tensor::empty({4, 6}, DType::BF16, gpu());
  EXPECT_THROW(gpu_backend().grouped_matmul({out}, {a}, {b}, false, false), std::exception);
  Tensor b32 = Tensor::zeros({8, 6}, DType::F32, gpu());
  EXPECT_THROW(gpu_backend().grouped_matmul({out}, {a}, {b32}, false, false), std::exception);
  EXPECT_THROW(gpu_backend().grouped_matmul({out, out}, {a}, {b}, false, false), std::exception);
}

}  // namespace
}  // namespace accel
