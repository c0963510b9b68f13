// RMSNorm forward/backward and rotary embeddings. Statistics in fp32; where Hugging Face's Llama
// rounds an intermediate to the activation dtype (x * rstd before the weight; rope's cos/sin and
// products) these kernels round there too, as the CPU reference does.
#include <cmath>

#include "ops/cuda/common.cuh"
#include "runtime/kernels.h"

namespace accel {
namespace {
using namespace cuda;

template <class T>
__host__ __device__ constexpr int vec_n() {
  return 16 / sizeof(T);
}

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

// N = vec_n when D % vec_n == 0 and rows are 16-byte aligned (chosen on the host), else 1.
// One block per row.
template <class T, int N>
__global__ void rms_norm_kernel(T* __restrict__ out, float* __restrict__ rstd,
                                const T* __restrict__ x, const T* __restrict__ w, int64_t rows,
                                int d, float eps) {
  __shared__ float sm[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    float ss = 0.f;
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float v[N];
      loadn<T, N>(xr + j, v);
#pragma unroll
      for (int k = 0; k < N; ++k) ss += v[k] * v[k];
    }
    ss = block_sum(ss, sm);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[r] = inv;
    T* orow = out + r * d;
    for (int j = threadIdx.x * N; j < d; j += blockDim.x * N) {
      float v[N], wv[N];
      loadn<T, N>(xr + j, v);
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
                                         int64_t rows, int d) {
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
      storen<T, N>(gx + r * d + j, o);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += blockDim.x) partial[int64_t(blockIdx.x) * d + j] = dw[j];
}

template <class T>
__global__ void sum_partials_kernel(T* __restrict__ gw, const float* __restrict__ partial,
                                    int blocks, int d) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= d) return;
  float s = 0.f;
#pragma unroll 8
  for (int b = 0; b < blocks; ++b) s += partial[int64_t(b) * d + j];
  gw[j] = from_f<T>(s);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// True when the 16-byte path applies: D a multiple of the vector width and aligned operands.
bool check_norm_layout(const char* op, int64_t d, DType t,
                       std::initializer_list<const Tensor*> ts) {
  const int n = 16 / static_cast<int>(dtype_size(t));
  bool vec = d % n == 0;
  for (const Tensor* p : ts) {
    require(p->is_contiguous(), op, "operands must be contiguous: " + p->str());
    vec = vec && aligned16(p->data_ptr());
  }
  return vec;
}

}  // namespace

void CudaBackend::rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x,
                           const Tensor& weight, double eps) {
  require_cuda(x, "rms_norm", "x");
  require(out.shape() == x.shape() && out.dtype() == x.dtype() && weight.dtype() == x.dtype() &&
              x.dim() >= 1 && weight.numel() == x.shape().back() && rstd.dtype() == DType::F32,
          "rms_norm", "x " + x.str() + ", weight " + weight.str() + ", rstd " + rstd.str());
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  if (rows == 0 || d == 0) return;
  Tensor wc = weight.is_contiguous() ? weight : weight.clone();
  const bool vec = check_norm_layout("rms_norm", d, x.dtype(), {&out, &x, &wc});
  OpScope sc(x);
  const int threads = d >= 4096 ? 256 : 128;
  const int grid = static_cast<int>(std::min<int64_t>(rows, int64_t(sm_count()) * 16));
  dispatch_float(x.dtype(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    auto kernel = vec ? rms_norm_kernel<T, vec_n<T>()> : rms_norm_kernel<T, 1>;
    kernel<<<grid, threads, 0, sc.stream>>>(
        static_cast<T*>(out.data_ptr()), static_cast<float*>(rstd.data_ptr()),
        static_cast<const T*>(x.data_ptr()), static_cast<const T*>(wc.data_ptr()), rows,
        static_cast<int>(d), static_cast<float>(eps));
  });
  ACCEL_CUDA_CHECK_LAUNCH("rms_norm");
}

void CudaBackend::rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight,
                                    const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                    const Tensor& rstd) {
  require_cuda(x, "rms_norm", "x");
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  require(grad_out.shape() == x.shape() && grad_out.dtype() == x.dtype() && weight.numel() == d &&
              weight.dtype() == x.dtype() && rstd.numel() == rows && rstd.dtype() == DType::F32 &&
              rstd.is_contiguous(),
          "rms_norm", "backward: grad_out, weight or rstd do not match x " + x.str());
  if (d == 0) return;
  OpScope sc(x);
  if (rows == 0) {
    if (grad_weight.defined()) ::accel::kernels::cuda::fill(grad_weight, 0.0);
    return;
  }
  Tensor wc = weight.is_contiguous() ? weight : weight.clone();
  Tensor gc =
      grad_out.is_contiguous() && aligned16(grad_out.data_ptr()) ? grad_out : grad_out.clone();
  bool vec = check_norm_layout("rms_norm", d, x.dtype(), {&x, &wc, &gc});
  if (grad_x.defined()) vec = check_norm_layout("rms_norm", d, x.dtype(), {&grad_x}) && vec;
  // 256 threads from d = 2048 (one 16-byte vector per thread and row for bf16) and 4 blocks per
  // SM: the per-row block reductions are latency-bound, so more warps in flight pay.
  const int threads = d >= 2048 ? 256 : 128;
  const int grid = static_cast<int>(std::min<int64_t>(rows, int64_t(sm_count()) * 4));
  DeviceBuffer partial(static_cast<size_t>(grid) * d * sizeof(float));
  const size_t smem = static_cast<size_t>(d) * sizeof(float);
  dispatch_float(x.dtype(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    auto kernel = vec ? rms_norm_backward_kernel<T, vec_n<T>()> : rms_norm_backward_kernel<T, 1>;
    if (smem > 48 * 1024)
      ACCEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    kernel<<<grid, threads, smem, sc.stream>>>(
        grad_x.defined() ? static_cast<T*>(grad_x.data_ptr()) : nullptr, partial.as<float>(),
        static_cast<const T*>(gc.data_ptr()), static_cast<const T*>(x.data_ptr()),
        static_cast<const T*>(wc.data_ptr()), static_cast<const float*>(rstd.data_ptr()), rows,
        static_cast<int>(d));
    ACCEL_CUDA_CHECK_LAUNCH("rms_norm_backward");
    if (grad_weight.defined()) {
      require(grad_weight.is_contiguous() && grad_weight.dtype() == x.dtype(), "rms_norm",
              "grad_weight must be contiguous of x's dtype");
      sum_partials_kernel<T><<<static_cast<int>((d + 255) / 256), 256, 0, sc.stream>>>(
          static_cast<T*>(grad_weight.data_ptr()), partial.as<float>(), grid, static_cast<int>(d));
      ACCEL_CUDA_CHECK_LAUNCH("rms_norm_backward (weight)");
    }
  });
}

// ---- rope ---------------------------------------------------------------------------------------
namespace {

constexpr int kMaxRopeHalf = 512;
struct InvFreq {
  float v[kMaxRopeHalf];
};

// One thread per (row, pair i): x[i] and x[i + half].
// One block per token position (b, s): cos/sin of its D/2 angles go to shared memory once, then
// the block rotates the pairs (i, i + D/2) of all H heads.
template <class T>
__global__ void rope_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t positions,
                            int s_len, int h_len, int half, int64_t position_offset, bool inverse,
                            const InvFreq inv) {
  __shared__ float cos_s[kMaxRopeHalf], sin_s[kMaxRopeHalf];
  for (int64_t pos = blockIdx.x; pos < positions; pos += gridDim.x) {
    const int64_t s = pos % s_len;
    __syncthreads();  // the previous position's tables are no longer read
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float angle = static_cast<float>(position_offset + s) * inv.v[i];
      sincosf(angle, &sin_s[i], &cos_s[i]);
    }
    __syncthreads();
    const T* xp = x + pos * h_len * 2 * half;
    T* op = out + pos * h_len * 2 * half;
    for (int idx = threadIdx.x; idx < h_len * half; idx += blockDim.x) {
      const int h = idx / half, i = idx - h * half;
      const T* xr = xp + h * 2 * half;
      T* orow = op + h * 2 * half;
      const float cs = cos_s[i], sn = sin_s[i];
      const float x1 = to_f(xr[i]), x2 = to_f(xr[i + half]);
      if (!inverse) {
        const float c = rnd<T>(cs), sv = rnd<T>(sn);
        orow[i] = from_f<T>(rnd<T>(x1 * c) + rnd<T>(-x2 * sv));
        orow[i + half] = from_f<T>(rnd<T>(x2 * c) + rnd<T>(x1 * sv));
      } else {
        orow[i] = from_f<T>(x1 * cs + x2 * sn);
        orow[i + half] = from_f<T>(x2 * cs - x1 * sn);
      }
    }
  }
}

}  // namespace

void CudaBackend::rope(const Tensor& out, const Tensor& x, double theta, int64_t position_offset,
                       bool inverse) {
  require_cuda(x, "rope", "x");
  require(x.dim() == 4 && x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype() && x.shape()[3] % 2 == 0,
          "rope", "needs contiguous [B, S, H, D] x and out with D even, got " + x.str());
  const int64_t s_len = x.shape()[1], h_len = x.shape()[2], d = x.shape()[3], half = d / 2;
  if (x.numel() == 0) return;
  if (half > kMaxRopeHalf)
    throw std::invalid_argument("[rope] CUDA kernel supports head dims up to " +
                                std::to_string(2 * kMaxRopeHalf) + ", got " + std::to_string(d));
  InvFreq inv{};
  // Exactly as Hugging Face (and the CPU backend): float32 1 / theta^(float(2i) / D).
  for (int64_t i = 0; i < half; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
    inv.v[i] = 1.0f / std::pow(static_cast<float>(theta), expo);
  }
  OpScope sc(x);
  dispatch_float(x.dtype(), "rope", [&](auto t) {
    using T = decltype(t);
    const int64_t positions = x.shape()[0] * s_len;
    rope_kernel<T><<<static_cast<int>(std::min<int64_t>(positions, int64_t(sm_count()) * 16)), 256,
                     0, sc.stream>>>(static_cast<T*>(out.data_ptr()),
                                     static_cast<const T*>(x.data_ptr()), positions,
                                     static_cast<int>(s_len), static_cast<int>(h_len),
                                     static_cast<int>(half), position_offset, inverse, inv);
  });
  ACCEL_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace accel
