// linear_cross_entropy on the GPU against the CPU twin of the two-op definition: the loss and both
// gradients, for 16-bit and f32 inputs, with chunks that split the rows unevenly. The weight's
// gradient in 16-bit is rounded once per chunk, so its bound grows with the chunk count.
// fp8_linear_cross_entropy (the fp8 LM head fused with the loss) on the GPU against its CPU
// emulation and against the unfused fp8 head on the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "ops/ops.h"
#include "runtime/autograd.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/ops/fp8_head_check.h"

namespace accel {
namespace {
using namespace cuda_test;

TEST(CudaLinearCrossEntropy, MatchesCpuLinearThenCrossEntropy) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t N = 300, D = 64, V = 1000;
  Tensor x64 = random_tensor({N, D}, DType::F64, rng), w64 = random_tensor({V, D}, DType::F64, rng);
  std::vector<int64_t> ids;
  for (double id : random_ints({N}, 0, V, rng).to_vector()) ids.push_back(static_cast<int64_t>(id));
  for (int64_t i = 0; i < N; i += 7) ids[static_cast<size_t>(i)] = -100;
  Tensor t = Tensor::from_vector(ids, {N}, DType::I64);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t chunk : {0, 64, 77}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " chunk_rows " + std::to_string(chunk));
      // The reference: the two ops on the CPU in f64 from the same rounded inputs.
      Tensor xr = cast(cast(x64, dt), DType::F64), wr = cast(cast(w64, dt), DType::F64);
      xr.set_requires_grad(true);
      wr.set_requires_grad(true);
      Tensor want = cross_entropy(linear(xr, wr), t);
      want.backward();
      Tensor xg = cast(x64, dt).to(gpu()), wg = cast(w64, dt).to(gpu());
      xg.set_requires_grad(true);
      wg.set_requires_grad(true);
      Tensor got = linear_cross_entropy(xg, wg, t.to(gpu()), -100, chunk);
      got.backward();
      const bool f32 = dt == DType::F32;
      const double tol = f32 ? 1e-4 : (dt == DType::BF16 ? 2e-2 : 4e-3);
      EXPECT_NEAR(got.item(), want.item(), (f32 ? 1e-5 : 1e-3) * std::abs(want.item()));
      // Relative to the largest gradient element: near-zero elements carry the same absolute error.
      auto largest = [](const Tensor& g) { return amax(g).item(); };
      expect_close(cast(xg.grad().to(Device::cpu()), DType::F64), xr.grad(), tol,
                   tol * largest(xr.grad()), "grad x");
      expect_close(cast(wg.grad().to(Device::cpu()), DType::F64), wr.grad(), tol,
                   tol * largest(wr.grad()), "grad w");
    }
  }
}

// The scaling state of two runs that cast with the same scales: x's and the weight's amaxes come
// from the same casts (bit for bit on the GPU), the output gradient's from logits whose GEMMs sum
// in another order, so its amax (a bf16 gradient element) may be a neighbouring value.
void expect_states_close(const test::HeadStep& got, const test::HeadStep& want) {
  ASSERT_EQ(got.history.size(), want.history.size());
  for (size_t i = 0; i < want.history.size(); ++i)
    EXPECT_NEAR(got.history[i], want.history[i], 2e-2 * std::abs(want.history[i]))
        << "amax history element " << i;
  for (size_t i = 0; i < want.scales.size(); ++i)
    EXPECT_NEAR(got.scales[i], want.scales[i], 2e-2 * std::abs(want.scales[i])) << "scale " << i;
}

// ||got - want|| / ||want||.
double relative_norm_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to(Device::cpu()).to_vector(), w = want.to_vector();
  double d = 0, n = 0;
  for (size_t i = 0; i < w.size(); ++i) d += (g[i] - w[i]) * (g[i] - w[i]), n += w[i] * w[i];
  return std::sqrt(d / std::max(n, 1e-300));
}

// How the gradients are compared. Elementwise: two GPU runs whose output gradients are cast from
// the same logits (fused against unfused). Norm: the GPU against the CPU emulation, where the
// logits differ by Hopper's fast fp8 accumulation, so a few output-gradient elements round to the
// neighbouring e5m2 value (2 mantissa bits: up to 25% of such an element); the weight and input
// gradients then differ elementwise wherever their sums cancel (seen on the H200: up to 201 of
// 131,072 weight-gradient elements past the elementwise bound, all near zero), while their norms
// agree to about the fraction of flipped elements times 25%. A wrong scale, layout or chunk is
// off by O(1) in norm.
enum class GradCheck { Elementwise, Norm };

void expect_head_steps_match(const std::vector<test::HeadStep>& got,
                             const std::vector<test::HeadStep>& want, const std::string& what,
                             GradCheck check) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t step = 0; step < want.size(); ++step) {
    SCOPED_TRACE(what + ", step " + std::to_string(step));
    // Tolerances of CudaFp8.LinearMatchesCpuEmulation: fp8 GEMMs (fprop with Hopper's fast
    // accumulation) against the fp32 emulation, bf16 outputs.
    EXPECT_NEAR(got[step].loss, want[step].loss, 2e-3 * std::abs(want[step].loss));
    if (check == GradCheck::Elementwise) {
      cuda_test::expect_matches(got[step].gx, want[step].gx, DType::BF16, "grad x", 2.0);
      cuda_test::expect_matches(got[step].gw, want[step].gw, DType::BF16, "grad w", 2.0);
    } else {
      EXPECT_LT(relative_norm_error(got[step].gx, want[step].gx), 5e-2) << "grad x";
      EXPECT_LT(relative_norm_error(got[step].gw, want[step].gw), 5e-2) << "grad w";
    }
    expect_states_close(got[step], want[step]);
  }
}

// 300 rows (ragged last chunks), bf16, TE's delayed recipe and MXFP8 (emulated), an upstream
// factor: the GPU against the CPU emulation of the same fused head, step by step from the same
// scales, and against the unfused head (fp8_linear, then cross_entropy) on the GPU.
TEST(CudaFp8LinearCrossEntropy, MatchesCpuAndTheUnfusedHead) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const test::HeadShape s{300, 128, 1024};
  for (test::HeadRecipe h : {test::HeadRecipe::Delayed, test::HeadRecipe::Mxfp8}) {
    for (int64_t chunk : {0, 64, 100}) {
      const std::string what =
          std::string(test::head_recipe_name(h)) + " chunk_rows " + std::to_string(chunk);
      SCOPED_TRACE(what);
      const std::vector<test::HeadStep> cpu =
          test::fp8_head_steps(Device::cpu(), h, DType::BF16, s, true, chunk, 0.5);
      const std::vector<test::HeadStep> fused =
          test::fp8_head_steps(gpu(), h, DType::BF16, s, true, chunk, 0.5, &cpu);
      expect_head_steps_match(fused, cpu, "GPU vs CPU", GradCheck::Norm);
      const std::vector<test::HeadStep> unfused =
          test::fp8_head_steps(gpu(), h, DType::BF16, s, false, 0, 0.5, &fused);
      expect_head_steps_match(fused, unfused, "fused vs unfused on the GPU",
                              GradCheck::Elementwise);
    }
  }
}

// The fp8 GEMM with an addend: into an f32 out itself (the fused head's weight gradient, beta 1),
// and a separate bf16 one (an input gradient's fold), each as the CPU emulation.
TEST(CudaFp8LinearCrossEntropy, Fp8GemmAccumulatesIntoF32Out) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(12);
  Tensor a = random_tensor({96, 64}, DType::F32, rng), b = random_tensor({48, 64}, DType::F32, rng);
  Fp8Tensor qa = fp8_cast_dynamic(a, DType::E5M2), qb = fp8_cast_dynamic(b, DType::E4M3);
  const Tensor start = random_tensor({96, 48}, DType::F32, rng);
  Tensor want = start.clone();
  fp8_gemm(want, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, want);
  Tensor got = start.to(gpu());
  fp8_gemm(got, qa.data.to(gpu()), qa.scale_inv.to(gpu()), qb.data.to(gpu()),
           qb.scale_inv.to(gpu()), false, got);
  cuda_test::expect_matches(got.to(Device::cpu()), want, DType::F32, "accumulated fp8 gemm", 100.0);
  // Twice: the second call adds the product again.
  fp8_gemm(got, qa.data.to(gpu()), qa.scale_inv.to(gpu()), qb.data.to(gpu()),
           qb.scale_inv.to(gpu()), false, got);
  fp8_gemm(want, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, want);
  cuda_test::expect_matches(got.to(Device::cpu()), want, DType::F32, "twice", 100.0);
  // A separate bf16 addend (an input gradient's fold): the GPU as the CPU emulation, and only read.
  const Tensor addend = cast(start, DType::BF16), addend_gpu = addend.to(gpu());
  Tensor want_bf = Tensor::empty({96, 48}, DType::BF16);
  fp8_gemm(want_bf, qa.data, qa.scale_inv, qb.data, qb.scale_inv, false, addend);
  Tensor got_bf = Tensor::empty({96, 48}, DType::BF16, gpu());
  fp8_gemm(got_bf, qa.data.to(gpu()), qa.scale_inv.to(gpu()), qb.data.to(gpu()),
           qb.scale_inv.to(gpu()), false, addend_gpu);
  cuda_test::expect_matches(got_bf.to(Device::cpu()), want_bf, DType::BF16, "bf16 addend", 100.0);
  EXPECT_EQ(addend_gpu.to(Device::cpu()).to_vector(), addend.to_vector()) << "addend written";
}

}  // namespace
}  // namespace accel
