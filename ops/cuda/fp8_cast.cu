// CUDA fp8 kernels other than the GEMM (the fp8_* methods of ops/backend.h): the fused cast + amax
// (+ transpose) of one tensor or of many groups in one launch (fp8_cast_grouped: a mixture of
// experts' operands), the amax reduction (also grouped) and scale computation of dynamic scaling,
// the byte transpose,
// the delayed-scaling update of all slots in one launch, and the MX fake quantization.
//
// Rounding: the casts use the hardware cvt.rn.satfinite (sm_89+) which rounds to nearest even and
// saturates exactly as detail::encode(..., saturate=true) in runtime/dtype.h does on the CPU
// (tests/cuda/fp8_cast_test.cpp compares them bit for bit); NaN stays NaN.
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "ops/cuda/common.cuh"
#include "ops/fp8.h"

namespace accel {
namespace {

using accel::cuda::block_max;
using accel::cuda::grid_for;
using accel::cuda::OpScope;
using accel::cuda::to_f;

// cast+transpose tile: 128 rows x 64 columns; thread (tx, ty) = (threadIdx.x % 8, threadIdx.x / 8)
// holds columns 8tx..8tx+7 of rows 4ty..4ty+3, so that a 4 x 4 byte transpose in registers
// gives it 4 consecutive bytes of each of its 8 columns in data_t.
constexpr int kTileRows = 128;
constexpr int kTileCols = 64;
constexpr int kThreads = 256;

template <bool kE5M2>
__device__ __forceinline__ uint16_t cvt2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                  kE5M2 ? __NV_E5M2 : __NV_E4M3);
#else
  const detail::SmallFloat fmt = kE5M2 ? detail::kE5M2 : detail::kE4M3;
  return static_cast<uint16_t>(detail::encode(lo, fmt, true) |
                               (detail::encode(hi, fmt, true) << 8));
#endif
}
template <bool kE5M2>
__device__ __forceinline__ uint8_t cvt1(float v) {
  return static_cast<uint8_t>(cvt2<kE5M2>(v, 0.0f) & 0xffu);
}

// amax accumulation: non-negative floats order like their bit patterns.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

// 8 consecutive elements as loaded, unconverted (so that a load issued early does not stall at a
// conversion placed right after it). Zero-initialized = eight +0.0.
template <class T>
struct Raw8 {
  uint4 u;
};
template <>
struct Raw8<float> {
  float4 a, b;
};
// p is 16-byte aligned.
template <class T>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  Raw8<T> r;
  if constexpr (std::is_same_v<T, float>) {
    r.a = reinterpret_cast<const float4*>(p)[0];
    r.b = reinterpret_cast<const float4*>(p)[1];
  } else {
    r.u = *reinterpret_cast<const uint4*>(p);
  }
  return r;
}
template <class T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&v)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    v[0] = r.a.x, v[1] = r.a.y, v[2] = r.a.z, v[3] = r.a.w;
    v[4] = r.b.x, v[5] = r.b.y, v[6] = r.b.z, v[7] = r.b.w;
  } else {
    const T* h = reinterpret_cast<const T*>(&r.u);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f(h[i]);
  }
}

// in[k] holds row k of a 4 x 4 byte block (byte b = column b); out[j] gets column j (byte k =
// row k).
__device__ __forceinline__ void transpose4x4(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(in[0], in[1], 0x5140);  // a0 b0 a1 b1
  const uint32_t ab_hi = __byte_perm(in[0], in[1], 0x7362);  // a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t cd_hi = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// Where one output of a fused cast goes: the scale it reads (written instead under a grouped cast's
// dynamic scaling), the row-major and transposed fp8 copies (either may be null), the amax it
// max-accumulates (read instead under dynamic scaling) and the scale_inv it sets (both optional).
struct CastOut {
  float* scale;
  uint8_t* data;
  uint8_t* data_t;
  float* amax;
  float* scale_inv;
};

// The groups of one cast launch: group g is rows [rows[g], C] of its input `in[g]` (handed to the
// producer's bind; producers with inputs of their own ignore it), padded to rows_p[g] (a multiple
// of 16) in its outputs o[g]; its tiles are the tile rows [first_tile_row[g], first_tile_row[g +
// 1]) of the launch, each across all tile columns. A single-tensor cast is one group (kMax 1); a
// grouped cast holds up to kMaxCastGroups per launch. The table travels as a __grid_constant__
// kernel parameter (no upload; 8.7 KB for 128 groups, within CUDA 12.1+'s 32 KB).
template <int kOut, int kMax>
struct CastGroups {
  const void* in[kMax];
  int64_t rows[kMax], rows_p[kMax];
  CastOut o[kMax][kOut];
  int32_t first_tile_row[kMax + 1];
  int count;
};
constexpr int kMaxCastGroups = 128;

// Producers hand the cast kernel its values: bind(in) sets the input of the group whose tiles
// follow, load(k, offset, inside) issues the loads for row k (of the thread's 4) at element
// offset `offset` of that input (8 consecutive columns; zeros when not inside), values(k, v)
// turns them into kOut sets of 8 floats to cast. Zero inputs give zero values, so the padding
// comes out as zeros.
template <class T>
struct CastInput {  // plain cast: the values of x
  static constexpr int kOut = 1;
  const T* x;
  Raw8<T> raw[4];
  __device__ __forceinline__ void bind(const void* in) { x = static_cast<const T*>(in); }
  __device__ __forceinline__ void load(int k, int64_t off, bool inside) {
    raw[k] = inside ? load_raw8<T>(x + off) : Raw8<T>{};
  }
  __device__ __forceinline__ void values(int k, float (&v)[1][8]) const {
    unpack8<T>(raw[k], v[0]);
  }
};

// swiglu(gate, up) exactly as the swiglu op computes it (silu rounded to T, the product rounded
// to T), so the fused cast is bit-identical to swiglu followed by a cast.
template <class T>
struct CastSwiglu {
  static constexpr int kOut = 1;
  const T *gate, *up;
  Raw8<T> g[4], u[4];
  __device__ __forceinline__ void bind(const void*) {}
  __device__ __forceinline__ void load(int k, int64_t off, bool inside) {
    g[k] = inside ? load_raw8<T>(gate + off) : Raw8<T>{};
    u[k] = inside ? load_raw8<T>(up + off) : Raw8<T>{};
  }
  __device__ __forceinline__ void values(int k, float (&v)[1][8]) const {
    float gv[8], uv[8];
    unpack8<T>(g[k], gv);
    unpack8<T>(u[k], uv);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[0][i] = accel::cuda::rnd<T>(accel::cuda::rnd<T>(accel::cuda::silu_for<T>(gv[i])) * uv[i]);
  }
};

// The two gradients of swiglu for an upstream gradient, as the swiglu op's backward computes them
// (each rounded to T): values 0 = d gate, 1 = d up.
template <class T>
struct CastSwigluGrad {
  static constexpr int kOut = 2;
  const T *grad, *gate, *up;
  Raw8<T> d[4], g[4], u[4];
  __device__ __forceinline__ void bind(const void*) {}
  __device__ __forceinline__ void load(int k, int64_t off, bool inside) {
    d[k] = inside ? load_raw8<T>(grad + off) : Raw8<T>{};
    g[k] = inside ? load_raw8<T>(gate + off) : Raw8<T>{};
    u[k] = inside ? load_raw8<T>(up + off) : Raw8<T>{};
  }
  __device__ __forceinline__ void values(int k, float (&v)[2][8]) const {
    float dv[8], gv[8], uv[8];
    unpack8<T>(d[k], dv);
    unpack8<T>(g[k], gv);
    unpack8<T>(u[k], uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float sg = accel::cuda::sigmoid_for<T>(gv[i]);
      v[0][i] = accel::cuda::rnd<T>(dv[i] * uv[i] * sg * (1.0f + gv[i] * (1.0f - sg)));
      v[1][i] = accel::cuda::rnd<T>(dv[i] * gv[i] * sg);
    }
  }
};

// Fused cast + amax + transpose over 128 x 64 tiles of one or more groups (CastGroups), a
// grid-stride loop over all groups' tiles with a grid of one wave (so that a few hundred blocks,
// not one per tile, contend for the amax atomics); the next tile's loads are issued before the
// current tile's transposed write. A block keeps the amax of the group in hand in registers and
// adds it to the group's amax when it moves on to another group (the group is the same for all
// threads of the block, so the reduction's barriers are safe); the block that casts a group's
// first tile writes its scale_inv (and, dynamic, its scale). The values come from a producer
// (above), one or two outputs per element. Requires C % 8 == 0, Cp % 8 == 0 and every
// rows_p % 16 == 0 (checked by the launcher); rows/cols beyond a group's R/C inside its padded
// outputs get 0.
//
// data_t goes through shared memory as 32-bit words, one row of `tile` per column of the tile: the
// word of rows 16q + 4k .. 16q + 4k + 3 of column col sits at tile[col][4 (q ^ (col / 8)) + k].
// The swizzle of the 16-byte chunks makes both the 32-bit stores (a warp: 8 threads' columns x 4
// row groups) and the 16-byte loads (8 lanes: the 8 chunks of one column) free of bank
// conflicts. Each 8 lanes then write one 128-byte run of a data_t row.
template <class P, bool kE5M2, int kMax>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(P p, int64_t C, int64_t Cp,
                          const __grid_constant__ CastGroups<P::kOut, kMax> gs,
                          const Fp8GroupScaling sc) {
  constexpr int kOut = P::kOut;
  __shared__ __align__(16) uint32_t tile[kOut][kTileCols][kTileRows / 4];
  __shared__ float red[32];
  const int64_t tiles_x = (Cp + kTileCols - 1) / kTileCols;
  const int64_t tiles_y = gs.first_tile_row[gs.count];
  const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
  auto group_of = [&](int64_t y) {
    return kMax == 1 ? 0
                     : accel::cuda::chunk_owner(gs.first_tile_row, gs.count, static_cast<int>(y));
  };
  // Loads tile row y (of group g) at columns c0..c0+63.
  auto load_tile = [&](int g, int64_t y, int64_t c0) {
    const int64_t R = gs.rows[g];
    const int64_t r = (y - gs.first_tile_row[g]) * kTileRows + 4 * ty, c = c0 + 8 * tx;
#pragma unroll
    for (int k = 0; k < 4; ++k)  // C % 8 == 0: all 8 columns or none are inside
      p.load(k, (r + k) * C + c, r + k < R && c < C);
  };
  float s[kOut], m[kOut];
  auto enter = [&](int g) {  // group g's scales, a fresh amax
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      const CastOut& out = gs.o[g][o];
      s[o] = sc.from_amax ? fp8_scale_for_amax(*out.amax, sc.fp8_max, sc.margin, 1.0f) : *out.scale;
      m[o] = 0.0f;
    }
  };
  auto leave = [&](int g) {  // group g's amax (delayed scaling records it)
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      float* amax = gs.o[g][o].amax;
      if (amax && !sc.from_amax) {
        const float bm = block_max(m[o], red);
        if (threadIdx.x == 0 && bm > __ldcg(amax)) atomic_max_nonneg(amax, bm);
      }
    }
  };
  // This block's tiles are blockIdx.x + i * gridDim.x in row-major order, walked as (tile row,
  // tile column) without a division per tile.
  const int64_t step_y = gridDim.x / tiles_x, step_x = gridDim.x % tiles_x;
  int64_t tile_y = blockIdx.x / tiles_x, tile_x = blockIdx.x % tiles_x;
  int g = -1;                                           // the group of the tile in hand
  int next = tile_y < tiles_y ? group_of(tile_y) : -1;  // the group of the tile loaded next
  if (next >= 0) {
    p.bind(gs.in[next]);
    load_tile(next, tile_y, tile_x * kTileCols);
  }
  while (tile_y < tiles_y) {
    if (next != g) {
      if (g >= 0) leave(g);
      g = next;
      enter(g);
    }
    const int64_t Rp = gs.rows_p[g];
    const int64_t r0 = (tile_y - gs.first_tile_row[g]) * kTileRows, c0 = tile_x * kTileCols;
    const int64_t r = r0 + 4 * ty, c = c0 + 8 * tx;
    bool any_t = false;
    uint32_t w[kOut][2][4];  // [output][column half][row]: bytes = columns 4h..4h+3 of row k
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float v[kOut][8];
      p.values(k, v);
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        uint32_t pair[4];
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          m[o] = fmaxf(m[o], fmaxf(fabsf(v[o][i]), fabsf(v[o][i + 1])));
          pair[i / 2] = cvt2<kE5M2>(v[o][i] * s[o], v[o][i + 1] * s[o]);
        }
        w[o][0][k] = pair[0] | (pair[1] << 16);
        w[o][1][k] = pair[2] | (pair[3] << 16);
      }
    }
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      const CastOut& out = gs.o[g][o];
      if (out.data && c < Cp) {  // Cp % 8 == 0: all 8 columns or none are inside
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (r + k < Rp)
            *reinterpret_cast<uint2*>(out.data + (r + k) * Cp + c) =
                make_uint2(w[o][0][k], w[o][1][k]);
      }
      if (out.data_t) {
        any_t = true;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t cols[4];
          transpose4x4(w[o][h], cols);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            tile[o][8 * tx + 4 * h + j][4 * ((ty / 4) ^ tx) + ty % 4] = cols[j];
        }
      }
      if (r0 == 0 && c0 == 0 && threadIdx.x == 0) {  // the group's first tile
        if (sc.from_amax) *out.scale = s[o];
        if (out.scale_inv) *out.scale_inv = 1.0f / s[o];
      }
    }
    tile_x += step_x;
    tile_y += step_y;
    if (tile_x >= tiles_x) {
      tile_x -= tiles_x;
      ++tile_y;
    }
    next = tile_y < tiles_y ? group_of(tile_y) : -1;
    if (next >= 0) {  // in flight below
      if (next != g) p.bind(gs.in[next]);
      load_tile(next, tile_y, tile_x * kTileCols);
    }
    if (any_t) {  // the same for every thread (one group)
      __syncthreads();
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        uint8_t* data_t = gs.o[g][o].data_t;
        if (!data_t) continue;
#pragma unroll
        for (int q2 = 0; q2 < 2; ++q2) {
          const int i = threadIdx.x + q2 * kThreads, col = i / 8, q = i % 8;
          const int64_t tc = c0 + col, tr = r0 + 16 * q;
          if (tc < Cp && tr < Rp)  // Rp % 16 == 0: the 16 rows are all inside
            *reinterpret_cast<uint4*>(data_t + tc * Rp + tr) =
                *reinterpret_cast<const uint4*>(&tile[o][col][4 * (q ^ (col / 8))]);
        }
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  }
  if (g >= 0) leave(g);
}

// Any shapes and alignments: one thread per padded element, written to data then data_t.
template <class T, bool kE5M2>
__global__ void cast_generic_kernel(const T* __restrict__ x, int64_t R, int64_t C, int64_t Rp,
                                    int64_t Cp, const float* __restrict__ scale_ptr,
                                    uint8_t* __restrict__ data, uint8_t* __restrict__ data_t,
                                    float* __restrict__ amax, float* __restrict__ scale_inv) {
  __shared__ float red[32];
  const float s = *scale_ptr;
  const int64_t n = Rp * Cp;
  float m = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (data) {  // i walks data row-major
      const int64_t r = i / Cp, c = i % Cp;
      float v = r < R && c < C ? to_f(x[r * C + c]) : 0.0f;
      m = fmaxf(m, fabsf(v));
      data[i] = cvt1<kE5M2>(v * s);
    }
    if (data_t) {  // i walks data_t row-major
      const int64_t c = i / Rp, r = i % Rp;
      float v = r < R && c < C ? to_f(x[r * C + c]) : 0.0f;
      if (!data) m = fmaxf(m, fabsf(v));
      data_t[i] = cvt1<kE5M2>(v * s);
    }
  }
  if (amax) {
    m = block_max(m, red);
    if (threadIdx.x == 0 && m > __ldcg(amax)) atomic_max_nonneg(amax, m);
  }
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / s;
}

// max |x| (NaN ignored) into *out. With 16-byte aligned x: each thread keeps 4 loads of 16 bytes
// in flight per iteration. Walks from the end of x towards its start, so that the cast that
// follows the amax pass of dynamic scaling (and starts at the beginning) finds the part read
// last still in L2.
template <class T>
__global__ void __launch_bounds__(256)
    amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ out) {
  __shared__ float red[32];
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t n8 = n / 8;  // vector j covers elements [8 (n8 - 1 - j), +8)
    int64_t j = i;
    for (; j + 3 * stride < n8; j += 4 * stride) {
      Raw8<T> raw[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) raw[u] = load_raw8<T>(x + 8 * (n8 - 1 - (j + u * stride)));
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float v[8];
        unpack8<T>(raw[u], v);
#pragma unroll
        for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
      }
    }
    for (; j < n8; j += stride) {
      float v[8];
      unpack8<T>(load_raw8<T>(x + 8 * (n8 - 1 - j)), v);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
    }
    for (int64_t k = n8 * 8 + i; k < n; k += stride) m = fmaxf(m, fabsf(to_f(x[k])));
  } else {
    for (int64_t k = i; k < n; k += stride) m = fmaxf(m, fabsf(to_f(x[k])));
  }
  m = block_max(m, red);
  if (threadIdx.x == 0 && m > __ldcg(out)) atomic_max_nonneg(out, m);
}

// max |x| of each of a list of tensors (NaN ignored), as amax_kernel gives each (the grouped casts
// of dynamic scaling): every tensor is cut into chunks of kAmaxChunk elements and each block
// reduces one chunk (chunk_owner finds its tensor) into that tensor's out, issuing all its loads
// before the first use. The table travels as a __grid_constant__ kernel parameter.
constexpr int kAmaxThreads = 256;
constexpr int kAmaxLoads = 8;  // 16-byte vectors of 8 elements per thread and chunk
constexpr int64_t kAmaxChunk = int64_t{kAmaxThreads} * kAmaxLoads * 8;
constexpr int kAmaxMax = 128;  // tensors per launch

template <class T>
struct AmaxGroups {
  const T* x[kAmaxMax];
  int64_t n[kAmaxMax];
  float* out[kAmaxMax];
  int32_t first_chunk[kAmaxMax + 1];
  int count;
};

template <class T>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_grouped_kernel(const __grid_constant__ AmaxGroups<T> a) {
  __shared__ float red[32];
  const int chunk = static_cast<int>(blockIdx.x);
  const int t = accel::cuda::chunk_owner(a.first_chunk, a.count, chunk);
  const T* __restrict__ x = a.x[t];
  const int64_t begin = static_cast<int64_t>(chunk - a.first_chunk[t]) * kAmaxChunk;
  const int64_t end = min(a.n[t], begin + kAmaxChunk);
  float m = 0.0f;
  int64_t rest = begin;                            // elements from here on go one at a time
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // then so is x + begin
    rest = begin + (end - begin) / 8 * 8;
    Raw8<T> raw[kAmaxLoads];
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) {
      const int64_t i = begin + (static_cast<int64_t>(u) * kAmaxThreads + threadIdx.x) * 8;
      raw[u] = i < rest ? load_raw8<T>(x + i) : Raw8<T>{};
    }
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) {
      float v[8];
      unpack8<T>(raw[u], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
    }
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += kAmaxThreads) m = fmaxf(m, fabsf(to_f(x[i])));
  m = block_max(m, red);
  if (threadIdx.x == 0 && m > __ldcg(a.out[t])) atomic_max_nonneg(a.out[t], m);
}

__global__ void scale_from_amax_kernel(const float* amax, float* scale, float* scale_inv,
                                       float fp8_max, int margin) {
  const float s = fp8_scale_for_amax(*amax, fp8_max, margin, 1.0f);
  *scale = s;
  *scale_inv = 1.0f / s;
}

__global__ void transpose_bytes_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                                       int64_t R, int64_t C) {
  __shared__ uint8_t t[32][33];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32,
                c0 = static_cast<int64_t>(blockIdx.x) * 32;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < R && c < C) t[k][threadIdx.x] = in[r * C + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < R && c < C) out[c * R + r] = t[threadIdx.x][k];
  }
}

// A block owns kHistSlots adjacent slots (x, coalesced) and all their history rows, which its
// kHistRowThreads row threads (y) shift kHistRowsPerThread rows each per pass: a pass reads rows
// i+1 of its tile into registers, syncs, then writes them to rows i, so no thread overwrites a row
// that another has yet to read. One thread per slot walking all L rows was latency bound (0.38 ms
// for llama-1b's 340 slots at L = 1024).
constexpr int kHistSlots = 32, kHistRowThreads = 32, kHistRowsPerThread = 4;
__global__ void __launch_bounds__(kHistSlots* kHistRowThreads)
    delayed_update_kernel(float* __restrict__ h, float* __restrict__ scale,
                          float* __restrict__ scale_inv, const float* __restrict__ fp8_max,
                          int64_t L, int64_t n, bool use_max, int margin, bool recompute) {
  __shared__ float red[kHistRowThreads][kHistSlots + 1];
  const int64_t j = int64_t(blockIdx.x) * kHistSlots + threadIdx.x;
  const bool slot = j < n;
  const int y = threadIdx.y;
  float m = 0.0f;  // max of the usable amaxes of rows 1..L-1 this thread saw
  auto see = [&](float v) {
    if (use_max && fp8_amax_usable(v)) m = fmaxf(m, v);
  };
  if (slot && y == 0 && L > 1) see(h[n + j]);  // row 1, the oldest: counts before it drops out
  constexpr int kTile = kHistRowThreads * kHistRowsPerThread;
  for (int64_t i0 = 1; i0 + 1 < L; i0 += kTile) {  // rows i0.. take rows i0+1..
    float v[kHistRowsPerThread];
#pragma unroll
    for (int k = 0; k < kHistRowsPerThread; ++k) {
      const int64_t i = i0 + y + int64_t(kHistRowThreads) * k;
      v[k] = slot && i + 1 < L ? h[(i + 1) * n + j] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kHistRowsPerThread; ++k) {
      const int64_t i = i0 + y + int64_t(kHistRowThreads) * k;
      if (slot && i + 1 < L) {
        h[i * n + j] = v[k];
        see(v[k]);
      }
    }
    __syncthreads();
  }
  red[y][threadIdx.x] = m;
  __syncthreads();
  if (!slot || y != 0) return;
  const float newest = h[j];
  float a = fp8_amax_usable(newest) ? newest : 0.0f;
  for (int r = 0; r < kHistRowThreads; ++r) a = fmaxf(a, red[r][threadIdx.x]);
  if (L > 1) h[(L - 1) * n + j] = newest;
  h[j] = 0.0f;
  if (recompute) {
    const float old = scale[j];
    const float s = fp8_scale_for_amax(a, fp8_max[j], margin, old);
    if (s != old) {
      scale[j] = s;
      scale_inv[j] = 1.0f / s;
    }
  }
}

// One thread per block of 32 elements along block_dim.
template <class T, bool kE5M2>
__global__ void mx_fake_quant_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t R,
                                     int64_t C, int block_dim) {
  const int64_t outer = block_dim == 1 ? R : C, inner = block_dim == 1 ? C : R;
  const int64_t nblocks = (inner + 31) / 32;
  const int64_t total = outer * nblocks;
  const float fmax = kE5M2 ? kE5M2Max : kE4M3Max;
  const detail::SmallFloat fmt = kE5M2 ? detail::kE5M2 : detail::kE4M3;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Columnwise: adjacent threads take adjacent columns of the same block row (coalesced).
    const int64_t o = block_dim == 1 ? t / nblocks : t % outer;
    const int64_t b = block_dim == 1 ? t % nblocks : t / outer;
    const int64_t i0 = b * 32, i1 = i0 + 32 < inner ? i0 + 32 : inner;
    auto at = [&](int64_t i) { return block_dim == 1 ? o * C + i : i * C + o; };
    float m = 0.0f;
    for (int64_t i = i0; i < i1; ++i) m = fmaxf(m, fabsf(to_f(x[at(i)])));
    const int e = fp8_mx_block_exponent(m, fmax);
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_f(x[at(i)]);
      const float back = detail::decode(cvt1<kE5M2>(ldexpf(v, -e)), fmt);
      out[at(i)] = accel::cuda::from_f<T>(ldexpf(back, e));
    }
  }
}

template <class F>
void dispatch_fp8(DType fmt, F&& f) {
  if (fmt == DType::E5M2)
    f(std::true_type{});
  else
    f(std::false_type{});
}

float* fptr(const Tensor& t) { return t.defined() ? static_cast<float*>(t.data_ptr()) : nullptr; }
uint8_t* bptr(const Tensor& t) {
  return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}
bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Blocks of `threads` that fit on one SM at once (for grids of exactly one wave).
template <class K>
int resident_blocks(K kernel, int threads) {
  int n = 0;
  ACCEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::max(1, n);
}

CastOut cast_out(const Fp8CastTarget& t) {
  return {fptr(t.scale), bptr(t.data), bptr(t.data_t), fptr(t.amax), fptr(t.scale_inv)};
}

// The fast layout of cast_transpose_kernel for inputs of C columns and targets padded to
// [Rp, Cp]: C, Cp multiples of 8, Rp of 16, 16-byte aligned inputs and data_t, 8-byte data.
bool tile_layout(int64_t C, int64_t Rp, int64_t Cp, const std::vector<const void*>& inputs,
                 size_t input_align, const std::vector<const Fp8CastTarget*>& targets) {
  bool ok = Rp > 0 && Cp > 0 && C % 8 == 0 && Cp % 8 == 0 && Rp % 16 == 0;
  for (const void* p : inputs) ok = ok && aligned(p, input_align);
  for (const Fp8CastTarget* t : targets)
    ok = ok && (!t->data.defined() || aligned(t->data.data_ptr(), 8)) &&
         (!t->data_t.defined() || aligned(t->data_t.data_ptr(), 16));
  return ok;
}

int64_t padded_rows(const Fp8CastTarget& t) {
  return t.data.defined() ? t.data.size(0) : t.data_t.size(1);
}
int64_t padded_cols(const Fp8CastTarget& t) {
  return t.data.defined() ? t.data.size(1) : t.data_t.size(0);
}
DType target_format(const Fp8CastTarget& t) {
  return t.data.defined() ? t.data.dtype() : t.data_t.dtype();
}

// One wave of cast_transpose_kernel blocks over the tiles of every group of `gs`.
template <class P, bool kE5M2, int kMax>
void launch_tiles(const P& producer, int64_t C, int64_t Cp, const CastGroups<P::kOut, kMax>& gs,
                  const Fp8GroupScaling& scaling, cudaStream_t stream) {
  auto kernel = cast_transpose_kernel<P, kE5M2, kMax>;
  static const int per_sm = resident_blocks(kernel, kThreads);
  const int64_t tiles = ((Cp + kTileCols - 1) / kTileCols) * gs.first_tile_row[gs.count];
  kernel<<<grid_for(tiles * kThreads, kThreads, per_sm), kThreads, 0, stream>>>(producer, C, Cp, gs,
                                                                                scaling);
}

// The one group of a single-tensor cast: R rows padded to Rp, read by the producer itself.
template <int kOut>
CastGroups<kOut, 1> one_group(int64_t R, int64_t Rp, const std::array<CastOut, kOut>& outs) {
  CastGroups<kOut, 1> gs{};
  gs.rows[0] = R;
  gs.rows_p[0] = Rp;
  for (int o = 0; o < kOut; ++o) gs.o[0][o] = outs[o];
  gs.first_tile_row[1] = static_cast<int32_t>((Rp + kTileRows - 1) / kTileRows);
  gs.count = 1;
  return gs;
}

}  // namespace

bool CudaBackend::fp8_fused_cast_layout(const std::vector<const Tensor*>& inputs, int64_t cols) {
  bool ok = cols % 8 == 0;
  for (const Tensor* t : inputs)
    ok = ok && t->is_contiguous() && t->device().is_cuda() && aligned(t->data_ptr(), 16);
  return ok;
}

void CudaBackend::fp8_cast(const Tensor& x, const Tensor& scale, const Tensor& data,
                           const Tensor& data_t, const Tensor& amax, const Tensor& scale_inv) {
  OpScope scope(x);
  const Fp8CastTarget target{scale, data, data_t, amax, scale_inv};
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t Rp = padded_rows(target), Cp = padded_cols(target);
  const bool fast =
      tile_layout(C, Rp, Cp, {x.data_ptr()}, x.dtype() == DType::F32 ? 32 : 16, {&target});
  accel::cuda::dispatch_float(x.dtype(), "fp8_cast", [&](auto tag) {
    using T = decltype(tag);
    dispatch_fp8(target_format(target), [&](auto e5m2) {
      constexpr bool kE5M2 = decltype(e5m2)::value;
      const T* xp = static_cast<const T*>(x.data_ptr());
      if (fast) {
        CastInput<T> producer{xp, {}};
        CastGroups<1, 1> gs = one_group<1>(R, Rp, {cast_out(target)});
        gs.in[0] = xp;
        launch_tiles<CastInput<T>, kE5M2>(producer, C, Cp, gs, Fp8GroupScaling{}, scope.stream);
      } else {
        // (Also for empty tensors: one block still records amax 0 and scale_inv.)
        const int blocks = std::max(1, grid_for(Rp * Cp, 256));
        cast_generic_kernel<T, kE5M2><<<blocks, 256, 0, scope.stream>>>(
            xp, R, C, Rp, Cp, fptr(scale), bptr(data), bptr(data_t), fptr(amax), fptr(scale_inv));
      }
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_cast");
}

void CudaBackend::fp8_swiglu_cast(const Tensor& gate, const Tensor& up, const Fp8CastTarget& out) {
  OpScope scope(gate);
  const int64_t R = gate.size(0), C = gate.size(1);
  const int64_t Rp = padded_rows(out), Cp = padded_cols(out);
  if (!tile_layout(C, Rp, Cp, {gate.data_ptr(), up.data_ptr()}, 16, {&out}) ||
      gate.dtype() == DType::F32)
    throw std::logic_error(
        "[fp8_swiglu_cast] layout outside the fused kernel's (see fp8_fused_cast_layout)");
  accel::cuda::dispatch_float(gate.dtype(), "fp8_swiglu_cast", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      dispatch_fp8(target_format(out), [&](auto e5m2) {
        CastSwiglu<T> producer{
            static_cast<const T*>(gate.data_ptr()), static_cast<const T*>(up.data_ptr()), {}, {}};
        launch_tiles<CastSwiglu<T>, decltype(e5m2)::value>(
            producer, C, Cp, one_group<1>(R, Rp, {cast_out(out)}), Fp8GroupScaling{}, scope.stream);
      });
    }
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_swiglu_cast");
}

void CudaBackend::fp8_swiglu_backward_cast(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                           const Fp8CastTarget& to_gate,
                                           const Fp8CastTarget& to_up) {
  OpScope scope(gate);
  const int64_t R = gate.size(0), C = gate.size(1);
  const int64_t Rp = padded_rows(to_gate), Cp = padded_cols(to_gate);
  if (!tile_layout(C, Rp, Cp, {grad.data_ptr(), gate.data_ptr(), up.data_ptr()}, 16,
                   {&to_gate, &to_up}) ||
      padded_rows(to_up) != Rp || padded_cols(to_up) != Cp ||
      target_format(to_up) != target_format(to_gate) || gate.dtype() == DType::F32)
    throw std::logic_error(
        "[fp8_swiglu_backward_cast] layout outside the fused kernel's (see fp8_fused_cast_layout)");
  accel::cuda::dispatch_float(gate.dtype(), "fp8_swiglu_backward_cast", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      dispatch_fp8(target_format(to_gate), [&](auto e5m2) {
        CastSwigluGrad<T> producer{static_cast<const T*>(grad.data_ptr()),
                                   static_cast<const T*>(gate.data_ptr()),
                                   static_cast<const T*>(up.data_ptr()),
                                   {},
                                   {},
                                   {}};
        launch_tiles<CastSwigluGrad<T>, decltype(e5m2)::value>(
            producer, C, Cp, one_group<2>(R, Rp, {cast_out(to_gate), cast_out(to_up)}),
            Fp8GroupScaling{}, scope.stream);
      });
    }
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_swiglu_backward_cast");
}

void CudaBackend::fp8_amax(const Tensor& x, const Tensor& out) {
  OpScope scope(x);
  const int64_t n = x.numel();
  if (n == 0) return;
  accel::cuda::dispatch_float(x.dtype(), "fp8_amax", [&](auto tag) {
    using T = decltype(tag);
    amax_kernel<T><<<grid_for((n + 31) / 32, 256, 8), 256, 0, scope.stream>>>(
        static_cast<const T*>(x.data_ptr()), n, fptr(out));
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_amax");
}

// All groups in one launch (kMaxCastGroups at a time) when they share the tile layout; else one
// by one through fp8_cast (the generic kernel for shapes the tiles do not take).
void CudaBackend::fp8_cast_grouped(const std::vector<Fp8CastGroup>& groups,
                                   const Fp8GroupScaling& scaling) {
  if (groups.empty()) return;
  const Tensor& x0 = groups[0].x;
  const int64_t C = x0.size(1), Cp = padded_cols(groups[0].out);
  const DType fmt = target_format(groups[0].out);
  bool fast = true;
  for (const Fp8CastGroup& g : groups)
    fast = fast && g.x.dtype() == x0.dtype() && g.x.size(1) == C && g.x.size(0) > 0 &&
           padded_cols(g.out) == Cp && target_format(g.out) == fmt &&
           tile_layout(C, padded_rows(g.out), Cp, {g.x.data_ptr()},
                       x0.dtype() == DType::F32 ? 32 : 16, {&g.out});
  if (!fast) {
    fp8_casts_one_by_one(*this, groups, scaling);
    return;
  }
  OpScope scope(x0);
  accel::cuda::dispatch_float(x0.dtype(), "fp8_cast_grouped", [&](auto tag) {
    using T = decltype(tag);
    dispatch_fp8(fmt, [&](auto e5m2) {
      for (size_t start = 0; start < groups.size(); start += kMaxCastGroups) {
        CastGroups<1, kMaxCastGroups> gs{};
        int64_t tile_rows = 0;
        for (size_t i = start; i < groups.size() && gs.count < kMaxCastGroups; ++i, ++gs.count) {
          const Fp8CastGroup& g = groups[i];
          const int64_t Rp = padded_rows(g.out);
          gs.in[gs.count] = g.x.data_ptr();
          gs.rows[gs.count] = g.x.size(0);
          gs.rows_p[gs.count] = Rp;
          gs.o[gs.count][0] = cast_out(g.out);
          gs.first_tile_row[gs.count] = static_cast<int32_t>(tile_rows);
          tile_rows += (Rp + kTileRows - 1) / kTileRows;
        }
        accel::cuda::require(tile_rows < (int64_t{1} << 31), "fp8_cast_grouped",
                             "too many tile rows for one launch");
        gs.first_tile_row[gs.count] = static_cast<int32_t>(tile_rows);
        launch_tiles<CastInput<T>, decltype(e5m2)::value>(CastInput<T>{nullptr, {}}, C, Cp, gs,
                                                          scaling, scope.stream);
      }
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_cast_grouped");
}

void CudaBackend::fp8_amax_grouped(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) {
  if (xs.empty()) return;
  bool one_dtype = true;
  for (const Tensor& x : xs) one_dtype = one_dtype && x.dtype() == xs[0].dtype();
  if (!one_dtype) {
    fp8_amaxes_one_by_one(*this, xs, outs);
    return;
  }
  OpScope scope(xs[0]);
  accel::cuda::dispatch_float(xs[0].dtype(), "fp8_amax_grouped", [&](auto tag) {
    using T = decltype(tag);
    for (size_t start = 0; start < xs.size(); start += kAmaxMax) {
      AmaxGroups<T> a{};
      int64_t chunks = 0;
      for (size_t i = start; i < xs.size() && a.count < kAmaxMax; ++i, ++a.count) {
        a.x[a.count] = static_cast<const T*>(xs[i].data_ptr());
        a.n[a.count] = xs[i].numel();
        a.out[a.count] = fptr(outs[i]);
        a.first_chunk[a.count] = static_cast<int32_t>(chunks);
        chunks += (xs[i].numel() + kAmaxChunk - 1) / kAmaxChunk;
      }
      a.first_chunk[a.count] = static_cast<int32_t>(chunks);
      if (chunks == 0) continue;
      accel::cuda::require(chunks < (int64_t{1} << 31), "fp8_amax_grouped",
                           "too many chunks for one launch");
      amax_grouped_kernel<T><<<static_cast<unsigned>(chunks), kAmaxThreads, 0, scope.stream>>>(a);
    }
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_amax_grouped");
}

void CudaBackend::fp8_scale_from_amax(const Tensor& amax, const Tensor& scale,
                                      const Tensor& scale_inv, float fp8_max, int margin) {
  OpScope scope(amax);
  scale_from_amax_kernel<<<1, 1, 0, scope.stream>>>(fptr(amax), fptr(scale), fptr(scale_inv),
                                                    fp8_max, margin);
  ACCEL_CUDA_CHECK_LAUNCH("fp8_scale_from_amax");
}

void CudaBackend::fp8_transpose(const Tensor& data_t, const Tensor& data) {
  OpScope scope(data);
  const int64_t R = data.size(0), C = data.size(1);
  if (R == 0 || C == 0) return;
  dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>((R + 31) / 32));
  transpose_bytes_kernel<<<grid, dim3(32, 8), 0, scope.stream>>>(bptr(data), bptr(data_t), R, C);
  ACCEL_CUDA_CHECK_LAUNCH("fp8_transpose");
}

void CudaBackend::fp8_delayed_update(const Tensor& history, const Tensor& scale,
                                     const Tensor& scale_inv, const Tensor& fp8_max, bool use_max,
                                     int margin, bool recompute) {
  OpScope scope(history);
  const int64_t L = history.size(0), n = history.size(1);
  if (n == 0) return;
  delayed_update_kernel<<<static_cast<unsigned>((n + kHistSlots - 1) / kHistSlots),
                          dim3(kHistSlots, kHistRowThreads), 0, scope.stream>>>(
      fptr(history), fptr(scale), fptr(scale_inv), fptr(fp8_max), L, n, use_max, margin, recompute);
  ACCEL_CUDA_CHECK_LAUNCH("fp8_delayed_update");
}

void CudaBackend::fp8_mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim) {
  OpScope scope(x);
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t blocks = (block_dim == 1 ? R * ((C + 31) / 32) : C * ((R + 31) / 32));
  if (blocks == 0) return;
  accel::cuda::dispatch_float(x.dtype(), "fp8_mx_fake_quant", [&](auto tag) {
    using T = decltype(tag);
    dispatch_fp8(fmt, [&](auto e5m2) {
      mx_fake_quant_kernel<T, decltype(e5m2)::value>
          <<<grid_for(blocks, 256), 256, 0, scope.stream>>>(static_cast<const T*>(x.data_ptr()),
                                                            static_cast<T*>(out.data_ptr()), R, C,
                                                            block_dim);
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("fp8_mx_fake_quant");
}

}  // namespace accel
