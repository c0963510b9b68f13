// Tensor-core flash attention forward for bf16/f16, head dim 64 or 128 (mma.sync m16n8k16 with
// fp32 accumulation, ldmatrix from XOR-swizzled shared memory, cp.async double buffering).
// A block of 4 warps owns 64 query rows (16 per warp) and walks 64-key tiles of K and V with an
// online softmax in the exp2 domain; the output and the natural-log lse are written once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

constexpr int kBr = 64, kBc = 64, kWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_fwd_mma(AttnParams p, T* __restrict__ out, float* __restrict__ lse,
                 const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v) {
  constexpr int KD = D / 16;   // k-steps over the head dim
  constexpr int NB = kBc / 8;  // 8-key blocks per tile
  constexpr int ND = D / 8;    // 8-dim blocks of the output
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kv = qs + kBr * D;  // [2 buffers][K tile, V tile]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t qblk = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // long rows first
  const int64_t i0 = qblk * kBr;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const T* qg = q + (b * p.sq * p.hq + h) * D;
  const T* kg = k + (b * p.sk * p.hkv + hk) * D;
  const T* vg = v + (b * p.sk * p.hkv + hk) * D;

  const int64_t last_row = (i0 + kBr < p.sq ? i0 + kBr : p.sq) - 1;
  int64_t n_keys = p.sk;
  if (p.causal) {
    n_keys = last_row + 1 + (p.sk - p.sq);
    n_keys = n_keys < 0 ? 0 : (n_keys > p.sk ? p.sk : n_keys);
  }
  const int n_tiles = static_cast<int>((n_keys + kBc - 1) / kBc);

  load_tile<T, D, kBr>(qs, qg, i0, p.sq, q_stride);
  if (n_tiles > 0) {
    load_tile<T, D, kBc>(kv, kg, 0, p.sk, kv_stride);
    load_tile<T, D, kBc>(kv + kBc * D, vg, 0, p.sk, kv_stride);
  }
  cp_async_commit();

  const int g = lane >> 2, tq = lane & 3;
  const int64_t row_a = i0 + warp * 16 + g, row_b = row_a + 8;
  const float scale2 = p.scale * kLog2e;
  float o[ND][4];
#pragma unroll
  for (int i = 0; i < ND; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  uint32_t qf[KD][4];

  for (int t = 0; t < n_tiles; ++t) {
    T* ks = kv + (t & 1) * 2 * kBc * D;
    T* vs = ks + kBc * D;
    if (t + 1 < n_tiles) {
      T* nk = kv + ((t + 1) & 1) * 2 * kBc * D;
      load_tile<T, D, kBc>(nk, kg, int64_t(t + 1) * kBc, p.sk, kv_stride);
      load_tile<T, D, kBc>(nk + kBc * D, vg, int64_t(t + 1) * kBc, p.sk, kv_stride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        ldsm_x4(qf[kk], qs + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }
    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[NB][4];
#pragma unroll
    for (int i = 0; i < NB; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        uint32_t bf[4];
        ldsm_x4(bf, ks + swz<D>(nb2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                kk * 2 + ((lane >> 3) & 1)));
        Mma<T>::run(s[2 * nb2], qf[kk], bf);
        Mma<T>::run(s[2 * nb2 + 1], qf[kk], bf + 2);
      }
    }
    // Scale into the exp2 domain and mask.
    const int64_t j0 = int64_t(t) * kBc;
    const bool need_mask = j0 + kBc > p.sk || (p.causal && j0 + kBc > i0 + 1 + (p.sk - p.sq));
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nb][e] * scale2;
        if (need_mask) {
          const int64_t j = j0 + nb * 8 + tq * 2 + (e & 1);
          const int64_t i = e < 2 ? row_a : row_b;
          if (j >= p.sk || (p.causal && j >= i + 1 + (p.sk - p.sq))) x = -INFINITY;
        }
        s[nb][e] = x;
      }
    float mt_a = -INFINITY, mt_b = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      mt_a = fmaxf(mt_a, fmaxf(s[nb][0], s[nb][1]));
      mt_b = fmaxf(mt_b, fmaxf(s[nb][2], s[nb][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      mt_a = fmaxf(mt_a, __shfl_xor_sync(0xffffffffu, mt_a, off));
      mt_b = fmaxf(mt_b, __shfl_xor_sync(0xffffffffu, mt_b, off));
    }
    const float mn_a = fmaxf(m_a, mt_a), mn_b = fmaxf(m_b, mt_b);
    const float use_a = mn_a == -INFINITY ? 0.f : mn_a, use_b = mn_b == -INFINITY ? 0.f : mn_b;
    const float al_a = exp2f(m_a - use_a), al_b = exp2f(m_b - use_b);
    m_a = mn_a;
    m_b = mn_b;
    float ls_a = 0.f, ls_b = 0.f;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      s[nb][0] = exp2f(s[nb][0] - use_a);
      s[nb][1] = exp2f(s[nb][1] - use_a);
      s[nb][2] = exp2f(s[nb][2] - use_b);
      s[nb][3] = exp2f(s[nb][3] - use_b);
      ls_a += s[nb][0] + s[nb][1];
      ls_b += s[nb][2] + s[nb][3];
    }
    l_a = l_a * al_a + ls_a;
    l_b = l_b * al_b + ls_b;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      o[nd][0] *= al_a;
      o[nd][1] *= al_a;
      o[nd][2] *= al_b;
      o[nd][3] *= al_b;
    }
    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t pf[4];
      pf[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pf[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pf[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pf[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int nd2 = 0; nd2 < ND / 2; ++nd2) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, vs + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                      nd2 * 2 + (lane >> 4)));
        Mma<T>::run(o[2 * nd2], pf, bf);
        Mma<T>::run(o[2 * nd2 + 1], pf, bf + 2);
      }
    }
    __syncthreads();  // the buffer is refilled two tiles later
  }
  cp_async_wait<0>();

#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  if (row_a < p.sq) {
    T* orow = out + ((b * p.sq + row_a) * p.hq + h) * D;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd)
      *reinterpret_cast<uint32_t*>(orow + nd * 8 + tq * 2) =
          Mma<T>::pack(o[nd][0] * inv_a, o[nd][1] * inv_a);
    if (tq == 0)
      lse[(b * p.hq + h) * p.sq + row_a] = l_a > 0.f ? (m_a + log2f(l_a)) * kLn2 : -INFINITY;
  }
  if (row_b < p.sq) {
    T* orow = out + ((b * p.sq + row_b) * p.hq + h) * D;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd)
      *reinterpret_cast<uint32_t*>(orow + nd * 8 + tq * 2) =
          Mma<T>::pack(o[nd][2] * inv_b, o[nd][3] * inv_b);
    if (tq == 0)
      lse[(b * p.hq + h) * p.sq + row_b] = l_b > 0.f ? (m_b + log2f(l_b)) * kLn2 : -INFINITY;
  }
}

template <class T, int D>
void launch_fwd(const AttnParams& p, const Tensor& out, const Tensor& lse, const Tensor& q,
                const Tensor& k, const Tensor& v, cudaStream_t stream) {
  const size_t smem = (kBr + 4 * kBc) * D * sizeof(T);
  static bool attr_set = false;  // per instantiation; the limit is per device but the same here
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(
        attn_fwd_mma<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    attr_set = true;
  }
  dim3 grid(static_cast<unsigned>((p.sq + kBr - 1) / kBr), static_cast<unsigned>(p.hq),
            static_cast<unsigned>(p.b));
  attn_fwd_mma<T, D><<<grid, kWarps * 32, smem, stream>>>(
      p, static_cast<T*>(out.data_ptr()), static_cast<float*>(lse.data_ptr()),
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()));
  ACCEL_CUDA_CHECK_LAUNCH("attention (tensor cores)");
}

// ---- backward
// ------------------------------------------------------------------------------------- Two
// kernels, no atomics: dQ walks key tiles for a block of 64 query rows; dK/dV walks query tiles (of
// every q head of the group) for a block of 64 keys. Both recompute P from the saved lse; delta =
// rowsum(dO * O) is computed beforehand.

// c[16 x 64] = A[16 rows from a_row0 of a_tile] x B^T where b_tile holds 64 rows of D.
template <class T, int D>
__device__ __forceinline__ void mm_abt(float (&c)[kBc / 8][4], const T* a_tile, int a_row0,
                                       const T* b_tile, int lane) {
#pragma unroll
  for (int i = 0; i < kBc / 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a_tile + swz<D>(a_row0 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
    for (int nb2 = 0; nb2 < kBc / 16; ++nb2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_tile + swz<D>(nb2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                  kk * 2 + ((lane >> 3) & 1)));
      Mma<T>::run(c[2 * nb2], af, bf);
      Mma<T>::run(c[2 * nb2 + 1], af, bf + 2);
    }
  }
}

// acc[16 x D] += P[16 x 64] (accumulator layout) x B where b_tile holds 64 rows (k) of D (n).
template <class T, int D>
__device__ __forceinline__ void mm_pb(float (&acc)[D / 8][4], const float (&pm)[kBc / 8][4],
                                      const T* b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    uint32_t pf[4];
    pf[0] = Mma<T>::pack(pm[2 * kk][0], pm[2 * kk][1]);
    pf[1] = Mma<T>::pack(pm[2 * kk][2], pm[2 * kk][3]);
    pf[2] = Mma<T>::pack(pm[2 * kk + 1][0], pm[2 * kk + 1][1]);
    pf[3] = Mma<T>::pack(pm[2 * kk + 1][2], pm[2 * kk + 1][3]);
#pragma unroll
    for (int nd2 = 0; nd2 < D / 16; ++nd2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                        nd2 * 2 + (lane >> 4)));
      Mma<T>::run(acc[2 * nd2], pf, bf);
      Mma<T>::run(acc[2 * nd2 + 1], pf, bf + 2);
    }
  }
}

template <class T, int D>
__device__ __forceinline__ void store_rows(T* base, int64_t row, int64_t rows, int64_t stride,
                                           const float (&acc)[D / 8][4], int half, float scale,
                                           int tq) {
  if (row >= rows) return;
  T* r = base + row * stride;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd)
    *reinterpret_cast<uint32_t*>(r + nd * 8 + tq * 2) =
        Mma<T>::pack(acc[nd][2 * half] * scale, acc[nd][2 * half + 1] * scale);
}

template <class T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dq_mma(AttnParams p, T* __restrict__ dq, const T* __restrict__ q,
                    const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta) {
  constexpr int NB = kBc / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* dos = qs + kBr * D;
  T* kv = dos + kBr * D;  // [2][K, V]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y, hk = h / p.group;
  const int64_t qblk = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t i0 = qblk * kBr;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const int64_t q_off = (b * p.sq * p.hq + h) * D;
  const T* kg = k + (b * p.sk * p.hkv + hk) * D;
  const T* vg = v + (b * p.sk * p.hkv + hk) * D;
  const int64_t last_row = (i0 + kBr < p.sq ? i0 + kBr : p.sq) - 1;
  int64_t n_keys = p.sk;
  if (p.causal) {
    n_keys = last_row + 1 + (p.sk - p.sq);
    n_keys = n_keys < 0 ? 0 : (n_keys > p.sk ? p.sk : n_keys);
  }
  const int n_tiles = static_cast<int>((n_keys + kBc - 1) / kBc);
  load_tile<T, D, kBr>(qs, q + q_off, i0, p.sq, q_stride);
  load_tile<T, D, kBr>(dos, dout + q_off, i0, p.sq, q_stride);
  if (n_tiles > 0) {
    load_tile<T, D, kBc>(kv, kg, 0, p.sk, kv_stride);
    load_tile<T, D, kBc>(kv + kBc * D, vg, 0, p.sk, kv_stride);
  }
  cp_async_commit();
  const int g = lane >> 2, tq = lane & 3;
  const int64_t row_a = i0 + warp * 16 + g, row_b = row_a + 8;
  const float* lse_b = lse + (b * p.hq + h) * p.sq;
  const float* delta_b = delta + (b * p.hq + h) * p.sq;
  const float lse_a2 = row_a < p.sq ? lse_b[row_a] * kLog2e : 0.f;
  const float lse_b2 = row_b < p.sq ? lse_b[row_b] * kLog2e : 0.f;
  const float del_a = row_a < p.sq ? delta_b[row_a] : 0.f;
  const float del_b = row_b < p.sq ? delta_b[row_b] : 0.f;
  const float scale2 = p.scale * kLog2e;
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int t = 0; t < n_tiles; ++t) {
    T* ks = kv + (t & 1) * 2 * kBc * D;
    T* vs = ks + kBc * D;
    if (t + 1 < n_tiles) {
      T* nk = kv + ((t + 1) & 1) * 2 * kBc * D;
      load_tile<T, D, kBc>(nk, kg, int64_t(t + 1) * kBc, p.sk, kv_stride);
      load_tile<T, D, kBc>(nk + kBc * D, vg, int64_t(t + 1) * kBc, p.sk, kv_stride);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float s[NB][4], dp[NB][4];
    mm_abt<T, D>(s, qs, warp * 16, ks, lane);
    mm_abt<T, D>(dp, dos, warp * 16, vs, lane);
    const int64_t j0 = int64_t(t) * kBc;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = j0 + nb * 8 + tq * 2 + (e & 1);
        const int64_t i = e < 2 ? row_a : row_b;
        const bool ok = j < p.sk && !(p.causal && j >= i + 1 + (p.sk - p.sq));
        const float pr = ok ? exp2f(s[nb][e] * scale2 - (e < 2 ? lse_a2 : lse_b2)) : 0.f;
        s[nb][e] = pr * (dp[nb][e] - (e < 2 ? del_a : del_b));
      }
    mm_pb<T, D>(acc, s, ks, lane);
    __syncthreads();
  }
  cp_async_wait<0>();
  store_rows<T, D>(dq + q_off, row_a, p.sq, q_stride, acc, 0, p.scale, tq);
  store_rows<T, D>(dq + q_off, row_b, p.sq, q_stride, acc, 1, p.scale, tq);
}

template <class T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dkv_mma(AttnParams p, T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ q,
                     const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta) {
  constexpr int NB = kBr / 8;  // query columns per tile / 8
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);
  T* vs = ks + kBc * D;
  T* qd = vs + kBc * D;                                       // [2][Q tile, dO tile]
  float* stats = reinterpret_cast<float*>(qd + 4 * kBr * D);  // [2][lse2 64, delta 64]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hk = blockIdx.y;
  const int64_t j0b = int64_t(blockIdx.x) * kBc;
  const int64_t q_stride = p.hq * D, kv_stride = p.hkv * D;
  const int64_t kv_off = (b * p.sk * p.hkv + hk) * D;
  load_tile<T, D, kBc>(ks, k + kv_off, j0b, p.sk, kv_stride);
  load_tile<T, D, kBc>(vs, v + kv_off, j0b, p.sk, kv_stride);
  int64_t i_start = p.causal ? j0b - (p.sk - p.sq) : 0;
  i_start = i_start < 0 ? 0 : i_start / kBr * kBr;
  const int n_qt = i_start < p.sq ? static_cast<int>((p.sq - i_start + kBr - 1) / kBr) : 0;
  const int n_it = n_qt * static_cast<int>(p.group);
  auto issue = [&](int it) {
    const int64_t h = hk * p.group + it / n_qt;
    const int64_t i0 = i_start + int64_t(it % n_qt) * kBr;
    const int64_t q_off = (b * p.sq * p.hq + h) * D;
    T* buf = qd + (it & 1) * 2 * kBr * D;
    load_tile<T, D, kBr>(buf, q + q_off, i0, p.sq, q_stride);
    load_tile<T, D, kBr>(buf + kBr * D, dout + q_off, i0, p.sq, q_stride);
    float* st = stats + (it & 1) * 2 * kBr;
    const int64_t row = i0 + (threadIdx.x & (kBr - 1));
    const int64_t base = (b * p.hq + h) * p.sq;
    if (threadIdx.x < kBr)
      st[threadIdx.x] = row < p.sq ? lse[base + row] * kLog2e : 0.f;
    else if (threadIdx.x < 2 * kBr)
      st[threadIdx.x] = row < p.sq ? delta[base + row] : 0.f;
  };
  if (n_it > 0) issue(0);
  cp_async_commit();
  const int g = lane >> 2, tq = lane & 3;
  const int64_t key_a = j0b + warp * 16 + g, key_b = key_a + 8;
  const float scale2 = p.scale * kLog2e;
  float acc_k[D / 8][4], acc_v[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    acc_k[i][0] = acc_k[i][1] = acc_k[i][2] = acc_k[i][3] = acc_v[i][0] = acc_v[i][1] =
        acc_v[i][2] = acc_v[i][3] = 0.f;
  for (int it = 0; it < n_it; ++it) {
    if (it + 1 < n_it) {
      issue(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* qs = qd + (it & 1) * 2 * kBr * D;
    const T* dos = qs + kBr * D;
    const float* lse2 = stats + (it & 1) * 2 * kBr;
    const float* dl = lse2 + kBr;
    const int64_t i0 = i_start + int64_t(it % n_qt) * kBr;
    float s[NB][4], dp[NB][4];
    mm_abt<T, D>(s, ks, warp * 16, qs, lane);    // S^T: keys x queries
    mm_abt<T, D>(dp, vs, warp * 16, dos, lane);  // dP^T
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + tq * 2 + (e & 1);
        const int64_t i = i0 + col;
        const int64_t j = e < 2 ? key_a : key_b;
        const bool ok = i < p.sq && j < p.sk && !(p.causal && j >= i + 1 + (p.sk - p.sq));
        const float pr = ok ? exp2f(s[nb][e] * scale2 - lse2[col]) : 0.f;
        s[nb][e] = pr;
        dp[nb][e] = pr * (dp[nb][e] - dl[col]);
      }
    mm_pb<T, D>(acc_v, s, dos, lane);
    mm_pb<T, D>(acc_k, dp, qs, lane);
    __syncthreads();
  }
  cp_async_wait<0>();
  store_rows<T, D>(dk + kv_off, key_a, p.sk, kv_stride, acc_k, 0, p.scale, tq);
  store_rows<T, D>(dk + kv_off, key_b, p.sk, kv_stride, acc_k, 1, p.scale, tq);
  store_rows<T, D>(dv + kv_off, key_a, p.sk, kv_stride, acc_v, 0, 1.0f, tq);
  store_rows<T, D>(dv + kv_off, key_b, p.sk, kv_stride, acc_v, 1, 1.0f, tq);
}

template <class T, int D>
void launch_bwd(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                const Tensor& grad_v, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                const Tensor& v, const float* lse, const float* delta, cudaStream_t stream) {
  const size_t smem_q = (2 * kBr + 4 * kBc) * D * sizeof(T);
  const size_t smem_kv = (2 * kBc + 4 * kBr) * D * sizeof(T) + 4 * kBr * sizeof(float);
  static bool attr_set = false;
  if (!attr_set) {
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_dq_mma<T, D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_q)));
    ACCEL_CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_dkv_mma<T, D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_kv)));
    attr_set = true;
  }
  dim3 grid_q(static_cast<unsigned>((p.sq + kBr - 1) / kBr), static_cast<unsigned>(p.hq),
              static_cast<unsigned>(p.b));
  attn_bwd_dq_mma<T, D><<<grid_q, kWarps * 32, smem_q, stream>>>(
      p, static_cast<T*>(grad_q.data_ptr()), static_cast<const T*>(q.data_ptr()),
      static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
      static_cast<const T*>(grad_out.data_ptr()), lse, delta);
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward dq (tensor cores)");
  dim3 grid_kv(static_cast<unsigned>((p.sk + kBc - 1) / kBc), static_cast<unsigned>(p.hkv),
               static_cast<unsigned>(p.b));
  attn_bwd_dkv_mma<T, D><<<grid_kv, kWarps * 32, smem_kv, stream>>>(
      p, static_cast<T*>(grad_k.data_ptr()), static_cast<T*>(grad_v.data_ptr()),
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()), static_cast<const T*>(grad_out.data_ptr()), lse, delta);
  ACCEL_CUDA_CHECK_LAUNCH("attention_backward dk/dv (tensor cores)");
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

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
  const float* l = static_cast<const float*>(lse.data_ptr());
  if (t == DType::BF16) {
    if (p.d == 64)
      launch_bwd<__nv_bfloat16, 64>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta, stream);
    else
      launch_bwd<__nv_bfloat16, 128>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta,
                                     stream);
  } else {
    if (p.d == 64)
      launch_bwd<__half, 64>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta, stream);
    else
      launch_bwd<__half, 128>(p, grad_q, grad_k, grad_v, grad_out, q, k, v, l, delta, stream);
  }
  return true;
}

}  // namespace accel::cuda
