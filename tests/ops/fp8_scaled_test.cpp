// The per-row and per-block scaled fp8 casts and GEMMs (the rowwise, rowwise_with_gw_hp and
// blockwise recipes) on the CPU emulation, against float64 references written here from the
// definitions: group amaxes, scales (and their power-of-2 rounding), saturation and rounding to
// e4m3, the scale layouts cuBLASLt takes, every GEMM against the product of its dequantized
// operands, the mode pairs that are refused, and fp8_linear's three GEMMs per recipe.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

using M = Fp8ScaleMode;

// x [R, C] in f32 with outliers (one column 50x, one row 30x) and one all-zero row.
Tensor test_input(int64_t R, int64_t C, uint64_t seed) {
  std::vector<double> v = test::randn({R, C}, seed).to_vector();
  for (int64_t r = 0; r < R; ++r) {
    v[r * C + (C > 3 ? 3 : 0)] *= 50.0;
    if (r == 1)
      for (int64_t c = 0; c < C; ++c) v[r * C + c] *= 30.0;
    if (r == 2)
      for (int64_t c = 0; c < C; ++c) v[r * C + c] = 0.0;
  }
  return Tensor::from_vector(v, {R, C}, DType::F32);
}

// The float64 definition of a group's scale: fp8_max / amax (as the float division rounds it),
// 2^floor(log2(scale)) with pow2, 1 for an empty or all-zero group.
double ref_scale(double amax, bool pow2) {
  if (!(amax > 0)) return 1.0;
  double s = static_cast<double>(kE4M3Max / static_cast<float>(amax));
  if (pow2) s = std::exp2(std::floor(std::log2(s)));
  return s;
}

// The group of operand element (r, k) under `mode`, as (row group, k group).
std::pair<int64_t, int64_t> group_of(M mode, int64_t r, int64_t k) {
  switch (mode) {
    case M::Row:
      return {r, 0};
    case M::Block1x128:
      return {r, k / 128};
    case M::Block128x128:
      return {r / 128, k / 128};
  }
  return {0, 0};
}

struct Case {
  M mode;
  bool transpose, pow2, one_scale;
};

std::string name(const Case& c) {
  return std::string(fp8_scale_mode_name(c.mode)) + (c.transpose ? " transposed" : "") +
         (c.pow2 ? " pow2" : "") + (c.one_scale ? " one scale" : "");
}

void check_cast(const Tensor& x, const Case& c) {
  const std::string what = name(c);
  Fp8ScaledTensor q = fp8_cast_scaled(x, DType::E4M3, c.mode, c.transpose, c.pow2, c.one_scale);
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t rows = c.transpose ? C : R, K = c.transpose ? R : C;
  ASSERT_EQ(q.rows, rows) << what;
  ASSERT_EQ(q.k, K) << what;
  const int64_t rows_p = (rows + 15) / 16 * 16, k_p = (K + 15) / 16 * 16;
  ASSERT_EQ(q.data.shape(), (Shape{rows_p, k_p})) << what;
  const int64_t kb = (k_p + 127) / 128, rb = (rows_p + 127) / 128, ld = (kb + 3) / 4 * 4;
  const Shape want_scales = c.mode == M::Row          ? Shape{rows_p}
                            : c.mode == M::Block1x128 ? Shape{kb, rows_p}
                                                      : Shape{rb, ld};
  ASSERT_EQ(q.scale_inv.shape(), want_scales) << what;

  std::vector<double> xv = x.to_vector();
  auto value = [&](int64_t r, int64_t k) { return c.transpose ? xv[k * C + r] : xv[r * C + k]; };
  // Group amaxes in double.
  std::map<std::pair<int64_t, int64_t>, double> amax;
  double global = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      double& m = amax[group_of(c.mode, r, k)];
      m = std::max(m, std::fabs(value(r, k)));
      global = std::max(global, std::fabs(value(r, k)));
    }
  auto scale_of = [&](int64_t r, int64_t k) {
    if (c.one_scale) return ref_scale(global, c.pow2);
    auto it = amax.find(group_of(c.mode, r, k));
    return ref_scale(it == amax.end() ? 0.0 : it->second, c.pow2);
  };
  std::vector<double> data = cast(q.data, DType::F32).to_vector();
  std::vector<double> si = q.scale_inv.to_vector();
  int64_t saturated = 0;
  for (int64_t r = 0; r < rows_p; ++r)
    for (int64_t k = 0; k < k_p; ++k) {
      const double got = data[r * k_p + k];
      if (r >= rows || k >= K) {
        ASSERT_EQ(got, 0.0) << what << ": padding at " << r << ", " << k;
        continue;
      }
      const double s = scale_of(r, k);
      const double scaled = value(r, k) * s;
      // Saturation: nothing beyond +-448; rounding: the e4m3 value nearest to v * s (ties to even),
      // which the scalar encoder computes (runtime/dtype.h; tested on its own).
      ASSERT_LE(std::fabs(got), 448.0) << what;
      const double want = e4m3_to_f32(f32_to_e4m3(static_cast<float>(scaled)));
      ASSERT_EQ(got, want) << what << " at " << r << ", " << k << " (x " << value(r, k)
                           << ", scale " << s << ")";
      if (std::fabs(scaled) > 448.0) ++saturated;
      // Within half an e4m3 ulp (2^-4 relative) of v * s above the subnormals (2^-6).
      if (std::fabs(scaled) >= 0.015625 && std::fabs(scaled) <= 448.0) {
        ASSERT_LE(std::fabs(got - scaled), std::fabs(scaled) / 16.0 + 1e-12) << what;
      }
      // Each data element's slot holds 1 / its group's scale.
      const int64_t slot = fp8_scale_index(c.mode, r, k, rows_p, k_p);
      ASSERT_EQ(si[slot], static_cast<double>(1.0f / static_cast<float>(s))) << what;
    }
  // fp8_max / amax rounds to float, so a group maximum can land just above 448 and saturate;
  // never more than one element per group.
  EXPECT_LE(saturated, static_cast<int64_t>(amax.size())) << what;
  // The largest element of each group maps to the top binade (pow2: [224, 448]; else 448).
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const auto g = group_of(c.mode, r, k);
      const double m = c.one_scale ? global : amax[g];
      if (m > 0 && std::fabs(value(r, k)) == m) {
        const double got = std::fabs(data[r * k_p + k]);
        if (c.pow2)
          EXPECT_GE(got, 224.0) << what;
        else
          EXPECT_EQ(got, 448.0) << what;
      }
    }
  // Slots without data (padding rows, ld padding of 128x128) hold 1.
  for (size_t i = 0; i < si.size(); ++i) EXPECT_TRUE(std::isfinite(si[i]) && si[i] > 0) << what;
  // Dequantization gives back the logical values.
  Tensor d = fp8_scaled_dequantize(q);
  ASSERT_EQ(d.shape(), (Shape{rows, K})) << what;
  std::vector<double> dv = d.to_vector();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      ASSERT_EQ(
          dv[r * K + k],
          static_cast<double>(static_cast<float>(data[r * k_p + k]) *
                              static_cast<float>(si[fp8_scale_index(c.mode, r, k, rows_p, k_p)])))
          << what;
}

TEST(Fp8Scaled, CastsMatchTheFloat64Definition) {
  // 150 x 300: partial 128-blocks in both dims, rows and columns padded (300 -> 304, 150 -> 160).
  Tensor x = test_input(150, 300, 7);
  for (M mode : {M::Row, M::Block1x128, M::Block128x128})
    for (bool transpose : {false, true})
      for (bool pow2 : {false, true}) check_cast(x, Case{mode, transpose, pow2, false});
  check_cast(x, Case{M::Row, true, false, true});  // rowwise_with_gw_hp's dgrad weight
  check_cast(cast(x, DType::BF16), Case{M::Block1x128, false, false, false});
}

TEST(Fp8Scaled, Pow2ScalesArePowersOfTwoAtMostTheExactScale) {
  for (double amax : {1e-30, 3e-3, 0.7, 1.0, 448.0, 3.0e4, 1e30}) {
    const float s = fp8_group_scale(static_cast<float>(amax), kE4M3Max, true);
    const float exact = fp8_group_scale(static_cast<float>(amax), kE4M3Max, false);
    int e;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << amax;
    EXPECT_LE(s, exact) << amax;
    EXPECT_GT(2.0f * s, exact) << amax;
  }
  EXPECT_EQ(fp8_group_scale(0.0f, kE4M3Max, true), 1.0f);
  EXPECT_EQ(fp8_group_scale(NAN, kE4M3Max, false), 1.0f);
}

// out = a . b^T against the float64 product of the dequantized operands.
void check_gemm(const Tensor& xa, M ma, const Tensor& xb, M mb, DType out_dtype, bool fast) {
  Fp8ScaledTensor a = fp8_cast_scaled(xa, DType::E4M3, ma, false, false);
  Fp8ScaledTensor b = fp8_cast_scaled(xb, DType::E4M3, mb, false, false);
  Tensor out = fp8_gemm_scaled(a, b, out_dtype, fast);
  const std::string what = std::string(fp8_scale_mode_name(ma)) + " x " + fp8_scale_mode_name(mb);
  ASSERT_EQ(out.shape(), (Shape{a.data.size(0), b.data.size(0)})) << what;
  ASSERT_EQ(out.dtype(), out_dtype);
  std::vector<double> da = fp8_scaled_dequantize(a).to_vector();
  std::vector<double> db = fp8_scaled_dequantize(b).to_vector();
  std::vector<double> got = out.to_vector();
  const int64_t Ma = a.rows, Nb = b.rows, K = a.k, Np = out.size(1);
  const double tol = out_dtype == DType::F32 ? 1e-5 : 1e-2;
  for (int64_t i = 0; i < out.size(0); ++i)
    for (int64_t j = 0; j < Np; ++j) {
      double want = 0, mag = 0;
      if (i < Ma && j < Nb)
        for (int64_t k = 0; k < K; ++k) {
          want += da[i * K + k] * db[j * K + k];
          mag += std::fabs(da[i * K + k] * db[j * K + k]);
        }
      ASSERT_NEAR(got[i * Np + j], want, tol * mag + 1e-30) << what << " at " << i << ", " << j;
    }
}

TEST(Fp8Scaled, GemmsEqualTheProductOfTheDequantizedOperands) {
  Tensor x = test_input(40, 300, 11), w = test_input(150, 300, 12);
  check_gemm(x, M::Row, w, M::Row, DType::F32, true);
  check_gemm(x, M::Row, w, M::Row, DType::BF16, false);
  check_gemm(x, M::Block1x128, w, M::Block128x128, DType::F32, false);
  check_gemm(w, M::Block128x128, x, M::Block1x128, DType::F32, false);
  check_gemm(x, M::Block1x128, w, M::Block1x128, DType::BF16, false);
}

TEST(Fp8Scaled, UnsupportedModePairsAreRefusedByName) {
  Tensor x = test_input(32, 256, 13);
  Fp8ScaledTensor row = fp8_cast_scaled(x, DType::E4M3, M::Row, false, false);
  Fp8ScaledTensor t1 = fp8_cast_scaled(x, DType::E4M3, M::Block1x128, false, false);
  Fp8ScaledTensor t2 = fp8_cast_scaled(x, DType::E4M3, M::Block128x128, false, false);
  auto refused = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "not refused: " << needle;
  };
  refused([&] { fp8_gemm_scaled(row, t1, DType::F32, false); }, "rowwise (OUTER_VEC_32F)");
  refused([&] { fp8_gemm_scaled(t2, t2, DType::F32, false); }, "128x128 blocks (BLK128x128_32F)");
  refused([&] { fp8_gemm_scaled(t1, t2, DType::F32, true); }, "no fast accumulation");
  Fp8ScaledTensor bad = t1;
  bad.scale_inv = Tensor::ones({3}, DType::F32);
  refused([&] { fp8_gemm_scaled(bad, t2, DType::F32, false); }, "must be a contiguous f32");
}

// ---- fp8_linear per recipe, against the GEMMs of explicitly quantized operands ----------------

Fp8Recipe recipe(Fp8Scaling scaling, bool pow2, bool gw_hp) {
  Fp8Recipe r;
  r.scaling = scaling;
  r.forward_dtype = r.backward_dtype = DType::E4M3;
  r.pow2_scales = pow2;
  r.dgrad_weight_tensorwise = gw_hp;
  r.hp_wgrad = gw_hp;
  return r;
}

// The float64 product of two dequantized operands [m, k] . [n, k]^T.
std::vector<double> ref_mm(const Fp8ScaledTensor& a, const Fp8ScaledTensor& b) {
  std::vector<double> da = fp8_scaled_dequantize(a).to_vector();
  std::vector<double> db = fp8_scaled_dequantize(b).to_vector();
  std::vector<double> out(static_cast<size_t>(a.rows * b.rows), 0.0);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      double s = 0;
      for (int64_t k = 0; k < a.k; ++k) s += da[i * a.k + k] * db[j * a.k + k];
      out[i * b.rows + j] = s;
    }
  return out;
}

void expect_close(const std::vector<double>& want, const Tensor& got, double rel,
                  const std::string& what) {
  std::vector<double> g = got.to_vector();
  ASSERT_EQ(g.size(), want.size()) << what;
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], want[i], rel * scale) << what << " element " << i;
}

TEST(Fp8Scaled, LinearRunsTheRecipesGemms) {
  const int64_t Mt = 37, K = 200, N = 144;  // padded: 37 -> 48, 200 -> 208
  Tensor x0 = test_input(Mt, K, 21);
  std::vector<double> wv = test_input(N, K, 22).to_vector();
  for (double& v : wv) v *= 0.05;
  Tensor w0 = Tensor::from_vector(wv, {N, K}, DType::F32);
  Tensor g0 = test::randn({Mt, N}, 23, DType::F32, 1e-3);
  struct R {
    const char* name;
    Fp8Recipe r;
  };
  for (const R& rc : {R{"rowwise", recipe(Fp8Scaling::Rowwise, true, false)},
                      R{"rowwise_with_gw_hp", recipe(Fp8Scaling::Rowwise, false, true)},
                      R{"blockwise", recipe(Fp8Scaling::Blockwise, false, false)}}) {
    const Fp8Recipe& r = rc.r;
    Fp8LinearContext ctx;
    ctx.recipe = r;
    Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
    Tensor y = fp8_linear(x, w, Tensor(), ctx);
    y.backward(g0);
    const bool block = r.scaling == Fp8Scaling::Blockwise;
    const M act = block ? M::Block1x128 : M::Row, wm = block ? M::Block128x128 : M::Row;
    const bool p2 = r.pow2_scales;
    // fprop: x along K x w along K.
    auto qx = fp8_cast_scaled(x0, DType::E4M3, act, false, p2);
    auto qw = fp8_cast_scaled(w0, DType::E4M3, wm, false, p2);
    expect_close(ref_mm(qx, qw), y, 1e-5, std::string(rc.name) + " output");
    // dgrad: dy along N x w^T along N (tensorwise for rowwise_with_gw_hp).
    auto qg = fp8_cast_scaled(g0, DType::E4M3, act, false, p2);
    auto qwt = fp8_cast_scaled(w0, DType::E4M3, wm, true, p2, r.dgrad_weight_tensorwise);
    expect_close(ref_mm(qg, qwt), x.grad(), 1e-5, std::string(rc.name) + " input gradient");
    if (r.dgrad_weight_tensorwise) {
      std::vector<double> si = qwt.scale_inv.to_vector();
      for (double v : si) ASSERT_EQ(v, si[0]) << "one tensorwise scale";
    }
    // wgrad: dy^T along M x x^T along M, or the high-precision product.
    if (r.hp_wgrad) {
      std::vector<double> want(static_cast<size_t>(N * K), 0.0), gv = g0.to_vector(),
                                                                 xv = x0.to_vector();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t m = 0; m < Mt; ++m) want[n * K + k] += gv[m * N + n] * xv[m * K + k];
      expect_close(want, w.grad(), 1e-5, std::string(rc.name) + " weight gradient (bf16 GEMM)");
    } else {
      auto qgt = fp8_cast_scaled(g0, DType::E4M3, act, true, p2);
      auto qxt = fp8_cast_scaled(x0, DType::E4M3, act, true, p2);
      expect_close(ref_mm(qgt, qxt), w.grad(), 1e-5, std::string(rc.name) + " weight gradient");
    }
    EXPECT_NE(r.str().find(block ? "blockwise" : "rowwise"), std::string::npos) << r.str();
  }
}

TEST(Fp8Scaled, LinearRefusesWhatTheRecipesCannotTake) {
  Fp8LinearContext ctx;
  ctx.recipe = recipe(Fp8Scaling::Blockwise, false, false);
  ctx.weight_provider = [](const Tensor&) { return Fp8Tensor{}; };
  Tensor x = test::randn({4, 32}, 1, DType::F32), w = test::randn({16, 32}, 2, DType::F32);
  EXPECT_THROW(fp8_linear(x, w, Tensor(), ctx), std::invalid_argument);
  ctx.weight_provider = nullptr;
  ctx.recipe.hp_dgrad = true;
  EXPECT_THROW(fp8_linear(x, w, Tensor(), ctx), std::invalid_argument);
}

}  // namespace
}  // namespace accel
