// Reductions: reduce over dims, max backward, softmax / log_softmax, chunk-free cross-entropy
// (one pass for the row statistics, one for the gradient; never an fp32 copy of the logits),
// sum of squares (fp64) and the non-finite check.
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

// ---- softmax and cross-entropy -----------------------------------------------------------------
namespace {

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
    const int64_t nv = len / N;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      T buf[N];
      *reinterpret_cast<uint4*>(buf) = reinterpret_cast<const uint4*>(row)[i];
      float mloc = -INFINITY;
#pragma unroll
      for (int k = 0; k < N; ++k) mloc = fmaxf(mloc, to_f(buf[k]));
      float sloc = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) sloc += exp_for<T>(to_f(buf[k]) - mloc);
      acc = merge<T>(acc, MaxSum{mloc, sloc});
    }
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

template <class T>
__global__ void softmax_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                               int64_t len, bool log) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * len;
    T* orow = out + r * len;
    MaxSum ms = row_max_sum(xr, len);
    const float lse = ms.m + logf(ms.s);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      float v = to_f(xr[i]);
      orow[i] = from_f<T>(log ? v - lse : expf(v - lse));
    }
  }
}

// One block per row: an online max/sum pass; loss = lse - x[target], lse kept for the backward.
// A target outside [0, V) that is not ignore_index gives a NaN loss (no host sync for a check).
template <class T, class I>
__global__ void cross_entropy_kernel(float* __restrict__ loss, float* __restrict__ lse_out,
                                     const T* __restrict__ logits, const I* __restrict__ targets,
                                     int64_t rows, int64_t len, int64_t ignore_index) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * len;
    const int64_t t = static_cast<int64_t>(targets[r]);
    if (t == ignore_index) {
      if (threadIdx.x == 0) {
        loss[r] = 0.0f;
        if (lse_out) lse_out[r] = 0.0f;
      }
      continue;
    }
    const bool bad = t < 0 || t >= len;
    MaxSum ms = row_max_sum(xr, len);
    const float lse = ms.m + logf(ms.s);
    if (threadIdx.x == 0) {
      loss[r] = bad ? NAN : lse - to_f(xr[t]);
      if (lse_out) lse_out[r] = lse;
    }
  }
}

// grad = (exp(x - lse) - onehot) * scale[0]; 0 on ignored rows, NaN on rows with a bad target.
template <class T, class I>
__global__ void cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                              const float* __restrict__ lse_in,
                                              const I* __restrict__ targets,
                                              const float* __restrict__ scale, int64_t rows,
                                              int64_t len, int64_t ignore_index) {
  constexpr int N = 16 / sizeof(T);
  const float k = *scale;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * len;
    T* gr = grad + r * len;
    const int64_t t = static_cast<int64_t>(targets[r]);
    const bool ignored = t == ignore_index, bad = !ignored && (t < 0 || t >= len);
    const float lse = lse_in[r];
    auto value = [&](float x, int64_t i) {
      if (ignored) return 0.0f;
      float p = exp_for<T>(x - lse);
      if (i == t) p -= 1.0f;
      return bad ? NAN : p * k;
    };
    const bool vec =
        ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(gr)) & 15) == 0;
    int64_t done = 0;
    if (vec) {
      const int64_t nv = len / N;
      for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        T buf[N];
        *reinterpret_cast<uint4*>(buf) = reinterpret_cast<const uint4*>(xr)[i];
#pragma unroll
        for (int e = 0; e < N; ++e) buf[e] = from_f<T>(value(to_f(buf[e]), i * N + e));
        reinterpret_cast<uint4*>(gr)[i] = *reinterpret_cast<uint4*>(buf);
      }
      done = nv * N;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x)
      gr[i] = from_f<T>(value(to_f(xr[i]), i));
  }
}

int row_grid(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, 65535 * 16)); }

}  // namespace

void CudaBackend::softmax(const Tensor& out, const Tensor& x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require_cuda(x, op, "input");
  require(x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype(),
          op, "needs contiguous x and out of one shape and dtype");
  if (x.numel() == 0) return;
  const int64_t len = x.dim() == 0 ? 1 : x.shape().back();
  const int64_t rows = x.numel() / len;
  OpScope sc(x);
  dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    softmax_kernel<T><<<row_grid(rows), len >= 2048 ? 512 : 128, 0, sc.stream>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), rows, len, log);
  });
  ACCEL_CUDA_CHECK_LAUNCH("softmax");
}

namespace {
void check_ce_rows(const Tensor& logits, const Tensor& targets, const Tensor& per_row,
                   const char* what) {
  require_cuda(logits, "cross_entropy", "logits");
  require_cuda(targets, "cross_entropy", "targets");
  require(logits.dim() == 2 && logits.is_contiguous(), "cross_entropy",
          "logits must be contiguous [N, V], got " + logits.str());
  const int64_t n = logits.shape()[0];
  require(targets.numel() == n && targets.is_contiguous() && per_row.numel() == n &&
              per_row.is_contiguous() && per_row.dtype() == DType::F32,
          "cross_entropy",
          std::string("targets must be contiguous [N] and ") + what + " contiguous f32 [N]");
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    unsupported_dtype("cross_entropy targets", targets.dtype());
}

int ce_threads(int64_t v) { return v >= 4096 ? 512 : 128; }
}  // namespace

void CudaBackend::cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                                const Tensor& targets, int64_t ignore_index) {
  check_ce_rows(logits, targets, loss_per_row, "loss");
  if (lse.defined())
    require(lse.numel() == loss_per_row.numel() && lse.is_contiguous() && lse.dtype() == DType::F32,
            "cross_entropy", "lse must be contiguous f32 [N]");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto t) {
    using T = decltype(t);
    float* loss = static_cast<float*>(loss_per_row.data_ptr());
    float* lse_out = lse.defined() ? static_cast<float*>(lse.data_ptr()) : nullptr;
    const T* x = static_cast<const T*>(logits.data_ptr());
    if (targets.dtype() == DType::I64)
      cross_entropy_kernel<T, int64_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          loss, lse_out, x, static_cast<const int64_t*>(targets.data_ptr()), n, v, ignore_index);
    else
      cross_entropy_kernel<T, int32_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          loss, lse_out, x, static_cast<const int32_t*>(targets.data_ptr()), n, v, ignore_index);
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy");
}

void CudaBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits,
                                         const Tensor& lse, const Tensor& targets,
                                         int64_t ignore_index, const Tensor& scale) {
  check_ce_rows(logits, targets, lse, "lse");
  require(grad_logits.shape() == logits.shape() && grad_logits.is_contiguous() &&
              grad_logits.dtype() == logits.dtype(),
          "cross_entropy", "grad_logits must be contiguous and match logits");
  require(scale.numel() == 1 && scale.dtype() == DType::F32 && scale.device() == logits.device(),
          "cross_entropy", "backward: scale must be one f32 element on the logits' device");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  if (n == 0) return;
  OpScope sc(logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto t) {
    using T = decltype(t);
    T* g = static_cast<T*>(grad_logits.data_ptr());
    const T* x = static_cast<const T*>(logits.data_ptr());
    const float* l = static_cast<const float*>(lse.data_ptr());
    const float* k = static_cast<const float*>(scale.data_ptr());
    if (targets.dtype() == DType::I64)
      cross_entropy_backward_kernel<T, int64_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          g, x, l, static_cast<const int64_t*>(targets.data_ptr()), k, n, v, ignore_index);
    else
      cross_entropy_backward_kernel<T, int32_t><<<row_grid(n), ce_threads(v), 0, sc.stream>>>(
          g, x, l, static_cast<const int32_t*>(targets.data_ptr()), k, n, v, ignore_index);
  });
  ACCEL_CUDA_CHECK_LAUNCH("cross_entropy_backward");
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
