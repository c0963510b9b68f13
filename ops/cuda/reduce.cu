// Reductions: reduce over dims, max backward, sum of squares (fp64) and the non-finite check.
#include <cfloat>

#include "ops/cuda/common.cuh"
#include "runtime/kernels.h"

namespace accel {
namespace {
using namespace cuda;

template <class C>
__device__ __forceinline__ C load_c(const void* p, DType t, int64_t i);
template <>
__device__ __forceinline__ float load_c<float>(const void* p, DType t, int64_t i) {
  return load_f(p, t, i);
}
template <>
__device__ __forceinline__ double load_c<double>(const void* p, DType t, int64_t i) {
  return load_as_double(p, t, i);
}

template <class C>
struct ReduceAcc {
  ReduceKind op;
  __device__ __forceinline__ C init() const {
    return op == ReduceKind::Sum ? C(0) : (op == ReduceKind::Max ? C(-INFINITY) : C(0));
  }
  __device__ __forceinline__ C combine(C a, C b) const {
    if (op == ReduceKind::Sum) return a + b;
    if (a != a || b != b) return a != a ? a : b;  // NaN propagates, as torch
    return a > b ? a : b;
  }
  __device__ __forceinline__ C prepare(C v) const {
    return op == ReduceKind::AbsMax ? (v < C(0) ? -v : v) : v;
  }
};

template <class C>
__device__ __forceinline__ C shfl_combine(const ReduceAcc<C>& r, C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = r.combine(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One warp per output element (kWarp) or one block per output element.
template <class C, bool kWarp>
__global__ void reduce_kernel(void* out, DType ot, const void* x, DType xt, StridedLayout outer,
                              StridedLayout inner, int64_t n_out, int64_t n_in, ReduceKind op) {
  ReduceAcc<C> r{op};
  __shared__ C smem[32];
  const int lane = threadIdx.x & 31;
  const int64_t per_block = kWarp ? blockDim.x / 32 : 1;
  const int64_t first = blockIdx.x * per_block + (kWarp ? threadIdx.x / 32 : 0);
  const int64_t step = int64_t(gridDim.x) * per_block;
  for (int64_t o = first; o < n_out; o += step) {
    const int64_t base = outer.offset(o);
    C acc = r.init();
    const int start = kWarp ? lane : threadIdx.x, stride = kWarp ? 32 : blockDim.x;
    for (int64_t j = start; j < n_in; j += stride)
      acc = r.combine(acc, r.prepare(load_c<C>(x, xt, base + inner.offset(j))));
    acc = shfl_combine(r, acc);
    if (!kWarp) {
      __syncthreads();
      if (lane == 0) smem[threadIdx.x / 32] = acc;
      __syncthreads();
      acc = lane < int(blockDim.x / 32) ? smem[lane] : r.init();
      acc = shfl_combine(r, acc);
    }
    if (lane == 0 && (kWarp || threadIdx.x == 0)) store_from_double(out, ot, o, double(acc));
  }
}

bool float_compute(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

}  // namespace

void CudaBackend::reduce(ReduceKind op, const Tensor& out, const Tensor& x,
                         const std::vector<int64_t>& dims) {
  require_cuda(x, "reduce", "input");
  require(out.is_contiguous() && out.dim() == x.dim(), "reduce", "out must be contiguous keepdim");
  const int64_t n_out = out.numel();
  if (n_out == 0) return;
  Shape outer_sizes, outer_strides, inner_sizes, inner_strides;
  std::vector<bool> reduced(x.dim(), false);
  for (int64_t d : dims) reduced[d] = true;
  for (int64_t d = 0; d < x.dim(); ++d) {
    (reduced[d] ? inner_sizes : outer_sizes).push_back(x.shape()[d]);
    (reduced[d] ? inner_strides : outer_strides).push_back(x.strides()[d]);
  }
  const int64_t n_in = shape_numel(inner_sizes);
  OpScope sc(out);
  if (n_in == 0) {  // empty reduction: the identity (sum 0; max of nothing is -inf)
    ::accel::kernels::cuda::fill(out, op == ReduceKind::Max ? -INFINITY : 0.0);
    return;
  }
  StridedLayout outer = make_layouts(outer_sizes, {outer_strides}, "reduce")[0];
  StridedLayout inner = make_layouts(inner_sizes, {inner_strides}, "reduce")[0];
  const bool fl = float_compute(x.dtype());
  const int threads = 256;
  if (n_in <= 2048) {
    int grid = static_cast<int>(std::min<int64_t>((n_out + 7) / 8, 65535 * 8));
    if (fl)
      reduce_kernel<float, true><<<grid, threads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), x.data_ptr(), x.dtype(), outer, inner, n_out, n_in, op);
    else
      reduce_kernel<double, true><<<grid, threads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), x.data_ptr(), x.dtype(), outer, inner, n_out, n_in, op);
  } else {
    int grid = static_cast<int>(std::min<int64_t>(n_out, 65535 * 8));
    if (fl)
      reduce_kernel<float, false><<<grid, threads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), x.data_ptr(), x.dtype(), outer, inner, n_out, n_in, op);
    else
      reduce_kernel<double, false><<<grid, threads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), x.data_ptr(), x.dtype(), outer, inner, n_out, n_in, op);
  }
  ACCEL_CUDA_CHECK_LAUNCH("reduce");
}

// ---- max backward ----------------------------------------------------------------------------
namespace {
__global__ void max_backward_kernel(void* gi, DType gt, const void* x, DType xt, const void* mx,
                                    const void* g, StridedLayout lx, StridedLayout lgi,
                                    StridedLayout lm, StridedLayout lg, int64_t n_pos, int64_t len,
                                    int64_t sx, int64_t sgi) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n_pos;
       p += int64_t(gridDim.x) * blockDim.x) {
    const double m = load_as_double(mx, xt, lm.offset(p));
    const double gv = load_as_double(g, gt, lg.offset(p));
    const int64_t bx = lx.offset(p), bg = lgi.offset(p);
    bool found = false;
    for (int64_t k = 0; k < len; ++k) {
      double v = load_as_double(x, xt, bx + k * sx);
      bool hit = !found && (v == m || (v != v && m != m));
      found = found || hit;
      store_from_double(gi, gt, bg + k * sgi, hit ? gv : 0.0);
    }
  }
}
}  // namespace

void CudaBackend::max_backward(const Tensor& grad_in, const Tensor& x, const Tensor& out_keepdim,
                               const Tensor& grad_keepdim, int64_t dim) {
  require(grad_in.shape() == x.shape() && grad_in.is_contiguous(), "max", "bad grad_in");
  const int64_t n_pos = out_keepdim.numel();
  if (n_pos == 0 || x.numel() == 0) return;
  OpScope sc(x);
  Shape pos_shape = x.shape();
  pos_shape[dim] = 1;
  Shape og = out_keepdim.strides(), gg = grad_keepdim.strides();
  auto l = make_layouts(pos_shape, {x.strides(), grad_in.strides(), og, gg}, "max");
  max_backward_kernel<<<grid_for(n_pos, 256), 256, 0, sc.stream>>>(
      grad_in.data_ptr(), grad_in.dtype(), x.data_ptr(), x.dtype(), out_keepdim.data_ptr(),
      grad_keepdim.data_ptr(), l[0], l[1], l[2], l[3], n_pos, x.shape()[dim], x.strides()[dim],
      grad_in.strides()[dim]);
  ACCEL_CUDA_CHECK_LAUNCH("max_backward");
}

// ---- sum of squares, non-finite check
// ------------------------------------------------------------
namespace {

// Sum of squares over many contiguous tensors of one dtype in one launch: each tensor is cut
// into chunks of kSqChunk elements, one block per chunk (chunk_owner finds its tensor), one fp64
// atomic per block. A llama-1b step's 147
// gradients take one launch instead of 147.
constexpr int kSqMax = 128;          // tensors per launch; the table stays under 4 KB
constexpr int64_t kSqChunk = 65536;  // elements per block (a multiple of every vector width)

template <class T>
struct SqMulti {
  const T* x[kSqMax];
  int64_t n[kSqMax];
  int32_t first_chunk[kSqMax + 1];
  int count;
};

template <class T>
__global__ void __launch_bounds__(256)
    sumsq_multi_kernel(double* acc, const __grid_constant__ SqMulti<T> a) {
  __shared__ double sm[32];
  const int chunk = static_cast<int>(blockIdx.x);
  const int t = chunk_owner(a.first_chunk, a.count, chunk);
  const T* __restrict__ x = a.x[t];
  const int64_t begin = static_cast<int64_t>(chunk - a.first_chunk[t]) * kSqChunk;
  const int64_t end = min(a.n[t], begin + kSqChunk);
  constexpr int N = 16 / sizeof(T);
  double s = 0;
  int64_t rest = begin;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    rest = begin + (end - begin) / N * N;
    for (int64_t i = begin / N + threadIdx.x; i < rest / N; i += blockDim.x) {
      T buf[N];
      *reinterpret_cast<uint4*>(buf) = reinterpret_cast<const uint4*>(x)[i];
      float part = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) part += to_f(buf[k]) * to_f(buf[k]);
      s += part;
    }
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_f(x[i]);
    s += double(v) * v;
  }
  s = block_sum(s, sm);
  if (threadIdx.x == 0) atomicAdd(acc, s);
}

// Launches sumsq_multi_kernel over `xs` (contiguous, dtype T), kSqMax tensors at a time.
template <class T>
void sumsq_multi(double* acc, const std::vector<const Tensor*>& xs, cudaStream_t stream) {
  for (size_t start = 0; start < xs.size(); start += kSqMax) {
    SqMulti<T> a{};
    int64_t chunks = 0;
    for (size_t i = start; i < xs.size() && a.count < kSqMax; ++i) {
      const int64_t n = xs[i]->numel();
      a.x[a.count] = static_cast<const T*>(xs[i]->data_ptr());
      a.n[a.count] = n;
      a.first_chunk[a.count] = static_cast<int32_t>(chunks);
      chunks += (n + kSqChunk - 1) / kSqChunk;
      ++a.count;
    }
    a.first_chunk[a.count] = static_cast<int32_t>(chunks);
    if (chunks == 0) continue;
    require(chunks < (int64_t(1) << 31), "sum_of_squares", "too many chunks for one launch");
    sumsq_multi_kernel<T><<<static_cast<unsigned>(chunks), 256, 0, stream>>>(acc, a);
    ACCEL_CUDA_CHECK_LAUNCH("sum_of_squares");
  }
}

__global__ void sumsq_generic_kernel(double* acc, const void* x, DType t, StridedLayout l,
                                     int64_t n) {
  __shared__ double sm[32];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    double v = load_as_double(x, t, l.offset(i));
    s += v * v;
  }
  s = block_sum(s, sm);
  if (threadIdx.x == 0) atomicAdd(acc, s);
}

template <class T>
__global__ void nonfinite_kernel(int* flag, const T* __restrict__ x, int64_t n) {
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    bad |= !isfinite(to_f(x[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

__global__ void nonfinite_generic_kernel(int* flag, const void* x, DType t, StridedLayout l,
                                         int64_t n) {
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    bad |= !isfinite(load_as_double(x, t, l.offset(i)));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

}  // namespace

double CudaBackend::sum_of_squares(const std::vector<Tensor>& xs) {
  if (xs.empty()) return 0.0;
  OpScope sc(xs[0]);
  DeviceBuffer acc(sizeof(double));
  ACCEL_CUDA_CHECK(cudaMemsetAsync(acc.get(), 0, sizeof(double), sc.stream));
  // Contiguous float tensors by dtype, one multi-tensor launch per dtype; others one by one.
  std::vector<const Tensor*> by_dtype[3];  // f32, bf16, f16
  for (const Tensor& x : xs) {
    require_cuda(x, "sum_of_squares", "tensor");
    require(x.device() == xs[0].device(), "sum_of_squares", "tensors on different devices");
    const int64_t n = x.numel();
    if (n == 0) continue;
    if (x.is_contiguous() && float_compute(x.dtype())) {
      by_dtype[x.dtype() == DType::F32 ? 0 : (x.dtype() == DType::BF16 ? 1 : 2)].push_back(&x);
    } else {
      auto l = make_layouts(x.shape(), {x.strides()}, "sum_of_squares");
      sumsq_generic_kernel<<<grid_for(n, 256, 4), 256, 0, sc.stream>>>(
          acc.as<double>(), x.data_ptr(), x.dtype(), l[0], n);
      ACCEL_CUDA_CHECK_LAUNCH("sum_of_squares");
    }
  }
  sumsq_multi<float>(acc.as<double>(), by_dtype[0], sc.stream);
  sumsq_multi<__nv_bfloat16>(acc.as<double>(), by_dtype[1], sc.stream);
  sumsq_multi<__half>(acc.as<double>(), by_dtype[2], sc.stream);
  double host = 0;
  accel::cuda::copy_to_host(&host, acc.get(), sizeof(double), sc.stream);
  return host;
}

bool CudaBackend::has_non_finite(const Tensor& x) {
  require_cuda(x, "has_non_finite", "tensor");
  const int64_t n = x.numel();
  if (n == 0 || !is_floating(x.dtype())) return false;
  OpScope sc(x);
  DeviceBuffer flag(sizeof(int));
  ACCEL_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, sizeof(int), sc.stream));
  if (x.is_contiguous() && float_compute(x.dtype())) {
    dispatch_float(x.dtype(), "has_non_finite", [&](auto t) {
      using T = decltype(t);
      nonfinite_kernel<T><<<grid_for(n, 256, 4), 256, 0, sc.stream>>>(
          flag.as<int>(), static_cast<const T*>(x.data_ptr()), n);
    });
  } else {
    auto l = make_layouts(x.shape(), {x.strides()}, "has_non_finite");
    nonfinite_generic_kernel<<<grid_for(n, 256, 4), 256, 0, sc.stream>>>(
        flag.as<int>(), x.data_ptr(), x.dtype(), l[0], n);
  }
  ACCEL_CUDA_CHECK_LAUNCH("has_non_finite");
  int host = 0;
  accel::cuda::copy_to_host(&host, flag.get(), sizeof(int), sc.stream);
  return host != 0;
}

}  // namespace accel
