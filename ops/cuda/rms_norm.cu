// RMSNorm forward/backward and the residual add fused into it (add_rms_norm). Statistics in fp32;
// where Hugging Face's Llama rounds an intermediate to the activation dtype (x * rstd before the
// weight) these kernels round there too, as the CPU reference does.
#include <cassert>
#include <cmath>

#include "ops/cuda/common.cuh"
#include "ops/cuda/vec.cuh"
#include "runtime/kernels.h"

namespace accel {
namespace {
using namespace cuda;

// N values: one 16-byte access when N == vec_n<T>(), else element by element (N == 1).
template <class T, int N>
__device__ __forceinline__ void loadn(const T* p, float* f) {
  if constexpr (N == vec_n<T>()) {
    T buf[N];
    *reinterpret_cast<uint4*>(buf) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_f(buf[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_f(p[k]);
  }
}
template <class T, int N>
__device__ __forceinline__ void storen(T* p, const float* f) {
  if constexpr (N == vec_n<T>()) {
    T buf[N];
#pragma unroll
    for (int k = 0; k < N; ++k) buf[k] = from_f<T>(f[k]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(buf);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = from_f<T>(f[k]);
  }
}

// o += the N pending gradient values at p (grad_x_add), in fp32 before the one rounding to T.
// __fadd_rn is never contracted into an FMA with the product that made o, so an fp32 result equals
// the unfused backward-then-add bit for bit.
template <int N>
__device__ __forceinline__ void fold_pending(float* o, const float* a) {
#pragma unroll
  for (int k = 0; k < N; ++k) o[k] = __fadd_rn(o[k], a[k]);
}
template <class T, int N>
__device__ __forceinline__ void add_pending(float* o, const T* p) {
  float a[N];
  loadn<T, N>(p, a);
  fold_pending<N>(o, a);
}

// Warp-per-row kernels: a row of d = 16-byte vectors * N stays in registers, lane l holding the
// vectors l, l + 32, ... (VPL of them at most); the reductions are warp shuffles, so no
// __syncthreads per row. kNormWarps warps per block work on different rows.
constexpr int kNormWarps = 8;
constexpr int kNormFwdMaxVpl = 16;  // bf16/f16 d <= 4096, f32 d <= 2048
constexpr int kNormBwdMaxVpl = 8;   // bf16/f16 d <= 2048, f32 d <= 1024 (x, g and dw in registers)

// With Add (add_rms_norm) the row is first sum = x + res, rounded to T exactly as the add kernel
// does, stored, and normalized from registers; the norm itself is the same code either way.
template <class T, int VPL, bool Add>
__global__ void __launch_bounds__(kNormWarps * 32)
    rms_norm_warp_kernel(T* __restrict__ out, float* __restrict__ rstd, T* __restrict__ sum,
                         const T* __restrict__ x, const T* __restrict__ res,
                         const T* __restrict__ w, int64_t rows, int d, float eps) {
  constexpr int N = vec_n<T>();
  const int lane = threadIdx.x & 31, nvec = d / N;
  const int64_t nwarps = int64_t(gridDim.x) * kNormWarps;
  for (int64_t r = int64_t(blockIdx.x) * kNormWarps + (threadIdx.x >> 5); r < rows; r += nwarps) {
    const T* xr = x + r * d;
    uint4 xv[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (lane + 32 * i < nvec) xv[i] = *reinterpret_cast<const uint4*>(xr + (lane + 32 * i) * N);
    if constexpr (Add) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int j = (lane + 32 * i) * N;
        if (j >= d) continue;
        float a[N], b[N];
        unpack<T>(xv[i], a);
        unpack<T>(*reinterpret_cast<const uint4*>(res + r * d + j), b);
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = a[k] + b[k];
        xv[i] = pack<T>(a);
        *reinterpret_cast<uint4*>(sum + r * d + j) = xv[i];
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (lane + 32 * i >= nvec) continue;
      float v[N];
      unpack<T>(xv[i], v);
#pragma unroll
      for (int k = 0; k < N; ++k) ss += v[k] * v[k];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (lane == 0) rstd[r] = inv;
    T* orow = out + r * d;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = (lane + 32 * i) * N;
      if (j >= d) continue;
      float v[N], wv[N];
      unpack<T>(xv[i], v);
      unpack<T>(*reinterpret_cast<const uint4*>(w + j), wv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = wv[k] * rnd<T>(v[k] * inv);
      *reinterpret_cast<uint4*>(orow + j) = pack<T>(v);
    }
  }
}

// Each lane sums its columns' grad_weight over the rows of its warp in registers; the block's
// warps then add theirs in warp order (deterministic) into one partial row per block.
template <class T, int VPL>
__global__ void __launch_bounds__(kNormWarps * 32)
    rms_norm_backward_warp_kernel(T* __restrict__ gx, float* __restrict__ partial,
                                  const T* __restrict__ g, const T* __restrict__ x,
                                  const T* __restrict__ w, const float* __restrict__ rstd,
                                  const T* __restrict__ gadd, int64_t rows, int d) {
  constexpr int N = vec_n<T>();
  extern __shared__ float acc[];  // [d]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nwarps = int64_t(gridDim.x) * kNormWarps;
  float dw[VPL][N];
#pragma unroll
  for (int i = 0; i < VPL; ++i)
#pragma unroll
    for (int k = 0; k < N; ++k) dw[i][k] = 0.f;
  for (int64_t r = int64_t(blockIdx.x) * kNormWarps + warp; r < rows; r += nwarps) {
    const T* xr = x + r * d;
    const T* gr = g + r * d;
    // The pending gradient is loaded with x and g, so that its latency overlaps theirs instead of
    // coming after the row's reduction.
    uint4 xv[VPL], gv[VPL], av[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = (lane + 32 * i) * N;
      if (j >= d) continue;
      xv[i] = *reinterpret_cast<const uint4*>(xr + j);
      gv[i] = *reinterpret_cast<const uint4*>(gr + j);
      if (gadd) av[i] = *reinterpret_cast<const uint4*>(gadd + r * d + j);
    }
    const float inv = rstd[r];
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = (lane + 32 * i) * N;
      if (j >= d) continue;
      float xf[N], gf[N], wf[N];
      unpack<T>(xv[i], xf);
      unpack<T>(gv[i], gf);
      unpack<T>(*reinterpret_cast<const uint4*>(w + j), wf);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dot += xf[k] * wf[k] * gf[k];
        dw[i][k] += gf[k] * xf[k] * inv;
      }
    }
    dot = warp_sum(dot);
    if (!gx) continue;
    const float c2 = inv * inv * dot / static_cast<float>(d);
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = (lane + 32 * i) * N;
      if (j >= d) continue;
      float xf[N], gf[N], wf[N], o[N];
      unpack<T>(xv[i], xf);
      unpack<T>(gv[i], gf);
      unpack<T>(*reinterpret_cast<const uint4*>(w + j), wf);
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = inv * (wf[k] * gf[k] - xf[k] * c2);
      if (gadd) {
        float af[N];
        unpack<T>(av[i], af);
        fold_pending<N>(o, af);
      }
      *reinterpret_cast<uint4*>(gx + r * d + j) = pack<T>(o);
    }
  }
  // Warp 0 writes every column (nvec <= 32 * VPL), the others add theirs in turn.
  for (int wi = 0; wi < kNormWarps; ++wi) {
    if (warp == wi) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        const int j = (lane + 32 * i) * N;
        if (j >= d) continue;
#pragma unroll
        for (int k = 0; k < N; ++k) acc[j + k] = (wi ? acc[j + k] : 0.f) + dw[i][k];
      }
    }
    __syncthreads();
  }
  for (int j = threadIdx.x; j < d; j += blockDim.x) partial[int64_t(blockIdx.x) * d + j] = acc[j];
}

// N = vec_n when D % vec_n == 0 and rows are 16-byte aligned (chosen on the host), else 1.
// One block per row. With Add, the first pass writes sum = x + res (rounded as the add kernel)
// and the second reads the row back from sum (each thread its own elements).
template <class T, int N, bool Add>
__global__ void rms_norm_kernel(T* __restrict__ out, float* __restrict__ rstd, T* __restrict__ sum,
                                const T* __restrict__ x, const T* __restrict__ res,
                                const T* __restrict__ w, int64_t rows, int d, float eps) {
  __shared__ float sm[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    float ss = 0.f;
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float v[N];
      loadn<T, N>(xr + j, v);
      if constexpr (Add) {
        float b[N];
        loadn<T, N>(res + r * d + j, b);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = rnd<T>(v[k] + b[k]);
        storen<T, N>(sum + r * d + j, v);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) ss += v[k] * v[k];
    }
    ss = block_sum(ss, sm);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[r] = inv;
    const T* nr = Add ? sum + r * d : xr;
    T* orow = out + r * d;
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float v[N], wv[N];
      loadn<T, N>(nr + j, v);
      loadn<T, N>(w + j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = wv[k] * rnd<T>(v[k] * inv);
      storen<T, N>(orow + j, v);
    }
  }
}

// Each block handles a contiguous range of rows; grad_weight partials per block go to
// partial[block][d] and a second kernel sums them.
template <class T, int N>
__global__ void rms_norm_backward_kernel(T* __restrict__ gx, float* __restrict__ partial,
                                         const T* __restrict__ g, const T* __restrict__ x,
                                         const T* __restrict__ w, const float* __restrict__ rstd,
                                         const T* __restrict__ gadd, int64_t rows, int d) {
  extern __shared__ float dw[];  // [d]
  __shared__ float sm[32];
  for (int j = threadIdx.x; j < d; j += blockDim.x) dw[j] = 0.f;
  __syncthreads();
  const int64_t per = (rows + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = blockIdx.x * per, r1 = min(rows, r0 + per);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * d;
    const T* gr = g + r * d;
    const float inv = rstd[r];
    float dot = 0.f;
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float xv[N], gv[N], wv[N];
      loadn<T, N>(xr + j, xv);
      loadn<T, N>(gr + j, gv);
      loadn<T, N>(w + j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dot += xv[k] * wv[k] * gv[k];
        dw[j + k] += gv[k] * xv[k] * inv;  // this thread owns columns j..j+N-1
      }
    }
    dot = block_sum(dot, sm);
    if (!gx) continue;
    const float c2 = inv * inv * dot / static_cast<float>(d);
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float xv[N], gv[N], wv[N], o[N];
      loadn<T, N>(xr + j, xv);
      loadn<T, N>(gr + j, gv);
      loadn<T, N>(w + j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = inv * (wv[k] * gv[k] - xv[k] * c2);
      if (gadd) add_pending<T, N>(o, gadd + r * d + j);
      storen<T, N>(gx + r * d + j, o);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += blockDim.x) partial[int64_t(blockIdx.x) * d + j] = dw[j];
}

// gw[j] = sum over the partial rows of column j. A block takes kSumCols columns; its kSumGroups
// row groups each sum every kSumGroups-th partial row, then thread row 0 adds the groups in order
// (deterministic, and kSumGroups times shorter dependent chains than one thread per column).
constexpr int kSumCols = 32, kSumGroups = 16, kSumThreads = kSumCols * kSumGroups;
template <class T>
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(T* __restrict__ gw, const float* __restrict__ partial, int blocks, int d) {
  __shared__ float sm[kSumGroups][kSumCols + 1];
  const int j = blockIdx.x * kSumCols + threadIdx.x;
  float s = 0.f;
  if (j < d) {
#pragma unroll 8
    for (int b = threadIdx.y; b < blocks; b += kSumGroups) s += partial[int64_t(b) * d + j];
  }
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || j >= d) return;
  float t = 0.f;
#pragma unroll
  for (int y = 0; y < kSumGroups; ++y) t += sm[y][threadIdx.x];
  gw[j] = from_f<T>(t);
}

// True when the 16-byte path applies: D a multiple of the vector width and aligned operands.
bool check_norm_layout(const char* op, int64_t d, DType t,
                       std::initializer_list<const Tensor*> ts) {
  const int n = 16 / static_cast<int>(dtype_size(t));
  bool vec = d % n == 0;
  for (const Tensor* p : ts) {
    require(p->is_contiguous(), op, [&] { return "operands must be contiguous: " + p->str(); });
    vec = vec && aligned16(p->data_ptr());
  }
  return vec;
}

// Calls f(std::integral_constant<int, V>{}) for the smallest vectors-per-lane V of the warp-per-row
// kernels with 32 * V >= nvec; the caller checks nvec <= 32 * MaxVpl.
template <int MaxVpl, class F>
void dispatch_vpl(int64_t nvec, F&& f) {
  static_assert(MaxVpl == 8 || MaxVpl == 16, "instantiated widths");
  assert(nvec >= 1 && nvec <= 32 * MaxVpl);
  if (nvec <= 32) return f(std::integral_constant<int, 1>{});
  if (nvec <= 64) return f(std::integral_constant<int, 2>{});
  if (nvec <= 96) return f(std::integral_constant<int, 3>{});  // d = 768 in bf16
  if (nvec <= 128) return f(std::integral_constant<int, 4>{});
  if (MaxVpl == 8 || nvec <= 256) return f(std::integral_constant<int, 8>{});
  if constexpr (MaxVpl >= 16) return f(std::integral_constant<int, 16>{});
}

}  // namespace

namespace {
// rms_norm (sum and res undefined) or add_rms_norm; arguments checked by the callers.
void launch_norm_forward(const char* op, const Tensor& out, const Tensor& rstd, const Tensor& sum,
                         const Tensor& x, const Tensor& res, const Tensor& weight, double eps) {
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  if (rows == 0 || d == 0) return;
  const bool add = res.defined();
  Tensor wc = weight.is_contiguous() ? weight : weight.clone();
  bool vec = check_norm_layout(op, d, x.dtype(), {&out, &x, &wc});
  if (add) vec = check_norm_layout(op, d, x.dtype(), {&sum, &res}) && vec;
  OpScope sc(x);
  const int64_t nvec = d / (16 / static_cast<int64_t>(dtype_size(x.dtype())));
  dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    T* outp = static_cast<T*>(out.data_ptr());
    float* rp = static_cast<float*>(rstd.data_ptr());
    T* sp = add ? static_cast<T*>(sum.data_ptr()) : nullptr;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* resp = add ? static_cast<const T*>(res.data_ptr()) : nullptr;
    const T* wp = static_cast<const T*>(wc.data_ptr());
    if (vec && nvec <= 32 * kNormFwdMaxVpl) {
      const int grid = static_cast<int>(
          std::min<int64_t>((rows + kNormWarps - 1) / kNormWarps, int64_t(sm_count()) * 16));
      dispatch_vpl<kNormFwdMaxVpl>(nvec, [&](auto vpl) {
        constexpr int V = decltype(vpl)::value;
        auto kernel = add ? rms_norm_warp_kernel<T, V, true> : rms_norm_warp_kernel<T, V, false>;
        kernel<<<grid, kNormWarps * 32, 0, sc.stream>>>(
            outp, rp, sp, xp, resp, wp, rows, static_cast<int>(d), static_cast<float>(eps));
      });
      return;
    }
    const int threads = d >= 4096 ? 256 : 128;
    const int grid = static_cast<int>(std::min<int64_t>(rows, int64_t(sm_count()) * 16));
    auto kernel =
        vec ? (add ? rms_norm_kernel<T, vec_n<T>(), true> : rms_norm_kernel<T, vec_n<T>(), false>)
            : (add ? rms_norm_kernel<T, 1, true> : rms_norm_kernel<T, 1, false>);
    kernel<<<grid, threads, 0, sc.stream>>>(outp, rp, sp, xp, resp, wp, rows, static_cast<int>(d),
                                            static_cast<float>(eps));
  });
  if (add)
    ACCEL_CUDA_CHECK_LAUNCH("add_rms_norm");
  else
    ACCEL_CUDA_CHECK_LAUNCH("rms_norm");
}
}  // namespace

void CudaBackend::rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x,
                           const Tensor& weight, double eps) {
  require_cuda(x, "rms_norm", "x");
  require(out.shape() == x.shape() && out.dtype() == x.dtype() && weight.dtype() == x.dtype() &&
              x.dim() >= 1 && weight.numel() == x.shape().back() && rstd.dtype() == DType::F32,
          "rms_norm",
          [&] { return "x " + x.str() + ", weight " + weight.str() + ", rstd " + rstd.str(); });
  launch_norm_forward("rms_norm", out, rstd, Tensor(), x, Tensor(), weight, eps);
}

void CudaBackend::add_rms_norm(const Tensor& sum, const Tensor& out, const Tensor& rstd,
                               const Tensor& x, const Tensor& r, const Tensor& weight, double eps) {
  require_cuda(x, "add_rms_norm", "x");
  require(out.shape() == x.shape() && out.dtype() == x.dtype() && weight.dtype() == x.dtype() &&
              x.dim() >= 1 && weight.numel() == x.shape().back() && rstd.dtype() == DType::F32 &&
              r.shape() == x.shape() && r.dtype() == x.dtype() && sum.shape() == x.shape() &&
              sum.dtype() == x.dtype(),
          "add_rms_norm", [&] {
            return "x " + x.str() + ", r " + r.str() + ", sum " + sum.str() + ", weight " +
                   weight.str() + ", rstd " + rstd.str();
          });
  launch_norm_forward("add_rms_norm", out, rstd, sum, x, r, weight, eps);
}

void CudaBackend::rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight,
                                    const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                    const Tensor& rstd, const Tensor& grad_x_add) {
  require_cuda(x, "rms_norm", "x");
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  require(grad_out.shape() == x.shape() && grad_out.dtype() == x.dtype() && weight.numel() == d &&
              weight.dtype() == x.dtype() && rstd.numel() == rows && rstd.dtype() == DType::F32 &&
              rstd.is_contiguous(),
          "rms_norm",
          [&] { return "backward: grad_out, weight or rstd do not match x " + x.str(); });
  if (d == 0) return;
  OpScope sc(x);
  if (rows == 0) {
    if (grad_weight.defined()) ::accel::kernels::cuda::fill(grad_weight, 0.0);
    return;
  }
  Tensor wc = weight.is_contiguous() ? weight : weight.clone();
  Tensor gc =
      grad_out.is_contiguous() && aligned16(grad_out.data_ptr()) ? grad_out : grad_out.clone();
  // The pending gradient to fold into grad_x: any layout (a strided or misaligned one is copied).
  Tensor ga;
  if (grad_x_add.defined()) {
    require(grad_x.defined() && grad_x_add.shape() == x.shape() && grad_x_add.dtype() == x.dtype(),
            "rms_norm", [&] {
              return "backward: grad_x_add " + grad_x_add.str() + " must match x " + x.str() +
                     " and needs grad_x";
            });
    require_cuda(grad_x_add, "rms_norm", "grad_x_add");
    ga = grad_x_add.is_contiguous() && aligned16(grad_x_add.data_ptr()) ? grad_x_add
                                                                        : grad_x_add.clone();
  }
  bool vec = check_norm_layout("rms_norm", d, x.dtype(), {&x, &wc, &gc});
  if (grad_x.defined()) vec = check_norm_layout("rms_norm", d, x.dtype(), {&grad_x}) && vec;
  if (ga.defined()) vec = check_norm_layout("rms_norm", d, x.dtype(), {&ga}) && vec;
  const size_t smem = static_cast<size_t>(d) * sizeof(float);
  const int64_t nvec = d / (16 / static_cast<int64_t>(dtype_size(x.dtype())));
  const bool warp_rows = vec && nvec <= 32 * kNormBwdMaxVpl;
  dispatch_float(x.dtype(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    T* gx = grad_x.defined() ? static_cast<T*>(grad_x.data_ptr()) : nullptr;
    const T* gp = static_cast<const T*>(gc.data_ptr());
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(wc.data_ptr());
    const float* rp = static_cast<const float*>(rstd.data_ptr());
    const T* ap = ga.defined() ? static_cast<const T*>(ga.data_ptr()) : nullptr;
    int grid = 0;  // = the number of partial grad_weight rows
    DeviceBuffer partial;
    if (warp_rows) {
      // One resident wave: every warp in flight at once, and few partial rows to sum.
      dispatch_vpl<kNormBwdMaxVpl>(nvec, [&](auto vpl) {
        auto kernel = rms_norm_backward_warp_kernel<T, decltype(vpl)::value>;
        int per_sm = 0;
        ACCEL_CUDA_CHECK(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kNormWarps * 32, smem));
        grid = static_cast<int>(std::min<int64_t>((rows + kNormWarps - 1) / kNormWarps,
                                                  int64_t(sm_count()) * std::max(per_sm, 1)));
        partial = DeviceBuffer(static_cast<size_t>(grid) * d * sizeof(float));
        kernel<<<grid, kNormWarps * 32, smem, sc.stream>>>(gx, partial.as<float>(), gp, xp, wp, rp,
                                                           ap, rows, static_cast<int>(d));
      });
    } else {
      // 256 threads from d = 2048 (one 16-byte vector per thread and row for bf16) and 4 blocks
      // per SM: the per-row block reductions are latency-bound, so more warps in flight pay.
      const int threads = d >= 2048 ? 256 : 128;
      grid = static_cast<int>(std::min<int64_t>(rows, int64_t(sm_count()) * 4));
      partial = DeviceBuffer(static_cast<size_t>(grid) * d * sizeof(float));
      auto kernel = vec ? rms_norm_backward_kernel<T, vec_n<T>()> : rms_norm_backward_kernel<T, 1>;
      if (smem > 48 * 1024)
        ACCEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
      kernel<<<grid, threads, smem, sc.stream>>>(gx, partial.as<float>(), gp, xp, wp, rp, ap, rows,
                                                 static_cast<int>(d));
    }
    ACCEL_CUDA_CHECK_LAUNCH("rms_norm_backward");
    if (grad_weight.defined()) {
      require(grad_weight.is_contiguous() && grad_weight.dtype() == x.dtype(), "rms_norm",
              "grad_weight must be contiguous of x's dtype");
      sum_partials_kernel<T><<<static_cast<int>((d + kSumCols - 1) / kSumCols),
                               dim3(kSumCols, kSumGroups), 0, sc.stream>>>(
          static_cast<T*>(grad_weight.data_ptr()), partial.as<float>(), grid, static_cast<int>(d));
      ACCEL_CUDA_CHECK_LAUNCH("rms_norm_backward (weight)");
    }
  });
}

}  // namespace accel
