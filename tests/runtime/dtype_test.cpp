// runtime/dtype.h conversions against exact tables: every fp8 code of both formats decoded from an
// independent formula and re-encoded, known values, round-to-nearest-even at every midpoint,
// overflow (saturating and not), and bf16/f16 ties.
#include "runtime/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ops/ops.h"

namespace accel {
namespace {

// Value of an fp8 code from its bit fields (OCP FP8 spec), independent of runtime/dtype.h.
double e4m3_reference(int code) {
  const int s = code >> 7, e = (code >> 3) & 0xf, m = code & 7;
  if (e == 0xf && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double v = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -v : v;
}

double e5m2_reference(int code) {
  const int s = code >> 7, e = (code >> 2) & 0x1f, m = code & 3;
  double v;
  if (e == 0x1f)
    v = m == 0 ? INFINITY : std::numeric_limits<double>::quiet_NaN();
  else
    v = e == 0 ? m * std::ldexp(1.0, -16) : (1 + m / 4.0) * std::ldexp(1.0, e - 15);
  return s ? -v : v;
}

bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

TEST(Fp8, AllE4M3CodesDecodeAndRoundTrip) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double ref = e4m3_reference(c);
    const float got = e4m3_to_f32(static_cast<uint8_t>(c));
    EXPECT_TRUE(same_value(got, ref)) << "code " << c << ": " << got << " vs " << ref;
    if (std::isnan(ref)) {
      ++nans;
      continue;
    }
    EXPECT_EQ(f32_to_e4m3(got), c) << "code " << c;
    EXPECT_EQ(f32_to_e4m3(got, false), c) << "code " << c;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff only
}

TEST(Fp8, AllE5M2CodesDecodeAndRoundTrip) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double ref = e5m2_reference(c);
    const float got = e5m2_to_f32(static_cast<uint8_t>(c));
    EXPECT_TRUE(same_value(got, ref)) << "code " << c << ": " << got << " vs " << ref;
    if (std::isnan(ref)) {
      ++nans;
      continue;
    }
    if (std::isinf(ref)) {
      EXPECT_EQ(f32_to_e5m2(got, false), c);  // inf stays inf when not saturating
      continue;
    }
    EXPECT_EQ(f32_to_e5m2(got), c) << "code " << c;
  }
  EXPECT_EQ(nans, 6);  // exponent all ones with a non-zero mantissa, both signs
}

TEST(Fp8, KnownValues) {
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f32_to_e4m3(-448.0f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(f32_to_e5m2(std::ldexp(1.0f, -16)), 0x01);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(f32_to_e5m2(1.0f), 0x3c);
  EXPECT_EQ(e5m2_to_f32(0x7c), INFINITY);
  EXPECT_EQ(e5m2_to_f32(0xfc), -INFINITY);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_TRUE(std::isnan(e5m2_to_f32(0x7e)));
  EXPECT_EQ(f32_to_e4m3(NAN) & 0x7f, 0x7f);
  EXPECT_EQ(f32_to_e5m2(NAN) & 0x7f, 0x7e);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(kE4M3Max, 448.0f);
  EXPECT_EQ(kE5M2Max, 57344.0f);
}

// For every pair of adjacent positive finite codes: the midpoint rounds to the even code, and
// the floats just either side of it round to the nearer code.
template <class Decode, class Encode>
void check_midpoints(int max_code, int sign_bit, Decode decode, Encode encode, const char* name) {
  for (int c = 0; c < max_code; ++c) {
    const float a = decode(c), b = decode(c + 1);
    const float mid =
        a + (b - a) / 2;  // exact: the formats have far fewer mantissa bits than float
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2) << name;
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(static_cast<int>(encode(mid)), even) << name << " midpoint of " << c;
    EXPECT_EQ(static_cast<int>(encode(std::nextafter(mid, 0.0f))), c) << name << " below " << c;
    EXPECT_EQ(static_cast<int>(encode(std::nextafter(mid, INFINITY))), c + 1)
        << name << " above " << c;
    EXPECT_EQ(static_cast<int>(encode(-mid)), even | sign_bit)
        << name << " negative midpoint of " << c;
  }
}

TEST(Fp8, RoundsToNearestEvenEverywhere) {
  check_midpoints(
      0x7e, 0x80, [](int c) { return e4m3_to_f32(static_cast<uint8_t>(c)); },
      [](float f) { return f32_to_e4m3(f); }, "e4m3");
  check_midpoints(
      0x7b, 0x80, [](int c) { return e5m2_to_f32(static_cast<uint8_t>(c)); },
      [](float f) { return f32_to_e5m2(f); }, "e5m2");
  // Spelled out: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39) -> even 0x38; 1.1875 -> 0x3a.
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);      // half the smallest subnormal
  EXPECT_EQ(f32_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);  // 1.5 subnormal ulps -> 2
}

TEST(Fp8, Overflow) {
  // e4m3: 464 is halfway between 448 and the (absent) 480: ties to even keeps 448.
  EXPECT_EQ(f32_to_e4m3(464.0f, false), 0x7e);
  EXPECT_EQ(f32_to_e4m3(465.0f, false), 0x7f);  // NaN: e4m3fn has no infinity
  EXPECT_EQ(f32_to_e4m3(465.0f), 0x7e);         // saturating: 448
  EXPECT_EQ(f32_to_e4m3(1e9f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(f32_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_e4m3(INFINITY, false), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-INFINITY, false), 0xff);
  // e5m2: 61440 is halfway between 57344 (odd code 0x7b) and 65536 (inf, 0x7c): ties to inf.
  EXPECT_EQ(f32_to_e5m2(61439.0f, false), 0x7b);
  EXPECT_EQ(f32_to_e5m2(61440.0f, false), 0x7c);
  EXPECT_EQ(f32_to_e5m2(61440.0f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(1e9f, false), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-1e9f, false), 0xfc);
  EXPECT_EQ(f32_to_e5m2(-1e9f), 0xfb);
}

TEST(Bf16, RoundToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even (down)
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  // A NaN whose payload is only in the low bits must not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(detail::bits_f32(0x7f800001u)))));
  // Every finite bf16 value round-trips, and every midpoint ties to even.
  for (uint32_t c = 0; c < 0x7f80; ++c) {
    const float a = bf16_to_f32(static_cast<uint16_t>(c));
    ASSERT_EQ(f32_to_bf16(a), c);
    ASSERT_EQ(f32_to_bf16(-a), c | 0x8000);
    if (c + 1 < 0x7f80) {
      // a + (b - a) / 2: a + b would overflow near the top of the range.
      const float mid = a + (bf16_to_f32(static_cast<uint16_t>(c + 1)) - a) / 2;
      ASSERT_EQ(f32_to_bf16(mid), (c % 2 == 0) ? c : c + 1) << c;
    }
  }
}

TEST(F16, RoundToNearestEvenAndOverflow) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // tie between 65504 (odd) and inf (even)
  EXPECT_EQ(f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> 0
  EXPECT_EQ(f32_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
  EXPECT_EQ(f16_to_f32(0x7c00), INFINITY);
  check_midpoints(
      0x7bff, 0x8000, [](int c) { return f16_to_f32(static_cast<uint16_t>(c)); },
      [](float f) { return f32_to_f16(f); }, "f16");
  for (uint32_t c = 0; c <= 0x7c00; ++c)
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(c))), c) << c;
}

TEST(Casts, TensorCastsUseTheSameRounding) {
  std::vector<double> v = {0.1, -3.3, 500.0, 1e-5, 65520.0, 1.0625, -0.0};
  Tensor x = Tensor::from_vector(v, {7}, DType::F32);
  std::vector<double> e4 = cast(x, DType::E4M3).to_vector(), e5 = cast(x, DType::E5M2).to_vector(),
                      bf = cast(x, DType::BF16).to_vector(), hf = cast(x, DType::F16).to_vector();
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    EXPECT_EQ(e4[i], e4m3_to_f32(f32_to_e4m3(f))) << i;  // saturating: 500 -> 448
    EXPECT_EQ(e5[i], e5m2_to_f32(f32_to_e5m2(f))) << i;
    EXPECT_EQ(bf[i], bf16_to_f32(f32_to_bf16(f))) << i;
    EXPECT_TRUE(same_value(hf[i], f16_to_f32(f32_to_f16(f)))) << i;
  }
  EXPECT_EQ(e4[2], 448.0);
  EXPECT_TRUE(std::isinf(hf[4]));
}

}  // namespace
}  // namespace accel
