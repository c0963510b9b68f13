// Per-dtype element traits for CPU code (the runtime's copy/fill/accumulate and the CPU ops):
// storage type S, compute type C (float for the 16- and 8-bit floats, which round on store), and
// dispatch from a runtime DType to them.
#pragma once

#include <cstdint>

#include "runtime/dtype.h"

namespace accel::cpu {

template <DType D>
struct Traits;
#define ACCEL_CPU_PLAIN_TRAITS(D, T)  \
  template <>                         \
  struct Traits<D> {                  \
    using S = T;                      \
    using C = T;                      \
    static constexpr DType dtype = D; \
    static C load(S s) { return s; }  \
    static S store(C c) { return c; } \
  };
ACCEL_CPU_PLAIN_TRAITS(DType::F32, float)
ACCEL_CPU_PLAIN_TRAITS(DType::F64, double)
ACCEL_CPU_PLAIN_TRAITS(DType::I32, int32_t)
ACCEL_CPU_PLAIN_TRAITS(DType::I64, int64_t)
ACCEL_CPU_PLAIN_TRAITS(DType::U8, uint8_t)
#undef ACCEL_CPU_PLAIN_TRAITS
template <>
struct Traits<DType::Bool> {
  using S = uint8_t;
  using C = bool;
  static constexpr DType dtype = DType::Bool;
  static C load(S s) { return s != 0; }
  static S store(C c) { return c ? 1 : 0; }
};
#define ACCEL_CPU_SMALL_FLOAT_TRAITS(D, T, TO_F32, FROM_F32) \
  template <>                                                \
  struct Traits<D> {                                         \
    using S = T;                                             \
    using C = float;                                         \
    static constexpr DType dtype = D;                        \
    static C load(S s) { return TO_F32(s); }                 \
    static S store(C c) { return FROM_F32(c); }              \
  };
ACCEL_CPU_SMALL_FLOAT_TRAITS(DType::BF16, uint16_t, bf16_to_f32, f32_to_bf16)
ACCEL_CPU_SMALL_FLOAT_TRAITS(DType::F16, uint16_t, f16_to_f32, f32_to_f16)
ACCEL_CPU_SMALL_FLOAT_TRAITS(DType::E4M3, uint8_t, e4m3_to_f32, f32_to_e4m3)
ACCEL_CPU_SMALL_FLOAT_TRAITS(DType::E5M2, uint8_t, e5m2_to_f32, f32_to_e5m2)
#undef ACCEL_CPU_SMALL_FLOAT_TRAITS

// Calls f(Traits<D>{}) for the one D among Ds that equals t and returns true; false (f not called)
// when t is none of them.
template <DType... Ds, class F>
bool dispatch_among(DType t, F&& f) {
  return ((t == Ds && (static_cast<void>(f(Traits<Ds>{})), true)) || ...);
}

}  // namespace accel::cpu
