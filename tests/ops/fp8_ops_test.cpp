// fp8 primitives on the CPU (the exact emulation): scale edge cases, casts against the scalar
// encoder, transposes and padding, GEMMs against the dequantized product and the unquantized one,
// delayed-scaling history/interval logic against hand-computed sequences, MX block scaling.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// 20 log10(|ref| / |ref - got|) over all elements.
double sqnr_db(const std::vector<double>& ref, const std::vector<double>& got) {
  double s = 0, e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += ref[i] * ref[i];
    e += (ref[i] - got[i]) * (ref[i] - got[i]);
  }
  return 10.0 * std::log10(s / std::max(e, 1e-300));
}

Tensor scalar(float v) { return Tensor::from_vector(std::vector<float>{v}, {1}); }
float value(const Tensor& t) { return static_cast<float>(t.item()); }

uint8_t encode(float v, DType fmt) { return fmt == DType::E4M3 ? f32_to_e4m3(v) : f32_to_e5m2(v); }

std::vector<uint8_t> codes(const Tensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data_ptr());
  return std::vector<uint8_t>(p, p + t.numel());
}

// ---- scale math -------------------------------------------------------------------------------

TEST(Fp8Scale, FromAmaxEdgeCases) {
  // Normal case: fp8_max / amax, margin divides by 2^margin.
  EXPECT_EQ(fp8_scale_for_amax(2.0f, kE4M3Max, 0, 1.0f), 224.0f);
  EXPECT_EQ(fp8_scale_for_amax(2.0f, kE4M3Max, 2, 1.0f), 56.0f);
  EXPECT_EQ(fp8_scale_for_amax(4.0f, kE5M2Max, 0, 1.0f), 14336.0f);
  // amax 0, inf and NaN carry no range: the fallback (previous scale, or 1).
  EXPECT_EQ(fp8_scale_for_amax(0.0f, kE4M3Max, 0, 3.0f), 3.0f);
  EXPECT_EQ(fp8_scale_for_amax(-0.0f, kE4M3Max, 0, 3.0f), 3.0f);
  EXPECT_EQ(fp8_scale_for_amax(kInf, kE4M3Max, 0, 3.0f), 3.0f);
  EXPECT_EQ(fp8_scale_for_amax(kNaN, kE4M3Max, 0, 3.0f), 3.0f);
  EXPECT_EQ(fp8_scale_for_amax(-1.0f, kE4M3Max, 0, 3.0f), 3.0f);
  // Tiny amax: the quotient overflows, the scale saturates at FLT_MAX (scale_inv stays > 0).
  EXPECT_EQ(fp8_scale_for_amax(1e-40f, kE4M3Max, 0, 1.0f), FLT_MAX);
  EXPECT_EQ(fp8_scale_for_amax(FLT_MIN, kE5M2Max, 0, 1.0f), FLT_MAX);
  EXPECT_GT(1.0f / FLT_MAX, 0.0f);
  // Huge amax with a large margin: clamped to FLT_MIN so that 1 / scale is finite.
  EXPECT_EQ(fp8_scale_for_amax(3e38f, kE4M3Max, 64, 1.0f), FLT_MIN);
  EXPECT_TRUE(std::isfinite(1.0f / FLT_MIN));
}

TEST(Fp8Scale, MxBlockExponentIsTheSmallestThatFits) {
  for (float amax : {1.0f, 448.0f, 449.0f, 896.0f, 897.0f, 0.001f, 3.5f, 1e-30f, 1e30f}) {
    int e = fp8_mx_block_exponent(amax, kE4M3Max);
    EXPECT_LE(amax, std::ldexp(448.0, e)) << amax;
    EXPECT_GT(amax, std::ldexp(448.0, e - 1)) << amax;
  }
  EXPECT_EQ(fp8_mx_block_exponent(448.0f, kE4M3Max), 0);
  EXPECT_EQ(fp8_mx_block_exponent(449.0f, kE4M3Max), 1);
  EXPECT_EQ(fp8_mx_block_exponent(224.0f, kE4M3Max), -1);
  EXPECT_EQ(fp8_mx_block_exponent(0.0f, kE4M3Max), 0);
  EXPECT_EQ(fp8_mx_block_exponent(kNaN, kE4M3Max), 0);
  EXPECT_EQ(fp8_mx_block_exponent(kInf, kE4M3Max), 0);
  EXPECT_EQ(fp8_mx_block_exponent(1e-44f, kE4M3Max), -127);  // clamped to e8m0's range
}

// ---- casts ------------------------------------------------------------------------------------

TEST(Fp8Cast, MatchesScalarEncoderWithTransposeAndPadding) {
  for (DType fmt : {DType::E4M3, DType::E5M2}) {
    for (DType in_dtype : {DType::F32, DType::BF16}) {
      const int64_t R = 5, C = 19;
      Tensor x = test::randn({R, C}, 7, in_dtype, 3.0);
      const float s = 37.5f;
      Tensor amax = scalar(0.5f);
      Fp8Tensor q = fp8_cast(x, fmt, scalar(s), amax, Fp8CastOptions{true, true, 16});
      ASSERT_EQ(q.data.shape(), (Shape{16, 32}));
      ASSERT_EQ(q.data_t.shape(), (Shape{32, 16}));
      ASSERT_EQ(q.data.dtype(), fmt);
      EXPECT_EQ(value(q.scale_inv), 1.0f / s);
      std::vector<double> xv = x.to_vector();
      std::vector<uint8_t> d = codes(q.data), dt = codes(q.data_t);
      double m = 0;
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t c = 0; c < 32; ++c) {
          uint8_t want = 0;
          if (r < R && c < C) {
            float v = static_cast<float>(xv[r * C + c]);
            m = std::max(m, std::fabs(static_cast<double>(v)));
            want = encode(v * s, fmt);
          }
          ASSERT_EQ(d[r * 32 + c], want) << dtype_name(fmt) << " at " << r << "," << c;
          ASSERT_EQ(dt[c * 16 + r], want) << dtype_name(fmt) << " transposed at " << r << "," << c;
        }
      EXPECT_EQ(value(amax), static_cast<float>(m));
      // The accumulator keeps a larger earlier value (micro-batches of one step).
      Tensor big = scalar(1000.0f);
      fp8_cast(x, fmt, scalar(s), big);
      EXPECT_EQ(value(big), 1000.0f);
      // Dequantization undoes the scale: within half an fp8 ulp of x.
      std::vector<double> back = fp8_dequantize(q).to_vector();
      const double rel = fmt == DType::E4M3 ? 1.0 / 16 : 1.0 / 8;
      for (size_t i = 0; i < xv.size(); ++i)
        EXPECT_NEAR(back[i], xv[i], rel * std::fabs(xv[i]) + 1e-6) << i;
    }
  }
}

TEST(Fp8Cast, SaturatesInsteadOfOverflowing) {
  Tensor x = Tensor::from_vector(std::vector<float>{1000.f, -1e6f, kInf, -kInf}, {1, 4});
  for (DType fmt : {DType::E4M3, DType::E5M2}) {
    const float s = fmt == DType::E4M3 ? 1.0f : 100.0f;
    Fp8Tensor q = fp8_cast(x, fmt, scalar(s));
    std::vector<double> v = fp8_dequantize(q).to_vector();
    const double mx = static_cast<double>(fp8_max_value(fmt) * (1.0f / s));
    EXPECT_EQ(v, (std::vector<double>{mx, -mx, mx, -mx})) << dtype_name(fmt);
  }
}

TEST(Fp8CastDynamic, EdgeCases) {
  // All zeros: amax 0 -> scale 1, codes 0.
  Fp8Tensor z = fp8_cast_dynamic(Tensor::zeros({3, 4}), DType::E4M3);
  EXPECT_EQ(value(z.scale), 1.0f);
  for (uint8_t c : codes(z.data)) EXPECT_EQ(c, 0);
  // An inf element: amax inf -> scale 1; inf saturates to 448, finite values stay.
  Tensor xi = Tensor::from_vector(std::vector<float>{kInf, 2.0f, -3.0f, 0.5f}, {2, 2});
  Fp8Tensor qi = fp8_cast_dynamic(xi, DType::E4M3);
  EXPECT_EQ(value(qi.scale), 1.0f);
  EXPECT_EQ(fp8_dequantize(qi).to_vector(), (std::vector<double>{448, 2, -3, 0.5}));
  // A NaN element is ignored by the amax (scale from the finite values) and stays NaN.
  Tensor xn = Tensor::from_vector(std::vector<float>{kNaN, 2.0f, -4.0f, 0.5f}, {2, 2});
  Fp8Tensor qn = fp8_cast_dynamic(xn, DType::E4M3);
  EXPECT_EQ(value(qn.scale), 112.0f);
  std::vector<double> vn = fp8_dequantize(qn).to_vector();
  EXPECT_TRUE(std::isnan(vn[0]));
  EXPECT_EQ(vn[1], 2.0);
  EXPECT_EQ(vn[2], -4.0);
  // Tiny values get a large scale and keep their precision (no flush to zero).
  Tensor xt = Tensor::from_vector(std::vector<float>{1e-30f, -3e-31f, 7e-31f, 0.0f}, {2, 2});
  Fp8Tensor qt = fp8_cast_dynamic(xt, DType::E4M3);
  EXPECT_EQ(value(qt.scale), 448.0f / 1e-30f);
  std::vector<double> vt = fp8_dequantize(qt).to_vector(), want = xt.to_vector();
  for (size_t i = 0; i < vt.size(); ++i) EXPECT_NEAR(vt[i], want[i], std::fabs(want[i]) / 16);
  // Denormal amax: scale FLT_MAX, still finite results.
  Tensor xd = Tensor::from_vector(std::vector<float>{1e-40f, 0.0f}, {1, 2});
  Fp8Tensor qd = fp8_cast_dynamic(xd, DType::E5M2);
  EXPECT_EQ(value(qd.scale), FLT_MAX);
  for (double v : fp8_dequantize(qd).to_vector()) EXPECT_TRUE(std::isfinite(v));
  // The margin halves the scale per step.
  Tensor x2 = Tensor::from_vector(std::vector<float>{2.0f, 1.0f}, {1, 2});
  EXPECT_EQ(value(fp8_cast_dynamic(x2, DType::E4M3, {}, 1).scale), 112.0f);
}

TEST(Fp8Cast, RoundTripSqnrAndTranspose) {
  Tensor x = test::randn({64, 96}, 3, DType::F32);
  Fp8Tensor q = fp8_cast_dynamic(x, DType::E4M3, Fp8CastOptions{true, false, 1});
  EXPECT_GE(sqnr_db(x.to_vector(), fp8_dequantize(q).to_vector()), 25.0);
  Fp8Tensor qt = fp8_with_transpose(q);
  ASSERT_TRUE(qt.data_t.defined());
  EXPECT_EQ(fp8_dequantize(qt).to_vector(), fp8_dequantize(q).to_vector());
  Fp8Tensor only_t = qt;
  only_t.data = Tensor();
  EXPECT_EQ(fp8_dequantize(only_t).to_vector(), fp8_dequantize(q).to_vector());
}

TEST(Fp8Cast, RejectsBadArguments) {
  Tensor x = Tensor::ones({2, 2});
  EXPECT_THROW(fp8_cast(x, DType::BF16, scalar(1)), std::invalid_argument);
  EXPECT_THROW(fp8_cast(Tensor::ones({2, 2, 2}), DType::E4M3, scalar(1)), std::invalid_argument);
  EXPECT_THROW(fp8_cast(x, DType::E4M3, Tensor::ones({2})), std::invalid_argument);
  EXPECT_THROW(fp8_cast(x, DType::E4M3, scalar(1), Tensor(), Fp8CastOptions{false, false, 1}),
               std::invalid_argument);
}

// ---- GEMM -------------------------------------------------------------------------------------

TEST(Fp8Gemm, MatchesDequantizedProductAndUnquantizedWithin25dB) {
  const int64_t M = 48, N = 32, K = 64;
  Tensor a = test::randn({M, K}, 11, DType::F32);
  Tensor b = test::randn({N, K}, 12, DType::F32, 0.05);
  std::vector<double> av = a.to_vector(), bv = b.to_vector();
  std::vector<double> exact(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) exact[i * N + j] += av[i * K + k] * bv[j * K + k];
  struct Case {
    DType fa, fb;
    double min_db;
  };
  for (Case c : {Case{DType::E4M3, DType::E4M3, 25.0}, Case{DType::E5M2, DType::E4M3, 20.0}}) {
    Fp8Tensor qa = fp8_cast_dynamic(a, c.fa), qb = fp8_cast_dynamic(b, c.fb);
    std::vector<double> da = fp8_dequantize(qa).to_vector(), db = fp8_dequantize(qb).to_vector();
    std::vector<double> deq(M * N, 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < K; ++k) deq[i * N + j] += da[i * K + k] * db[j * K + k];
    for (DType out : {DType::F32, DType::BF16}) {
      Tensor y = fp8_gemm(qa.data, qa.scale_inv, qb.data, qb.scale_inv, out, true);
      ASSERT_EQ(y.shape(), (Shape{M, N}));
      test::expect_close(y, deq, out == DType::F32 ? 1e-5 : 1e-2, 1e-4, "fp8 gemm vs dequantized");
      const double db_snr = sqnr_db(exact, y.to_vector());
      EXPECT_GE(db_snr, c.min_db) << dtype_name(c.fa) << " x " << dtype_name(c.fb);
    }
  }
}

TEST(Fp8Gemm, RejectsBadOperands) {
  Tensor a = Tensor::zeros({4, 16}, DType::E5M2), b = Tensor::zeros({8, 16}, DType::E5M2);
  Tensor s = scalar(1);
  EXPECT_THROW(fp8_gemm(a, s, b, s, DType::F32, false), std::invalid_argument);  // e5m2 x e5m2
  Tensor c = Tensor::zeros({8, 32}, DType::E4M3);
  EXPECT_THROW(fp8_gemm(a, s, c, s, DType::F32, false), std::invalid_argument);  // K differs
  EXPECT_THROW(fp8_gemm(Tensor::zeros({4, 16}), s, c, s, DType::F32, false),
               std::invalid_argument);  // not fp8
}

// The addend is summed with the product in fp32 and the sum rounded once: out itself accumulates
// into an f32 out (the fused head sums its weight gradient over chunks so), a separate bf16 addend
// (an input gradient folding the one its input has) is only read.
TEST(Fp8Gemm, AddsTheAddendBeforeTheOneRounding) {
  Tensor a = test::randn({24, 32}, 13, DType::F32), b = test::randn({16, 32}, 14, DType::F32);
  Fp8Tensor qa = fp8_cast_dynamic(a, DType::E5M2), qb = fp8_cast_dynamic(b, DType::E4M3);
  const Tensor product = fp8_gemm(qa.data, qa.scale_inv, qb.data, qb.scale_inv, DType::F32, false);
  const Tensor start = test::randn({24, 16}, 15, DType::F32);
  Tensor out = start.clone();
  fp8_gemm(out, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, /*addend=*/out);
  test::expect_close(out, add(start, product), 1e-6, 1e-6, "start + product");
  fp8_gemm(out, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, out);
  test::expect_close(out, add(start, mul(product, 2.0)), 1e-6, 1e-6, "start + 2 x product");

  const Tensor addend = cast(start, DType::BF16), kept = addend.clone();
  Tensor bf = Tensor::empty({24, 16}, DType::BF16);
  fp8_gemm(bf, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, addend);
  EXPECT_EQ(addend.to_vector(), kept.to_vector()) << "the addend is only read";
  // The f32 sum rounded to bf16 (within that one rounding).
  test::expect_close(bf, add(product, cast(addend, DType::F32)), 1.0 / 256, 1e-6,
                     "product + addend");
  // Decisive: product 2^-8 (1 + 2^-9) plus 1. Rounded once, 1 + 2^-8 + 2^-17 (exact in f32 in any
  // order) lies above the midpoint of 1 and 1 + 2^-7 and rounds up; rounded twice, the product
  // becomes 2^-8 first and 1 + 2^-8 is a tie that rounds to even, 1.
  {
    std::vector<double> av(16 * 16, 0.0), bv(16 * 16, 0.0);
    av[0] = av[1] = std::ldexp(1.0, -8);       // e5m2: exact
    bv[0] = 1.0, bv[1] = std::ldexp(1.0, -9);  // e4m3: exact (2^-9 its least subnormal)
    const Tensor one = Tensor::full({1}, 1.0);
    Fp8Tensor qa1 = fp8_cast(Tensor::from_vector(av, {16, 16}), DType::E5M2, one);
    Fp8Tensor qb1 = fp8_cast(Tensor::from_vector(bv, {16, 16}), DType::E4M3, one);
    Tensor sum = Tensor::empty({16, 16}, DType::BF16);
    fp8_gemm(sum, qa1.data, qa1.scale_inv, qb1.data, qb1.scale_inv, false,
             Tensor::full({16, 16}, 1.0, DType::BF16));
    EXPECT_EQ(sum.to_vector()[0], 1.0 + std::ldexp(1.0, -7)) << "the sum was rounded twice";
    EXPECT_EQ(sum.to_vector()[1], 1.0);
  }
  Tensor wrong = Tensor::zeros({16, 24}, DType::BF16);
  EXPECT_THROW(fp8_gemm(bf, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, wrong),
               std::invalid_argument);
  EXPECT_THROW(fp8_gemm(bf, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, start),
               std::invalid_argument);  // f32 addend for a bf16 out
}

// ---- delayed scaling --------------------------------------------------------------------------

// Runs one delayed-scaling slot through steps whose tensors have the given amaxes (recorded by
// real casts) and returns the scale after each step's update.
std::vector<float> delayed_scales(Fp8Recipe r, const std::vector<float>& amaxes,
                                  std::vector<std::vector<float>>* histories = nullptr) {
  Fp8DelayedScaling st(r, Device::cpu());
  int slot = st.add_slot(DType::E4M3);
  int other = st.add_slot(DType::E5M2);  // an unused slot keeps scale 1
  std::vector<float> out;
  for (float a : amaxes) {
    Tensor x = Tensor::from_vector(std::vector<float>{a / 2, -a}, {1, 2});
    fp8_cast(x, DType::E4M3, st.scale(slot), st.amax(slot));
    fp8_cast(Tensor::from_vector(std::vector<float>{a / 4}, {1, 1}), DType::E4M3, st.scale(slot),
             st.amax(slot));  // a second micro-batch: the step's amax is the max
    st.update();
    EXPECT_EQ(value(st.scale(other)), 1.0f);
    EXPECT_EQ(value(st.scale_inv(slot)), 1.0f / value(st.scale(slot)));
    out.push_back(value(st.scale(slot)));
    if (histories) {
      std::vector<double> h = st.amax_history().to_vector();
      std::vector<float> col;
      for (int64_t i = 0; i < r.amax_history_len; ++i) col.push_back(static_cast<float>(h[i * 2]));
      histories->push_back(col);
    }
  }
  return out;
}

TEST(Fp8DelayedScaling, MaxOverHistoryWindow) {
  Fp8Recipe r;
  r.amax_history_len = 3;
  r.amax_algo = AmaxAlgo::Max;
  std::vector<std::vector<float>> h;
  // Windows: {2} {2,8} {2,8,1} {8,1,.5} {1,.5,.25}
  EXPECT_EQ(delayed_scales(r, {2, 8, 1, 0.5, 0.25}, &h),
            (std::vector<float>{224, 56, 56, 56, 448}));
  // TE's layout: row 0 restarts at 0, the newest amax sits in row L-1, row 1 is the oldest.
  EXPECT_EQ(h[0], (std::vector<float>{0, 0, 2}));
  EXPECT_EQ(h[1], (std::vector<float>{0, 2, 8}));
  EXPECT_EQ(h[2], (std::vector<float>{0, 8, 1}));
  EXPECT_EQ(h[3], (std::vector<float>{0, 1, 0.5}));
}

TEST(Fp8DelayedScaling, MostRecentMarginAndHistoryOfOne) {
  Fp8Recipe r;
  r.amax_history_len = 4;
  r.amax_algo = AmaxAlgo::MostRecent;
  EXPECT_EQ(delayed_scales(r, {2, 8, 1, 0.5}), (std::vector<float>{224, 56, 448, 896}));
  r.margin = 1;
  EXPECT_EQ(delayed_scales(r, {2, 8, 1, 0.5}), (std::vector<float>{112, 28, 224, 448}));
  r.margin = 0;
  r.amax_history_len = 1;
  r.amax_algo = AmaxAlgo::Max;
  EXPECT_EQ(delayed_scales(r, {2, 8, 1}), (std::vector<float>{224, 56, 448}));
}

TEST(Fp8DelayedScaling, IntervalRecomputesAfterSteps1And1PlusInterval) {
  Fp8Recipe r;
  r.amax_history_len = 3;
  r.amax_algo = AmaxAlgo::Max;
  r.interval = 2;
  // Recomputed after updates 1, 3, 5 only; windows {2}, {2,8,1}, {1,.5,.25}.
  EXPECT_EQ(delayed_scales(r, {2, 8, 1, 0.5, 0.25}), (std::vector<float>{224, 224, 56, 56, 448}));
  r.interval = 3;
  r.amax_algo = AmaxAlgo::MostRecent;
  EXPECT_EQ(delayed_scales(r, {2, 8, 1, 0.5, 4}), (std::vector<float>{224, 224, 224, 896, 896}));
}

TEST(Fp8DelayedScaling, UnusableAmaxesKeepTheScale) {
  Fp8Recipe r;
  r.amax_history_len = 2;
  r.amax_algo = AmaxAlgo::MostRecent;
  // Step 2 records nothing (amax 0), step 3 an inf: the scale of step 1 stays.
  EXPECT_EQ(delayed_scales(r, {2, 0, kInf, 4}), (std::vector<float>{224, 224, 224, 112}));
  r.amax_algo = AmaxAlgo::Max;
  // With 'max' the inf entry is ignored, the finite ones still count.
  EXPECT_EQ(delayed_scales(r, {2, kInf, 1}), (std::vector<float>{224, 224, 448}));
  // Before any usable amax the scale stays at its initial 1.
  EXPECT_EQ(delayed_scales(r, {0, 0}), (std::vector<float>{1, 1}));
  // A tiny amax saturates the scale at FLT_MAX.
  EXPECT_EQ(delayed_scales(r, {1e-40f}), (std::vector<float>{FLT_MAX}));
}

TEST(Fp8DelayedScaling, CurrentAmaxesIsRowZeroAndStateRoundTrips) {
  Fp8Recipe r;
  r.amax_history_len = 2;
  Fp8DelayedScaling st(r, Device::cpu());
  int a = st.add_slot(DType::E4M3), b = st.add_slot(DType::E5M2);
  st.amax(a).fill_(3.0);
  st.amax(b).fill_(5.0);
  Tensor cur = st.current_amaxes();
  EXPECT_EQ(cur.to_vector(), (std::vector<double>{3, 5}));
  cur.copy_(Tensor::from_vector(std::vector<float>{7, 9}, {2}));  // what an all-reduce does
  st.update();
  EXPECT_EQ(value(st.scale(a)), 64.0f);
  EXPECT_EQ(value(st.scale(b)), 57344.0f / 9);
  EXPECT_THROW(st.add_slot(DType::E4M3), std::logic_error);

  Fp8DelayedScaling st2(r, Device::cpu());
  st2.add_slot(DType::E4M3);
  st2.add_slot(DType::E5M2);
  st2.load_state(st.state_tensors());
  EXPECT_EQ(st2.updates(), 1);
  EXPECT_EQ(st2.scales().to_vector(), st.scales().to_vector());
  EXPECT_EQ(st2.amax_history().to_vector(), st.amax_history().to_vector());
  Fp8DelayedScaling st3(r, Device::cpu());
  st3.add_slot(DType::E4M3);
  EXPECT_THROW(st3.load_state(st.state_tensors()), std::invalid_argument);
}

// ---- MX emulation -----------------------------------------------------------------------------

TEST(Fp8Mx, FakeQuantBlocksAlongEitherDim) {
  const int64_t R = 40, C = 70;  // partial blocks in both directions
  Tensor x = test::randn({R, C}, 5, DType::F32);
  // One huge element per block row must not spoil the other blocks.
  std::vector<double> xv = x.to_vector();
  xv[3] = 5000.0;
  x = Tensor::from_vector(xv, {R, C});
  for (int dim : {0, 1}) {
    Tensor y = fp8_mx_fake_quant(x, DType::E4M3, dim);
    std::vector<double> yv = y.to_vector();
    const int64_t outer = dim == 1 ? R : C, inner = dim == 1 ? C : R;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t b0 = 0; b0 < inner; b0 += 32) {
        double m = 0;
        auto idx = [&](int64_t i) { return dim == 1 ? o * C + i : i * C + o; };
        for (int64_t i = b0; i < std::min(inner, b0 + 32); ++i)
          m = std::max(m, std::fabs(xv[idx(i)]));
        const int e = fp8_mx_block_exponent(static_cast<float>(m), kE4M3Max);
        for (int64_t i = b0; i < std::min(inner, b0 + 32); ++i) {
          float want = std::ldexp(
              e4m3_to_f32(f32_to_e4m3(std::ldexp(static_cast<float>(xv[idx(i)]), -e))), e);
          ASSERT_EQ(static_cast<float>(yv[idx(i)]), want)
              << "dim " << dim << " o " << o << " i " << i;
        }
      }
    EXPECT_GE(sqnr_db(xv, yv), 25.0);
  }
  // bf16 in, bf16 out: the dequantized values are exact in bf16.
  Tensor xb = cast(x, DType::BF16);
  Tensor yb = fp8_mx_fake_quant(xb, DType::E4M3, 1);
  EXPECT_EQ(yb.dtype(), DType::BF16);
  EXPECT_EQ(yb.to_vector(), fp8_mx_fake_quant(cast(xb, DType::F32), DType::E4M3, 1).to_vector());
}

}  // namespace
}  // namespace accel
