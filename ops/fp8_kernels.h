// Per-device kernels behind ops/fp8.h (internal): ops/cpu/fp8.cpp is the exact emulation,
// ops/cuda/fp8_*.cu the CUDA versions (ops/no_cuda/fp8_stub.cpp throws in builds without CUDA).
// Arguments arrive checked and allocated by ops/fp8.cpp; tensors are contiguous.
#pragma once

#include <vector>

#include "ops/fp8.h"

namespace accel::fp8_kernels {

// Where a fused cast writes (allocated by ops/fp8.cpp): scale f32 [1] is read; data [Rp, Cp] and
// data_t [Cp, Rp] (each optional, zero padding beyond the input) get the fp8 values; amax f32 [1]
// (optional) becomes max(amax, max |value|); scale_inv (optional) gets 1 / scale.
struct CastTarget {
  Tensor scale, data, data_t, amax, scale_inv;
};

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

// CUDA only, fused: the elementwise op and the cast (+ transpose, amax) in one pass. Inputs
// [R, C] bf16/f16 in the layout fused_cast_layout accepts; targets padded as for `cast`.
// Whether `inputs` (CUDA, contiguous, 16-byte aligned) with `cols` columns suit the kernels below.
bool fused_cast_layout(const std::vector<const Tensor*>& inputs, int64_t cols);
// Casts swiglu(gate, up), computed and rounded as the swiglu op does (bit-identical to swiglu
// followed by cast).
void swiglu_cast(const Tensor& gate, const Tensor& up, const CastTarget& out);
// Casts the gradients of swiglu for `grad` (as the swiglu op's backward computes and rounds them):
// d gate into to_gate, d up into to_up (same padding and fp8 format).
void swiglu_backward_cast(const Tensor& grad, const Tensor& gate, const Tensor& up,
                          const CastTarget& to_gate, const CastTarget& to_up);
}  // namespace cuda

}  // namespace accel::fp8_kernels
