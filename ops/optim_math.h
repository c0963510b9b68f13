// The per-element AdamW and SGD updates of bf16 master weights (optimizer.master_weights bf16)
// and their stochastic rounding, shared by the CPU and CUDA kernels (ops/cpu/optim.cpp,
// ops/cuda/optim.cu) so that the GPU's result equals the CPU's bit for bit. Every operation is a
// separately rounded fp32 op: on the GPU the __f*_rn intrinsics, which nvcc never contracts into
// an FMA; on the CPU plain operators in a file compiled with -ffp-contract=off (CMakeLists.txt).
// Division and square root are IEEE-rounded on both (no fast-math flags in the build).
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/ops.h"
#include "runtime/random.h"

namespace accel::optim_math {

ACCEL_HD float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ACCEL_HD float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ACCEL_HD float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ACCEL_HD float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ACCEL_HD float sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// A step's AdamW scalars, computed on the host in double and used as fp32.
struct AdamScalars {
  float beta1, beta2, eps, decay;  // decay = 1 - lr * weight_decay
  float step_size, inv_bias2_sqrt, grad_scale;
};

inline AdamScalars adam_scalars(const AdamWParams& p, double grad_scale) {
  const double bias1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bias2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  AdamScalars s;
  s.beta1 = static_cast<float>(p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.eps = static_cast<float>(p.eps);
  s.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  s.step_size = static_cast<float>(p.lr / bias1);
  s.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(bias2));
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

// One element of AdamW in the order of the CUDA fp32-master kernel, each op rounded on its own.
// `g` is the unscaled gradient; m and v are updated in place (the caller stores them in their
// dtype); returns the new parameter value before its rounding to bf16.
ACCEL_HD float adamw_element(float g, float p, float& m, float& v, const AdamScalars& s) {
  g = mul(g, s.grad_scale);
  p = mul(p, s.decay);
  m = add(m, mul(sub(1.0f, s.beta1), sub(g, m)));
  v = add(mul(s.beta2, v), mul(mul(sub(1.0f, s.beta2), g), g));
  const float denom = add(mul(sqrt(v), s.inv_bias2_sqrt), s.eps);
  return sub(p, div(mul(s.step_size, m), denom));
}

// One element of SGD (torch semantics: weight decay added to the gradient, then momentum);
// `buf` is the momentum buffer's value, updated in place when momentum != 0. Returns the new
// parameter value before its rounding.
ACCEL_HD float sgd_element(float g, float p, float& buf, float lr, float momentum, float wd,
                           float grad_scale) {
  float d = mul(g, grad_scale);
  if (wd != 0.f) d = add(d, mul(wd, p));
  if (momentum != 0.f) {
    buf = add(mul(momentum, buf), d);
    d = buf;
  }
  return sub(p, mul(lr, d));
}

// bfloat16 by stochastic rounding (llm.c's): the low 16 bits of `random` added to the fp32 bit
// pattern, then truncated, so |f| rounds up (away from zero) with probability (its distance from
// the bf16 below) / (one bf16 ulp): unbiased. Values bf16 holds stay as they are, Inf stays Inf
// (its low bits are zero), NaN a quiet NaN; the largest finite values may round to Inf.
ACCEL_HD uint16_t f32_to_bf16_stochastic(float f, uint32_t random) {
  const uint32_t u = detail::f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + (random & 0xffffu)) >> 16);
}

// Element `i` of a tensor under stochastic rounding `r` (ops.h): rounded with the bits of the
// counter-based Philox stream at (r.seed, r.first + i).
ACCEL_HD uint16_t stochastic_bf16(float x, const StochasticRounding& r, int64_t i) {
  return f32_to_bf16_stochastic(x, philox::bits(r.seed, r.first, static_cast<uint64_t>(i)));
}

// The bits philox::bits(r.seed, r.first, i + k) gives for k = 0..3 when r.first + i is a multiple
// of 4: one Philox block instead of four (the CUDA kernel's vector path).
ACCEL_HD philox::U4 stochastic_bits4(const StochasticRounding& r, int64_t i) {
  const uint64_t block = (r.first + static_cast<uint64_t>(i)) >> 2;
  return philox::philox4x32(
      philox::U4{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u},
      static_cast<uint32_t>(r.seed), static_cast<uint32_t>(r.seed >> 32));
}

}  // namespace accel::optim_math
