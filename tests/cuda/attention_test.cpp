// Attention forward/backward (tensor-core and generic kernels) against the CPU backend, with
// grouped KV heads, causal and full masks, and sequence lengths that are not tile multiples.
#include <gtest/gtest.h>

#include <cmath>

#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace accel {
namespace {
using namespace cuda_test;

struct AttnCase {
  DType dtype;
  int64_t b, s, hq, hkv, d;
  bool causal;
  bool generic;  // force the generic kernels
};

std::string case_name(const AttnCase& c) {
  return std::string(dtype_name(c.dtype)) + "_b" + std::to_string(c.b) + "_s" +
         std::to_string(c.s) + "_hq" + std::to_string(c.hq) + "_hkv" + std::to_string(c.hkv) +
         "_d" + std::to_string(c.d) + (c.causal ? "_causal" : "_full") +
         (c.generic ? "_generic" : "");
}

class CudaAttention : public ::testing::TestWithParam<AttnCase> {
 protected:
  void SetUp() override {
#ifdef ACCEL_WITH_CUDA
    if (cuda::available()) cuda::set_attention_impl(GetParam().generic ? "generic" : "auto");
#endif
  }
  void TearDown() override {
#ifdef ACCEL_WITH_CUDA
    if (cuda::available()) cuda::set_attention_impl("auto");
#endif
  }
};

TEST_P(CudaAttention, ForwardAndBackwardMatchCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const AttnCase c = GetParam();
  const DType t = c.dtype;
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const Shape qs{c.b, c.s, c.hq, c.d}, ks{c.b, c.s, c.hkv, c.d}, ls{c.b, c.hq, c.s};
  Tensor q = random_tensor(qs, t, rng, -2, 2), k = random_tensor(ks, t, rng, -2, 2);
  Tensor v = random_tensor(ks, t, rng);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Tensor want = cpu_out(qs, t), wl = cpu_out(ls, DType::F32);
  cpu_backend().attention(want, wl, q, k, v, c.causal, scale);
  Tensor qg = q.to(gpu()), kg = k.to(gpu()), vg = v.to(gpu());
  Tensor got = poisoned(qs, t), gl = poisoned(ls, DType::F32);
  cuda_backend().attention(got, gl, qg, kg, vg, c.causal, scale);
  expect_matches(got, want, t, "attention out", 2.0);
  expect_close(gl, wl, t == DType::F32 ? 1e-5 : 2e-3, t == DType::F32 ? 1e-5 : 2e-3, "lse");

  Tensor dout = random_tensor(qs, t, rng);
  Tensor wdq = cpu_out(qs, t), wdk = cpu_out(ks, t), wdv = cpu_out(ks, t);
  cpu_backend().attention_backward(wdq, wdk, wdv, dout, q, k, v, want, wl, c.causal, scale);
  Tensor gdq = poisoned(qs, t), gdk = poisoned(ks, t), gdv = poisoned(ks, t);
  cuda_backend().attention_backward(gdq, gdk, gdv, dout.to(gpu()), qg, kg, vg, want.to(gpu()),
                                    wl.to(gpu()), c.causal, scale);
  // Gradients sum over many rows: compare against each tensor's scale.
  const double r = t == DType::F32 ? 1e-4 : 2e-2;
  expect_close(gdq, wdq, r, r * rms(wdq), "grad_q");
  expect_close(gdk, wdk, r, r * rms(wdk), "grad_k");
  expect_close(gdv, wdv, r, r * rms(wdv), "grad_v");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention,
                         ::testing::Values(AttnCase{DType::BF16, 2, 100, 4, 2, 64, true, false},
                                           AttnCase{DType::BF16, 1, 130, 4, 1, 128, true, false},
                                           AttnCase{DType::BF16, 2, 77, 2, 2, 64, false, false},
                                           AttnCase{DType::F16, 1, 129, 4, 2, 128, true, false},
                                           AttnCase{DType::BF16, 1, 300, 4, 1, 64, true, false},
                                           AttnCase{DType::F16, 1, 200, 2, 2, 64, false, false},
                                           AttnCase{DType::BF16, 2, 100, 4, 2, 64, true, true},
                                           AttnCase{DType::F32, 2, 70, 4, 2, 64, true, false},
                                           AttnCase{DType::F32, 1, 45, 3, 1, 80, false, false},
                                           AttnCase{DType::F32, 1, 33, 2, 2, 16, true, false}),
                         [](const auto& info) { return case_name(info.param); });

TEST(CudaAttentionOps, AutogradThroughOpsLayer) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor q = random_tensor({1, 20, 2, 32}, DType::F32, rng);
  Tensor k = random_tensor({1, 20, 1, 32}, DType::F32, rng);
  Tensor v = random_tensor({1, 20, 1, 32}, DType::F32, rng);
  Tensor want = attention(q, k, v, true);
  Tensor got = attention(q.to(gpu()), k.to(gpu()), v.to(gpu()), true);
  expect_matches(got, want, DType::F32, "attention op", 2.0);
}

}  // namespace
}  // namespace accel
