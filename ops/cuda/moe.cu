// Mixture-of-experts kernels (the contract is in ops/backend.h): top-k over router logits, and the
// row gathers / weighted sums that move tokens into and out of expert order. Every reduction runs
// in fp32 in a fixed order and rounds once; nothing uses atomics, so results are deterministic.
// The row kernels use one warp per output row with 16-byte accesses when the rows allow.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ops/cuda/common.cuh"
#include "ops/cuda/vec.cuh"

namespace accel {
namespace {
using namespace cuda;

constexpr int kThreads = 256;  // 8 warps per block, one row per warp

int warp_grid(int64_t rows) {
  const int64_t warps_per_block = kThreads / 32;
  return static_cast<int>(std::max<int64_t>(
      1,
      std::min<int64_t>((rows + warps_per_block - 1) / warps_per_block, int64_t(sm_count()) * 16)));
}

// ---- topk ---------------------------------------------------------------------------------------

// A total order on (value, index) as one integer, larger = earlier in topk's output: the value's
// bits mapped to an order-preserving unsigned key in the high half (NaN largest, as torch does;
// -0 equal to +0), and the complemented index in the low half so equal values put the lower
// index first.
__device__ __forceinline__ uint64_t rank_key(float v, int idx) {
  uint32_t key;
  if (isnan(v)) {
    key = 0xffffffffu;
  } else {
    if (v == 0.f) v = 0.f;  // -0 -> +0
    const uint32_t b = __float_as_uint(v);
    key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return (uint64_t(key) << 32) | uint64_t(0xffffffffu - static_cast<uint32_t>(idx));
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// One warp per row: k passes, each taking the largest key below the previous pass's key (keys
// are distinct because they contain the index, so each pass finds the next entry).
template <class T>
__global__ void topk_kernel(T* __restrict__ values, int64_t* __restrict__ indices,
                            const T* __restrict__ x, int64_t rows, int cols, int k) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = warp; r < rows; r += warps) {
    const T* row = x + r * cols;
    uint64_t prev = ~uint64_t(0);  // above every key
    for (int j = 0; j < k; ++j) {
      uint64_t best = 0;  // below every key (index complement of 0 needs idx = 2^32 - 1)
      for (int c = lane; c < cols; c += 32) {
        const uint64_t key = rank_key(to_f(row[c]), c);
        if (key < prev && key > best) best = key;
      }
      best = warp_max_u64(best);
      const int idx = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best & 0xffffffffu));
      if (lane == 0) {
        values[r * k + j] = row[idx];
        indices[r * k + j] = idx;
      }
      prev = best;
    }
  }
}

// One thread per row, the row's k entries in order (+=: repeated indices add up).
template <class T>
__global__ void topk_backward_kernel(T* __restrict__ grad_x, const T* __restrict__ grad_values,
                                     const int64_t* __restrict__ indices, int64_t rows, int cols,
                                     int k) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    for (int j = 0; j < k; ++j) {
      const int64_t c = indices[r * k + j];
      if (c < 0 || c >= cols) continue;  // not from topk: nothing to scatter to
      T* dst = grad_x + r * cols + c;
      *dst = from_f<T>(to_f(*dst) + to_f(grad_values[r * k + j]));
    }
  }
}

// ---- permute ------------------------------------------------------------------------------------

// Whether rows of h elements of T starting at each pointer allow 16-byte vectors.
template <class T>
bool vec_rows(int64_t h, std::initializer_list<const void*> ptrs) {
  if ((h * int64_t(sizeof(T))) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

// out row i = x row order[i] / k. An out-of-range source is reported as a NaN row (no host sync
// for a check).
template <class T, bool kVec>
__global__ void permute_kernel(T* __restrict__ out, const T* __restrict__ x,
                               const int64_t* __restrict__ order, int64_t rows, int64_t tokens,
                               int64_t h, int k) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t i = warp; i < rows; i += warps) {
    const int64_t slot = order[i];
    const int64_t t = slot >= 0 ? slot / k : -1;
    T* o = out + i * h;
    if (t < 0 || t >= tokens) {
      for (int64_t c = lane; c < h; c += 32) o[c] = from_f<T>(NAN);
      continue;
    }
    const T* src = x + t * h;
    if constexpr (kVec) {
      constexpr int V = vec_n<T>();
      for (int64_t c = int64_t(lane) * V; c < h; c += 32 * V) store_vec(o, c, load_vec(src, c));
    } else {
      for (int64_t c = lane; c < h; c += 32) o[c] = src[c];
    }
  }
}

// ---- unpermute ----------------------------------------------------------------------------------

// out row t = sum_j weights[t, j] * y row inverse[t * k + j] (fp32, j ascending). `weights` is
// read through its own dtype (fp32 router probabilities or the activations' dtype); null weights
// count as 1, which makes this permute's backward (1 * f is exact, so the sums are unchanged).
template <class T, bool kVec>
__global__ void combine_rows_kernel(T* __restrict__ out, const T* __restrict__ y,
                                    const void* __restrict__ weights, DType wdtype,
                                    const int64_t* __restrict__ inverse, int64_t tokens, int64_t h,
                                    int k) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t rows = tokens * k;
  for (int64_t t = warp; t < tokens; t += warps) {
    T* o = out + t * h;
    const int64_t* inv = inverse + t * k;
    if constexpr (kVec) {
      constexpr int V = vec_n<T>();
      for (int64_t c = int64_t(lane) * V; c < h; c += 32 * V) {
        float acc[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        for (int j = 0; j < k; ++j) {
          const int64_t src = inv[j];
          const float w = weights ? load_f(weights, wdtype, t * k + j) : 1.f;
          float f[V];
          if (src < 0 || src >= rows) {
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] = NAN;
          } else {
            unpack<T>(*reinterpret_cast<const uint4*>(y + src * h + c), f);
          }
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += w * f[e];
        }
        *reinterpret_cast<uint4*>(o + c) = pack<T>(acc);
      }
    } else {
      for (int64_t c = lane; c < h; c += 32) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j) {
          const int64_t src = inv[j];
          const float w = weights ? load_f(weights, wdtype, t * k + j) : 1.f;
          acc += (src < 0 || src >= rows) ? NAN : w * to_f(y[src * h + c]);
        }
        o[c] = from_f<T>(acc);
      }
    }
  }
}

// One warp per permuted row i, slot = order[i], t = slot / k: grad_y row i = weights[slot] *
// grad_out row t, and grad_weights[slot] = <grad_out row t, y row i>. `order` is a permutation,
// so every output element is written by exactly one warp. Either output may be null (not wanted).
template <class T, bool kVec>
__global__ void unpermute_backward_kernel(T* __restrict__ grad_y, void* __restrict__ grad_weights,
                                          DType gwdtype, const T* __restrict__ grad_out,
                                          const T* __restrict__ y, const void* __restrict__ weights,
                                          DType wdtype, const int64_t* __restrict__ order,
                                          int64_t tokens, int64_t h, int k) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t rows = tokens * k;
  for (int64_t i = warp; i < rows; i += warps) {
    const int64_t slot = order[i];
    const bool ok = slot >= 0 && slot < rows;
    const int64_t t = ok ? slot / k : 0;
    const float w = ok ? load_f(weights, wdtype, slot) : NAN;
    const T* g = grad_out + t * h;
    const T* yr = y + i * h;
    T* gy = grad_y ? grad_y + i * h : nullptr;
    float dot = 0.f;
    if constexpr (kVec) {
      constexpr int V = vec_n<T>();
      for (int64_t c = int64_t(lane) * V; c < h; c += 32 * V) {
        float gf[V];
        unpack<T>(*reinterpret_cast<const uint4*>(g + c), gf);
        if (gy) {
          float o[V];
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = w * gf[e];
          *reinterpret_cast<uint4*>(gy + c) = pack<T>(o);
        }
        if (grad_weights) {
          float yf[V];
          unpack<T>(*reinterpret_cast<const uint4*>(yr + c), yf);
#pragma unroll
          for (int e = 0; e < V; ++e) dot += gf[e] * yf[e];
        }
      }
    } else {
      for (int64_t c = lane; c < h; c += 32) {
        const float gf = to_f(g[c]);
        if (gy) gy[c] = from_f<T>(w * gf);
        if (grad_weights) dot += gf * to_f(yr[c]);
      }
    }
    if (grad_weights) {
      dot = warp_sum(dot);
      if (lane == 0 && ok) store_f(grad_weights, gwdtype, slot, dot);
    }
  }
}

// ---- argument checks ----------------------------------------------------------------------------

void require_float(const Tensor& t, const char* op, const char* what) {
  if (t.dtype() != DType::F32 && t.dtype() != DType::BF16 && t.dtype() != DType::F16)
    throw std::invalid_argument(std::string("[") + op + "] " + what +
                                " must be f32, bf16 or f16; got " + t.str());
}

void require_index(const Tensor& t, const char* op, const char* what) {
  if (t.dtype() != DType::I64 || !t.is_contiguous())
    throw std::invalid_argument(std::string("[") + op + "] " + what +
                                " must be a contiguous I64 tensor; got " + t.str());
}

void require_same_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!t->device().is_cuda())
      throw std::invalid_argument(std::string("[") + op + "] " + t->str() +
                                  " is not on a CUDA device");
    if (first && t->device() != first->device())
      throw std::invalid_argument(std::string("[") + op + "] operands on different devices: " +
                                  first->str() + ", " + t->str());
    if (!first) first = t;
  }
}

Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.clone(); }

std::string shapes(std::initializer_list<const Tensor*> ts) {
  std::string s;
  for (const Tensor* t : ts) s += (s.empty() ? "" : ", ") + (t->defined() ? t->str() : "none");
  return s;
}

}  // namespace

void CudaBackend::topk(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t k) {
  const char* op = "topk";
  require_same_device(op, {&values, &indices, &x});
  require_float(x, op, "x");
  require_index(indices, op, "indices");
  const bool ok = x.dim() == 2 && values.dim() == 2 && indices.dim() == 2 && k >= 1 &&
                  k <= x.shape()[1] && values.shape() == Shape{x.shape()[0], k} &&
                  indices.shape() == values.shape() && values.dtype() == x.dtype() &&
                  values.is_contiguous() && x.shape()[1] < (int64_t(1) << 31);
  require(ok, op, [&] {
    return "needs x [R, C] and values, indices [R, k] with 1 <= k <= C, values of x's dtype; got "
           "k=" +
           std::to_string(k) + ", " + shapes({&values, &indices, &x});
  });
  const int64_t rows = x.shape()[0];
  if (rows == 0) return;
  Tensor xc = dense(x);
  OpScope sc(x);
  dispatch_float(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    topk_kernel<T><<<warp_grid(rows), kThreads, 0, sc.stream>>>(
        static_cast<T*>(values.data_ptr()), static_cast<int64_t*>(indices.data_ptr()),
        static_cast<const T*>(xc.data_ptr()), rows, static_cast<int>(x.shape()[1]),
        static_cast<int>(k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("topk");
}

void CudaBackend::topk_backward(const Tensor& grad_x, const Tensor& grad_values,
                                const Tensor& indices) {
  const char* op = "topk";
  require_same_device(op, {&grad_x, &grad_values, &indices});
  require_float(grad_x, op, "grad_x");
  require_index(indices, op, "indices");
  const bool ok = grad_x.dim() == 2 && grad_x.is_contiguous() && grad_values.dim() == 2 &&
                  grad_values.dtype() == grad_x.dtype() && grad_values.shape() == indices.shape() &&
                  grad_values.shape()[0] == grad_x.shape()[0];
  require(ok, op, [&] {
    return "backward needs grad_x [R, C] (contiguous), grad_values and indices [R, k] of grad_x's "
           "dtype; got " +
           shapes({&grad_x, &grad_values, &indices});
  });
  const int64_t rows = grad_x.shape()[0], k = grad_values.shape()[1];
  if (rows == 0 || k == 0) return;
  Tensor g = dense(grad_values);
  OpScope sc(grad_x);
  dispatch_float(grad_x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    topk_backward_kernel<T><<<grid_for(rows, kThreads), kThreads, 0, sc.stream>>>(
        static_cast<T*>(grad_x.data_ptr()), static_cast<const T*>(g.data_ptr()),
        static_cast<const int64_t*>(indices.data_ptr()), rows, static_cast<int>(grad_x.shape()[1]),
        static_cast<int>(k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("topk_backward");
}

void CudaBackend::moe_permute(const Tensor& out, const Tensor& x, const Tensor& order,
                              int64_t top_k) {
  const char* op = "moe_permute";
  require_same_device(op, {&out, &x, &order});
  require_float(x, op, "x");
  require_index(order, op, "order");
  const bool ok = top_k >= 1 && x.dim() == 2 && out.dim() == 2 && order.dim() == 1 &&
                  out.dtype() == x.dtype() && out.is_contiguous() &&
                  order.numel() == x.shape()[0] * top_k && out.shape()[0] == order.numel() &&
                  out.shape()[1] == x.shape()[1];
  require(ok, op, [&] {
    return "needs x [N, H], order [N * k], out [N * k, H] (contiguous, x's dtype); got k=" +
           std::to_string(top_k) + ", " + shapes({&out, &x, &order});
  });
  const int64_t tokens = x.shape()[0], h = x.shape()[1], rows = out.shape()[0];
  if (rows == 0 || h == 0) return;
  Tensor xc = dense(x);
  OpScope sc(x);
  dispatch_float(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    const T* src = static_cast<const T*>(xc.data_ptr());
    const int64_t* ord = static_cast<const int64_t*>(order.data_ptr());
    if (vec_rows<T>(h, {o, src}))
      permute_kernel<T, true><<<warp_grid(rows), kThreads, 0, sc.stream>>>(
          o, src, ord, rows, tokens, h, static_cast<int>(top_k));
    else
      permute_kernel<T, false><<<warp_grid(rows), kThreads, 0, sc.stream>>>(
          o, src, ord, rows, tokens, h, static_cast<int>(top_k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("moe_permute");
}

void CudaBackend::moe_permute_backward(const Tensor& grad_x, const Tensor& grad_out,
                                       const Tensor& inverse, int64_t top_k) {
  const char* op = "moe_permute";
  require_same_device(op, {&grad_x, &grad_out, &inverse});
  require_float(grad_x, op, "grad_x");
  require_index(inverse, op, "inverse");
  const bool ok = top_k >= 1 && grad_x.dim() == 2 && grad_out.dim() == 2 && inverse.dim() == 1 &&
                  grad_out.dtype() == grad_x.dtype() && grad_x.is_contiguous() &&
                  inverse.numel() == grad_x.shape()[0] * top_k &&
                  grad_out.shape()[0] == inverse.numel() &&
                  grad_out.shape()[1] == grad_x.shape()[1];
  require(ok, op, [&] {
    return "backward needs grad_x [N, H] (contiguous), grad_out [N * k, H] of its dtype, inverse "
           "[N * k]; got k=" +
           std::to_string(top_k) + ", " + shapes({&grad_x, &grad_out, &inverse});
  });
  const int64_t tokens = grad_x.shape()[0], h = grad_x.shape()[1];
  if (tokens == 0 || h == 0) return;
  Tensor g = dense(grad_out);
  OpScope sc(grad_x);
  dispatch_float(grad_x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(grad_x.data_ptr());
    const T* src = static_cast<const T*>(g.data_ptr());
    const int64_t* inv = static_cast<const int64_t*>(inverse.data_ptr());
    if (vec_rows<T>(h, {o, src}))
      combine_rows_kernel<T, true><<<warp_grid(tokens), kThreads, 0, sc.stream>>>(
          o, src, nullptr, DType::F32, inv, tokens, h, static_cast<int>(top_k));
    else
      combine_rows_kernel<T, false><<<warp_grid(tokens), kThreads, 0, sc.stream>>>(
          o, src, nullptr, DType::F32, inv, tokens, h, static_cast<int>(top_k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("moe_permute_backward");
}

void CudaBackend::moe_unpermute(const Tensor& out, const Tensor& y, const Tensor& weights,
                                const Tensor& inverse) {
  const char* op = "moe_unpermute";
  require_same_device(op, {&out, &y, &weights, &inverse});
  require_float(y, op, "y");
  require_float(weights, op, "weights");
  require_index(inverse, op, "inverse");
  const bool ok = out.dim() == 2 && y.dim() == 2 && weights.dim() == 2 && inverse.dim() == 1 &&
                  out.dtype() == y.dtype() && out.is_contiguous() && weights.shape()[1] >= 1 &&
                  weights.shape()[0] == out.shape()[0] && inverse.numel() == weights.numel() &&
                  y.shape()[0] == inverse.numel() && y.shape()[1] == out.shape()[1];
  require(ok, op, [&] {
    return "needs y [N * k, H], weights [N, k], inverse [N * k], out [N, H] (contiguous, y's "
           "dtype); "
           "got " +
           shapes({&out, &y, &weights, &inverse});
  });
  const int64_t tokens = out.shape()[0], h = out.shape()[1], k = weights.shape()[1];
  if (tokens == 0 || h == 0) return;
  Tensor yc = dense(y), wc = dense(weights);
  OpScope sc(out);
  dispatch_float(y.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    const T* src = static_cast<const T*>(yc.data_ptr());
    const int64_t* inv = static_cast<const int64_t*>(inverse.data_ptr());
    if (vec_rows<T>(h, {o, src}))
      combine_rows_kernel<T, true><<<warp_grid(tokens), kThreads, 0, sc.stream>>>(
          o, src, wc.data_ptr(), wc.dtype(), inv, tokens, h, static_cast<int>(k));
    else
      combine_rows_kernel<T, false><<<warp_grid(tokens), kThreads, 0, sc.stream>>>(
          o, src, wc.data_ptr(), wc.dtype(), inv, tokens, h, static_cast<int>(k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("moe_unpermute");
}

void CudaBackend::moe_unpermute_backward(const Tensor& grad_y, const Tensor& grad_weights,
                                         const Tensor& grad_out, const Tensor& y,
                                         const Tensor& weights, const Tensor& order) {
  const char* op = "moe_unpermute";
  require_same_device(op, {&grad_y, &grad_weights, &grad_out, &y, &weights, &order});
  require_float(y, op, "y");
  require_float(weights, op, "weights");
  require_index(order, op, "order");
  if (grad_weights.defined()) require_float(grad_weights, op, "grad_weights");
  bool ok = grad_out.dim() == 2 && y.dim() == 2 && weights.dim() == 2 && order.dim() == 1 &&
            grad_out.dtype() == y.dtype() && weights.shape()[1] >= 1 &&
            weights.shape()[0] == grad_out.shape()[0] && order.numel() == weights.numel() &&
            y.shape()[0] == order.numel() && y.shape()[1] == grad_out.shape()[1];
  if (grad_y.defined())
    ok = ok && grad_y.is_contiguous() && grad_y.dtype() == y.dtype() && grad_y.shape() == y.shape();
  if (grad_weights.defined())
    ok = ok && grad_weights.is_contiguous() && grad_weights.shape() == weights.shape();
  require(ok, op, [&] {
    return "backward needs grad_out [N, H], y [N * k, H] of its dtype, weights [N, k], order "
           "[N * k], grad_y like y and grad_weights like weights (contiguous; either may be "
           "none); got " +
           shapes({&grad_y, &grad_weights, &grad_out, &y, &weights, &order});
  });
  const int64_t tokens = grad_out.shape()[0], h = grad_out.shape()[1], k = weights.shape()[1];
  const int64_t rows = tokens * k;
  if (rows == 0 || (!grad_y.defined() && !grad_weights.defined())) return;
  Tensor g = dense(grad_out), yc = dense(y), wc = dense(weights);
  OpScope sc(grad_out);
  dispatch_float(y.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* gy = grad_y.defined() ? static_cast<T*>(grad_y.data_ptr()) : nullptr;
    void* gw = grad_weights.defined() ? grad_weights.data_ptr() : nullptr;
    const DType gwt = grad_weights.defined() ? grad_weights.dtype() : DType::F32;
    const T* gp = static_cast<const T*>(g.data_ptr());
    const T* yp = static_cast<const T*>(yc.data_ptr());
    const int64_t* ord = static_cast<const int64_t*>(order.data_ptr());
    if (vec_rows<T>(h, {gy, gp, yp}))
      unpermute_backward_kernel<T, true><<<warp_grid(rows), kThreads, 0, sc.stream>>>(
          gy, gw, gwt, gp, yp, wc.data_ptr(), wc.dtype(), ord, tokens, h, static_cast<int>(k));
    else
      unpermute_backward_kernel<T, false><<<warp_grid(rows), kThreads, 0, sc.stream>>>(
          gy, gw, gwt, gp, yp, wc.data_ptr(), wc.dtype(), ord, tokens, h, static_cast<int>(k));
  });
  ACCEL_CUDA_CHECK_LAUNCH("moe_unpermute_backward");
}

}  // namespace accel
