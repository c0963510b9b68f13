// Causal / full attention with grouped KV heads, never an S x S buffer.
//
// This file holds the generic kernels (any float dtype, head dim up to 256) and the backend entry
// points; attention_mma.cu holds the tensor-core forward and backward for bf16/f16 with head dim
// 64/128 (its backward: the FlashAttention-2-style kernel or the split pair, attention.cuh).
// Generic scheme: a block of 4 warps owns 4 rows (query rows for the forward and dQ, key rows for
// dK/dV); tiles of 32 columns (keys, or queries) are staged in shared memory as fp32 with padded
// rows, lane j handles column j of the tile, and each lane accumulates output dims lane + 32 t.
// The backward recomputes probabilities from the saved log-sum-exp (flash-attention style) in two
// kernels: dQ over key tiles and dK/dV over query tiles, so no atomics are needed.
// Causal masking is bottom-right aligned when the key count differs from the query count, as in
// the CPU reference: query i sees keys j < i + 1 + (Sk - Sq). Sliding windows and documents
// (segment_ids) narrow each row to one range of keys (attention.cuh); every kernel walks only the
// key (or query) tiles its rows see (the tensor-core kernels mask elements only in the tiles at a
// range's edges; the generic ones test each element, which costs them little).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/common.cuh"
#include "runtime/kernels.h"

namespace accel {
namespace cuda {
namespace {

AttnImpl parse_impl(const char* name) {
  if (std::strcmp(name, "auto") == 0) return AttnImpl::Auto;
  if (std::strcmp(name, "cudnn") == 0) return AttnImpl::Cudnn;
  if (std::strcmp(name, "flash") == 0) return AttnImpl::Flash;
  if (std::strcmp(name, "generic") == 0) return AttnImpl::Generic;
  throw std::invalid_argument(std::string("[attention] unknown implementation '") + name +
                              "' (use auto, cudnn, flash or generic)");
}

// ACCEL_ATTENTION=<impl> sets the initial choice (a switch for benchmarks and debugging).
AttnImpl g_impl = [] {
  const char* e = std::getenv("ACCEL_ATTENTION");
  return e ? parse_impl(e) : AttnImpl::Auto;
}();

// Auto: the first time cuDNN turns down a problem it would otherwise run, say so once.
void note_cudnn_declined(const std::string& why) {
  static bool said = false;
  if (said) return;
  said = true;
  std::fprintf(stderr, "[attention] %s; using accel's own kernels\n", why.c_str());
}

// Runs cuDNN's kernels when the choice allows it; throws when cuDNN was demanded and declines.
bool try_cudnn(const std::function<bool(std::string*)>& run) {
  if (g_impl != AttnImpl::Auto && g_impl != AttnImpl::Cudnn) return false;
  std::string why;
  if (run(&why)) return true;
  if (g_impl == AttnImpl::Cudnn)
    throw std::invalid_argument(
        "[attention] cuDNN attention was demanded (ACCEL_ATTENTION=cudnn or "
        "set_attention_impl(\"cudnn\")), but " +
        why);
  note_cudnn_declined(why);
  return false;
}

constexpr int kRows = 4;   // warps (rows) per block
constexpr int kTile = 32;  // columns per shared-memory tile
constexpr int kMaxT = 8;   // head dim up to 32 * kMaxT

template <class T>
__device__ __forceinline__ void stage_rows(float* dst, int ld, const T* src, int64_t row0,
                                           int64_t rows_total, int64_t row_stride, int n_rows,
                                           int d) {
  for (int idx = threadIdx.x; idx < n_rows * d; idx += blockDim.x) {
    int r = idx / d, c = idx - r * d;
    int64_t row = row0 + r;
    dst[r * ld + c] = row < rows_total ? to_f(src[row * row_stride + c]) : 0.f;
  }
}

template <class T>
__global__ void attn_fwd_generic(AttnParams p, T* __restrict__ out, float* __restrict__ lse,
                                 const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v) {
  extern __shared__ float smem[];
  const int d = p.d, ld = d + 1;
  float* ks = smem;             // [kTile][ld]
  float* vs = ks + kTile * ld;  // [kTile][ld]
  float* qs = vs + kTile * ld;  // [kRows][d]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t i0 = int64_t(blockIdx.x) * kRows, i = i0 + warp;
  const bool row_ok = i < p.sq;
  const int64_t q_stride = p.hq * d, kv_stride = p.hkv * d;
  const T* qb = q + (b * p.sq * p.hq + h) * d;
  const T* kb = k + (b * p.sk * p.hkv + hk) * d;
  const T* vb = v + (b * p.sk * p.hkv + hk) * d;
  stage_rows(qs, d, qb, i0, p.sq, q_stride, kRows, d);
  // This row's keys [lo_i, hi_i); the block's rows together see [j_begin, j_end).
  const int64_t lo_i = row_ok ? attn_keys_lo(p, b, i) : 0;
  const int64_t hi_i = row_ok ? attn_keys_hi(p, i) : 0;
  const int64_t j_begin = attn_keys_lo(p, b, i0);
  const int64_t j_end = attn_keys_hi(p, (i0 + kRows < p.sq ? i0 + kRows : p.sq) - 1);
  const int nt = (d + 31) / 32;
  float acc[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) acc[t] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    __syncthreads();
    stage_rows(ks, ld, kb, j0, p.sk, kv_stride, kTile, d);
    stage_rows(vs, ld, vb, j0, p.sk, kv_stride, kTile, d);
    __syncthreads();
    if (j0 >= hi_i || j0 + kTile <= lo_i) continue;  // warp-uniform
    float s = -INFINITY;
    if (j0 + lane >= lo_i && j0 + lane < hi_i) {
      float dot = 0.f;
      const float* kr = ks + lane * ld;
      const float* qr = qs + warp * d;
      for (int c = 0; c < d; ++c) dot += qr[c] * kr[c];
      s = dot * p.scale;
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float alpha = exp_for<T>(m - m_new);  // m == -inf on the first tile: 0
    const float pj = s == -INFINITY ? 0.f : exp_for<T>(s - m_new);
    l = l * alpha + warp_sum(pj);
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) acc[t] *= alpha;
    for (int jj = 0; jj < kTile; ++jj) {
      const float pv = __shfl_sync(0xffffffffu, pj, jj);
      const float* vr = vs + jj * ld;
#pragma unroll
      for (int t = 0; t < kMaxT; ++t)
        if (t < nt && lane + 32 * t < d) acc[t] += pv * vr[lane + 32 * t];
    }
    m = m_new;
  }
  if (!row_ok) return;
  T* orow = out + ((b * p.sq + i) * p.hq + h) * d;
  const float inv = l > 0.f ? 1.0f / l : 0.f;
#pragma unroll
  for (int t = 0; t < kMaxT; ++t)
    if (t < nt && lane + 32 * t < d) orow[lane + 32 * t] = from_f<T>(acc[t] * inv);
  if (lane == 0) lse[(b * p.hq + h) * p.sq + i] = l > 0.f ? m + logf(l) : -INFINITY;
}

// delta[b, h, i] = sum_c dO * O, one warp per row.
template <class T>
__global__ void attn_delta(AttnParams p, float* __restrict__ delta, const T* __restrict__ dout,
                           const T* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.b * p.hq * p.sq;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; r < rows;
       r += (int64_t(gridDim.x) * blockDim.x) >> 5) {
    const int64_t i = r % p.sq, h = (r / p.sq) % p.hq, b = r / (p.sq * p.hq);
    const int64_t off = ((b * p.sq + i) * p.hq + h) * p.d;
    float s = 0.f;
    for (int c = lane; c < p.d; c += 32) s += to_f(dout[off + c]) * to_f(out[off + c]);
    s = warp_sum(s);
    if (lane == 0) delta[r] = s;
  }
}

// delta for 16-bit dtypes with 16-byte accesses: TPR = d / 8 threads per (b, i, h) row, rows
// taken in memory order; TPR is a power of two <= 32 so a row never straddles warps.
template <class T>
__global__ void attn_delta_vec(AttnParams p, int tpr, float* __restrict__ delta,
                               const T* __restrict__ dout, const T* __restrict__ out) {
  const int64_t rows = p.b * p.sq * p.hq;
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t row = t / tpr;
  const int c = static_cast<int>(t - row * tpr);
  float s = 0.f;
  if (row < rows) {
    const uint4 a = reinterpret_cast<const uint4*>(dout + row * p.d)[c];
    const uint4 b = reinterpret_cast<const uint4*>(out + row * p.d)[c];
    const T* av = reinterpret_cast<const T*>(&a);
    const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int k = 0; k < 8; ++k) s += to_f(av[k]) * to_f(bv[k]);
  }
  for (int off = tpr >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (row < rows && c == 0) {
    const int64_t h = row % p.hq, i = (row / p.hq) % p.sq, b = row / (p.hq * p.sq);
    delta[(b * p.hq + h) * p.sq + i] = s;
  }
}

template <class T>
__global__ void attn_bwd_dq_generic(AttnParams p, T* __restrict__ dq, const T* __restrict__ q,
                                    const T* __restrict__ k, const T* __restrict__ v,
                                    const T* __restrict__ dout, const float* __restrict__ lse,
                                    const float* __restrict__ delta) {
  extern __shared__ float smem[];
  const int d = p.d, ld = d + 1;
  float* ks = smem;
  float* vs = ks + kTile * ld;
  float* qs = vs + kTile * ld;  // [kRows][d]
  float* dos = qs + kRows * d;  // [kRows][d]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t i0 = int64_t(blockIdx.x) * kRows, i = i0 + warp;
  const bool row_ok = i < p.sq;
  const int64_t q_stride = p.hq * d, kv_stride = p.hkv * d;
  const T* kb = k + (b * p.sk * p.hkv + hk) * d;
  const T* vb = v + (b * p.sk * p.hkv + hk) * d;
  stage_rows(qs, d, q + (b * p.sq * p.hq + h) * d, i0, p.sq, q_stride, kRows, d);
  stage_rows(dos, d, dout + (b * p.sq * p.hq + h) * d, i0, p.sq, q_stride, kRows, d);
  const int64_t lo_i = row_ok ? attn_keys_lo(p, b, i) : 0;
  const int64_t hi_i = row_ok ? attn_keys_hi(p, i) : 0;
  const int64_t j_begin = attn_keys_lo(p, b, i0);
  const int64_t j_end = attn_keys_hi(p, (i0 + kRows < p.sq ? i0 + kRows : p.sq) - 1);
  const float row_lse = row_ok ? lse[(b * p.hq + h) * p.sq + i] : 0.f;
  const float row_delta = row_ok ? delta[(b * p.hq + h) * p.sq + i] : 0.f;
  const int nt = (d + 31) / 32;
  float acc[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) acc[t] = 0.f;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    __syncthreads();
    stage_rows(ks, ld, kb, j0, p.sk, kv_stride, kTile, d);
    stage_rows(vs, ld, vb, j0, p.sk, kv_stride, kTile, d);
    __syncthreads();
    if (j0 >= hi_i || j0 + kTile <= lo_i) continue;  // warp-uniform
    float ds = 0.f;
    if (j0 + lane >= lo_i && j0 + lane < hi_i) {
      float dot = 0.f, dp = 0.f;
      const float* kr = ks + lane * ld;
      const float* vr = vs + lane * ld;
      const float* qr = qs + warp * d;
      const float* dr = dos + warp * d;
      for (int c = 0; c < d; ++c) {
        dot += qr[c] * kr[c];
        dp += dr[c] * vr[c];
      }
      const float pj = exp_for<T>(dot * p.scale - row_lse);
      ds = pj * (dp - row_delta);
    }
    for (int jj = 0; jj < kTile; ++jj) {
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
      const float* kr = ks + jj * ld;
#pragma unroll
      for (int t = 0; t < kMaxT; ++t)
        if (t < nt && lane + 32 * t < d) acc[t] += dsj * kr[lane + 32 * t];
    }
  }
  if (!row_ok) return;
  T* row = dq + ((b * p.sq + i) * p.hq + h) * d;
#pragma unroll
  for (int t = 0; t < kMaxT; ++t)
    if (t < nt && lane + 32 * t < d) row[lane + 32 * t] = from_f<T>(acc[t] * p.scale);
}

template <class T>
__global__ void attn_bwd_dkv_generic(AttnParams p, T* __restrict__ dk, T* __restrict__ dv,
                                     const T* __restrict__ q, const T* __restrict__ k,
                                     const T* __restrict__ v, const T* __restrict__ dout,
                                     const float* __restrict__ lse,
                                     const float* __restrict__ delta) {
  extern __shared__ float smem[];
  const int d = p.d, ld = d + 1;
  float* qs = smem;                // [kTile][ld]
  float* dos = qs + kTile * ld;    // [kTile][ld]
  float* kw = dos + kTile * ld;    // [kRows][d]
  float* vw = kw + kRows * d;      // [kRows][d]
  float* lse_s = vw + kRows * d;   // [kTile]
  float* delta_s = lse_s + kTile;  // [kTile]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hk = blockIdx.y;
  const int64_t j0b = int64_t(blockIdx.x) * kRows, j = j0b + warp;
  const bool row_ok = j < p.sk;
  const int64_t q_stride = p.hq * d, kv_stride = p.hkv * d;
  stage_rows(kw, d, k + (b * p.sk * p.hkv + hk) * d, j0b, p.sk, kv_stride, kRows, d);
  stage_rows(vw, d, v + (b * p.sk * p.hkv + hk) * d, j0b, p.sk, kv_stride, kRows, d);
  const int nt = (d + 31) / 32;
  float acc_k[kMaxT], acc_v[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) acc_k[t] = acc_v[t] = 0.f;
  // This key's queries [qlo, qhi); the block's keys together are seen by [i_start, i_end).
  const int64_t qlo = row_ok ? attn_queries_lo(p, j) : 0;
  const int64_t qhi = row_ok ? attn_queries_hi(p, b, j) : 0;
  const int64_t i_start = attn_queries_lo(p, j0b);
  const int64_t i_end = attn_queries_hi(p, b, (j0b + kRows < p.sk ? j0b + kRows : p.sk) - 1);
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t h = hk * p.group + g;
    const T* qb = q + (b * p.sq * p.hq + h) * d;
    const T* db = dout + (b * p.sq * p.hq + h) * d;
    const float* lse_b = lse + (b * p.hq + h) * p.sq;
    const float* delta_b = delta + (b * p.hq + h) * p.sq;
    for (int64_t i0 = i_start; i0 < i_end; i0 += kTile) {
      __syncthreads();
      stage_rows(qs, ld, qb, i0, p.sq, q_stride, kTile, d);
      stage_rows(dos, ld, db, i0, p.sq, q_stride, kTile, d);
      if (threadIdx.x < kTile) {
        int64_t ii = i0 + threadIdx.x;
        lse_s[threadIdx.x] = ii < p.sq ? lse_b[ii] : 0.f;
        delta_s[threadIdx.x] = ii < p.sq ? delta_b[ii] : 0.f;
      }
      __syncthreads();
      const int64_t i = i0 + lane;
      float pj = 0.f, ds = 0.f;
      if (i >= qlo && i < qhi) {
        float dot = 0.f, dp = 0.f;
        const float* qr = qs + lane * ld;
        const float* dr = dos + lane * ld;
        const float* kr = kw + warp * d;
        const float* vr = vw + warp * d;
        for (int c = 0; c < d; ++c) {
          dot += qr[c] * kr[c];
          dp += dr[c] * vr[c];
        }
        pj = exp_for<T>(dot * p.scale - lse_s[lane]);
        ds = pj * (dp - delta_s[lane]);
      }
      for (int ii = 0; ii < kTile; ++ii) {
        const float pv = __shfl_sync(0xffffffffu, pj, ii);
        const float dsv = __shfl_sync(0xffffffffu, ds, ii);
        const float* qr = qs + ii * ld;
        const float* dr = dos + ii * ld;
#pragma unroll
        for (int t = 0; t < kMaxT; ++t)
          if (t < nt && lane + 32 * t < d) {
            acc_v[t] += pv * dr[lane + 32 * t];
            acc_k[t] += dsv * qr[lane + 32 * t];
          }
      }
    }
  }
  if (!row_ok) return;
  const int64_t off = ((b * p.sk + j) * p.hkv + hk) * d;
#pragma unroll
  for (int t = 0; t < kMaxT; ++t)
    if (t < nt && lane + 32 * t < d) {
      dk[off + lane + 32 * t] = from_f<T>(acc_k[t] * p.scale);
      dv[off + lane + 32 * t] = from_f<T>(acc_v[t]);
    }
}

// Inclusive scan over the block's threads (blockDim.x a multiple of 32, at most 1024) with a
// commutative, associative op; every thread also gets the block's total.
template <class Op>
__device__ int block_scan(int v, Op op, int* total) {
  __shared__ int warp_totals[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v = op(v, o);
  }
  __syncthreads();  // warp_totals of a previous call are read
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int t = lane < warps ? warp_totals[lane] : warp_totals[0];
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, t, off);
      if (lane >= off) t = op(t, o);
    }
    warp_totals[lane] = t;  // inclusive over warps
  }
  __syncthreads();
  if (warp > 0) v = op(v, warp_totals[warp - 1]);
  *total = warp_totals[warps - 1];
  return v;
}

// Document bounds from segment ids [B, S] (one block per row): lo[i] = the first position of the
// run of equal ids holding i (a max-scan of run starts), hi[i] = one past its last position (a
// min-scan of run ends, right to left).
__global__ void attn_segment_bounds(int64_t rows, int64_t s, const int32_t* __restrict__ seg,
                                    int32_t* __restrict__ lo, int32_t* __restrict__ hi) {
  auto max_op = [](int a, int b) { return a > b ? a : b; };
  auto min_op = [](int a, int b) { return a < b ? a : b; };
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t* id = seg + r * s;
    int carry = 0, total = 0;
    for (int64_t c0 = 0; c0 < s; c0 += blockDim.x) {
      const int64_t i = c0 + threadIdx.x;
      const int start = i < s && (i == 0 || id[i] != id[i - 1]) ? static_cast<int>(i) : 0;
      const int v = max_op(block_scan(start, max_op, &total), carry);
      if (i < s) lo[r * s + i] = v;
      carry = max_op(carry, total);
    }
    carry = static_cast<int>(s);
    for (int64_t c0 = 0; c0 < s; c0 += blockDim.x) {
      const int64_t i = s - 1 - (c0 + threadIdx.x);
      const int end = i >= 0 && (i == s - 1 || id[i] != id[i + 1]) ? static_cast<int>(i + 1)
                                                                   : static_cast<int>(s);
      const int v = min_op(block_scan(end, min_op, &total), carry);
      if (i >= 0) hi[r * s + i] = v;
      carry = min_op(carry, total);
    }
  }
}

// The kernels' parameters; with segment_ids, `bounds` receives the documents' bounds (computed
// on `stream`) that the parameters point to.
AttnParams make_params(const Tensor& q, const Tensor& k, const AttentionMask& mask, double scale,
                       DeviceBuffer& bounds, cudaStream_t stream) {
  AttnParams p;
  p.b = q.shape()[0];
  p.sq = q.shape()[1];
  p.hq = q.shape()[2];
  p.d = static_cast<int>(q.shape()[3]);
  p.sk = k.shape()[1];
  p.hkv = k.shape()[2];
  p.group = p.hq / p.hkv;
  p.causal = mask.causal;
  p.window = mask.window;
  p.seg_lo = p.seg_hi = nullptr;
  p.scale = static_cast<float>(scale);
  const Tensor& seg = mask.segment_ids;
  if (seg.defined() && p.b * p.sq > 0) {
    const int64_t n = p.b * p.sq;
    bounds = DeviceBuffer(static_cast<size_t>(2 * n) * sizeof(int32_t));
    int32_t* lo = bounds.as<int32_t>();
    const unsigned blocks = static_cast<unsigned>(p.b < 65535 ? p.b : 65535);
    attn_segment_bounds<<<blocks, 1024, 0, stream>>>(
        p.b, p.sq, static_cast<const int32_t*>(seg.data_ptr()), lo, lo + n);
    ACCEL_CUDA_CHECK_LAUNCH("attention (document bounds)");
    p.seg_lo = lo;
    p.seg_hi = lo + n;
  }
  return p;
}

void check_attention(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q,
                     const Tensor& k, const Tensor& v, const AttentionMask& mask) {
  require_cuda(q, op, "q");
  require_cuda(k, op, "k");
  require_cuda(v, op, "v");
  require(q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape() && q.shape()[0] == k.shape()[0] &&
              q.shape()[3] == k.shape()[3] && k.shape()[2] > 0 &&
              q.shape()[2] % k.shape()[2] == 0 && out.shape() == q.shape() && q.is_contiguous() &&
              k.is_contiguous() && v.is_contiguous() && out.is_contiguous() &&
              lse.is_contiguous() && lse.dtype() == DType::F32 &&
              lse.shape() == Shape{q.shape()[0], q.shape()[2], q.shape()[1]},
          op, [&] {
            return "got q " + q.str() + ", k " + k.str() + ", v " + v.str() + ", out " + out.str() +
                   ", lse " + lse.str();
          });
  require(k.dtype() == q.dtype() && v.dtype() == q.dtype() && out.dtype() == q.dtype(), op,
          "q, k, v and out must share a dtype");
  const Tensor& seg = mask.segment_ids;
  if (seg.defined())
    require(seg.dtype() == DType::I32 && seg.is_contiguous() && seg.device() == q.device() &&
                q.shape()[1] == k.shape()[1] && seg.shape() == Shape{q.shape()[0], q.shape()[1]},
            op,
            [&] { return "segment_ids " + seg.str() + " for q " + q.str() + " and k " + k.str(); });
  require(mask.window >= 0 && (mask.causal || (mask.window == 0 && !seg.defined())), op,
          "a window or segment_ids needs causal attention");
  if (q.shape()[3] > 32 * kMaxT)
    throw std::invalid_argument(
        std::string("[") + op + "] the CUDA kernels support head dims up to " +
        std::to_string(32 * kMaxT) + ", got " + std::to_string(q.shape()[3]));
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
}

}  // namespace

void set_attention_impl(const char* impl) { g_impl = parse_impl(impl); }

}  // namespace cuda

void CudaBackend::attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, const AttentionMask& mask, double scale) {
  using namespace cuda;
  check_attention("attention", out, lse, q, k, v, mask);
  if (out.numel() == 0 && lse.numel() == 0) return;
  OpScope sc(q);
  DeviceBuffer bounds;
  const AttnParams p = make_params(q, k, mask, scale, bounds, sc.stream);
  if (p.sk == 0) {
    ::accel::kernels::cuda::fill(out, 0.0);
    ::accel::kernels::cuda::fill(lse, -INFINITY);
    return;
  }
  if (try_cudnn([&](std::string* why) {
        return attention_forward_cudnn(p, out, lse, q, k, v, sc.stream, why);
      }))
    return;
  if (g_impl != AttnImpl::Generic && attention_forward_mma(p, out, lse, q, k, v, sc.stream)) return;
  const size_t smem = (2 * kTile * (p.d + 1) + kRows * p.d) * sizeof(float);
  dim3 grid(static_cast<unsigned>((p.sq + kRows - 1) / kRows), static_cast<unsigned>(p.hq),
            static_cast<unsigned>(p.b));
  dispatch_float(q.dtype(), "attention", [&](auto t) {
    using T = decltype(t);
    set_smem(attn_fwd_generic<T>, smem);
    attn_fwd_generic<T><<<grid, kRows * 32, smem, sc.stream>>>(
        p, static_cast<T*>(out.data_ptr()), static_cast<float*>(lse.data_ptr()),
        static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
        static_cast<const T*>(v.data_ptr()));
  });
  ACCEL_CUDA_CHECK_LAUNCH("attention");
}

void CudaBackend::attention_backward(const Tensor& grad_q, const Tensor& grad_k,
                                     const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                                     const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const AttentionMask& mask, double scale) {
  using namespace cuda;
  check_attention("attention", out, lse, q, k, v, mask);
  require(grad_q.shape() == q.shape() && grad_k.shape() == k.shape() &&
              grad_v.shape() == v.shape() && grad_out.shape() == q.shape() &&
              grad_q.is_contiguous() && grad_k.is_contiguous() && grad_v.is_contiguous() &&
              grad_q.dtype() == q.dtype() && grad_k.dtype() == q.dtype() &&
              grad_v.dtype() == q.dtype() && grad_out.dtype() == q.dtype(),
          "attention", "backward: gradients must be contiguous and match q, k, v");
  OpScope sc(q);
  if (q.numel() == 0 || k.numel() == 0) {
    if (grad_q.numel()) ::accel::kernels::cuda::fill(grad_q, 0.0);
    if (grad_k.numel()) ::accel::kernels::cuda::fill(grad_k, 0.0);
    if (grad_v.numel()) ::accel::kernels::cuda::fill(grad_v, 0.0);
    return;
  }
  DeviceBuffer bounds;
  const AttnParams p = make_params(q, k, mask, scale, bounds, sc.stream);
  Tensor dout = grad_out.is_contiguous() ? grad_out : grad_out.clone();
  if (try_cudnn([&](std::string* why) {
        return attention_backward_cudnn(p, grad_q, grad_k, grad_v, dout, q, k, v, out, lse,
                                        sc.stream, why);
      }))
    return;
  DeviceBuffer delta(static_cast<size_t>(p.b * p.hq * p.sq) * sizeof(float));
  dispatch_float(q.dtype(), "attention", [&](auto t) {
    using T = decltype(t);
    const int64_t rows = p.b * p.hq * p.sq;
    const int tpr = p.d / 8;
    const bool vec = sizeof(T) == 2 && p.d % 8 == 0 && tpr <= 32 && (tpr & (tpr - 1)) == 0 &&
                     (reinterpret_cast<uintptr_t>(dout.data_ptr()) & 15) == 0 &&
                     (reinterpret_cast<uintptr_t>(out.data_ptr()) & 15) == 0;
    if (vec)
      attn_delta_vec<T><<<static_cast<unsigned>((rows * tpr + 255) / 256), 256, 0, sc.stream>>>(
          p, tpr, delta.as<float>(), static_cast<const T*>(dout.data_ptr()),
          static_cast<const T*>(out.data_ptr()));
    else
      attn_delta<T><<<grid_for(rows * 32, 256), 256, 0, sc.stream>>>(
          p, delta.as<float>(), static_cast<const T*>(dout.data_ptr()),
          static_cast<const T*>(out.data_ptr()));
    ACCEL_CUDA_CHECK_LAUNCH("attention_backward (delta)");
  });
  if (g_impl != AttnImpl::Generic &&
      attention_backward_mma(p, grad_q, grad_k, grad_v, dout, q, k, v, out, lse, delta.as<float>(),
                             sc.stream))
    return;
  dispatch_float(q.dtype(), "attention", [&](auto t) {
    using T = decltype(t);
    const size_t smem_q = (2 * kTile * (p.d + 1) + 2 * kRows * p.d) * sizeof(float);
    set_smem(attn_bwd_dq_generic<T>, smem_q);
    dim3 grid_q(static_cast<unsigned>((p.sq + kRows - 1) / kRows), static_cast<unsigned>(p.hq),
                static_cast<unsigned>(p.b));
    attn_bwd_dq_generic<T><<<grid_q, kRows * 32, smem_q, sc.stream>>>(
        p, static_cast<T*>(grad_q.data_ptr()), static_cast<const T*>(q.data_ptr()),
        static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
        static_cast<const T*>(dout.data_ptr()), static_cast<const float*>(lse.data_ptr()),
        delta.as<float>());
    ACCEL_CUDA_CHECK_LAUNCH("attention_backward (dq)");
    const size_t smem_kv = (2 * kTile * (p.d + 1) + 2 * kRows * p.d + 2 * kTile) * sizeof(float);
    set_smem(attn_bwd_dkv_generic<T>, smem_kv);
    dim3 grid_kv(static_cast<unsigned>((p.sk + kRows - 1) / kRows), static_cast<unsigned>(p.hkv),
                 static_cast<unsigned>(p.b));
    attn_bwd_dkv_generic<T><<<grid_kv, kRows * 32, smem_kv, sc.stream>>>(
        p, static_cast<T*>(grad_k.data_ptr()), static_cast<T*>(grad_v.data_ptr()),
        static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
        static_cast<const T*>(v.data_ptr()), static_cast<const T*>(dout.data_ptr()),
        static_cast<const float*>(lse.data_ptr()), delta.as<float>());
    ACCEL_CUDA_CHECK_LAUNCH("attention_backward (dk, dv)");
  });
}

}  // namespace accel
