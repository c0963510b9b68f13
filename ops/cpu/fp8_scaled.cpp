// The CPU emulation of the per-row / per-block scaled fp8 casts and GEMMs
// (Backend::fp8_cast_scaled / fp8_gemm_scaled, ops/backend.h): the same e4m3/e5m2 rounding as
// runtime/dtype.h (the encoder the CUDA tests compare against), group amaxes and scales as
// ops/fp8.h's fp8_group_scale defines them.
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {

using cpu::dispatch_float;

uint8_t encode_fp8(float v, DType fmt) {
  return fmt == DType::E4M3 ? f32_to_e4m3(v) : f32_to_e5m2(v);
}

// max over |v| that skips NaN (a NaN compares false).
inline float max_abs(float m, float v) {
  float a = std::fabs(v);
  return a > m ? a : m;
}

float* f32(const Tensor& t) { return static_cast<float*>(t.data_ptr()); }
uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Decoded values of all 256 codes of a format.
const std::array<float, 256>& decode_table(DType fmt) {
  static std::array<float, 256> e4m3, e5m2;
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = e4m3_to_f32(static_cast<uint8_t>(i));
      e5m2[i] = e5m2_to_f32(static_cast<uint8_t>(i));
    }
  });
  return fmt == DType::E4M3 ? e4m3 : e5m2;
}

void scaled_cast(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2, bool one_scale,
                 const Tensor& data, const Tensor& scale_inv) {
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t rows = transpose ? C : R, K = transpose ? R : C;
  const int64_t rows_p = data.size(0), k_p = data.size(1);
  const int64_t slots = scale_inv.numel();
  const DType fmt = data.dtype();
  const float fmax = fp8_max_value(fmt);
  uint8_t* d = bytes(data);
  float* si = f32(scale_inv);
  std::memset(d, 0, static_cast<size_t>(data.numel()));
  std::vector<float> amax(static_cast<size_t>(one_scale ? 1 : slots), 0.0f);
  dispatch_float(x.dtype(), "fp8_cast_scaled", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* src = accel::cpu::ptr<Tr>(x);
    auto value = [&](int64_t r, int64_t k) {
      return static_cast<float>(Tr::load(transpose ? src[k * C + r] : src[r * C + k]));
    };
    auto slot = [&](int64_t r, int64_t k) {
      return one_scale ? 0 : fp8_scale_index(mode, r, k, rows_p, k_p);
    };
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) {
        float& m = amax[static_cast<size_t>(slot(r, k))];
        m = max_abs(m, value(r, k));
      }
    std::vector<float> scale(amax.size());
    for (size_t i = 0; i < amax.size(); ++i) scale[i] = fp8_group_scale(amax[i], fmax, pow2);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k)
        d[r * k_p + k] = encode_fp8(value(r, k) * scale[static_cast<size_t>(slot(r, k))], fmt);
    for (int64_t i = 0; i < slots; ++i)
      si[i] = 1.0f / scale[one_scale ? 0 : static_cast<size_t>(i)];
  });
}

// The per-row / per-block scaled GEMM: both operands dequantized to fp32 with their scales (each
// product q * scale_inv rounded once to fp32), then one fp32 GEMM. The tensor cores instead scale
// each 128-long partial sum (block modes) or the finished sum (row mode); the difference is fp32
// rounding only.
void scaled_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, Fp8ScaleMode a_mode,
                 const Tensor& b, const Tensor& b_scale_inv, Fp8ScaleMode b_mode) {
  auto decode = [](const Tensor& q, const Tensor& si, Fp8ScaleMode mode) {
    const int64_t rows = q.size(0), K = q.size(1);
    Tensor f = Tensor::empty(q.shape(), DType::F32);
    const auto& table = decode_table(q.dtype());
    const uint8_t* src = bytes(q);
    const float* s = f32(si);
    float* dst = f32(f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k)
        dst[r * K + k] = table[src[r * K + k]] * s[fp8_scale_index(mode, r, k, rows, K)];
    return f;
  };
  Tensor fa = decode(a, a_scale_inv, a_mode), fb = decode(b, b_scale_inv, b_mode);
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  Tensor acc = out.dtype() == DType::F32 ? out : Tensor::empty({M, N}, DType::F32);
  cpu_backend().matmul(acc.as_strided({1, M, N}, {M * N, N, 1}, acc.offset()),
                       fa.as_strided({1, M, K}, {M * K, K, 1}, 0),
                       fb.as_strided({1, N, K}, {N * K, K, 1}, 0), false, true, 1.0, 0.0, Tensor());
  if (!acc.same(out)) out.copy_(acc);
}

}  // namespace

void CpuBackend::fp8_cast_scaled(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2,
                                 bool one_scale, const Tensor& data, const Tensor& scale_inv) {
  scaled_cast(x, transpose, mode, pow2, one_scale, data, scale_inv);
}

void CpuBackend::fp8_gemm_scaled(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                                 Fp8ScaleMode a_mode, const Tensor& b, const Tensor& b_scale_inv,
                                 Fp8ScaleMode b_mode, bool fast_accum) {
  (void)fast_accum;  // fp32 accumulation either way
  scaled_gemm(out, a, a_scale_inv, a_mode, b, b_scale_inv, b_mode);
}

}  // namespace accel
