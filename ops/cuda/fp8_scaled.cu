// CUDA kernels of the per-row / per-block scaled fp8 casts (Backend::fp8_cast_scaled; the GEMM is
// in fp8_scaled_gemm.cpp). Rounding as ops/cuda/fp8_cast.cu: the hardware cvt.rn.satfinite, which
// rounds and saturates as runtime/dtype.h's encoder does on the CPU (tests/cuda/fp8_scaled_test.cpp
// compares them bit for bit).
#include <cuda_fp8.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cuda_backend.h"

namespace accel {
namespace {

using accel::cuda::block_max;
using accel::cuda::grid_for;
using accel::cuda::OpScope;
using accel::cuda::to_f;

template <bool kE5M2>
__device__ __forceinline__ uint8_t cvt1(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint8_t>(__nv_cvt_float2_to_fp8x2(make_float2(v, 0.0f), __NV_SATFINITE,
                                                       kE5M2 ? __NV_E5M2 : __NV_E4M3) &
                              0xffu);
#else
  return static_cast<uint8_t>(detail::encode(v, kE5M2 ? detail::kE5M2 : detail::kE4M3, true));
#endif
}

// amax accumulation: non-negative floats order like their bit patterns.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

// max |x| over all of x (NaN ignored) into *out (zeroed by the caller).
template <class T>
__global__ void __launch_bounds__(256)
    tensor_amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ out) {
  __shared__ float red[32];
  float m = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(to_f(x[i])));
  m = block_max(m, red);
  if (threadIdx.x == 0 && m > 0.0f) atomic_max_nonneg(out, m);
}

template <class F>
void dispatch_fp8(DType fmt, F&& f) {
  if (fmt == DType::E5M2)
    f(std::true_type{});
  else
    f(std::false_type{});
}

float* fptr(const Tensor& t) { return t.defined() ? static_cast<float*>(t.data_ptr()) : nullptr; }
uint8_t* bptr(const Tensor& t) {
  return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}
bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ---- per-row / per-block scaled casts (rowwise and blockwise recipes) ---------------------------
//
// One thread per chunk of 16 operand elements along K (16 divides 128, so a chunk lies in one
// group of every mode). Without transpose adjacent threads take adjacent chunks of one row (each
// reads 16 contiguous source elements); with transpose adjacent threads take adjacent operand rows
// (= adjacent source columns), so each of the 16 loads of a warp is coalesced. Three passes: the
// group amaxes (one atomic max per chunk, or the tensor's amax for one_scale), the cast (each
// thread derives its group's scale from the amax), and the slots' 1 / scale.
constexpr int kChunk = 16;

struct ScaledCastShape {
  int64_t R, C;         // the source x [R, C]
  int64_t rows, K;      // the operand
  int64_t rows_p, k_p;  // its padded data
  bool transpose;
  __device__ __forceinline__ int64_t chunks() const { return k_p / kChunk; }
  __device__ __forceinline__ void locate(int64_t t, int64_t& r, int64_t& c) const {
    if (transpose) {
      r = t % rows_p;
      c = t / rows_p;
    } else {
      r = t / chunks();
      c = t % chunks();
    }
  }
  __device__ __forceinline__ int64_t src(int64_t r, int64_t k) const {
    return transpose ? k * C + r : r * C + k;
  }
};

template <class T>
__global__ void scaled_amax_kernel(const T* __restrict__ x, ScaledCastShape sh, Fp8ScaleMode mode,
                                   float* __restrict__ amax) {
  const int64_t total = sh.rows_p * sh.chunks();
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r, c;
    sh.locate(t, r, c);
    if (r >= sh.rows) continue;
    const int64_t k0 = c * kChunk, k1 = k0 + kChunk < sh.K ? k0 + kChunk : sh.K;
    float m = 0.0f;
    for (int64_t k = k0; k < k1; ++k) m = fmaxf(m, fabsf(to_f(x[sh.src(r, k)])));
    if (m > 0.0f) atomic_max_nonneg(amax + fp8_scale_index(mode, r, k0, sh.rows_p, sh.k_p), m);
  }
}

template <class T, bool kE5M2>
__global__ void scaled_cast_kernel(const T* __restrict__ x, ScaledCastShape sh, Fp8ScaleMode mode,
                                   bool one_scale, bool pow2, const float* __restrict__ amax,
                                   uint8_t* __restrict__ data) {
  const int64_t total = sh.rows_p * sh.chunks();
  const float fmax = kE5M2 ? kE5M2Max : kE4M3Max;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r, c;
    sh.locate(t, r, c);
    const int64_t k0 = c * kChunk;
    const float a = amax[one_scale ? 0 : fp8_scale_index(mode, r, k0, sh.rows_p, sh.k_p)];
    const float s = fp8_group_scale(a, fmax, pow2);
    alignas(16) uint8_t q[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int64_t k = k0 + i;
      q[i] = (r < sh.rows && k < sh.K) ? cvt1<kE5M2>(to_f(x[sh.src(r, k)]) * s) : 0;
    }
    *reinterpret_cast<uint4*>(data + r * sh.k_p + k0) = *reinterpret_cast<const uint4*>(q);
  }
}

__global__ void scaled_scale_inv_kernel(const float* __restrict__ amax, int64_t slots,
                                        bool one_scale, bool pow2, float fmax,
                                        float* __restrict__ scale_inv) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < slots;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    scale_inv[i] = 1.0f / fp8_group_scale(amax[one_scale ? 0 : i], fmax, pow2);
}

void scaled_cast(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2, bool one_scale,
                 const Tensor& data, const Tensor& scale_inv) {
  OpScope scope(x);
  ScaledCastShape sh;
  sh.R = x.size(0);
  sh.C = x.size(1);
  sh.rows = transpose ? sh.C : sh.R;
  sh.K = transpose ? sh.R : sh.C;
  sh.rows_p = data.size(0);
  sh.k_p = data.size(1);
  sh.transpose = transpose;
  if (sh.k_p % kChunk != 0 || !aligned(data.data_ptr(), 16))
    throw std::invalid_argument(
        "[fp8_cast_scaled] the CUDA kernels need the data padded to a "
        "multiple of 16 columns, 16-byte aligned");
  const int64_t slots = scale_inv.numel();
  const float fmax = fp8_max_value(data.dtype());
  Tensor amax = Tensor::empty({one_scale ? 1 : slots}, DType::F32, x.device());
  ACCEL_CUDA_CHECK(
      cudaMemsetAsync(amax.data_ptr(), 0, static_cast<size_t>(amax.nbytes()), scope.stream));
  const int64_t threads_total = sh.rows_p * (sh.k_p / kChunk);
  accel::cuda::dispatch_float(x.dtype(), "fp8_cast_scaled", [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.data_ptr());
    if (one_scale) {
      const int64_t n = x.numel();
      if (n > 0)
        tensor_amax_kernel<T><<<grid_for(n, 256), 256, 0, scope.stream>>>(px, n, fptr(amax));
    } else if (threads_total > 0) {
      scaled_amax_kernel<T>
          <<<grid_for(threads_total, 256), 256, 0, scope.stream>>>(px, sh, mode, fptr(amax));
    }
    if (threads_total > 0)
      dispatch_fp8(data.dtype(), [&](auto e5m2) {
        scaled_cast_kernel<T, decltype(e5m2)::value>
            <<<grid_for(threads_total, 256), 256, 0, scope.stream>>>(px, sh, mode, one_scale, pow2,
                                                                     fptr(amax), bptr(data));
      });
  });
  if (slots > 0)
    scaled_scale_inv_kernel<<<grid_for(slots, 256), 256, 0, scope.stream>>>(
        fptr(amax), slots, one_scale, pow2, fmax, fptr(scale_inv));
  ACCEL_CUDA_CHECK_LAUNCH("fp8_cast_scaled");
}

}  // namespace

void CudaBackend::fp8_cast_scaled(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2,
                                  bool one_scale, const Tensor& data, const Tensor& scale_inv) {
  scaled_cast(x, transpose, mode, pow2, one_scale, data, scale_inv);
}

}  // namespace accel
