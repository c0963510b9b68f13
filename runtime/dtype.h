// Element types and their conversions. The conversion helpers are header-only and marked for both
// host and device so CUDA kernels and the CPU reference round exactly the same way.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define ACCEL_HD __host__ __device__ __forceinline__
#else
#define ACCEL_HD inline
#endif

namespace accel {

enum class DType : uint8_t { F32, F64, BF16, F16, E4M3, E5M2, I32, I64, U8, Bool };
constexpr int kNumDTypes = 10;

size_t dtype_size(DType t);
const char* dtype_name(DType t);                 // "f32", "bf16", "e4m3", ...
bool is_floating(DType t);                       // f32 f64 bf16 f16 e4m3 e5m2
DType dtype_from_name(const std::string& name);  // throws std::invalid_argument on unknown names

namespace detail {
ACCEL_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
ACCEL_HD float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
ACCEL_HD float pow2(int e) { return ldexpf(1.0f, e); }

// A small binary float format: exponent bits, mantissa bits, bias, and how it spells the
// largest finite value, infinity and NaN.
struct SmallFloat {
  int exp_bits, man_bits, bias;
  uint32_t max_code;  // code of the largest finite magnitude
  bool has_inf;       // IEEE-style inf at exponent all-ones, mantissa zero
  uint32_t nan_code;  // the canonical positive NaN
};
// e4m3fn (OCP): no infinities, one NaN pattern (S.1111.111), max 448.
constexpr SmallFloat kE4M3{4, 3, 7, 0x7e, false, 0x7f};
// e5m2 (OCP): IEEE-like, max 57344.
constexpr SmallFloat kE5M2{5, 2, 15, 0x7b, true, 0x7e};
// IEEE binary16, max 65504.
constexpr SmallFloat kF16{5, 10, 15, 0x7bff, true, 0x7e00};

// Round-to-nearest-even encode. Overflow gives +-max when `saturate`, else inf (or NaN for formats
// without inf).
ACCEL_HD uint32_t encode(float f, const SmallFloat& fmt, bool saturate) {
  const int m_bits = fmt.man_bits;
  const uint32_t sign = (f32_bits(f) >> 31) << (fmt.exp_bits + m_bits);
  const uint32_t inf_code = ((1u << fmt.exp_bits) - 1u) << m_bits;
  const uint32_t overflow = saturate ? fmt.max_code : (fmt.has_inf ? inf_code : fmt.nan_code);
  float a = fabsf(f);
  if (a != a) return sign | fmt.nan_code;
  if (a > 3.0e38f) return sign | overflow;  // inf, or close enough that every format overflows
  const int min_normal_exp = 1 - fmt.bias;
  uint32_t code;
  if (a < pow2(min_normal_exp)) {
    // Subnormal: a = q * 2^(min_normal_exp - m_bits). Scaling by a power of two is exact.
    float scaled = a * pow2(m_bits - min_normal_exp);
    uint32_t q = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    code = q;  // q == 2^m_bits is exactly the smallest normal's code
  } else {
    uint32_t ua = f32_bits(a);
    int e = static_cast<int>((ua >> 23) & 0xffu) - 127;
    uint32_t mant = ua & 0x7fffffu;
    int shift = 23 - m_bits;
    uint32_t keep = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    code = (static_cast<uint32_t>(e + fmt.bias) << m_bits) | keep;
    if (rest > half || (rest == half && (keep & 1u))) code++;  // a carry moves into the exponent
  }
  if (code > fmt.max_code) return sign | overflow;
  return sign | code;
}

ACCEL_HD float decode(uint32_t code, const SmallFloat& fmt) {
  const int m_bits = fmt.man_bits;
  const uint32_t exp_mask = (1u << fmt.exp_bits) - 1u;
  const uint32_t man_mask = (1u << m_bits) - 1u;
  bool neg = (code >> (fmt.exp_bits + m_bits)) & 1u;
  uint32_t e = (code >> m_bits) & exp_mask;
  uint32_t m = code & man_mask;
  float v;
  if (fmt.has_inf && e == exp_mask) {
    v = m == 0 ? INFINITY : NAN;
  } else if (!fmt.has_inf && (code & ~(1u << (fmt.exp_bits + m_bits))) == fmt.nan_code) {
    v = NAN;
  } else if (e == 0) {
    v = static_cast<float>(m) * pow2(1 - fmt.bias - m_bits);
  } else {
    v = (1.0f + static_cast<float>(m) * pow2(-m_bits)) * pow2(static_cast<int>(e) - fmt.bias);
  }
  return neg ? -v : v;
}
}  // namespace detail

// bfloat16: the top 16 bits of an fp32, round to nearest even; NaN stays a quiet NaN.
ACCEL_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = detail::f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
ACCEL_HD float bf16_to_f32(uint16_t h) { return detail::bits_f32(static_cast<uint32_t>(h) << 16); }

ACCEL_HD uint16_t f32_to_f16(float f) {
  return static_cast<uint16_t>(detail::encode(f, detail::kF16, false));
}
ACCEL_HD float f16_to_f32(uint16_t h) { return detail::decode(h, detail::kF16); }

// fp8 casts saturate by default, as training recipes do (TE, torchao); pass saturate=false for the
// OCP non-saturating behaviour (overflow -> NaN for e4m3, inf for e5m2).
ACCEL_HD uint8_t f32_to_e4m3(float f, bool saturate = true) {
  return static_cast<uint8_t>(detail::encode(f, detail::kE4M3, saturate));
}
ACCEL_HD float e4m3_to_f32(uint8_t b) { return detail::decode(b, detail::kE4M3); }
ACCEL_HD uint8_t f32_to_e5m2(float f, bool saturate = true) {
  return static_cast<uint8_t>(detail::encode(f, detail::kE5M2, saturate));
}
ACCEL_HD float e5m2_to_f32(uint8_t b) { return detail::decode(b, detail::kE5M2); }

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

}  // namespace accel
