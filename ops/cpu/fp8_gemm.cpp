// The CPU emulation of the fp8 GEMM (CpuBackend::fp8_gemm): fp32 GEMMs on the decoded values.
// The products of two fp8 values are exact in fp32, so only the summation order differs from a
// tensor-core fp8 GEMM.
#include <array>
#include <mutex>

#include "ops/cpu/cpu_backend.h"

namespace accel {
namespace {

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

float* f32(const Tensor& t) { return static_cast<float*>(t.data_ptr()); }
uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

void CpuBackend::fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                          const Tensor& b, const Tensor& b_scale_inv, bool fast_accum,
                          const Tensor& addend) {
  (void)fast_accum;  // fp32 accumulation either way
  auto decode = [](const Tensor& q) {
    Tensor f = Tensor::empty(q.shape(), DType::F32);
    const auto& table = decode_table(q.dtype());
    const uint8_t* src = bytes(q);
    float* dst = f32(f);
    for (int64_t i = 0; i < q.numel(); ++i) dst[i] = table[src[i]];
    return f;
  };
  Tensor fa = decode(a), fb = decode(b);
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  // The sum is made in fp32 and rounded once to out's dtype, as cuBLASLt's epilogue does: an f32
  // out accumulates in place, a 16-bit one through an f32 buffer.
  Tensor acc = out.dtype() == DType::F32 ? out : Tensor::empty({M, N}, DType::F32);
  const bool add = addend.defined();
  if (add && addend.data_ptr() != acc.data_ptr()) acc.copy_(addend);  // exact in f32
  // cuBLASLt scales the accumulated product: D = (scale_a * scale_b) * (A . B) + C.
  const float alpha = *f32(a_scale_inv) * *f32(b_scale_inv);
  cpu_backend().matmul(acc.as_strided({1, M, N}, {M * N, N, 1}, acc.offset()),
                       fa.as_strided({1, M, K}, {M * K, K, 1}, 0),
                       fb.as_strided({1, N, K}, {N * K, K, 1}, 0), false, true, alpha,
                       add ? 1.0 : 0.0, Tensor());
  if (!acc.same(out)) out.copy_(acc);
}

}  // namespace accel
