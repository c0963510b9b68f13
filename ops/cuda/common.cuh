// Helpers shared by the ops/cuda kernels: dtype dispatch to storage types, argument checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/device_common.cuh"

namespace accel::cuda {

// Calls f(T{}) with T = float, __nv_bfloat16 or __half for the dtype; other dtypes are an error.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32:
      f(float{});
      break;
    case DType::BF16:
      f(__nv_bfloat16{});
      break;
    case DType::F16:
      f(__half{});
      break;
    default:
      unsupported_dtype(op, t);
  }
}

// Multi-tensor kernels: tensor t of a launch owns blocks [first_chunk[t], first_chunk[t + 1]);
// the tensor of block `chunk` (binary search: the last t with first_chunk[t] <= chunk).
__device__ __forceinline__ int chunk_owner(const int32_t* first_chunk, int count, int chunk) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_chunk[mid] <= chunk)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// backend_require (ops/backend.h) for the CUDA kernels.
template <class Msg>
void require(bool ok, const char* op, Msg&& msg) {
  backend_require(ok, op, "CUDA backend: ", std::forward<Msg>(msg));
}

inline void require_cuda(const Tensor& t, const char* op, const char* what) {
  if (t.defined() && !t.device().is_cuda())
    throw std::invalid_argument(std::string("[") + op + "] " + what + " is on " + t.device().str() +
                                ", not a CUDA device");
}

// Sets the device of `t` current for the scope of a backend call.
struct OpScope {
  DeviceGuard guard;
  cudaStream_t stream;
  explicit OpScope(const Tensor& t) : guard(t.device().index), stream(current_stream()) {}
};

// exp for kernels templated on the storage type: full-precision expf for fp32 tensors (their
// tests hold 1e-5), the fast __expf for 16-bit ones, where it is far below the output's rounding.
template <class T>
__device__ __forceinline__ float exp_for(float x) {
  if constexpr (std::is_same_v<T, float>)
    return expf(x);
  else
    return __expf(x);
}

// silu(x) = x sigmoid(x) and sigmoid(x) for kernels templated on the storage type, as exp_for:
// IEEE division and expf for fp32 tensors; __expf and the fast division for 16-bit ones, whose
// errors (a few fp32 ulps) lie far below their rounding. The swiglu kernels and the fused fp8
// swiglu casts share them, so the two stay bit-identical.
template <class T>
__device__ __forceinline__ float silu_for(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x / (1.0f + expf(-x));
  else
    return __fdividef(x, 1.0f + __expf(-x));
}
template <class T>
__device__ __forceinline__ float sigmoid_for(float x) {
  if constexpr (std::is_same_v<T, float>)
    return 1.0f / (1.0f + expf(-x));
  else
    return __fdividef(1.0f, 1.0f + __expf(-x));
}

template <class T>
__device__ __forceinline__ T round_to(float v) {
  return from_f<T>(v);
}
// Rounds v through T and back (identity for float): where HF rounds an intermediate.
template <class T>
__device__ __forceinline__ float rnd(float v) {
  return to_f<T>(from_f<T>(v));
}

}  // namespace accel::cuda
