// The CPU emulation of the fp8 casts (the fp8_* methods of ops/backend.h; the GEMM is in
// fp8_gemm.cpp): exact e4m3/e5m2 rounding through runtime/dtype.h (the same encoder the CUDA tests
// compare against).
#include <algorithm>
#include <cstring>
#include <mutex>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"
#include "ops/fp8.h"

namespace accel {
namespace {

using cpu::dispatch_float;
using cpu::parallel_for;

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

}  // namespace

void CpuBackend::fp8_cast(const Tensor& x, const Tensor& scale, const Tensor& data,
                          const Tensor& data_t, const Tensor& amax, const Tensor& scale_inv) {
  const int64_t R = x.size(0), C = x.size(1);
  const float s = *f32(scale);
  const DType fmt = data.defined() ? data.dtype() : data_t.dtype();
  uint8_t* d = data.defined() ? bytes(data) : nullptr;
  uint8_t* dt = data_t.defined() ? bytes(data_t) : nullptr;
  const int64_t cp = data.defined() ? data.size(1) : (dt ? data_t.size(0) : C);
  const int64_t rp = data.defined() ? data.size(0) : (dt ? data_t.size(1) : R);
  if (d) std::memset(d, 0, static_cast<size_t>(data.numel()));
  if (dt) std::memset(dt, 0, static_cast<size_t>(data_t.numel()));
  float m = 0.0f;
  dispatch_float(x.dtype(), "fp8_cast", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* src = accel::cpu::ptr<Tr>(x);
    std::mutex mu;
    parallel_for(R, std::max<int64_t>(1, accel::cpu::kGrain / std::max<int64_t>(C, 1)),
                 [&](int64_t r0, int64_t r1) {
                   float local = 0.0f;
                   for (int64_t r = r0; r < r1; ++r) {
                     for (int64_t c = 0; c < C; ++c) {
                       float v = static_cast<float>(Tr::load(src[r * C + c]));
                       local = max_abs(local, v);
                       uint8_t q = encode_fp8(v * s, fmt);
                       if (d) d[r * cp + c] = q;
                       if (dt) dt[c * rp + r] = q;
                     }
                   }
                   std::lock_guard<std::mutex> lock(mu);
                   m = std::max(m, local);
                 });
  });
  if (amax.defined()) {
    float* a = f32(amax);
    if (!(*a >= m)) *a = m;
  }
  if (scale_inv.defined()) *f32(scale_inv) = 1.0f / s;
}

void CpuBackend::fp8_amax(const Tensor& x, const Tensor& out) {
  float m = 0.0f;
  dispatch_float(x.dtype(), "fp8_amax", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* src = accel::cpu::ptr<Tr>(x);
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) m = max_abs(m, static_cast<float>(Tr::load(src[i])));
  });
  *f32(out) = m;
}

// The grouped casts are the single-tensor ones, group by group: the reference the CUDA kernels
// are held to.
void CpuBackend::fp8_cast_grouped(const std::vector<Fp8CastGroup>& groups,
                                  const Fp8GroupScaling& scaling) {
  fp8_casts_one_by_one(*this, groups, scaling);
}

void CpuBackend::fp8_amax_grouped(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) {
  fp8_amaxes_one_by_one(*this, xs, outs);
}

void CpuBackend::fp8_scale_from_amax(const Tensor& amax, const Tensor& scale,
                                     const Tensor& scale_inv, float fp8_max, int margin) {
  const float s = fp8_scale_for_amax(*f32(amax), fp8_max, margin, 1.0f);
  *f32(scale) = s;
  *f32(scale_inv) = 1.0f / s;
}

void CpuBackend::fp8_transpose(const Tensor& data_t, const Tensor& data) {
  const int64_t R = data.size(0), C = data.size(1);
  const uint8_t* src = bytes(data);
  uint8_t* dst = bytes(data_t);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) dst[c * R + r] = src[r * C + c];
}

void CpuBackend::fp8_delayed_update(const Tensor& history, const Tensor& scale,
                                    const Tensor& scale_inv, const Tensor& fp8_max, bool use_max,
                                    int margin, bool recompute) {
  const int64_t L = history.size(0), n = history.size(1);
  float* h = f32(history);
  float* s = f32(scale);
  float* si = f32(scale_inv);
  const float* mx = f32(fp8_max);
  for (int64_t j = 0; j < n; ++j) {
    if (recompute) {
      float a = 0.0f;
      const int64_t rows = use_max ? L : 1;
      for (int64_t i = 0; i < rows; ++i) {
        float v = h[i * n + j];
        if (fp8_amax_usable(v) && v > a) a = v;
      }
      const float ns = fp8_scale_for_amax(a, mx[j], margin, s[j]);
      if (ns != s[j]) {
        s[j] = ns;
        si[j] = 1.0f / ns;
      }
    }
    // Roll: the newest amax (row 0) goes to row L-1, rows 2..L-1 move up one, row 1 (the oldest)
    // drops out, row 0 restarts.
    const float newest = h[j];
    for (int64_t i = 1; i + 1 < L; ++i) h[i * n + j] = h[(i + 1) * n + j];
    if (L > 1) h[(L - 1) * n + j] = newest;
    h[j] = 0.0f;
  }
}

void CpuBackend::fp8_mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim) {
  const int64_t R = x.size(0), C = x.size(1);
  const float fmax = fp8_max_value(fmt);
  constexpr int64_t kBlock = 32;
  dispatch_float(x.dtype(), "fp8_mx_fake_quant", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* src = accel::cpu::ptr<Tr>(x);
    auto* dst = accel::cpu::ptr<Tr>(out);
    // Blocks run along `block_dim`: element k of block (outer, blk) is at index(outer, blk*32+k).
    const int64_t outer = block_dim == 1 ? R : C, inner = block_dim == 1 ? C : R;
    auto index = [&](int64_t o, int64_t i) { return block_dim == 1 ? o * C + i : i * C + o; };
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t b0 = 0; b0 < inner; b0 += kBlock) {
        const int64_t b1 = std::min(inner, b0 + kBlock);
        float m = 0.0f;
        for (int64_t i = b0; i < b1; ++i)
          m = max_abs(m, static_cast<float>(Tr::load(src[index(o, i)])));
        const int e = fp8_mx_block_exponent(m, fmax);
        for (int64_t i = b0; i < b1; ++i) {
          float v = static_cast<float>(Tr::load(src[index(o, i)]));
          uint8_t q = encode_fp8(ldexpf(v, -e), fmt);
          float back = fmt == DType::E4M3 ? e4m3_to_f32(q) : e5m2_to_f32(q);
          dst[index(o, i)] = Tr::store(ldexpf(back, e));
        }
      }
    }
  });
}

}  // namespace accel
