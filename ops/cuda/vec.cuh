// 16-byte vector access shared by the elementwise kernels (elementwise.cu, swiglu.cu) and the
// row kernels (rms_norm.cu, rope.cu).
#pragma once

#include <cstdint>

#include "ops/cuda/common.cuh"

namespace accel::cuda {

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <class T>
__device__ __forceinline__ Vec<T> load_vec(const T* p, int64_t i) {
  Vec<T> r;
  *reinterpret_cast<uint4*>(r.v) = *reinterpret_cast<const uint4*>(p + i);
  return r;
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, int64_t i, const Vec<T>& r) {
  *reinterpret_cast<uint4*>(p + i) = *reinterpret_cast<const uint4*>(r.v);
}

template <class T>
__host__ __device__ constexpr int vec_n() {
  return 16 / sizeof(T);
}

// The N = vec_n<T>() values of one 16-byte vector held in registers (4 registers whatever T).
template <class T>
__device__ __forceinline__ void unpack(const uint4& raw, float* f) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < vec_n<T>(); ++k) f[k] = to_f(v[k]);
}
template <class T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < vec_n<T>(); ++k) v[k] = from_f<T>(f[k]);
  return raw;
}

}  // namespace accel::cuda
