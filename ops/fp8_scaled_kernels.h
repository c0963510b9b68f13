// The kernels behind ops/fp8.h's per-row / per-block scaled fp8 (fp8_cast_scaled, fp8_gemm_scaled:
// the rowwise, rowwise_with_gw_hp and blockwise recipes), one implementation per device kind:
// ops/cpu/fp8_scaled.cpp (the exact emulation) and ops/cuda/fp8_scaled.cu +
// ops/cuda/fp8_scaled_gemm.cpp (cast kernels, cuBLASLt). Arguments are checked and allocated by
// ops/fp8.cpp. A kernel family of its own beside Backend (ops/backend.h), reached the same way
// (by the tensors' device); it could become Backend methods.
#pragma once

#include "ops/fp8.h"

namespace accel {

class Fp8ScaledKernels {
 public:
  virtual ~Fp8ScaledKernels() = default;
  // The operand is x [R, C] (contiguous, f32/bf16/f16), or x^T when transpose; data [rows_p, K_p]
  // (fp8, zero padding) gets sat(rne(v * scale)) with the scale of v's group in `mode`
  // (fp8_group_scale of the group's amax); scale_inv (f32, fp8_scale_slots elements) gets
  // 1 / every slot's scale (1 for slots without data). one_scale: one group, the whole tensor.
  virtual void cast(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2, bool one_scale,
                    const Tensor& data, const Tensor& scale_inv) = 0;
  // out [Ma, Mb] = sum_k a[i, k] sa(i, k) b[j, k] sb(j, k) for a [Ma, K], b [Mb, K] (padded
  // data), the scales in their modes' layouts (a mode pair ops/fp8.cpp accepted).
  virtual void gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                    Fp8ScaleMode a_mode, const Tensor& b, const Tensor& b_scale_inv,
                    Fp8ScaleMode b_mode, bool fast_accum) = 0;
};

Fp8ScaledKernels& cpu_fp8_scaled_kernels();
// CUDA builds: ops/cuda/fp8_scaled.cu; builds without CUDA: ops/no_cuda (throws, saying so).
Fp8ScaledKernels& cuda_fp8_scaled_kernels();

inline Fp8ScaledKernels& fp8_scaled_kernels_for(Device d) {
  return d.is_cuda() ? cuda_fp8_scaled_kernels() : cpu_fp8_scaled_kernels();
}

}  // namespace accel
