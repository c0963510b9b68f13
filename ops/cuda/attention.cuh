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
  float scale;
};

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
