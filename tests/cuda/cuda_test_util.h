// Helpers for the CUDA tests: skip without a GPU, fresh random inputs, NaN-poisoned outputs, and
// comparison of a CUDA result against the CPU backend's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "ops/ops.h"
#include "runtime/device.h"
#include "runtime/tensor.h"

namespace accel::cuda_test {

#define ACCEL_SKIP_WITHOUT_CUDA()                                                           \
  do {                                                                                      \
    if (!::accel::cuda::available())                                                        \
      GTEST_SKIP() << "no CUDA device visible (or built without CUDA): CUDA tests skipped"; \
  } while (0)

inline Device gpu() { return Device::cuda(0); }

// A fresh seed per call (printed on failure through SCOPED_TRACE in the callers).
inline uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Random values in [lo, hi) rounded to dtype, on the CPU.
inline Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, double lo = -1.0,
                            double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (double& x : v) x = dist(rng);
  return Tensor::from_vector(v, shape, dtype);
}

inline Tensor random_ints(const Shape& shape, int64_t lo, int64_t hi, std::mt19937_64& rng,
                          DType dtype = DType::I64) {
  std::uniform_int_distribution<int64_t> dist(lo, hi - 1);
  std::vector<int64_t> v(static_cast<size_t>(shape_numel(shape)));
  for (int64_t& x : v) x = dist(rng);
  return Tensor::from_vector(v, shape, dtype);
}

// An output on the GPU filled with NaN (or 0x7f.. for integer types) so unwritten elements fail.
inline Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, gpu());
  t.fill_(is_floating(dtype) ? NAN : (dtype == DType::Bool ? 1.0 : 123456.0));
  return t;
}
inline Tensor cpu_out(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  t.fill_(is_floating(dtype) ? NAN : 0.0);
  return t;
}

// |got - want| <= atol + rtol * |want| elementwise (+ slack[i] where a per-element slack is
// given); NaN only where want is NaN.
inline void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol,
                         const std::string& what, const std::vector<double>* slack = nullptr) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  std::vector<double> g = got.to_vector(), w = want.to_vector();
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < g.size(); ++i) {
    bool ok;
    if (std::isnan(w[i]))
      ok = std::isnan(g[i]);
    else if (std::isinf(w[i]))
      ok = g[i] == w[i];
    else
      ok = !std::isnan(g[i]) &&
           std::fabs(g[i] - w[i]) <= atol + rtol * std::fabs(w[i]) + (slack ? (*slack)[i] : 0.0);
    if (!ok && bad++ == 0)
      first = "element " + std::to_string(i) + ": cuda " + std::to_string(g[i]) + " vs cpu " +
              std::to_string(w[i]);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements differ; first "
                    << first;
}

// Root mean square of a tensor's values (a scale for absolute tolerances).
inline double rms(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Tolerance pair for a dtype: fp32 ~1e-5 relative, 16-bit ~1e-2.
struct Tol {
  double rtol, atol_scale;
};
inline Tol tol_for(DType t) {
  if (t == DType::F32) return {1e-5, 1e-5};
  if (t == DType::F64) return {1e-10, 1e-10};
  return {1e-2, 1e-2};
}

inline void expect_matches(const Tensor& gpu_result, const Tensor& cpu_result, DType t,
                           const std::string& what, double extra = 1.0) {
  Tol tol = tol_for(t);
  expect_close(gpu_result, cpu_result, tol.rtol * extra,
               tol.atol_scale * extra * std::max(rms(cpu_result), 1e-30), what);
}

inline std::string seed_note(uint64_t seed) { return "seed " + std::to_string(seed); }

// fp8 codes equal, or both NaN (the hardware may keep a NaN's sign differently).
inline void expect_same_codes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  Tensor g = contiguous(got).to(Device::cpu()), w = contiguous(want).to(Device::cpu());
  const uint8_t* a = static_cast<const uint8_t*>(g.data_ptr());
  const uint8_t* b = static_cast<const uint8_t*>(w.data_ptr());
  const bool e4m3 = want.dtype() == DType::E4M3;
  int64_t bad = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const float fa = e4m3 ? e4m3_to_f32(a[i]) : e5m2_to_f32(a[i]);
    const float fb = e4m3 ? e4m3_to_f32(b[i]) : e5m2_to_f32(b[i]);
    if (a[i] == b[i] || (std::isnan(fa) && std::isnan(fb))) continue;
    if (bad++ < 5)
      ADD_FAILURE() << what << " element " << i << ": cuda 0x" << std::hex << int(a[i]) << " cpu 0x"
                    << int(b[i]) << std::dec << " (" << fa << " vs " << fb << ")";
  }
  EXPECT_EQ(bad, 0) << what;
}

// x with fp8 edge values (infinities, NaN, saturating and underflowing magnitudes, the largest
// codes' neighbours, signed zeros) at every 7th element from the start.
inline Tensor with_specials(Tensor x) {
  std::vector<double> v = x.to_vector();
  const double specials[] = {INFINITY, -INFINITY, NAN,   1e30,    -1e30, 1e-30, -0.0,
                             0.0,      447.9,     448.1, 57344.0, 1e-7,  3e-3,  -2.0e-3};
  for (size_t i = 0; i < sizeof(specials) / sizeof(double) && i * 7 < v.size(); ++i)
    v[i * 7] = specials[i];
  return Tensor::from_vector(v, x.shape(), x.dtype());
}

}  // namespace accel::cuda_test
