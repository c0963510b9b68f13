// Rotary position embeddings (and the transposed rotation for the backward). cos/sin and the
// products are rounded to the activation dtype where Hugging Face's Llama rounds them, as the CPU
// reference does.
#include <cmath>

#include "ops/cuda/common.cuh"
#include "ops/cuda/vec.cuh"

namespace accel {
namespace {
using namespace cuda;

constexpr int kMaxRopeHalf = 512;
struct InvFreq {
  float v[kMaxRopeHalf];
};

// Where the tokens sit: position_ids (one of the two pointers, [B * S]) or offset + s.
struct Positions {
  const int64_t* ids64 = nullptr;
  const int32_t* ids32 = nullptr;
  int64_t offset = 0;
  int s_len = 1;
  __device__ __forceinline__ float at(int64_t token) const {
    if (ids64) return static_cast<float>(ids64[token]);
    if (ids32) return static_cast<float>(ids32[token]);
    return static_cast<float>(offset + token % s_len);
  }
};

// The rotation of the pair (x1, x2) = (x[i], x[i + half]) by the angle with cosine cs and sine sn,
// before the final rounding to T. One function for both rope kernels, so that they round alike.
template <class T>
__device__ __forceinline__ void rope_rotate(float x1, float x2, float cs, float sn, bool inverse,
                                            float& o1, float& o2) {
  if (!inverse) {
    const float c = rnd<T>(cs), sv = rnd<T>(sn);
    o1 = rnd<T>(x1 * c) + rnd<T>(-x2 * sv);
    o2 = rnd<T>(x2 * c) + rnd<T>(x1 * sv);
  } else {
    o1 = x1 * cs + x2 * sn;
    o2 = x2 * cs - x1 * sn;
  }
}

// Element by element, for any even head dim (the path of shapes and pointers the vector kernel
// does not take). One block per token position (b, s): cos/sin of its D/2 angles go to shared
// memory once, then the block rotates the pairs (i, i + D/2) of all H heads.
template <class T>
__global__ void rope_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t positions,
                            int h_len, int half, const Positions where, float scale, bool inverse,
                            const InvFreq inv) {
  __shared__ float cos_s[kMaxRopeHalf], sin_s[kMaxRopeHalf];
  for (int64_t pos = blockIdx.x; pos < positions; pos += gridDim.x) {
    const float p = where.at(pos);
    __syncthreads();  // the previous position's tables are no longer read
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      float sn, cs;
      sincosf(p * inv.v[i], &sn, &cs);
      sin_s[i] = sn * scale;
      cos_s[i] = cs * scale;
    }
    __syncthreads();
    const T* xp = x + pos * h_len * 2 * half;
    T* op = out + pos * h_len * 2 * half;
    for (int idx = threadIdx.x; idx < h_len * half; idx += blockDim.x) {
      const int h = idx / half, i = idx - h * half;
      const T* xr = xp + h * 2 * half;
      T* orow = op + h * 2 * half;
      float o1, o2;
      rope_rotate<T>(to_f(xr[i]), to_f(xr[i + half]), cos_s[i], sin_s[i], inverse, o1, o2);
      orow[i] = from_f<T>(o1);
      orow[i + half] = from_f<T>(o2);
    }
  }
}

// 16-byte vectors, for half % vec_n<T>() == 0 and 16-byte aligned x and out. A thread takes one
// chunk of N consecutive i of one position (and the matching N of the second half), computes its
// N angles once and rotates them in up to kRopeHeads heads of that position; no shared memory and
// no barriers. Same angles, sincosf and rounding as rope_kernel, so the results are bit-identical.
constexpr int kRopeHeads = 4;
template <class T>
__global__ void __launch_bounds__(256)
    rope_vec_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t positions, int h_len,
                    int half, const Positions where, float scale, bool inverse, const InvFreq inv) {
  constexpr int N = vec_n<T>();
  const int chunks = half / N, groups = (h_len + kRopeHeads - 1) / kRopeHeads;
  const int64_t items = positions * chunks * groups, d = 2 * half;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < items;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int i0 = static_cast<int>(t % chunks) * N;
    const int64_t rest = t / chunks;
    const int h0 = static_cast<int>(rest % groups) * kRopeHeads;
    const int64_t pos = rest / groups;
    const int nh = min(kRopeHeads, h_len - h0);
    const int64_t base = (pos * h_len + h0) * d + i0;
    uint4 a[kRopeHeads], b[kRopeHeads];
#pragma unroll
    for (int h = 0; h < kRopeHeads; ++h) {
      if (h >= nh) continue;
      a[h] = *reinterpret_cast<const uint4*>(x + base + h * d);
      b[h] = *reinterpret_cast<const uint4*>(x + base + h * d + half);
    }
    const float p = where.at(pos);
    float cs[N], sn[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      sincosf(p * inv.v[i0 + k], &sn[k], &cs[k]);
      sn[k] *= scale;
      cs[k] *= scale;
    }
#pragma unroll
    for (int h = 0; h < kRopeHeads; ++h) {
      if (h >= nh) continue;
      float x1[N], x2[N], o1[N], o2[N];
      unpack<T>(a[h], x1);
      unpack<T>(b[h], x2);
#pragma unroll
      for (int k = 0; k < N; ++k) rope_rotate<T>(x1[k], x2[k], cs[k], sn[k], inverse, o1[k], o2[k]);
      *reinterpret_cast<uint4*>(out + base + h * d) = pack<T>(o1);
      *reinterpret_cast<uint4*>(out + base + h * d + half) = pack<T>(o2);
    }
  }
}

}  // namespace

void CudaBackend::rope(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs,
                       int64_t position_offset, const Tensor& position_ids, bool inverse) {
  require_cuda(x, "rope", "x");
  require(rope_layout_ok(out, x, freqs), "rope", [&] { return rope_layout_error(x); });
  const int64_t s_len = x.shape()[1], h_len = x.shape()[2], d = x.shape()[3], half = d / 2;
  if (x.numel() == 0) return;
  if (half > kMaxRopeHalf)
    throw std::invalid_argument("[rope] CUDA kernel supports head dims up to " +
                                std::to_string(2 * kMaxRopeHalf) + ", got " + std::to_string(d));
  InvFreq inv{};
  for (int64_t i = 0; i < half; ++i) inv.v[i] = freqs.inv_freq[static_cast<size_t>(i)];
  Positions where;
  where.offset = position_offset;
  where.s_len = static_cast<int>(s_len);
  if (position_ids.defined()) {
    require_cuda(position_ids, "rope", "position_ids");
    require(position_ids.is_contiguous() && position_ids.numel() == x.shape()[0] * s_len, "rope",
            [&] { return "position_ids must be contiguous [B, S], got " + position_ids.str(); });
    if (position_ids.dtype() == DType::I64)
      where.ids64 = static_cast<const int64_t*>(position_ids.data_ptr());
    else
      where.ids32 = static_cast<const int32_t*>(position_ids.data_ptr());
  }
  const float scale = static_cast<float>(freqs.attention_scaling);
  OpScope sc(x);
  const int64_t positions = x.shape()[0] * s_len;
  const int64_t n = 16 / static_cast<int64_t>(dtype_size(x.dtype()));
  if (half % n == 0 && aligned16(x.data_ptr()) && aligned16(out.data_ptr())) {
    const int64_t items = positions * (half / n) * ((h_len + kRopeHeads - 1) / kRopeHeads);
    const int grid = static_cast<int>(std::min<int64_t>((items + 255) / 256, sm_count() * 32));
    dispatch_float(x.dtype(), "rope", [&](auto t) {
      using T = decltype(t);
      rope_vec_kernel<T><<<grid, 256, 0, sc.stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), positions,
          static_cast<int>(h_len), static_cast<int>(half), where, scale, inverse, inv);
    });
    ACCEL_CUDA_CHECK_LAUNCH("rope");
    return;
  }
  dispatch_float(x.dtype(), "rope", [&](auto t) {
    using T = decltype(t);
    rope_kernel<T><<<static_cast<int>(std::min<int64_t>(positions, int64_t(sm_count()) * 16)), 256,
                     0, sc.stream>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), positions,
        static_cast<int>(h_len), static_cast<int>(half), where, scale, inverse, inv);
  });
  ACCEL_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace accel
