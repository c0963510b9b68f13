// Per-device kernels behind ops/fp8.h (internal): ops/cpu/fp8.cpp is the exact emulation,
// ops/cuda/fp8_*.cu the CUDA versions (ops/no_cuda/fp8_stub.cpp throws in builds without CUDA).
// Arguments arrive checked and allocated by ops/fp8.cpp; tensors are contiguous.
#pragma once

#include "ops/fp8.h"

namespace accel::fp8_kernels {

namespace cpu {
// x [R, C] f32/bf16/f16; scale f32 [1]. data [Rp, Cp] and data_t [Cp, Rp] (each optional, zero
// padding beyond R, C) get sat(rne(x * scale)) in their fp8 dtype; amax (optional) becomes
// max(amax, max|x|); scale_inv (optional) gets 1 / scale.
void cast(const Tensor& x, const Tensor& scale, const Tensor& data, const Tensor& data_t,
          const Tensor& amax, const Tensor& scale_inv);
// out f32 [1] = max |x| over all elements (NaN ignored).
void amax(const Tensor& x, const Tensor& out);
// scale = fp8_scale_for_amax(amax, fp8_max, margin, 1), scale_inv = 1 / scale (all f32 [1]).
void scale_from_amax(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                     float fp8_max, int margin);
// out [M, N] = (a [M, K] . b [N, K]^T) * a_scale_inv * b_scale_inv.
void gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
          const Tensor& b_scale_inv, bool fast_accum);
// data_t [C, R] = data [R, C]^T, one-byte elements.
void transpose(const Tensor& data_t, const Tensor& data);
// history [L, n], scale / scale_inv / fp8_max [n] f32: see Fp8DelayedScaling::update.
void delayed_update(const Tensor& history, const Tensor& scale, const Tensor& scale_inv,
                    const Tensor& fp8_max, bool use_max, int margin, bool recompute);
// out = MX fake quantization of x [R, C] (blocks of 32 along block_dim), same dtype as x.
void mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim);
}  // namespace cpu

namespace cuda {  // the same contracts
void cast(const Tensor& x, const Tensor& scale, const Tensor& data, const Tensor& data_t,
          const Tensor& amax, const Tensor& scale_inv);
void amax(const Tensor& x, const Tensor& out);
void scale_from_amax(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                     float fp8_max, int margin);
void gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
          const Tensor& b_scale_inv, bool fast_accum);
void transpose(const Tensor& data_t, const Tensor& data);
void delayed_update(const Tensor& history, const Tensor& scale, const Tensor& scale_inv,
                    const Tensor& fp8_max, bool use_max, int margin, bool recompute);
void mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim);
}  // namespace cuda

}  // namespace accel::fp8_kernels
