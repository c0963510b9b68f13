// Tensor-core flash attention for bf16/f16, head dim 64 or 128 (mma.sync m16n8k16 with fp32
// accumulation, ldmatrix from XOR-swizzled shared memory, cp.async double buffering).
// Forward: a block of 4 warps owns 64 query rows (16 per warp) and walks 64-key tiles of K and V
// with an online softmax in the exp2 domain; the output and the natural-log lse are written once.
// Backward: two implementations (attention_backward_impl picks one, see attention.cuh): the
// FlashAttention-2-style single kernel with an fp32 dQ accumulator (default) and the older split
// pair of kernels without atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/common.cuh"

namespace accel::cuda {
namespace {

template <class T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16-byte async copy; zero-fills when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Element offset of 16-byte chunk `ch` of row `r` in a [rows][D] tile, XOR-swizzled so that the
// 8 rows read by one ldmatrix phase hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int r, int ch) {
  return r * D + ((ch ^ (r & 7)) << 3);
}

template <class T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row0, int64_t rows_total,
                                          int64_t row_stride) {
  constexpr int CH = D / 8;
  for (int c = threadIdx.x; c < ROWS * CH; c += blockDim.x) {
    const int r = c / CH, ch = c - r * CH;
    const int64_t row = row0 + r;
    const bool ok = row < rows_total;
    cp_async16(dst + swz<D>(r, ch), src + (ok ? row : 0) * row_stride + ch * 8, ok);
  }
}

constexpr int kBc = 64, kWarps = 4;
// Backward m16 tiles per warp for head dim 64 (see launch_bwd).
constexpr int kDefaultDqMt = 1, kDefaultDkvMt = 1;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// m16 tiles per warp: two for head dim 64 (each K/V fragment loaded from shared memory feeds two
// MMAs, halving ldmatrix traffic, which bounds the one-tile version), one for 128 (registers).
template <int D>
constexpr int mtiles() {
  return D <= 64 ? 2 : 1;
}

// The masks seen from the MT m16 tiles of rows of one warp (rows first .. first + 16 MT - 1; row r
// is held by the lanes with g = r % 8): for query rows the keys each sees, for key rows (the
// backward's dK/dV) the queries that see each. Per thread the ranges of its rows; per warp those
// of its first and last valid row, which bound every tile test (ranges never move backwards
// from one row to the next).
template <int MT>
struct WarpRanges {
  int lo[MT][2], hi[MT][2];  // this thread's rows; rows past the end see nothing
  int64_t first_lo, first_hi, last_lo, last_hi;
  bool none;  // no valid row in this warp
  // No row of the warp sees columns [c0, c0 + n).
  __device__ bool skip(int64_t c0, int n) const {
    return none || c0 + n <= first_lo || c0 >= last_hi;
  }
  // Every row of the warp (all 16 MT of them valid) sees all of columns [c0, c0 + n).
  __device__ bool all_seen(int64_t c0, int n) const {
    return full && last_lo <= c0 && c0 + n <= first_hi;
  }
  __device__ bool sees(int mt, int hf, int64_t c) const {
    return c >= lo[mt][hf] && c < hi[mt][hf];
  }
  bool full;  // every row of the warp is valid
};

// Query rows: rows i of [0, sq), columns keys.
template <int MT>
__device__ __forceinline__ WarpRanges<MT> warp_keys(const AttnParams& p, int64_t b, int64_t first,
                                                    int g) {
  WarpRanges<MT> w;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t i = first + mt * 16 + g + hf * 8;
      const bool ok = i < p.sq;
      w.lo[mt][hf] = ok ? static_cast<int>(attn_keys_lo(p, b, i)) : 0;
      w.hi[mt][hf] = ok ? static_cast<int>(attn_keys_hi(p, i)) : 0;
    }
  w.none = first >= p.sq;
  w.full = first + 16 * MT <= p.sq;
  const int64_t last = (first + 16 * MT < p.sq ? first + 16 * MT : p.sq) - 1;
  w.first_lo = w.none ? 0 : attn_keys_lo(p, b, first);
  w.first_hi = w.none ? 0 : attn_keys_hi(p, first);
  w.last_lo = w.none ? 0 : attn_keys_lo(p, b, last);
  w.last_hi = w.none ? 0 : attn_keys_hi(p, last);
  return w;
}

// Key rows: rows j of [0, sk), columns queries.
template <int MT>
__device__ __forceinline__ WarpRanges<MT> warp_queries(const AttnParams& p, int64_t b,
                                                       int64_t first, int g) {
  WarpRanges<MT> w;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t j = first + mt * 16 + g + hf * 8;
      const bool ok = j < p.sk;
      w.lo[mt][hf] = ok ? static_cast<int>(attn_queries_lo(p, j)) : 0;
      w.hi[mt][hf] = ok ? static_cast<int>(attn_queries_hi(p, b, j)) : 0;
    }
  w.none = first >= p.sk;
  w.full = first + 16 * MT <= p.sk;
  const int64_t last = (first + 16 * MT < p.sk ? first + 16 * MT : p.sk) - 1;
  w.first_lo = w.none ? 0 : attn_queries_lo(p, first);
  w.first_hi = w.none ? 0 : attn_queries_hi(p, b, first);
  w.last_lo = w.none ? 0 : attn_queries_lo(p, last);
  w.last_hi = w.none ? 0 : attn_queries_hi(p, b, last);
  return w;
}

template <class T, int D, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    attn_fwd_mma(AttnParams p, T* __restrict__ out, float* __restrict__ lse,
                 const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v) {
  constexpr int BR = 16 * kWarps * MT;  // query rows per block
  constexpr int KD = D / 16;            // k-steps over the head dim
  constexpr int NB = kBc / 8;           // 8-key blocks per tile
  constexpr int ND = D / 8;             // 8-dim blocks of the output
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kv = qs + BR * D;  // [2 buffers][K tile, V tile]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t qblk = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // long rows first
  const int64_t i0 = qblk * BR;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const T* qg = q + (b * p.sq * p.hq + h) * D;
  const T* kg = k + (b * p.sk * p.hkv + hk) * D;
  const T* vg = v + (b * p.sk * p.hkv + hk) * D;
  const int64_t last_row = (i0 + BR < p.sq ? i0 + BR : p.sq) - 1;
  // The key tiles this block's rows see.
  const int tile0 = static_cast<int>(attn_keys_lo(p, b, i0) / kBc);
  const int n_tiles = static_cast<int>((attn_keys_hi(p, last_row) + kBc - 1) / kBc) - tile0;

  load_tile<T, D, BR>(qs, qg, i0, p.sq, q_stride);
  if (n_tiles > 0) {
    load_tile<T, D, kBc>(kv, kg, int64_t(tile0) * kBc, p.sk, kv_stride);
    load_tile<T, D, kBc>(kv + kBc * D, vg, int64_t(tile0) * kBc, p.sk, kv_stride);
  }
  cp_async_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int wr0 = warp * 16 * MT;   // first row of this warp inside the block
  const int64_t wfirst = i0 + wr0;  // ... and in the sequence
  const WarpRanges<MT> wk = warp_keys<MT>(p, b, wfirst, g);
  const float scale2 = p.scale * kLog2e;
  float o[MT][ND][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < ND; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  uint32_t qf[MT][KD][4];

  for (int t = 0; t < n_tiles; ++t) {
    T* ks = kv + (t & 1) * 2 * kBc * D;
    T* vs = ks + kBc * D;
    if (t + 1 < n_tiles) {
      T* nk = kv + ((t + 1) & 1) * 2 * kBc * D;
      load_tile<T, D, kBc>(nk, kg, int64_t(tile0 + t + 1) * kBc, p.sk, kv_stride);
      load_tile<T, D, kBc>(nk + kBc * D, vg, int64_t(tile0 + t + 1) * kBc, p.sk, kv_stride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          ldsm_x4(qf[mt][kk], qs + swz<D>(wr0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }
    const int64_t j0 = int64_t(tile0 + t) * kBc;
    // A tile that no row of this warp sees adds nothing.
    if (!wk.skip(j0, kBc)) {
      // S = Q K^T for this warp's rows x 64 keys.
      float s[MT][NB][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NB; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
      for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
          uint32_t bf[4];
          ldsm_x4(bf, ks + swz<D>(nb2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                  kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(s[mt][2 * nb2], qf[mt][kk], bf);
            Mma<T>::run(s[mt][2 * nb2 + 1], qf[mt][kk], bf + 2);
          }
        }
      }
      if (!wk.all_seen(j0, kBc)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int64_t j = j0 + nb * 8 + tq * 2 + (e & 1);
              if (!wk.sees(mt, e >> 1, j)) s[mt][nb][e] = -INFINITY;
            }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // Online softmax in the exp2 domain; the running max is kept pre-scaled.
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          mx_a = fmaxf(mx_a, fmaxf(s[mt][nb][0], s[mt][nb][1]));
          mx_b = fmaxf(mx_b, fmaxf(s[mt][nb][2], s[mt][nb][3]));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
          mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
          mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        const float mn_a = fmaxf(m[mt][0], mx_a * scale2), mn_b = fmaxf(m[mt][1], mx_b * scale2);
        const float use_a = mn_a == -INFINITY ? 0.f : mn_a;
        const float use_b = mn_b == -INFINITY ? 0.f : mn_b;
        const float al_a = exp2f(m[mt][0] - use_a), al_b = exp2f(m[mt][1] - use_b);
        m[mt][0] = mn_a;
        m[mt][1] = mn_b;
        float ls_a = 0.f, ls_b = 0.f;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          s[mt][nb][0] = exp2f(fmaf(s[mt][nb][0], scale2, -use_a));
          s[mt][nb][1] = exp2f(fmaf(s[mt][nb][1], scale2, -use_a));
          s[mt][nb][2] = exp2f(fmaf(s[mt][nb][2], scale2, -use_b));
          s[mt][nb][3] = exp2f(fmaf(s[mt][nb][3], scale2, -use_b));
          ls_a += s[mt][nb][0] + s[mt][nb][1];
          ls_b += s[mt][nb][2] + s[mt][nb][3];
        }
        l[mt][0] = l[mt][0] * al_a + ls_a;
        l[mt][1] = l[mt][1] * al_b + ls_b;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
          o[mt][nd][0] *= al_a;
          o[mt][nd][1] *= al_a;
          o[mt][nd][2] *= al_b;
          o[mt][nd][3] *= al_b;
        }
      }
      // O += P V.
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        uint32_t pf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pf[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pf[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pf[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pf[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nd2 = 0; nd2 < ND / 2; ++nd2) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, vs + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                        nd2 * 2 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(o[mt][2 * nd2], pf[mt], bf);
            Mma<T>::run(o[mt][2 * nd2 + 1], pf[mt], bf + 2);
          }
        }
      }
    }
    __syncthreads();  // the buffer is refilled two tiles later
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lv = l[mt][hf];
      lv += __shfl_xor_sync(0xffffffffu, lv, 1);
      lv += __shfl_xor_sync(0xffffffffu, lv, 2);
      const int64_t row = wfirst + mt * 16 + g + hf * 8;
      if (row >= p.sq) continue;
      const float inv = lv > 0.f ? 1.f / lv : 0.f;
      T* orow = out + ((b * p.sq + row) * p.hq + h) * D;
#pragma unroll
      for (int nd = 0; nd < ND; ++nd)
        *reinterpret_cast<uint32_t*>(orow + nd * 8 + tq * 2) =
            Mma<T>::pack(o[mt][nd][2 * hf] * inv, o[mt][nd][2 * hf + 1] * inv);
      if (tq == 0)
        lse[(b * p.hq + h) * p.sq + row] = lv > 0.f ? (m[mt][hf] + log2f(lv)) * kLn2 : -INFINITY;
    }
  }
}

template <class T, int D>
void launch_fwd(const AttnParams& p, const Tensor& out, const Tensor& lse, const Tensor& q,
                const Tensor& k, const Tensor& v, cudaStream_t stream) {
  constexpr int MT = mtiles<D>();
  constexpr int BR = 16 * kWarps * MT;
  const size_t smem = (BR + 4 * kBc) * D * sizeof(T);
  static bool attr_set = false;  // per instantiation; the limit is per device but the same here
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_fwd_mma<T, D, MT>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    attr_set = true;
  }
  dim3 grid(static_cast<unsigned>((p.sq + BR - 1) / BR), static_cast<unsigned>(p.hq),
            static_cast<unsigned>(p.b));
  attn_fwd_mma<T, D, MT><<<grid, kWarps * 32, smem, stream>>>(
      p, static_cast<T*>(out.data_ptr()), static_cast<float*>(lse.data_ptr()),
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()));
  ACCEL_CUDA_CHECK_LAUNCH("attention (tensor cores)");
}

// ---- backward, split path ----------------------------------------------------------------------
// Two kernels, no atomics: dQ walks key tiles for a block of query rows; dK/dV walks query tiles
// (of every q head of the group) for a block of keys. Both recompute P from the saved lse;
// delta = rowsum(dO * O) is computed beforehand. Each warp owns MT m16 tiles so that every B
// fragment read from shared memory feeds MT MMAs.

// c[MT x 16 rows][NC] = A[rows a_row0.. of a_tile] x B^T where b_tile holds NC rows of D.
template <class T, int D, int MT, int NC>
__device__ __forceinline__ void mm_abt(float (&c)[MT][NC / 8][4], const T* a_tile, int a_row0,
                                       const T* b_tile, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NC / 8; ++i) c[mt][i][0] = c[mt][i][1] = c[mt][i][2] = c[mt][i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldsm_x4(af[mt], a_tile + swz<D>(a_row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
    for (int nb2 = 0; nb2 < NC / 16; ++nb2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_tile + swz<D>(nb2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                  kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma<T>::run(c[mt][2 * nb2], af[mt], bf);
        Mma<T>::run(c[mt][2 * nb2 + 1], af[mt], bf + 2);
      }
    }
  }
}

// acc[MT x 16][D] += P[MT x 16][KR] (accumulator layout) x B where b_tile holds KR rows (k) of D.
template <class T, int D, int MT, int KR>
__device__ __forceinline__ void mm_pb(float (&acc)[MT][D / 8][4], const float (&pm)[MT][KR / 8][4],
                                      const T* b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < KR / 16; ++kk) {
    uint32_t pf[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      pf[mt][0] = Mma<T>::pack(pm[mt][2 * kk][0], pm[mt][2 * kk][1]);
      pf[mt][1] = Mma<T>::pack(pm[mt][2 * kk][2], pm[mt][2 * kk][3]);
      pf[mt][2] = Mma<T>::pack(pm[mt][2 * kk + 1][0], pm[mt][2 * kk + 1][1]);
      pf[mt][3] = Mma<T>::pack(pm[mt][2 * kk + 1][2], pm[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nd2 = 0; nd2 < D / 16; ++nd2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                        nd2 * 2 + (lane >> 4)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma<T>::run(acc[mt][2 * nd2], pf[mt], bf);
        Mma<T>::run(acc[mt][2 * nd2 + 1], pf[mt], bf + 2);
      }
    }
  }
}

template <class T, int D, int MT>
__device__ __forceinline__ void store_rows(T* base, int64_t row0, int64_t rows, int64_t stride,
                                           const float (&acc)[MT][D / 8][4], float scale, int g,
                                           int tq) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t row = row0 + mt * 16 + g + hf * 8;
      if (row >= rows) continue;
      T* r = base + row * stride;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
        *reinterpret_cast<uint32_t*>(r + nd * 8 + tq * 2) =
            Mma<T>::pack(acc[mt][nd][2 * hf] * scale, acc[mt][nd][2 * hf + 1] * scale);
    }
}

template <class T, int D, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dq_mma(AttnParams p, T* __restrict__ dq, const T* __restrict__ q,
                    const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta) {
  constexpr int BR = 16 * kWarps * MT;
  constexpr int NB = kBc / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* dos = qs + BR * D;
  T* kv = dos + BR * D;  // [2][K, V]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t qblk = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t i0 = qblk * BR;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const int64_t q_off = (b * p.sq * p.hq + h) * D;
  const T* kg = k + (b * p.sk * p.hkv + hk) * D;
  const T* vg = v + (b * p.sk * p.hkv + hk) * D;
  const int64_t last_row = (i0 + BR < p.sq ? i0 + BR : p.sq) - 1;
  const int tile0 = static_cast<int>(attn_keys_lo(p, b, i0) / kBc);
  const int n_tiles = static_cast<int>((attn_keys_hi(p, last_row) + kBc - 1) / kBc) - tile0;
  load_tile<T, D, BR>(qs, q + q_off, i0, p.sq, q_stride);
  load_tile<T, D, BR>(dos, dout + q_off, i0, p.sq, q_stride);
  if (n_tiles > 0) {
    load_tile<T, D, kBc>(kv, kg, int64_t(tile0) * kBc, p.sk, kv_stride);
    load_tile<T, D, kBc>(kv + kBc * D, vg, int64_t(tile0) * kBc, p.sk, kv_stride);
  }
  cp_async_commit();
  const int g = lane >> 2, tq = lane & 3;
  const int wr0 = warp * 16 * MT;
  const int64_t wfirst = i0 + wr0;
  const WarpRanges<MT> wk = warp_keys<MT>(p, b, wfirst, g);
  const float* lse_b = lse + (b * p.hq + h) * p.sq;
  const float* delta_b = delta + (b * p.hq + h) * p.sq;
  float lse2[MT][2], del[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t row = wfirst + mt * 16 + g + hf * 8;
      lse2[mt][hf] = row < p.sq ? lse_b[row] * kLog2e : 0.f;
      del[mt][hf] = row < p.sq ? delta_b[row] : 0.f;
    }
  const float scale2 = p.scale * kLog2e;
  float acc[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  for (int t = 0; t < n_tiles; ++t) {
    T* ks = kv + (t & 1) * 2 * kBc * D;
    T* vs = ks + kBc * D;
    if (t + 1 < n_tiles) {
      T* nk = kv + ((t + 1) & 1) * 2 * kBc * D;
      load_tile<T, D, kBc>(nk, kg, int64_t(tile0 + t + 1) * kBc, p.sk, kv_stride);
      load_tile<T, D, kBc>(nk + kBc * D, vg, int64_t(tile0 + t + 1) * kBc, p.sk, kv_stride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int64_t j0 = int64_t(tile0 + t) * kBc;
    if (!wk.skip(j0, kBc)) {
      float s[MT][NB][4], dp[MT][NB][4];
      mm_abt<T, D, MT, kBc>(s, qs, wr0, ks, lane);
      mm_abt<T, D, MT, kBc>(dp, dos, wr0, vs, lane);
      const bool need_mask = !wk.all_seen(j0, kBc);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hf = e >> 1;
            const bool ok = !need_mask || wk.sees(mt, hf, j0 + nb * 8 + tq * 2 + (e & 1));
            const float pr = ok ? exp2f(fmaf(s[mt][nb][e], scale2, -lse2[mt][hf])) : 0.f;
            s[mt][nb][e] = pr * (dp[mt][nb][e] - del[mt][hf]);
          }
      mm_pb<T, D, MT, kBc>(acc, s, ks, lane);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  store_rows<T, D, MT>(dq + q_off, wfirst, p.sq, q_stride, acc, p.scale, g, tq);
}

// The query tiles (BQ rows each) that see some key of the block [j0b, j0b + bk): from the tile
// holding the first query that sees key j0b to the last query that sees the block's last key.
// Shared by both backward paths.
struct QueryTiles {
  int64_t start;  // first query row, a multiple of BQ
  int count;
};
template <int BQ>
__device__ __forceinline__ QueryTiles query_tiles_seeing(const AttnParams& p, int64_t b,
                                                         int64_t j0b, int bk) {
  const int64_t start = attn_queries_lo(p, j0b) / BQ * BQ;
  const int64_t end = attn_queries_hi(p, b, (j0b + bk < p.sk ? j0b + bk : p.sk) - 1);
  return {start, end > start ? static_cast<int>((end - start + BQ - 1) / BQ) : 0};
}

// dK/dV for BK = 16 * kWarps * MT keys per block, over query tiles of BQ rows.
template <class T, int D, int MT, int BQ>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dkv_mma(AttnParams p, T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ q,
                     const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta) {
  constexpr int BK = 16 * kWarps * MT;
  constexpr int NB = BQ / 8;  // query columns per tile / 8
  static_assert(2 * BQ <= kWarps * 32, "one thread per statistic");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);
  T* vs = ks + BK * D;
  T* qd = vs + BK * D;                                       // [2][Q tile, dO tile]
  float* stats = reinterpret_cast<float*>(qd + 4 * BQ * D);  // [2][lse2 BQ, delta BQ]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hk = blockIdx.y;
  const int64_t j0b = int64_t(blockIdx.x) * BK;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const int64_t kv_off = (b * p.sk * p.hkv + hk) * D;
  load_tile<T, D, BK>(ks, k + kv_off, j0b, p.sk, kv_stride);
  load_tile<T, D, BK>(vs, v + kv_off, j0b, p.sk, kv_stride);
  const QueryTiles qt = query_tiles_seeing<BQ>(p, b, j0b, BK);
  const int64_t i_start = qt.start;
  const int n_qt = qt.count;
  const int n_it = n_qt * static_cast<int>(p.group);
  auto issue = [&](int it) {
    const int64_t h = hk * p.group + it / n_qt;
    const int64_t i0 = i_start + int64_t(it % n_qt) * BQ;
    const int64_t q_off = (b * p.sq * p.hq + h) * D;
    T* buf = qd + (it & 1) * 2 * BQ * D;
    load_tile<T, D, BQ>(buf, q + q_off, i0, p.sq, q_stride);
    load_tile<T, D, BQ>(buf + BQ * D, dout + q_off, i0, p.sq, q_stride);
    float* st = stats + (it & 1) * 2 * BQ;
    const int64_t row = i0 + (threadIdx.x & (BQ - 1));
    const int64_t base = (b * p.hq + h) * p.sq;
    if (threadIdx.x < BQ)
      st[threadIdx.x] = row < p.sq ? lse[base + row] * kLog2e : 0.f;
    else if (threadIdx.x < 2 * BQ)
      st[threadIdx.x] = row < p.sq ? delta[base + row] : 0.f;
  };
  if (n_it > 0) issue(0);
  cp_async_commit();
  const int g = lane >> 2, tq = lane & 3;
  const int wr0 = warp * 16 * MT;
  const int64_t kfirst = j0b + wr0;
  const WarpRanges<MT> wq = warp_queries<MT>(p, b, kfirst, g);
  const float scale2 = p.scale * kLog2e;
  float acc_k[MT][D / 8][4], acc_v[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      acc_k[mt][i][0] = acc_k[mt][i][1] = acc_k[mt][i][2] = acc_k[mt][i][3] = acc_v[mt][i][0] =
          acc_v[mt][i][1] = acc_v[mt][i][2] = acc_v[mt][i][3] = 0.f;
  for (int it = 0; it < n_it; ++it) {
    if (it + 1 < n_it) {
      issue(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* qs = qd + (it & 1) * 2 * BQ * D;
    const T* dos = qs + BQ * D;
    const float* lse2 = stats + (it & 1) * 2 * BQ;
    const float* dl = lse2 + BQ;
    const int64_t i0 = i_start + int64_t(it % n_qt) * BQ;
    // No key of this warp seen by any query row of the tile: nothing to add.
    if (!wq.skip(i0, BQ)) {
      float s[MT][NB][4], dp[MT][NB][4];
      mm_abt<T, D, MT, BQ>(s, ks, wr0, qs, lane);    // S^T: keys x queries
      mm_abt<T, D, MT, BQ>(dp, vs, wr0, dos, lane);  // dP^T
      const bool need_mask = !wq.all_seen(i0, BQ);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = nb * 8 + tq * 2 + (e & 1);
            const bool ok = !need_mask || wq.sees(mt, e >> 1, i0 + col);
            const float pr = ok ? exp2f(fmaf(s[mt][nb][e], scale2, -lse2[col])) : 0.f;
            s[mt][nb][e] = pr;
            dp[mt][nb][e] = pr * (dp[mt][nb][e] - dl[col]);
          }
      mm_pb<T, D, MT, BQ>(acc_v, s, dos, lane);
      mm_pb<T, D, MT, BQ>(acc_k, dp, qs, lane);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  store_rows<T, D, MT>(dk + kv_off, kfirst, p.sk, kv_stride, acc_k, p.scale, g, tq);
  store_rows<T, D, MT>(dv + kv_off, kfirst, p.sk, kv_stride, acc_v, 1.0f, g, tq);
}

// ---- backward, FlashAttention-2 style ----------------------------------------------------------
// One kernel: a block owns BK = 16 * kWarps keys of one KV head (one m16 tile of keys per warp)
// and walks the query tiles of `hpc` q heads of its group (causal: only the tiles at or after the
// key block), accumulating dK/dV in registers; with hpc == group it stores them directly, else
// the blocks of one key block add fp32 partial sums (converted afterwards). Per BQ-query tile:
//   S^T = K Q^T, dP^T = V dO^T       (each warp: its 16 keys x BQ queries)
//   P^T = exp2(S^T * scale2 - lse2), dS^T = P^T * (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q       (registers)
//   dS^T -> shared memory; dQ[BQ x D] += dS K (each warp: 16 query rows), added into an fp32
//   accumulator in global memory with vectorized atomics (red.global.add.v4.f32 on sm_90).
// 5 GEMM-equivalents instead of the split path's 7. attn_dq_convert scales the accumulator into dQ.

// acc[16][NC] += A[16][KR] x B[KR][c0 .. c0 + NC) where A^T is stored in a_t ([KR][AW] swizzled,
// this warp's 16 columns starting at chunk a_ch0) and B is b_tile ([KR][D] swizzled).
template <class T, int D, int AW, int NC>
__device__ __forceinline__ void mm_atb(float (&acc)[NC / 8][4], const T* a_t, int a_ch0, int k16,
                                       const T* b_tile, int c0, int lane) {
  uint32_t af[4];
  // .trans: matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) of A
  // are the transposes of 8x8 blocks of a_t at key rows +0/+0/+8/+8 and chunks +0/+1/+0/+1.
  ldsm_x4_trans(
      af, a_t + swz<AW>(k16 * 16 + (lane & 7) + ((lane >> 4) << 3), a_ch0 + ((lane >> 3) & 1)));
#pragma unroll
  for (int nd2 = 0; nd2 < NC / 16; ++nd2) {
    uint32_t bf[4];
    ldsm_x4_trans(bf, b_tile + swz<D>(k16 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                      c0 / 8 + nd2 * 2 + (lane >> 4)));
    Mma<T>::run(acc[2 * nd2], af, bf);
    Mma<T>::run(acc[2 * nd2 + 1], af, bf + 2);
  }
}

// Adds a 16 x NC accumulator (mma layout) into fp32 rows of `base` (row r at base + r * stride,
// columns c0 ..): lanes pair up (tq, tq ^ 1) so each adds four consecutive floats of one row.
template <int NC>
__device__ __forceinline__ void red_rows(float* base, int64_t row0, int64_t rows, int64_t stride,
                                         int c0, const float (&acc)[NC / 8][4], int g, int tq) {
  const bool odd = tq & 1;
  const int64_t row = row0 + g + (odd ? 8 : 0);
  float* r = base + row * stride + c0 + 2 * (tq & ~1);
#pragma unroll
  for (int nd = 0; nd < NC / 8; ++nd) {
    // Even lanes keep row g and take the partner's row-g pair; odd lanes keep row g + 8.
    const float s0 = __shfl_xor_sync(0xffffffffu, odd ? acc[nd][0] : acc[nd][2], 1);
    const float s1 = __shfl_xor_sync(0xffffffffu, odd ? acc[nd][1] : acc[nd][3], 1);
    if (row >= rows) continue;
    const float4 val = odd ? make_float4(s0, s1, acc[nd][2], acc[nd][3])
                           : make_float4(acc[nd][0], acc[nd][1], s0, s1);
    float* dst = r + nd * 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // No-return vector reduction (atomicAdd on float4 may emit the returning atom form).
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(val.x),
                 "f"(val.y), "f"(val.z), "f"(val.w));
#else
    atomicAdd(dst, val.x);
    atomicAdd(dst + 1, val.y);
    atomicAdd(dst + 2, val.z);
    atomicAdd(dst + 3, val.w);
#endif
  }
}

template <class T, int D, int BQ>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_fa2_mma(AttnParams p, int hpc, float* __restrict__ dq_acc, float* __restrict__ dk_acc,
                     float* __restrict__ dv_acc, T* __restrict__ dk, T* __restrict__ dv,
                     const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse,
                     const float* __restrict__ delta) {
  constexpr int MT = 1;
  constexpr int BK = 16 * kWarps;  // keys per block, 16 per warp
  constexpr int NB = BQ / 8;
  constexpr int DC = D <= 64 ? D : 32;  // dQ columns per pass (bounds the accumulator registers)
  static_assert(BQ == 16 * kWarps, "dQ: one m16 tile of query rows per warp");
  static_assert(2 * BQ <= kWarps * 32, "one thread per statistic");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);
  T* vs = ks + BK * D;
  T* qd = vs + BK * D;                                     // [2][Q tile, dO tile]
  T* dss = qd + 4 * BQ * D;                                // dS^T [BK][BQ], swizzled
  float* stats = reinterpret_cast<float*>(dss + BK * BQ);  // [2][lse2 BQ, delta BQ]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // x: (kv head, part of its q heads), fastest, so that all blocks of the low key blocks (the most
  // work under a causal mask) start first; y: batch; z: key block.
  const int n_parts = static_cast<int>(p.group) / hpc;
  const int64_t hk = blockIdx.x / n_parts, h0 = hk * p.group + int64_t(blockIdx.x % n_parts) * hpc;
  const int64_t b = blockIdx.y;
  const int64_t j0b = int64_t(blockIdx.z) * BK;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const int64_t kv_off = (b * p.sk * p.hkv + hk) * D;
  load_tile<T, D, BK>(ks, k + kv_off, j0b, p.sk, kv_stride);
  load_tile<T, D, BK>(vs, v + kv_off, j0b, p.sk, kv_stride);
  const QueryTiles qt = query_tiles_seeing<BQ>(p, b, j0b, BK);
  const int64_t i_start = qt.start;
  const int n_qt = qt.count;
  const int n_it = n_qt * hpc;
  // Starts the copies of Q/dO tile `it` and returns this thread's statistic of it (thread t < BQ:
  // lse of row t, BQ <= t < 2 BQ: delta of row t - BQ), kept in a register until put_stat stores
  // it so that the load's latency hides behind the current tile's work.
  auto issue = [&](int it) -> float {
    const int64_t h = h0 + it / n_qt;
    const int64_t i0 = i_start + int64_t(it % n_qt) * BQ;
    const int64_t q_off = (b * p.sq * p.hq + h) * D;
    T* buf = qd + (it & 1) * 2 * BQ * D;
    load_tile<T, D, BQ>(buf, q + q_off, i0, p.sq, q_stride);
    load_tile<T, D, BQ>(buf + BQ * D, dout + q_off, i0, p.sq, q_stride);
    const int64_t row = i0 + (threadIdx.x & (BQ - 1));
    const int64_t idx = (b * p.hq + h) * p.sq + row;
    if (threadIdx.x >= 2 * BQ || row >= p.sq) return 0.f;
    return threadIdx.x < BQ ? lse[idx] : delta[idx];
  };
  auto put_stat = [&](int it, float val) {
    if (threadIdx.x < 2 * BQ)
      stats[(it & 1) * 2 * BQ + threadIdx.x] = threadIdx.x < BQ ? val * kLog2e : val;
  };
  if (n_it > 0) put_stat(0, issue(0));
  cp_async_commit();
  const int g = lane >> 2, tq = lane & 3;
  const int wr0 = warp * 16;  // this warp's keys inside the block, and its dQ rows inside a tile
  const int64_t kfirst = j0b + wr0;
  const WarpRanges<MT> wq = warp_queries<MT>(p, b, kfirst, g);
  // Which warps wrote their dS^T rows this iteration (the dQ pass reads only those).
  __shared__ bool wrote_ds[kWarps];
  const float scale2 = p.scale * kLog2e;
  float acc_k[MT][D / 8][4], acc_v[MT][D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[0][i][e] = acc_v[0][i][e] = 0.f;
  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // tile `it` is in; every warp is done with iteration it - 1
    // Into the buffers iteration it - 1 read; the statistic is stored at the end of this one.
    const float next_stat = it + 1 < n_it ? issue(it + 1) : 0.f;
    cp_async_commit();
    const T* qs = qd + (it & 1) * 2 * BQ * D;
    const T* dos = qs + BQ * D;
    const float* lse2 = stats + (it & 1) * 2 * BQ;
    const float* dl = lse2 + BQ;
    const int64_t h = h0 + it / n_qt;
    const int64_t i0 = i_start + int64_t(it % n_qt) * BQ;
    // No key of this warp seen by any query row of the tile: nothing to add, and its dS^T rows
    // are not written (nor read by the dQ pass below).
    const bool active = !wq.skip(i0, BQ);
    if (lane == 0) wrote_ds[warp] = active;
    if (active) {
      float s[MT][NB][4], dp[MT][NB][4];
      mm_abt<T, D, MT, BQ>(s, ks, wr0, qs, lane);    // S^T: keys x queries
      mm_abt<T, D, MT, BQ>(dp, vs, wr0, dos, lane);  // dP^T
      const bool need_mask = !wq.all_seen(i0, BQ);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nb * 8 + tq * 2 + (e & 1);
          const bool ok = !need_mask || wq.sees(0, e >> 1, i0 + col);
          const float pr = ok ? exp2f(fmaf(s[0][nb][e], scale2, -lse2[col])) : 0.f;
          s[0][nb][e] = pr;
          dp[0][nb][e] = pr * (dp[0][nb][e] - dl[col]);
        }
      mm_pb<T, D, MT, BQ>(acc_v, s, dos, lane);
      mm_pb<T, D, MT, BQ>(acc_k, dp, qs, lane);
      // dS^T rows of this warp, rounded to T exactly as dK used them.
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(dss + swz<BQ>(wr0 + g + hf * 8, nb) + tq * 2) =
              Mma<T>::pack(dp[0][nb][2 * hf], dp[0][nb][2 * hf + 1]);
    }
    __syncthreads();  // dS^T complete
    // dQ rows i0 + wr0 .. + 15 of head h from the key chunks c (keys j0b + 16 c .., written by
    // warp c) that these rows see.
    const int64_t r0 = i0 + wr0;
    if (r0 < p.sq) {
      const WarpRanges<MT> rk = warp_keys<MT>(p, b, r0, g);
      float* dq_base = dq_acc + (b * p.sq * p.hq + h) * D;
#pragma unroll
      for (int c0 = 0; c0 < D; c0 += DC) {
        float acc[DC / 8][4];
#pragma unroll
        for (int i = 0; i < DC / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        bool any = false;
#pragma unroll
        for (int c = 0; c < BK / 16; ++c) {
          if (!wrote_ds[c] || rk.skip(j0b + 16 * c, 16)) continue;
          mm_atb<T, D, BQ, DC>(acc, dss, wr0 / 8, c, ks, c0, lane);
          any = true;
        }
        if (any) red_rows<DC>(dq_base, r0, p.sq, q_stride, c0, acc, g, tq);
      }
    }
    if (it + 1 < n_it) put_stat(it + 1, next_stat);
  }
  cp_async_wait<0>();
  if (dk_acc != nullptr) {  // the group's q heads are split over blocks: add fp32 partial sums
    if (kfirst < p.sk) {
      red_rows<D>(dk_acc + kv_off, kfirst, p.sk, kv_stride, 0, acc_k[0], g, tq);
      red_rows<D>(dv_acc + kv_off, kfirst, p.sk, kv_stride, 0, acc_v[0], g, tq);
    }
  } else {
    store_rows<T, D, MT>(dk + kv_off, kfirst, p.sk, kv_stride, acc_k, p.scale, g, tq);
    store_rows<T, D, MT>(dv + kv_off, kfirst, p.sk, kv_stride, acc_v, 1.0f, g, tq);
  }
}

// dQ = scale * acc, 8 elements per thread (n8 groups of 8; both pointers 16-byte aligned).
template <class T>
__global__ void attn_dq_convert(int64_t n8, float scale, T* __restrict__ dq,
                                const float* __restrict__ acc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(acc)[2 * i];
    const float4 c = reinterpret_cast<const float4*>(acc)[2 * i + 1];
    uint4 o;
    o.x = Mma<T>::pack(a.x * scale, a.y * scale);
    o.y = Mma<T>::pack(a.z * scale, a.w * scale);
    o.z = Mma<T>::pack(c.x * scale, c.y * scale);
    o.w = Mma<T>::pack(c.z * scale, c.w * scale);
    reinterpret_cast<uint4*>(dq)[i] = o;
  }
}

template <class T, int D, int MT>
void launch_bwd_dq(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_out,
                   const Tensor& q, const Tensor& k, const Tensor& v, const float* lse,
                   const float* delta, cudaStream_t stream) {
  constexpr int BR = 16 * kWarps * MT;
  const size_t smem = (2 * BR + 4 * kBc) * D * sizeof(T);
  static bool attr_set = false;
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_dq_mma<T, D, MT>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    attr_set = true;
  }
  dim3 grid(static_cast<unsigned>((p.sq + BR - 1) / BR), static_cast<unsigned>(p.hq),
            static_cast<unsigned>(p.b));
  attn_bwd_dq_mma<T, D, MT><<<grid, kWarps * 32, smem, stream>>>(
      p, static_cast<T*>(grad_q.data_ptr()), static_cast<const T*>(q.data_ptr()),
      static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
      static_cast<const T*>(grad_out.data_ptr()), lse, delta);
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward dq (tensor cores)");
}

template <class T, int D, int MT, int BQ>
void launch_bwd_dkv(const AttnParams& p, const Tensor& grad_k, const Tensor& grad_v,
                    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const float* lse, const float* delta, cudaStream_t stream) {
  constexpr int BK = 16 * kWarps * MT;
  const size_t smem = (2 * BK + 4 * BQ) * D * sizeof(T) + 4 * BQ * sizeof(float);
  static bool attr_set = false;
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_dkv_mma<T, D, MT, BQ>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    attr_set = true;
  }
  dim3 grid(static_cast<unsigned>((p.sk + BK - 1) / BK), static_cast<unsigned>(p.hkv),
            static_cast<unsigned>(p.b));
  attn_bwd_dkv_mma<T, D, MT, BQ><<<grid, kWarps * 32, smem, stream>>>(
      p, static_cast<T*>(grad_k.data_ptr()), static_cast<T*>(grad_v.data_ptr()),
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()), static_cast<const T*>(grad_out.data_ptr()), lse, delta);
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward dk/dv (tensor cores)");
}

// q heads per fa2 block: ACCEL_ATTN_FA2_HEADS (read per call, for benchmarking) or the whole
// group, lowered to a divisor of the group. The whole group keeps dK/dV in registers and stores
// them directly; fewer heads balance a causal mask better (the first key block carries group
// times the work of an average one) but add fp32 dK/dV partial sums through atomics. Measured on
// an H200 (llama-1b, B=4 S=2048 Hq=32 Hkv=8 D=64): group 1.33 ms, one head 1.40 ms.
int fa2_heads_per_block(int64_t group) {
  const char* e = std::getenv("ACCEL_ATTN_FA2_HEADS");
  int64_t n = e ? std::atoll(e) : group;
  n = n < 1 ? 1 : (n > group ? group : n);
  while (group % n != 0) --n;
  return static_cast<int>(n);
}

// n8 groups of 8 fp32 values in `acc` -> T (scaled) on the stream.
template <class T>
void convert_acc(const Tensor& dst, const Tensor& acc, float scale, cudaStream_t stream) {
  const int64_t n8 = dst.numel() / 8;  // D is 64 or 128
  const int64_t blocks = (n8 + 255) / 256;
  attn_dq_convert<T>
      <<<static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16), 256, 0, stream>>>(
          n8, scale, static_cast<T*>(dst.data_ptr()), static_cast<const float*>(acc.data_ptr()));
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward fp32 -> gradient");
}

// fp32 accumulator shaped like `like`, from the caching allocator, zeroed on the stream.
Tensor zeroed_acc(const Tensor& like, cudaStream_t stream) {
  Tensor acc = Tensor::empty(like.shape(), DType::F32, like.device(), MemCategory::Other);
  ACCEL_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0,
                                   static_cast<size_t>(like.numel()) * sizeof(float), stream));
  return acc;
}

template <class T, int D>
void launch_bwd_fa2(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                    const Tensor& grad_v, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                    const Tensor& v, const float* lse, const float* delta, cudaStream_t stream) {
  constexpr int BQ = 16 * kWarps, BK = 16 * kWarps;
  const size_t smem = ((2 * BK + 4 * BQ) * D + BK * BQ) * sizeof(T) + 4 * BQ * sizeof(float);
  static bool attr_set = false;
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_fa2_mma<T, D, BQ>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    attr_set = true;
  }
  const int hpc = fa2_heads_per_block(p.group);
  const bool split_kv = hpc < p.group;
  Tensor dq_acc = zeroed_acc(grad_q, stream);
  Tensor dk_acc, dv_acc;
  if (split_kv) {
    dk_acc = zeroed_acc(grad_k, stream);
    dv_acc = zeroed_acc(grad_v, stream);
  }
  dim3 grid(static_cast<unsigned>(p.hkv * (p.group / hpc)), static_cast<unsigned>(p.b),
            static_cast<unsigned>((p.sk + BK - 1) / BK));
  attn_bwd_fa2_mma<T, D, BQ><<<grid, kWarps * 32, smem, stream>>>(
      p, hpc, static_cast<float*>(dq_acc.data_ptr()),
      split_kv ? static_cast<float*>(dk_acc.data_ptr()) : nullptr,
      split_kv ? static_cast<float*>(dv_acc.data_ptr()) : nullptr,
      static_cast<T*>(grad_k.data_ptr()), static_cast<T*>(grad_v.data_ptr()),
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()), static_cast<const T*>(grad_out.data_ptr()), lse, delta);
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward fa2 (tensor cores)");
  convert_acc<T>(grad_q, dq_acc, p.scale, stream);
  if (split_kv) {
    convert_acc<T>(grad_k, dk_acc, p.scale, stream);
    convert_acc<T>(grad_v, dv_acc, 1.0f, stream);
  }
}

// m16 tiles per warp of the backward kernels for head dim 64 (128 always uses one):
// ACCEL_ATTN_DQ_MT / ACCEL_ATTN_DKV_MT = 1 or 2 override the defaults (for benchmarking).
int env_mt(const char* name, int dflt) {
  const char* e = std::getenv(name);
  if (!e) return dflt;
  return e[0] == '2' ? 2 : 1;
}

template <class T, int D>
void launch_bwd_split(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                      const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                      const Tensor& k, const Tensor& v, const float* lse, const float* delta,
                      cudaStream_t stream) {
  if constexpr (D <= 64) {
    static const int dq_mt = env_mt("ACCEL_ATTN_DQ_MT", kDefaultDqMt);
    static const int dkv_mt = env_mt("ACCEL_ATTN_DKV_MT", kDefaultDkvMt);
    if (dq_mt == 2)
      launch_bwd_dq<T, D, 2>(p, grad_q, grad_out, q, k, v, lse, delta, stream);
    else
      launch_bwd_dq<T, D, 1>(p, grad_q, grad_out, q, k, v, lse, delta, stream);
    if (dkv_mt == 2)
      launch_bwd_dkv<T, D, 2, 32>(p, grad_k, grad_v, grad_out, q, k, v, lse, delta, stream);
    else
      launch_bwd_dkv<T, D, 1, 64>(p, grad_k, grad_v, grad_out, q, k, v, lse, delta, stream);
  } else {
    launch_bwd_dq<T, D, 1>(p, grad_q, grad_out, q, k, v, lse, delta, stream);
    launch_bwd_dkv<T, D, 1, 64>(p, grad_k, grad_v, grad_out, q, k, v, lse, delta, stream);
  }
}

template <class T, int D>
void launch_bwd(AttnBwdImpl impl, const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                const Tensor& grad_v, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                const Tensor& v, const float* lse, const float* delta, cudaStream_t stream) {
  // fa2's grid puts key blocks in z and the batch in y (at most 65535 each).
  const bool fa2_fits = (p.sk + 63) / 64 <= 65535 && p.b <= 65535;
  if (impl == AttnBwdImpl::Fa2 && fa2_fits)
    launch_bwd_fa2<T, D>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, lse, delta, stream);
  else
    launch_bwd_split<T, D>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, lse, delta, stream);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

AttnBwdImpl attention_backward_impl(DType dtype, int head_dim) {
  if ((dtype != DType::BF16 && dtype != DType::F16) || (head_dim != 64 && head_dim != 128))
    return AttnBwdImpl::None;
  // Read on every call so a benchmark can time both paths in one process.
  const char* e = std::getenv("ACCEL_ATTN_BWD");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "fa2") == 0) return AttnBwdImpl::Fa2;
  if (std::strcmp(e, "split") == 0) return AttnBwdImpl::Split;
  throw std::invalid_argument(std::string("[attention] ACCEL_ATTN_BWD='") + e +
                              "' is not a backward implementation; use fa2 or split (or unset it)");
}

bool attention_forward_mma(const AttnParams& p, const Tensor& out, const Tensor& lse,
                           const Tensor& q, const Tensor& k, const Tensor& v, cudaStream_t stream) {
  const DType t = q.dtype();
  if ((t != DType::BF16 && t != DType::F16) || (p.d != 64 && p.d != 128)) return false;
  if (!aligned16(q.data_ptr()) || !aligned16(k.data_ptr()) || !aligned16(v.data_ptr()) ||
      !aligned16(out.data_ptr()))
    return false;
  if (t == DType::BF16) {
    if (p.d == 64)
      launch_fwd<__nv_bfloat16, 64>(p, out, lse, q, k, v, stream);
    else
      launch_fwd<__nv_bfloat16, 128>(p, out, lse, q, k, v, stream);
  } else {
    if (p.d == 64)
      launch_fwd<__half, 64>(p, out, lse, q, k, v, stream);
    else
      launch_fwd<__half, 128>(p, out, lse, q, k, v, stream);
  }
  return true;
}

bool attention_backward_mma(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                            const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            float* delta, cudaStream_t stream) {
  (void)out;
  const DType t = q.dtype();
  if ((t != DType::BF16 && t != DType::F16) || (p.d != 64 && p.d != 128)) return false;
  for (const Tensor* x : {&grad_q, &grad_k, &grad_v, &grad_out, &q, &k, &v})
    if (!aligned16(x->data_ptr())) return false;
  const AttnBwdImpl impl = attention_backward_impl(t, p.d);
  const float* l = static_cast<const float*>(lse.data_ptr());
  if (t == DType::BF16) {
    if (p.d == 64)
      launch_bwd<__nv_bfloat16, 64>(impl, p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta,
                                    stream);
    else
      launch_bwd<__nv_bfloat16, 128>(impl, p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta,
                                     stream);
  } else {
    if (p.d == 64)
      launch_bwd<__half, 64>(impl, p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta, stream);
    else
      launch_bwd<__half, 128>(impl, p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta, stream);
  }
  return true;
}

}  // namespace accel::cuda
