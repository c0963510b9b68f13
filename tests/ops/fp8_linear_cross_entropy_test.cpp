// fp8_linear_cross_entropy (the LM head in fp8 fused with the loss over row chunks) against the
// unfused fp8 head, fp8_linear and then cross_entropy, on the CPU emulation: TE's delayed recipe
// (HYBRID, E4M3, the wgrad GEMM in high precision) and MXFP8, f32 and bf16, over three steps with
// scale updates, several chunkings with a ragged last chunk, ignored targets and an upstream
// factor (expected: grad_scale); the logits-sized buffers are gone; fp8 switched off is
// linear_cross_entropy; recipes whose scales span all rows run unfused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "runtime/autograd.h"
#include "runtime/device.h"
#include "tests/ops/fp8_head_check.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {
using test::first_difference;
using test::HeadRecipe;
using test::HeadShape;
using test::HeadStep;

// The weight gradient is the one quantity whose arithmetic differs: the fused head sums the
// chunks' wgrad GEMMs in fp32 and rounds once, the unfused head runs one GEMM over all rows. The
// products (of fp8 values, or of the MX-quantized values) are the same; only their fp32 sum is
// grouped differently: each chunk is summed, scaled by the two scale_invs and added. With R
// rows that changes each element by at most ~(R + chunks) * 2^-24 of the sum of its terms'
// magnitudes; on these gradients (no cancellation beyond ~10x) that is < 1e-5 of the largest
// element. For 16-bit weights the sums are then rounded once to the weight's dtype, so an
// element may land on the neighbouring value: at most one ulp of that dtype apart.
void expect_weight_grads_agree(const Tensor& fused, const Tensor& unfused) {
  ASSERT_EQ(fused.shape(), unfused.shape());
  ASSERT_EQ(fused.dtype(), unfused.dtype());
  const std::vector<double> a = fused.to_vector(), b = unfused.to_vector();
  double largest = 0;
  for (double v : b) largest = std::max(largest, std::abs(v));
  ASSERT_GT(largest, 0.0);
  const bool f32 = fused.dtype() == DType::F32;
  const int mantissa = fused.dtype() == DType::BF16 ? 7 : 10;
  size_t same = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    same += a[i] == b[i];
    const double m = std::max(std::abs(a[i]), std::abs(b[i]));
    const double ulp = m > 0 ? std::ldexp(1.0, std::ilogb(m) - mantissa) : 0.0;
    const double tol = f32 ? 1e-5 * largest : ulp + 1e-5 * largest * std::ldexp(1.0, -mantissa);
    ASSERT_LE(std::abs(a[i] - b[i]), tol)
        << "weight grad element " << i << ": fused " << a[i] << " vs unfused " << b[i];
  }
  // In 16 bits the regrouped fp32 sums mostly round to the same value.
  if (!f32) {
    EXPECT_GT(same, a.size() / 2) << "only " << same << " of " << a.size() << " equal";
  }
}

void expect_same(const std::vector<double>& a, const std::vector<double>& b, const char* what) {
  const std::string d = first_difference(a, b);
  EXPECT_TRUE(d.empty()) << what << ": " << d;
}

TEST(Fp8LinearCrossEntropy, EqualsFp8LinearThenCrossEntropy) {
  const HeadShape s{200, 48, 96};  // 200 rows: 16 | 48 | 64 | 112-row chunks end ragged
  for (HeadRecipe h : {HeadRecipe::Delayed, HeadRecipe::DelayedE4M3, HeadRecipe::DelayedHpWgrad,
                       HeadRecipe::Mxfp8}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      const double factor = 0.375;  // the trainer's loss scale / micro-batch weight
      const std::vector<HeadStep> want =
          test::fp8_head_steps(Device::cpu(), h, dt, s, false, 0, factor);
      // 0: one chunk (2^27 / V rows); 16, 48 (MXFP8: 64) and 112 rows (100 rounded up to whole
      // 16- or 32-row multiples) leave a last chunk of 8, 8 (MXFP8: 8) and 88 rows.
      for (int64_t chunk : {0, 16, 48, 100}) {
        SCOPED_TRACE(std::string(test::head_recipe_name(h)) + " " + dtype_name(dt) +
                     " chunk_rows " + std::to_string(chunk));
        const std::vector<HeadStep> got =
            test::fp8_head_steps(Device::cpu(), h, dt, s, true, chunk, factor);
        for (size_t step = 0; step < want.size(); ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          // Row by row the same arithmetic: the same casts (x's rows with the slot's scale), the
          // same GEMM per row, the same cross-entropy.
          EXPECT_EQ(got[step].loss, want[step].loss);
          expect_same(got[step].gx.to_vector(), want[step].gx.to_vector(), "grad x");
          expect_weight_grads_agree(got[step].gw, want[step].gw);
          // The scaling state: every amax (x's and the output gradient's the max over the chunks)
          // and the scales computed from them.
          expect_same(got[step].history, want[step].history, "amax history");
          expect_same(got[step].scales, want[step].scales, "scales");
          expect_same(got[step].scale_invs, want[step].scale_invs, "scale_invs");
        }
        if (h != HeadRecipe::Mxfp8) {  // the scales moved off 1: the later steps cast with them
          for (double sc : got.back().scales) EXPECT_NE(sc, 1.0);
        }
      }
    }
  }
}

// The peak of activation bytes of a forward and backward: the unfused head holds the [N, V]
// logits, their gradient and its fp8 copies; the fused one a chunk of each.
int64_t peak_activation_bytes(bool fused, int64_t chunk) {
  const int64_t N = 512, D = 32, V = 1024;
  Fp8LinearContext ctx = test::fp8_head_context(HeadRecipe::Delayed, Device::cpu());
  Tensor x = test::randn({N, D}, 5, DType::F32).set_requires_grad(true);
  Tensor w = test::randn({V, D}, 6, DType::F32, 0.2).set_requires_grad(true);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < N; ++i) ids.push_back((i * 13) % V);
  const Tensor t = Tensor::from_vector(ids, {N}, DType::I64);
  const int cat = static_cast<int>(MemCategory::Activations);
  const int64_t before = memory_stats(Device::cpu()).current[cat];
  reset_peak_memory_stats(Device::cpu());
  {
    Tensor loss = fused ? fp8_linear_cross_entropy(x, w, t, ctx, -100, chunk)
                        : cross_entropy(fp8_linear(x, w, Tensor(), ctx), t);
    loss.backward();
  }
  return memory_stats(Device::cpu()).peak[cat] - before;
}

TEST(Fp8LinearCrossEntropy, HoldsNoLogitsSizedBuffers) {
  const int64_t logits = int64_t{512} * 1024 * 4;  // [N, V] f32
  const int64_t unfused = peak_activation_bytes(false, 0);
  const int64_t fused = peak_activation_bytes(true, 64);
  std::printf("peak activation bytes: unfused %lld, fused (64-row chunks) %lld, logits %lld\n",
              static_cast<long long>(unfused), static_cast<long long>(fused),
              static_cast<long long>(logits));
  // Unfused: the logits, their gradient (each N x V x 4 bytes) and its e5m2 copies (2 x N x V);
  // fused: 8 chunks, so what is left are chunk-sized buffers and x- and weight-sized ones.
  EXPECT_GE(unfused - fused, 2 * logits);
  EXPECT_LT(fused, logits);
}

TEST(Fp8LinearCrossEntropy, Fp8OffIsLinearCrossEntropyAndRecordsNothing) {
  Fp8LinearContext ctx = test::fp8_head_context(HeadRecipe::Delayed, Device::cpu());
  auto off = std::make_shared<Fp8Autocast>();
  off->enabled = false;
  ctx.autocast = off;
  const Tensor x = test::randn({40, 16}, 7, DType::F32), w = test::randn({32, 16}, 8, DType::F32);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 40; ++i) ids.push_back(i % 32);
  const Tensor t = Tensor::from_vector(ids, {40}, DType::I64);
  EXPECT_EQ(fp8_linear_cross_entropy(x, w, t, ctx, -100, 16).item(),
            linear_cross_entropy(x, w, t, -100, 16).item());
  for (double a : ctx.delayed->current_amaxes().to_vector()) EXPECT_EQ(a, 0.0);
  // Evaluation in fp8 (use_autocast_during_eval) runs fused and records nothing either.
  off->enabled = true;
  off->record_amax = false;
  NoGradGuard no_grad;
  const double in_fp8 = fp8_linear_cross_entropy(x, w, t, ctx, -100, 16).item();
  EXPECT_EQ(in_fp8, cross_entropy(fp8_linear(x, w, Tensor(), ctx), t).item());
  for (double a : ctx.delayed->current_amaxes().to_vector()) EXPECT_EQ(a, 0.0);
}

// Dynamic scaling casts the whole output gradient with one amax, the rowwise recipes scale its
// wgrad operand per column over all rows: those run the fp8 linear, then the loss (the LM head
// never converts under AO; the op still gives the unfused result).
TEST(Fp8LinearCrossEntropy, RecipesWhoseScalesSpanAllRowsRunUnfused) {
  EXPECT_EQ(fp8_linear_cross_entropy_unfused_reason(Fp8Recipe{}), "");
  Fp8Recipe mx;
  mx.scaling = Fp8Scaling::MxBlock;
  EXPECT_EQ(fp8_linear_cross_entropy_unfused_reason(mx), "");
  for (Fp8Scaling sc : {Fp8Scaling::Dynamic, Fp8Scaling::Rowwise, Fp8Scaling::Blockwise}) {
    Fp8LinearContext ctx;
    ctx.recipe.scaling = sc;
    if (sc != Fp8Scaling::Dynamic) ctx.recipe.backward_dtype = DType::E4M3;
    EXPECT_NE(fp8_linear_cross_entropy_unfused_reason(ctx.recipe), "");
    const Tensor x0 = test::randn({48, 32}, 9, DType::F32), w0 = test::randn({64, 32}, 10);
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 48; ++i) ids.push_back(i % 3 == 2 ? -100 : (i * 5) % 64);
    const Tensor t = Tensor::from_vector(ids, {48}, DType::I64);
    Tensor x1 = x0.clone().set_requires_grad(true), w1 = cast(w0, DType::F32);
    Tensor x2 = x0.clone().set_requires_grad(true), w2 = cast(w0, DType::F32);
    w1.set_requires_grad(true);
    w2.set_requires_grad(true);
    Tensor a = fp8_linear_cross_entropy(x1, w1, t, ctx, -100, 16);
    Tensor b = cross_entropy(fp8_linear(x2, w2, Tensor(), ctx), t);
    EXPECT_EQ(a.item(), b.item());
    a.backward();
    b.backward();
    expect_same(x1.grad().to_vector(), x2.grad().to_vector(), "grad x");
    expect_same(w1.grad().to_vector(), w2.grad().to_vector(), "grad w");
  }
}

}  // namespace
}  // namespace accel
