// Embedding lookup and its deterministic backward: positions are radix-sorted by id, then one warp
// per distinct id sums that id's gradient rows in fp32 and adds them to the weight row once
// (no atomics, so 16-bit gradients round once per row like the CPU reference).
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/common.cuh"

namespace accel {
namespace {
using namespace cuda;

template <class T, class I>
__global__ void embedding_kernel(T* __restrict__ out, const T* __restrict__ w,
                                 const I* __restrict__ ids, int64_t n, int64_t vocab, int d) {
  // One warp per output row, 16-byte copies when the row allows.
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t row_bytes = int64_t(d) * sizeof(T);
  for (int64_t i = warp; i < n; i += warps) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    T* o = out + i * d;
    if (id < 0 || id >= vocab) {  // reported as a NaN row: no host sync for a check
      for (int j = lane; j < d; j += 32) o[j] = from_f<T>(NAN);
      continue;
    }
    const T* src = w + id * d;
    if (row_bytes % 16 == 0 &&
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(o)) & 15) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* o4 = reinterpret_cast<uint4*>(o);
      for (int64_t j = lane; j < row_bytes / 16; j += 32) o4[j] = s4[j];
    } else {
      for (int j = lane; j < d; j += 32) o[j] = src[j];
    }
  }
}

template <class I>
__global__ void make_keys_kernel(int32_t* keys, int32_t* pos, const I* ids, int64_t n,
                                 int64_t vocab) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    keys[i] = (id < 0 || id >= vocab) ? static_cast<int32_t>(vocab) : static_cast<int32_t>(id);
    pos[i] = static_cast<int32_t>(i);
  }
}

// One warp per sorted position; the warp at the start of an id's run sums the run.
template <class T>
__global__ void embedding_backward_kernel(T* __restrict__ gw, const T* __restrict__ g,
                                          const int32_t* __restrict__ keys,
                                          const int32_t* __restrict__ pos, int64_t n, int64_t vocab,
                                          int d) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t p = warp; p < n; p += warps) {
    const int32_t id = keys[p];
    if (id >= vocab || (p > 0 && keys[p - 1] == id)) continue;
    int64_t end = p + 1;
    while (end < n && keys[end] == id) ++end;
    T* row = gw + int64_t(id) * d;
    constexpr int kCols = 4;  // columns per lane per pass
    for (int j0 = 0; j0 < d; j0 += 32 * kCols) {
      float acc[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        int j = j0 + c * 32 + lane;
        acc[c] = j < d ? to_f(row[j]) : 0.f;
      }
      for (int64_t q = p; q < end; ++q) {
        const T* src = g + int64_t(pos[q]) * d;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          int j = j0 + c * 32 + lane;
          if (j < d) acc[c] += to_f(src[j]);
        }
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        int j = j0 + c * 32 + lane;
        if (j < d) row[j] = from_f<T>(acc[c]);
      }
    }
  }
}

int warp_grid(int64_t n) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((n + 7) / 8, int64_t(sm_count()) * 32)));
}

}  // namespace

void CudaBackend::embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) {
  require_cuda(weight, "embedding", "weight");
  require_cuda(ids, "embedding", "ids");
  require(weight.dim() == 2 && ids.is_contiguous() && out.is_contiguous() &&
              out.dtype() == weight.dtype() && out.numel() == ids.numel() * weight.shape()[1],
          "embedding",
          [&] { return "weight " + weight.str() + ", ids " + ids.str() + " -> " + out.str(); });
  if (ids.dtype() != DType::I64 && ids.dtype() != DType::I32)
    unsupported_dtype("embedding ids", ids.dtype());
  const int64_t n = ids.numel(), vocab = weight.shape()[0], d = weight.shape()[1];
  if (n == 0 || d == 0) return;
  Tensor w = weight.is_contiguous() ? weight : weight.clone();
  OpScope sc(weight);
  dispatch_float(w.dtype(), "embedding", [&](auto t) {
    using T = decltype(t);
    if (ids.dtype() == DType::I64)
      embedding_kernel<T, int64_t><<<warp_grid(n), 256, 0, sc.stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(w.data_ptr()),
          static_cast<const int64_t*>(ids.data_ptr()), n, vocab, static_cast<int>(d));
    else
      embedding_kernel<T, int32_t><<<warp_grid(n), 256, 0, sc.stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(w.data_ptr()),
          static_cast<const int32_t*>(ids.data_ptr()), n, vocab, static_cast<int>(d));
  });
  ACCEL_CUDA_CHECK_LAUNCH("embedding");
}

void CudaBackend::embedding_backward(const Tensor& grad_weight, const Tensor& grad_out,
                                     const Tensor& ids) {
  require_cuda(grad_weight, "embedding", "grad_weight");
  require(grad_weight.dim() == 2 && grad_weight.is_contiguous() && ids.is_contiguous() &&
              grad_out.dtype() == grad_weight.dtype() &&
              grad_out.numel() == ids.numel() * grad_weight.shape()[1],
          "embedding", [&] {
            return "backward: grad_weight " + grad_weight.str() + ", grad_out " + grad_out.str() +
                   ", ids " + ids.str();
          });
  if (ids.dtype() != DType::I64 && ids.dtype() != DType::I32)
    unsupported_dtype("embedding ids", ids.dtype());
  const int64_t n = ids.numel(), vocab = grad_weight.shape()[0], d = grad_weight.shape()[1];
  if (n == 0 || d == 0) return;
  if (n >= (int64_t(1) << 31) || vocab >= (int64_t(1) << 31) - 1)
    throw std::invalid_argument("[embedding] CUDA backward supports fewer than 2^31 ids and rows");
  Tensor g = grad_out.is_contiguous() ? grad_out : grad_out.clone();
  OpScope sc(grad_weight);
  // keys_in, pos_in, keys_out, pos_out, then cub's scratch.
  DeviceBuffer arrays(4 * static_cast<size_t>(n) * sizeof(int32_t));
  int32_t* keys_in = arrays.as<int32_t>();
  int32_t* pos_in = keys_in + n;
  int32_t* keys_out = pos_in + n;
  int32_t* pos_out = keys_out + n;
  if (ids.dtype() == DType::I64)
    make_keys_kernel<<<grid_for(n, 256), 256, 0, sc.stream>>>(
        keys_in, pos_in, static_cast<const int64_t*>(ids.data_ptr()), n, vocab);
  else
    make_keys_kernel<<<grid_for(n, 256), 256, 0, sc.stream>>>(
        keys_in, pos_in, static_cast<const int32_t*>(ids.data_ptr()), n, vocab);
  ACCEL_CUDA_CHECK_LAUNCH("embedding keys");
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= vocab) ++end_bit;
  size_t temp_bytes = 0;
  ACCEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, pos_in,
                                                   pos_out, static_cast<int>(n), 0, end_bit,
                                                   sc.stream));
  DeviceBuffer temp(std::max<size_t>(temp_bytes, 1));
  ACCEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys_in, keys_out,
                                                   pos_in, pos_out, static_cast<int>(n), 0, end_bit,
                                                   sc.stream));
  dispatch_float(grad_weight.dtype(), "embedding", [&](auto t) {
    using T = decltype(t);
    embedding_backward_kernel<T><<<warp_grid(n), 256, 0, sc.stream>>>(
        static_cast<T*>(grad_weight.data_ptr()), static_cast<const T*>(g.data_ptr()), keys_out,
        pos_out, n, vocab, static_cast<int>(d));
  });
  ACCEL_CUDA_CHECK_LAUNCH("embedding_backward");
}

}  // namespace accel
