// Device-side helpers shared by runtime/cuda and ops/cuda: loads and stores by run-time dtype
// (rounding exactly as runtime/dtype.h does on the host), strided index arithmetic, launch sizes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/cuda/context.h"
#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace accel::cuda {

constexpr int kMaxDims = 8;

// Device twins of dtype.h's small-float conversions (same code path: detail::encode/decode),
// taking the format tables by value so device code does not odr-use the host constants.
__device__ __forceinline__ uint16_t d_f32_to_f16(float f) {
  const detail::SmallFloat fmt = detail::kF16;
  return static_cast<uint16_t>(detail::encode(f, fmt, false));
}
__device__ __forceinline__ float d_f16_to_f32(uint16_t h) {
  const detail::SmallFloat fmt = detail::kF16;
  return detail::decode(h, fmt);
}
__device__ __forceinline__ uint8_t d_f32_to_e4m3(float f) {
  const detail::SmallFloat fmt = detail::kE4M3;
  return static_cast<uint8_t>(detail::encode(f, fmt, true));
}
__device__ __forceinline__ float d_e4m3_to_f32(uint8_t b) {
  const detail::SmallFloat fmt = detail::kE4M3;
  return detail::decode(b, fmt);
}
__device__ __forceinline__ uint8_t d_f32_to_e5m2(float f) {
  const detail::SmallFloat fmt = detail::kE5M2;
  return static_cast<uint8_t>(detail::encode(f, fmt, true));
}
__device__ __forceinline__ float d_e5m2_to_f32(uint8_t b) {
  const detail::SmallFloat fmt = detail::kE5M2;
  return detail::decode(b, fmt);
}

// Value of element `i` of a typed buffer, as double (exact for every dtype but i64 beyond 2^53).
__device__ __forceinline__ double load_as_double(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(p)[i];
    case DType::F64:
      return static_cast<const double*>(p)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16:
      return d_f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::E4M3:
      return d_e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
    case DType::E5M2:
      return d_e5m2_to_f32(static_cast<const uint8_t*>(p)[i]);
    case DType::I32:
      return static_cast<const int32_t*>(p)[i];
    case DType::I64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::U8:
      return static_cast<const uint8_t*>(p)[i];
    case DType::Bool:
      return static_cast<const uint8_t*>(p)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

// Stores v into element i, converting like the CPU kernels (via float for the small floats).
__device__ __forceinline__ void store_from_double(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::F64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::BF16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(static_cast<float>(v));
      break;
    case DType::F16:
      static_cast<uint16_t*>(p)[i] = d_f32_to_f16(static_cast<float>(v));
      break;
    case DType::E4M3:
      static_cast<uint8_t*>(p)[i] = d_f32_to_e4m3(static_cast<float>(v));
      break;
    case DType::E5M2:
      static_cast<uint8_t*>(p)[i] = d_f32_to_e5m2(static_cast<float>(v));
      break;
    case DType::I32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::I64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
    case DType::U8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
      break;
    case DType::Bool:
      static_cast<uint8_t*>(p)[i] = v != 0.0;
      break;
  }
}

// Float loads/stores for the float dtypes used in compute (f32, bf16, f16); the fast paths.
__device__ __forceinline__ float load_f(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(p)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<float>(load_as_double(p, t, i));
  }
}
__device__ __forceinline__ void store_f(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::BF16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
    // __float2half_rn rounds to nearest even like f32_to_f16, overflow to inf included.
    case DType::F16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      store_from_double(p, t, i, v);
      break;
  }
}

// Compile-time typed element access for kernels templated on the storage type.
template <class T>
struct Num;
template <>
struct Num<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
};
template <>
struct Num<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};
template <>
struct Num<__half> {
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};
template <class T>
__device__ __forceinline__ float to_f(T v) {
  return Num<T>::to_float(v);
}
template <class T>
__device__ __forceinline__ T from_f(float v) {
  return Num<T>::from_float(v);
}

// Layout of one operand over a shared logical shape: offsets from a row-major linear index.
struct StridedLayout {
  int nd = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  bool contiguous = true;  // offset == linear index
  __device__ __forceinline__ int64_t offset(int64_t linear) const {
    if (contiguous) return linear;
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      int64_t s = sizes[d];
      int64_t q = linear / s;
      off += (linear - q * s) * strides[d];
      linear = q;
    }
    return off;
  }
};

// Merges adjacent dims that are contiguous in every operand, then builds one layout per operand.
// Throws when more than kMaxDims dims remain.
std::vector<StridedLayout> make_layouts(const Shape& shape, const std::vector<Shape>& strides,
                                        const char* op);

// Grid size for a grid-stride loop over n items.
int grid_for(int64_t n, int threads, int blocks_per_sm = 8);

// Names the dtype in the message when a kernel does not support it.
[[noreturn]] void unsupported_dtype(const char* op, DType t);

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `smem` holds 32 values. blockDim.x % 32 == 0.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  T r = lane < nw ? smem[lane] : T(0);
  return warp_sum(r);
}
__device__ __forceinline__ float block_max(float v, float* smem) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = lane < nw ? smem[lane] : -INFINITY;
  return warp_max(r);
}

}  // namespace accel::cuda
