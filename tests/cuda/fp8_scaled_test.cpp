// The CUDA path of the rowwise / rowwise_with_gw_hp / blockwise recipes against the CPU emulation:
// the per-row and per-block casts bit for bit (data and scale_inv, every mode, transposed or not,
// power-of-2 scales, the one-scale variant), the cuBLASLt GEMMs with OUTER_VEC_32F, VEC128_32F and
// BLK128x128_32F scales against the CPU's dequantized fp32 GEMM, and fp8_linear's output and
// gradients per recipe. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {

using cuda_test::gpu;
using cuda_test::random_tensor;
using M = Fp8ScaleMode;

// Random values with an outlier column and a zero row, so groups differ.
Tensor input(int64_t R, int64_t C, DType dtype, std::mt19937_64& rng) {
  std::vector<double> v = random_tensor({R, C}, DType::F32, rng).to_vector();
  for (int64_t r = 0; r < R; ++r) {
    v[r * C + (C > 5 ? 5 : 0)] *= 40.0;
    if (r == 3 && r < R)
      for (int64_t c = 0; c < C; ++c) v[r * C + c] = 0.0;
  }
  return Tensor::from_vector(v, {R, C}, dtype);
}

void expect_equal_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  Tensor g = got.to(Device::cpu());
  const auto* a = static_cast<const uint8_t*>(g.data_ptr());
  const auto* b = static_cast<const uint8_t*>(want.data_ptr());
  int64_t bad = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(want.nbytes()); ++i)
    if (a[i] != b[i] && bad++ < 5)
      ADD_FAILURE() << what << " byte " << i << ": cuda " << int(a[i]) << " cpu " << int(b[i]);
  EXPECT_EQ(bad, 0) << what;
}

TEST(CudaFp8Scaled, CastsMatchCpuBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  struct Shape2 {
    int64_t R, C;
  };
  for (Shape2 sh : {Shape2{150, 300}, Shape2{256, 512}, Shape2{7, 40}, Shape2{1000, 2048}})
    for (DType dt : {DType::BF16, DType::F32}) {
      Tensor x = input(sh.R, sh.C, dt, rng);
      Tensor xg = x.to(gpu());
      for (M mode : {M::Row, M::Block1x128, M::Block128x128})
        for (bool transpose : {false, true})
          for (bool pow2 : {false, true})
            for (bool one : {false, true}) {
              if (one && mode != M::Row) continue;
              const std::string what = std::to_string(sh.R) + "x" + std::to_string(sh.C) + " " +
                                       dtype_name(dt) + " " + fp8_scale_mode_name(mode) +
                                       (transpose ? " T" : "") + (pow2 ? " pow2" : "") +
                                       (one ? " one" : "");
              Fp8ScaledTensor c = fp8_cast_scaled(x, DType::E4M3, mode, transpose, pow2, one);
              Fp8ScaledTensor g = fp8_cast_scaled(xg, DType::E4M3, mode, transpose, pow2, one);
              expect_equal_bytes(g.data, c.data, what + " data");
              expect_equal_bytes(g.scale_inv, c.scale_inv, what + " scale_inv");
            }
    }
}

void check_gemm(M ma, M mb, int64_t m, int64_t n, int64_t k, DType out, bool fast,
                std::mt19937_64& rng) {
  Tensor xa = input(m, k, DType::BF16, rng), xb = input(n, k, DType::BF16, rng);
  Fp8ScaledTensor a = fp8_cast_scaled(xa, DType::E4M3, ma, false, false);
  Fp8ScaledTensor b = fp8_cast_scaled(xb, DType::E4M3, mb, false, false);
  Fp8ScaledTensor ag = fp8_cast_scaled(xa.to(gpu()), DType::E4M3, ma, false, false);
  Fp8ScaledTensor bg = fp8_cast_scaled(xb.to(gpu()), DType::E4M3, mb, false, false);
  std::vector<double> want = fp8_gemm_scaled(a, b, DType::F32, false).to_vector();
  std::vector<double> got = fp8_gemm_scaled(ag, bg, out, fast).to(Device::cpu()).to_vector();
  ASSERT_EQ(got.size(), want.size());
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  // Hopper's fp8 tensor cores keep fewer bits than fp32 in their partial sums (seen on the H200:
  // up to 1.2e-3 of the largest output at K = 300..1000, for every scale mode, with and without
  // fast accumulation), so an fp32 output gets the bf16 output's allowance, as
  // CudaFp8.GemmMatchesCpuEmulation gives the per-tensor GEMM. A wrong scale (a slot misread,
  // a block misplaced) moves elements by far more.
  const double tol = 8e-3 * scale + 1e-30;
  const std::string what = std::string(fp8_scale_mode_name(ma)) + " x " + fp8_scale_mode_name(mb) +
                           " -> " + dtype_name(out) + (fast ? " fast" : "") + " " +
                           std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

TEST(CudaFp8Scaled, GemmsMatchCpuEmulation) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(6);
  for (DType out : {DType::BF16, DType::F32}) {
    check_gemm(M::Row, M::Row, 256, 512, 384, out, false, rng);
    check_gemm(M::Row, M::Row, 200, 144, 300, out, true, rng);
    check_gemm(M::Block1x128, M::Block128x128, 256, 512, 384, out, false, rng);
    check_gemm(M::Block1x128, M::Block128x128, 200, 144, 300, out, false, rng);
    check_gemm(M::Block128x128, M::Block1x128, 512, 256, 384, out, false, rng);
    check_gemm(M::Block1x128, M::Block1x128, 256, 512, 1000, out, false, rng);
  }
}

TEST(CudaFp8Scaled, LinearMatchesCpuPerRecipe) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  struct R {
    const char* name;
    Fp8Recipe r;
  };
  auto recipe = [](Fp8Scaling s, bool pow2, bool gw_hp) {
    Fp8Recipe r;
    r.scaling = s;
    r.forward_dtype = r.backward_dtype = DType::E4M3;
    r.pow2_scales = pow2;
    r.dgrad_weight_tensorwise = r.hp_wgrad = gw_hp;
    return r;
  };
  const int64_t Mt = 300, K = 384, N = 256;
  Tensor x0 = input(Mt, K, DType::BF16, rng);
  Tensor w0 = cast(mul(cast(input(N, K, DType::F32, rng), DType::F32),
                       Tensor::from_vector(std::vector<double>{0.05}, {1}, DType::F32)),
                   DType::BF16);
  Tensor g0 = cast(mul(random_tensor({Mt, N}, DType::F32, rng),
                       Tensor::from_vector(std::vector<double>{1e-3}, {1}, DType::F32)),
                   DType::BF16);
  for (const R& rc : {R{"rowwise", recipe(Fp8Scaling::Rowwise, true, false)},
                      R{"rowwise_with_gw_hp", recipe(Fp8Scaling::Rowwise, false, true)},
                      R{"blockwise", recipe(Fp8Scaling::Blockwise, false, false)}}) {
    Fp8LinearContext ctx;
    ctx.recipe = rc.r;
    auto run = [&](Device d) {
      Tensor x = x0.to(d).clone().set_requires_grad(true);
      Tensor w = w0.to(d).clone().set_requires_grad(true);
      Tensor y = fp8_linear(x, w, Tensor(), ctx);
      y.backward(g0.to(d));
      return std::vector<Tensor>{y.detach().to(Device::cpu()), x.grad().to(Device::cpu()),
                                 w.grad().to(Device::cpu())};
    };
    std::vector<Tensor> c = run(Device::cpu()), g = run(gpu());
    const char* parts[3] = {"output", "input gradient", "weight gradient"};
    for (int i = 0; i < 3; ++i) {
      std::vector<double> a = c[i].to_vector(), b = g[i].to_vector();
      ASSERT_EQ(a.size(), b.size());
      double scale = 0;
      for (double v : a) scale = std::max(scale, std::fabs(v));
      // bf16 outputs: one bf16 rounding apart (2^-8 relative) plus accumulation order.
      for (size_t j = 0; j < a.size(); ++j)
        ASSERT_NEAR(b[j], a[j], 1e-2 * scale) << rc.name << " " << parts[i] << " element " << j;
    }
  }
}

}  // namespace
}  // namespace accel
