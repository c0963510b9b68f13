// kernels::cuda: the runtime's own device kernels (strided copy with dtype conversion, fill,
// gradient accumulation) and the host helpers of device_common.cuh.
#include <algorithm>
#include <type_traits>

#include "runtime/cuda/device_common.cuh"
#include "runtime/kernels.h"

namespace accel::cuda {

std::vector<StridedLayout> make_layouts(const Shape& shape, const std::vector<Shape>& strides,
                                        const char* op) {
  // Drop size-1 dims, then merge dim d into d+1 where every operand has stride[d] ==
  // stride[d+1] * size[d+1].
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> st(strides.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    sizes.push_back(shape[d]);
    for (size_t k = 0; k < strides.size(); ++k) st[k].push_back(strides[k][d]);
  }
  std::vector<int64_t> ms;
  std::vector<std::vector<int64_t>> mst(strides.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    bool merge = !ms.empty();
    for (size_t k = 0; merge && k < strides.size(); ++k)
      merge = mst[k].back() == st[k][d] * sizes[d];
    if (merge) {
      ms.back() *= sizes[d];
      for (size_t k = 0; k < strides.size(); ++k) mst[k].back() = st[k][d];
    } else {
      ms.push_back(sizes[d]);
      for (size_t k = 0; k < strides.size(); ++k) mst[k].push_back(st[k][d]);
    }
  }
  if (ms.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument(std::string("[") + op + "] CUDA kernels take at most " +
                                std::to_string(kMaxDims) + " non-mergeable dims, got shape " +
                                shape_str(shape));
  std::vector<StridedLayout> out(strides.size());
  for (size_t k = 0; k < strides.size(); ++k) {
    StridedLayout& l = out[k];
    l.nd = static_cast<int>(ms.size());
    for (size_t d = 0; d < ms.size(); ++d) {
      l.sizes[d] = ms[d];
      l.strides[d] = mst[k][d];
    }
    l.contiguous = ms.empty() || (ms.size() == 1 && mst[k][0] == 1);
  }
  return out;
}

int grid_for(int64_t n, int threads, int blocks_per_sm) {
  int64_t need = (n + threads - 1) / threads;
  int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min(need, cap)));
}

void unsupported_dtype(const char* op, DType t) {
  throw std::invalid_argument(std::string("[") + op + "] the CUDA backend does not support dtype " +
                              dtype_name(t) + " here");
}

namespace {

__global__ void copy_kernel(void* dst, DType dt, StridedLayout dl, const void* src, DType st,
                            StridedLayout sl, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_from_double(dst, dt, dl.offset(i), load_as_double(src, st, sl.offset(i)));
}

// The common casts of mixed precision, 4 elements per thread with one vector access per side
// (both pointers aligned to 4 elements, checked on the host).
template <class T>
struct alignas(4 * sizeof(T)) Four {
  T v[4];
};

template <class TD, class TS>
__global__ void cast_contiguous_kernel(TD* __restrict__ dst, const TS* __restrict__ src,
                                       int64_t n) {
  int64_t n4 = n / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Four<TS> a = reinterpret_cast<const Four<TS>*>(src)[i];
    Four<TD> b;
#pragma unroll
    for (int k = 0; k < 4; ++k) b.v[k] = from_f<TD>(to_f<TS>(a.v[k]));
    reinterpret_cast<Four<TD>*>(dst)[i] = b;
  }
  for (int64_t i = 4 * n4 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<TD>(to_f<TS>(src[i]));
}

__global__ void fill_kernel(void* dst, DType dt, StridedLayout dl, double v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_from_double(dst, dt, dl.offset(i), v);
}

__global__ void accumulate_kernel(void* dst, DType t, const void* src, StridedLayout sl,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_from_double(dst, t, i, load_as_double(dst, t, i) + load_as_double(src, t, sl.offset(i)));
}

// dst = base + src (base == dst: accumulate in place).
template <class T>
__global__ void accumulate_contiguous_kernel(T* dst, const T* base, const T* __restrict__ src,
                                             int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<T>(to_f<T>(base[i]) + to_f<T>(src[i]));
}

// Same with 16-byte accesses (all pointers 16-byte aligned); the tail element by element.
template <class T>
__global__ void accumulate_vec_kernel(T* dst, const T* base, const T* __restrict__ src, int64_t n) {
  constexpr int N = 16 / sizeof(T);
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint4 a = reinterpret_cast<const uint4*>(base)[i];
    const uint4 b = reinterpret_cast<const uint4*>(src)[i];
    T* av = reinterpret_cast<T*>(&a);
    const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int k = 0; k < N; ++k) av[k] = from_f<T>(to_f<T>(av[k]) + to_f<T>(bv[k]));
    reinterpret_cast<uint4*>(dst)[i] = a;
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<T>(to_f<T>(base[i]) + to_f<T>(src[i]));
}

constexpr int kThreads = 256;

}  // namespace
}  // namespace accel::cuda

namespace accel::kernels::cuda {
using namespace accel::cuda;

void copy(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  DeviceGuard g(dst.device().index);
  cudaStream_t s = current_stream();
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.data_ptr() != src.data_ptr())
      ACCEL_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                       cudaMemcpyDeviceToDevice, s));
    return;
  }
  const auto aligned4 = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % (4 * t.element_size()) == 0;
  };
  if (dst.is_contiguous() && src.is_contiguous() && aligned4(dst) && aligned4(src)) {
    int grid = grid_for(n / 4 + 1, kThreads);
    auto* d = dst.data_ptr();
    auto* sp = src.data_ptr();
    if (dst.dtype() == DType::BF16 && src.dtype() == DType::F32) {
      cast_contiguous_kernel<<<grid, kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(d),
                                                       static_cast<const float*>(sp), n);
      ACCEL_CUDA_CHECK_LAUNCH("cast f32->bf16");
      return;
    }
    if (dst.dtype() == DType::F32 && src.dtype() == DType::BF16) {
      cast_contiguous_kernel<<<grid, kThreads, 0, s>>>(static_cast<float*>(d),
                                                       static_cast<const __nv_bfloat16*>(sp), n);
      ACCEL_CUDA_CHECK_LAUNCH("cast bf16->f32");
      return;
    }
  }
  auto l = make_layouts(dst.shape(), {dst.strides(), src.strides()}, "copy");
  copy_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(dst.data_ptr(), dst.dtype(), l[0],
                                                         src.data_ptr(), src.dtype(), l[1], n);
  ACCEL_CUDA_CHECK_LAUNCH("copy");
}

void fill(const Tensor& dst, double value) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  DeviceGuard g(dst.device().index);
  cudaStream_t s = current_stream();
  if (value == 0.0 && !std::signbit(value) && dst.is_contiguous()) {
    ACCEL_CUDA_CHECK(cudaMemsetAsync(dst.data_ptr(), 0, dst.nbytes(), s));
    return;
  }
  auto l = make_layouts(dst.shape(), {dst.strides()}, "fill");
  fill_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(dst.data_ptr(), dst.dtype(), l[0], value,
                                                         n);
  ACCEL_CUDA_CHECK_LAUNCH("fill");
}

namespace {
// dst = base + src for contiguous f32/bf16 (base may be dst); false when no fast kernel applies.
bool add_contiguous(const Tensor& dst, const Tensor& base, const Tensor& src, cudaStream_t s) {
  if (!src.is_contiguous() || !base.is_contiguous() ||
      (dst.dtype() != DType::F32 && dst.dtype() != DType::BF16))
    return false;
  const int64_t n = dst.numel();
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(dst.data_ptr()) | reinterpret_cast<uintptr_t>(base.data_ptr()) |
        reinterpret_cast<uintptr_t>(src.data_ptr())) &
       15) == 0;
  auto launch = [&](auto* d) {
    using T = std::remove_pointer_t<decltype(d)>;
    const T* b = static_cast<const T*>(base.data_ptr());
    const T* x = static_cast<const T*>(src.data_ptr());
    if (aligned)
      accumulate_vec_kernel<<<grid_for(n / (16 / sizeof(T)) + 1, kThreads), kThreads, 0, s>>>(d, b,
                                                                                              x, n);
    else
      accumulate_contiguous_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(d, b, x, n);
  };
  if (dst.dtype() == DType::F32)
    launch(static_cast<float*>(dst.data_ptr()));
  else
    launch(static_cast<__nv_bfloat16*>(dst.data_ptr()));
  return true;
}
}  // namespace

void accumulate(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  DeviceGuard g(dst.device().index);
  cudaStream_t s = current_stream();
  if (!add_contiguous(dst, dst, src, s)) {
    auto l = make_layouts(dst.shape(), {src.strides()}, "accumulate");
    accumulate_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(dst.data_ptr(), dst.dtype(),
                                                                 src.data_ptr(), l[0], n);
  }
  ACCEL_CUDA_CHECK_LAUNCH("accumulate");
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  if (out.numel() == 0) return;
  DeviceGuard g(out.device().index);
  cudaStream_t s = current_stream();
  if (!add_contiguous(out, a, b, s)) {  // other dtypes: copy, then accumulate
    copy(out, a);
    accumulate(out, b);
    return;
  }
  ACCEL_CUDA_CHECK_LAUNCH("add");
}

}  // namespace accel::kernels::cuda
