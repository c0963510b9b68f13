// The row statistics shared by softmax.cu and cross_entropy.cu: an online max / sum of
// exponentials over one row per block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda/common.cuh"

namespace accel::cuda {

// Online max / sum-of-exp pair, merged across threads.
struct MaxSum {
  float m, s;
};
template <class T>
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  float m = fmaxf(a.m, b.m);
  return {m, a.s * exp_for<T>(a.m - m) + b.s * exp_for<T>(b.m - m)};
}
template <class T>
__device__ __forceinline__ MaxSum add_value(MaxSum a, float v) {
  if (v > a.m) return {v, a.s * exp_for<T>(a.m - v) + 1.0f};
  return {a.m, a.s + exp_for<T>(v - a.m)};
}

// Row statistics over `len` values of row (block-wide), result in every thread.
template <class T>
__device__ MaxSum row_max_sum(const T* __restrict__ row, int64_t len) {
  __shared__ MaxSum sm[32];
  MaxSum acc{-INFINITY, 0.0f};
  constexpr int N = 16 / sizeof(T);
  const bool vec = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  int64_t done = 0;
  if (vec) {
    // A thread's 16-byte chunks i, i + blockDim.x, ...: kLoads of them loaded before the first is
    // used (loads in flight), merged in that order.
    constexpr int kLoads = 4;
    auto chunk_stats = [](const uint4& raw) {
      T buf[N];
      *reinterpret_cast<uint4*>(buf) = raw;
      float mloc = -INFINITY;
#pragma unroll
      for (int k = 0; k < N; ++k) mloc = fmaxf(mloc, to_f(buf[k]));
      float sloc = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) sloc += exp_for<T>(to_f(buf[k]) - mloc);
      return MaxSum{mloc, sloc};
    };
    const int64_t nv = len / N, stride = blockDim.x;
    const uint4* chunks = reinterpret_cast<const uint4*>(row);
    int64_t i = threadIdx.x;
    for (; i + (kLoads - 1) * stride < nv; i += kLoads * stride) {
      uint4 raw[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) raw[u] = chunks[i + u * stride];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) acc = merge<T>(acc, chunk_stats(raw[u]));
    }
    for (; i < nv; i += stride) acc = merge<T>(acc, chunk_stats(chunks[i]));
    done = nv * N;
  }
  for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x)
    acc = add_value<T>(acc, to_f(row[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)};
    acc = merge<T>(acc, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sm[warp] = acc;
  __syncthreads();
  acc = lane < int(blockDim.x >> 5) ? sm[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)};
    acc = merge<T>(acc, other);
  }
  return acc;
}

// Blocks for one block per row (grid-stride beyond).
inline int row_grid(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, 65535 * 16)); }

}  // namespace accel::cuda
