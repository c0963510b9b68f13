// Shared between attention.cu (generic kernels, entry points) and attention_mma.cu (tensor-core
// kernels for bf16/f16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "runtime/tensor.h"

namespace accel::cuda {

struct AttnParams {
  int64_t b, sq, sk, hq, hkv, group;
  int d;
  bool causal;
  int64_t window;  // 0: none, else query i sees keys j > i + (sk - sq) - window (needs causal)
  // Documents (segment_ids, sk == sq), or null: for each position [B, S], the first position of
  // its document and one past the last (attention.cu computes them from the ids).
  const int32_t* seg_lo;
  const int32_t* seg_hi;
  float scale;
};

#ifdef __CUDACC__
// Every mask leaves query row i one contiguous range of keys [attn_keys_lo, attn_keys_hi), and
// key j one range of queries [attn_queries_lo, attn_queries_hi); both ends never decrease with
// i (or j), so a block of rows sees the keys from its first row's lo to its last row's hi.
// Rows and keys must be in range (0 <= i < sq, 0 <= j < sk).
__device__ __forceinline__ int64_t attn_keys_hi(const AttnParams& p, int64_t i) {
  if (!p.causal) return p.sk;
  const int64_t n = i + 1 + (p.sk - p.sq);  // bottom-right aligned when sk != sq
  return n < 0 ? 0 : (n > p.sk ? p.sk : n);
}
__device__ __forceinline__ int64_t attn_keys_lo(const AttnParams& p, int64_t b, int64_t i) {
  int64_t lo = p.window > 0 ? i + (p.sk - p.sq) - p.window + 1 : 0;
  if (p.seg_lo != nullptr) {
    const int64_t start = p.seg_lo[b * p.sq + i];
    lo = lo > start ? lo : start;
  }
  return lo < 0 ? 0 : lo;
}
__device__ __forceinline__ int64_t attn_queries_lo(const AttnParams& p, int64_t j) {
  if (!p.causal) return 0;
  const int64_t i = j - (p.sk - p.sq);
  return i < 0 ? 0 : i;
}
__device__ __forceinline__ int64_t attn_queries_hi(const AttnParams& p, int64_t b, int64_t j) {
  int64_t hi = p.sq;
  if (p.window > 0) {
    const int64_t w = j - (p.sk - p.sq) + p.window;
    hi = w < hi ? w : hi;
  }
  if (p.seg_hi != nullptr) {
    const int64_t end = p.seg_hi[b * p.sk + j];
    hi = end < hi ? end : hi;
  }
  return hi < 0 ? 0 : hi;
}
#endif

// The tensor-core backward: Fa2 (one kernel over key blocks, dQ through fp32 atomics, 5
// GEMM-equivalents) or Split (a dQ kernel and a dK/dV kernel, no atomics, 7 GEMM-equivalents).
// attention_backward_impl picks it for (dtype, head dim): None where the tensor-core kernels do
// not apply, else Fa2 unless the environment variable ACCEL_ATTN_BWD=split (read on every call;
// ACCEL_ATTN_BWD=fa2 or unset: the default; any other value throws).
enum class AttnBwdImpl { None, Fa2, Split };
AttnBwdImpl attention_backward_impl(DType dtype, int head_dim);

// Run the tensor-core kernels when they support the problem (bf16/f16, head dim 64 or 128);
// return false to fall back to the generic kernels. `delta` is scratch of B * Hq * Sq floats.
bool attention_forward_mma(const AttnParams& p, const Tensor& out, const Tensor& lse,
                           const Tensor& q, const Tensor& k, const Tensor& v, cudaStream_t stream);
bool attention_backward_mma(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                            const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            float* delta, cudaStream_t stream);

// Which kernels run (set_attention_impl, ACCEL_ATTENTION): Auto takes cuDNN's fused attention
// where it supports the problem, else our tensor-core kernels where they do, else the generic
// ones; Cudnn demands cuDNN (an error where it declines); Flash skips cuDNN; Generic forces the
// generic kernels.
enum class AttnImpl { Auto, Cudnn, Flash, Generic };

// cuDNN's fused flash attention (attention_cudnn.cpp). Run cuDNN's kernels; false (with the reason
// in `why_not`) where cuDNN does not support the problem. The backward's lse is the forward's
// (either implementation's).
bool attention_forward_cudnn(const AttnParams& p, const Tensor& out, const Tensor& lse,
                             const Tensor& q, const Tensor& k, const Tensor& v, cudaStream_t stream,
                             std::string* why_not);
bool attention_backward_cudnn(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                              const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, cudaStream_t stream, std::string* why_not);

}  // namespace accel::cuda
