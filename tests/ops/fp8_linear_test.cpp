// The fp8 linear op on the CPU emulation, against the high-precision linear: every recipe
// (delayed, dynamic, MX emulation), GEMM precision overrides, odd (padded) shapes, evaluation
// switches and a supplied fp8 weight.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/fp8_mlp_check.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

double sqnr_db(const Tensor& ref, const Tensor& got) {
  std::vector<double> a = ref.to_vector(), b = got.to_vector();
  EXPECT_EQ(a.size(), b.size());
  double s = 0, e = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    s += a[i] * a[i];
    e += (a[i] - b[i]) * (a[i] - b[i]);
  }
  return 10.0 * std::log10(s / std::max(e, 1e-300));
}

struct Result {
  Tensor y, dx, dw;
};

// y = f(x, w); loss = sum(y * g) so that dy = g.
Result run(const std::function<Tensor(const Tensor&, const Tensor&)>& f, const Tensor& x0,
           const Tensor& w0, const Tensor& g) {
  Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
  Tensor y = f(x, w);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad()};
}

struct Problem {
  Tensor x, w, g;
  Result ref;  // the f32 linear on the same (bf16-rounded) values
};

Problem make_problem(Shape x_shape, int64_t out, uint64_t seed, DType dtype = DType::BF16) {
  const int64_t in = x_shape.back();
  Problem p;
  p.x = test::randn(x_shape, seed, dtype);
  p.w = test::randn({out, in}, seed + 1, dtype, 1.0 / std::sqrt(static_cast<double>(in)));
  Shape y_shape = x_shape;
  y_shape.back() = out;
  p.g = test::randn(y_shape, seed + 2, dtype, 1e-3);  // gradients are small, as in training
  p.ref = run([](const Tensor& x, const Tensor& w) { return linear(x, w); }, cast(p.x, DType::F32),
              cast(p.w, DType::F32), cast(p.g, DType::F32));
  return p;
}

Fp8LinearContext dynamic_ctx() {
  Fp8LinearContext c;
  c.recipe.scaling = Fp8Scaling::Dynamic;
  return c;
}

Fp8LinearContext delayed_ctx(int64_t history = 4) {
  Fp8LinearContext c;
  c.recipe.scaling = Fp8Scaling::Delayed;
  c.recipe.amax_history_len = history;
  c.recipe.amax_algo = AmaxAlgo::Max;
  c.delayed = std::make_shared<Fp8DelayedScaling>(c.recipe, Device::cpu());
  c.slot_input = c.delayed->add_slot(DType::E4M3);
  c.slot_weight = c.delayed->add_slot(DType::E4M3);
  c.slot_grad_output = c.delayed->add_slot(DType::E5M2);
  return c;
}

Result run_fp8(const Problem& p, const Fp8LinearContext& ctx) {
  return run([&](const Tensor& x, const Tensor& w) { return fp8_linear(x, w, Tensor(), ctx); }, p.x,
             p.w, p.g);
}

// Thresholds in the spirit of torchao's test_base (output >= 18 dB, grads >= 17 dB vs bf16).
void expect_sqnr(const Problem& p, const Result& r, double y_db, double dx_db, double dw_db,
                 const std::string& what) {
  ASSERT_EQ(r.y.shape(), p.ref.y.shape()) << what;
  ASSERT_EQ(r.dx.shape(), p.ref.dx.shape()) << what;
  ASSERT_EQ(r.dw.shape(), p.ref.dw.shape()) << what;
  EXPECT_EQ(r.y.dtype(), p.x.dtype()) << what;
  EXPECT_EQ(r.dx.dtype(), p.x.dtype()) << what;
  EXPECT_EQ(r.dw.dtype(), p.w.dtype()) << what;
  EXPECT_GE(sqnr_db(p.ref.y, r.y), y_db) << what << " output";
  EXPECT_GE(sqnr_db(p.ref.dx, r.dx), dx_db) << what << " input gradient";
  EXPECT_GE(sqnr_db(p.ref.dw, r.dw), dw_db) << what << " weight gradient";
}

TEST(Fp8Linear, DynamicScalingMatchesHighPrecision) {
  Problem p = make_problem({2, 16, 64}, 48, 1);
  expect_sqnr(p, run_fp8(p, dynamic_ctx()), 25, 20, 20, "dynamic");
}

TEST(Fp8Linear, DelayedScalingAfterTheFirstStepMatchesDynamic) {
  Problem p = make_problem({2, 16, 64}, 48, 2);
  Fp8LinearContext ctx = delayed_ctx();
  // Step 1 casts with the initial scale 1 (as TE does): gradients of 1e-3 lose most bits in e5m2.
  run_fp8(p, ctx);
  std::vector<double> h = ctx.delayed->current_amaxes().to_vector();
  EXPECT_GT(h[0], 1.0);   // input amax recorded in the forward cast
  EXPECT_GT(h[1], 0.1);   // weight amax
  EXPECT_GT(h[2], 1e-4);  // grad-output amax recorded in the backward cast
  ctx.delayed->update();
  // Step 2 uses scales from step 1's amaxes: the same tensors, so the same scales as dynamic.
  Result r2 = run_fp8(p, ctx);
  Result rd = run_fp8(p, dynamic_ctx());
  EXPECT_EQ(r2.y.to_vector(), rd.y.to_vector());
  EXPECT_EQ(r2.dx.to_vector(), rd.dx.to_vector());
  EXPECT_EQ(r2.dw.to_vector(), rd.dw.to_vector());
  expect_sqnr(p, r2, 25, 20, 20, "delayed");
}

TEST(Fp8Linear, E4M3FormatUsesE4M3Gradients) {
  Problem p = make_problem({32, 64}, 32, 3);
  Fp8LinearContext ctx = dynamic_ctx();
  ctx.recipe.backward_dtype = DType::E4M3;
  Result r = run_fp8(p, ctx);
  expect_sqnr(p, r, 25, 23, 23, "e4m3 gradients");
  // ... which are more precise than e5m2 ones.
  Result h = run_fp8(p, dynamic_ctx());
  EXPECT_GT(sqnr_db(p.ref.dx, r.dx), sqnr_db(p.ref.dx, h.dx));
}

TEST(Fp8Linear, OddShapesArePaddedForTheGemms) {
  // M = 7, K = 24, N = 40: none a multiple of 16.
  Problem p = make_problem({7, 24}, 40, 4);
  expect_sqnr(p, run_fp8(p, dynamic_ctx()), 25, 20, 20, "padded");
  Problem q = make_problem({3, 5, 17}, 9, 5, DType::F32);
  expect_sqnr(q, run_fp8(q, dynamic_ctx()), 25, 20, 20, "padded f32");
}

TEST(Fp8Linear, OverrideLinearPrecisionRunsThoseGemmsInHighPrecision) {
  Problem p = make_problem({32, 64}, 48, 6);
  Result bf16 = run([](const Tensor& x, const Tensor& w) { return linear(x, w); }, p.x, p.w, p.g);
  Fp8LinearContext ctx = dynamic_ctx();
  ctx.recipe.hp_wgrad = true;  // TE's (False, False, True)
  Result r = run_fp8(p, ctx);
  test::expect_close(r.dw, bf16.dw, 1e-2, 1e-6, "wgrad in bf16");
  EXPECT_LT(sqnr_db(p.ref.y, r.y), 40.0);  // the forward is still fp8
  ctx.recipe.hp_fprop = ctx.recipe.hp_dgrad = true;
  Result all = run_fp8(p, ctx);
  test::expect_close(all.y, bf16.y, 1e-2, 1e-5, "fprop in bf16");
  test::expect_close(all.dx, bf16.dx, 1e-2, 1e-8, "dgrad in bf16");
  test::expect_close(all.dw, bf16.dw, 1e-2, 1e-6, "wgrad in bf16");
  ctx.recipe.hp_wgrad = false;  // fprop and dgrad in bf16, wgrad in fp8
  Result w8 = run_fp8(p, ctx);
  test::expect_close(w8.y, bf16.y, 1e-2, 1e-5, "fprop in bf16");
  EXPECT_GE(sqnr_db(p.ref.dw, w8.dw), 20);
  EXPECT_LT(sqnr_db(p.ref.dw, w8.dw), 40);
}

TEST(Fp8Linear, MxBlockEmulation) {
  Problem p = make_problem({2, 16, 64}, 48, 7);
  Fp8LinearContext ctx;
  ctx.recipe.scaling = Fp8Scaling::MxBlock;
  ctx.recipe.backward_dtype = DType::E4M3;
  Result r = run_fp8(p, ctx);
  expect_sqnr(p, r, 25, 23, 23, "mxfp8");
  // The forward is exactly a GEMM of the block-quantized operands.
  Tensor x2 = reshape(p.x, {-1, 64});
  Tensor want = matmul(fp8_mx_fake_quant(x2, DType::E4M3, 1),
                       transpose(fp8_mx_fake_quant(p.w, DType::E4M3, 1), 0, 1));
  EXPECT_EQ(reshape(r.y, {-1, 48}).to_vector(), want.to_vector());
}

TEST(Fp8Linear, AutocastSwitches) {
  Problem p = make_problem({16, 32}, 16, 8);
  Fp8LinearContext ctx = delayed_ctx();
  auto mode = std::make_shared<Fp8Autocast>();
  ctx.autocast = mode;
  mode->enabled = false;  // evaluation in bf16: exactly the plain linear, nothing recorded
  Result off = run_fp8(p, ctx);
  Result bf16 = run([](const Tensor& x, const Tensor& w) { return linear(x, w); }, p.x, p.w, p.g);
  EXPECT_EQ(off.y.to_vector(), bf16.y.to_vector());
  for (double v : ctx.delayed->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
  mode->enabled = true;  // evaluation in fp8: histories untouched
  mode->record_amax = false;
  Tensor y;
  {
    NoGradGuard no_grad;
    y = fp8_linear(p.x, p.w, Tensor(), ctx);
  }
  EXPECT_FALSE(y.requires_grad());
  EXPECT_NE(y.to_vector(), bf16.y.to_vector());
  for (double v : ctx.delayed->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
  mode->record_amax = true;
  {
    NoGradGuard no_grad;
    fp8_linear(p.x, p.w, Tensor(), ctx);
  }
  EXPECT_GT(ctx.delayed->current_amaxes().to_vector()[0], 0.0);
}

TEST(Fp8Linear, WeightProviderAndBias) {
  Problem p = make_problem({16, 32}, 16, 9);
  Fp8LinearContext ctx = dynamic_ctx();
  int calls = 0;
  Fp8LinearContext with = ctx;
  with.weight_provider = [&](const Tensor& w) {
    ++calls;
    return fp8_cast_dynamic(w, DType::E4M3, Fp8CastOptions{true, false, 16});
  };
  Result a = run_fp8(p, ctx), b = run_fp8(p, with);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(a.y.to_vector(), b.y.to_vector());
  EXPECT_EQ(a.dx.to_vector(), b.dx.to_vector());
  EXPECT_EQ(a.dw.to_vector(), b.dw.to_vector());
  with.weight_provider = [&](const Tensor& w) {
    return fp8_cast_dynamic(w, DType::E4M3, Fp8CastOptions{true, false, 1});
  };
  Problem odd = make_problem({4, 24}, 8, 10);
  EXPECT_THROW(run_fp8(odd, with), std::invalid_argument);  // not padded to 16

  Tensor bias = Tensor::from_vector(std::vector<double>(16, 0.5), {16}, DType::BF16);
  Tensor y0 = fp8_linear(p.x, p.w, Tensor(), ctx), y1 = fp8_linear(p.x, p.w, bias, ctx);
  test::expect_close(y1, add(y0, bias).to_vector(), 0, 0, "bias");
}

TEST(Fp8Linear, GradientOnlyWhereNeeded) {
  Problem p = make_problem({16, 32}, 16, 11);
  Tensor w = p.w.clone().set_requires_grad(true);
  Tensor y = fp8_linear(p.x, w, Tensor(), dynamic_ctx());
  y.backward(p.g);
  EXPECT_TRUE(w.grad().defined());
  Tensor x = p.x.clone().set_requires_grad(true);
  Tensor y2 = fp8_linear(x, p.w, Tensor(), dynamic_ctx());
  y2.backward(p.g);
  EXPECT_GE(sqnr_db(p.ref.dx, x.grad()), 20);
  EXPECT_THROW(fp8_linear(p.x, Tensor::ones({16, 31}, DType::BF16), Tensor(), dynamic_ctx()),
               std::invalid_argument);
  Fp8LinearContext broken;  // delayed scaling without a state
  EXPECT_THROW(fp8_linear(p.x, p.w, Tensor(), broken), std::logic_error);
}

// The wgrad GEMM accumulates in fp32 and writes the weight's dtype: an fp32 weight receives the
// fp32 product unrounded, a 16-bit weight the product rounded once to its dtype. The reference is
// built from the same casts and the GEMM with fp32 output; odd shapes exercise the padding
// (M=60, K=40, N=24).
TEST(Fp8Linear, WeightGradientIsTheFp32GemmRoundedOnceToTheWeightDtype) {
  Problem p = make_problem({3, 20, 40}, 24, 31);
  const int64_t K = 40, N = 24;
  Tensor x2 = reshape(p.x, {-1, K}), g2 = reshape(p.g, {-1, N});
  Fp8Tensor qx = fp8_cast_dynamic(x2, DType::E4M3, Fp8CastOptions{false, true, 16});
  Fp8Tensor qg = fp8_cast_dynamic(g2, DType::E5M2, Fp8CastOptions{false, true, 16});
  Tensor ref32 = contiguous(
      narrow(narrow(fp8_gemm(qg.data_t, qg.scale_inv, qx.data_t, qx.scale_inv, DType::F32, false),
                    0, 0, N),
             1, 0, K));
  // The fp32 product has digits bf16 cannot hold, so the two cases below differ.
  EXPECT_NE(cast(cast(ref32, DType::BF16), DType::F32).to_vector(), ref32.to_vector());
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(wt));
    Tensor x = p.x.clone().set_requires_grad(true);
    Tensor w = cast(p.w, wt).clone().set_requires_grad(true);
    fp8_linear(x, w, Tensor(), dynamic_ctx()).backward(p.g);
    Tensor dw = w.grad();
    ASSERT_EQ(dw.dtype(), wt);
    Tensor want = wt == DType::F32 ? ref32 : cast(ref32, wt);
    EXPECT_EQ(dw.to_vector(), want.to_vector());
    EXPECT_EQ(x.grad().dtype(), DType::BF16);
  }
}

// Two layers reading one tensor inside an Fp8SharedInputCast scope: the second takes the first
// one's cast. With equal scaling state (the normal case) that is exactly what its own cast would
// have been: outputs, gradients and amax slots match the unshared run bit for bit. With a
// different input scale in the second layer's slot, its output follows the first layer's scale,
// which shows that the cast is shared; its slot still receives the same amax.
TEST(Fp8Linear, SharedInputCastServesLayersReadingTheSameTensor) {
  Problem p = make_problem({2, 16, 64}, 48, 11);
  Tensor w2 = test::randn({32, 64}, 12, DType::BF16, 0.125);
  auto two_layers = [&](const Fp8LinearContext& a, const Fp8LinearContext& b, bool shared) {
    Tensor x = p.x.clone().set_requires_grad(true);
    Tensor wa = p.w.clone().set_requires_grad(true), wb = w2.clone().set_requires_grad(true);
    Tensor ya, yb;
    {
      std::unique_ptr<Fp8SharedInputCast> scope;
      if (shared) scope = std::make_unique<Fp8SharedInputCast>(x);
      ya = fp8_linear(x, wa, Tensor(), a);
      yb = fp8_linear(x, wb, Tensor(), b);
    }
    Tensor loss = add(sum(mul(ya, p.g)), sum(yb));
    loss.backward();
    return std::vector<Tensor>{ya.detach(), yb.detach(), x.grad(), wa.grad(), wb.grad()};
  };
  auto two_delayed = [] {
    Fp8LinearContext a = delayed_ctx(), b = a;  // one state, separate slots
    b.slot_input = a.delayed->add_slot(DType::E4M3);
    b.slot_weight = a.delayed->add_slot(DType::E4M3);
    b.slot_grad_output = a.delayed->add_slot(DType::E5M2);
    return std::make_pair(a, b);
  };
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed" : "dynamic");
    auto [a1, b1] = delayed ? two_delayed() : std::make_pair(dynamic_ctx(), dynamic_ctx());
    auto [a2, b2] = delayed ? two_delayed() : std::make_pair(dynamic_ctx(), dynamic_ctx());
    std::vector<Tensor> own = two_layers(a1, b1, false), shared = two_layers(a2, b2, true);
    for (size_t i = 0; i < own.size(); ++i)
      EXPECT_EQ(own[i].to_vector(), shared[i].to_vector()) << "result " << i;
    if (delayed) {
      EXPECT_EQ(a1.delayed->current_amaxes().to_vector(), a2.delayed->current_amaxes().to_vector());
    }
  }
  // The second layer's input scale differs: shared, it still uses the first layer's cast.
  auto [a, b] = two_delayed();
  b.delayed->scale(b.slot_input).fill_(0.25);
  b.delayed->scale_inv(b.slot_input).fill_(4.0);
  std::vector<Tensor> own = two_layers(a, b, false);
  auto [a3, b3] = two_delayed();
  b3.delayed->scale(b3.slot_input).fill_(0.25);
  b3.delayed->scale_inv(b3.slot_input).fill_(4.0);
  std::vector<Tensor> shared = two_layers(a3, b3, true);
  EXPECT_NE(own[1].to_vector(), shared[1].to_vector());
  std::vector<double> amax = a3.delayed->current_amaxes().to_vector();
  EXPECT_EQ(amax[static_cast<size_t>(a3.slot_input)], amax[static_cast<size_t>(b3.slot_input)]);
  EXPECT_GT(amax[static_cast<size_t>(b3.slot_input)], 1.0);
}

// Layers reading one input (q/k/v) fold the gradient it already has into their dgrad GEMM: the
// input's gradient is the sum of each layer's own, up to one rounding per layer. Rows a multiple of
// 16 fold inside the GEMM, others (padded operands) add after it; both must keep the earlier
// layers' part (a fold that dropped it would leave only the last layer's).
TEST(Fp8Linear, LayersReadingOneInputSumTheirInputGradients) {
  for (const Shape& x_shape : {Shape{2, 16, 64}, Shape{37, 72}}) {
    SCOPED_TRACE(shape_str(x_shape));
    const int64_t in = x_shape.back();
    const Tensor x0 = test::randn(x_shape, 21, DType::BF16);
    std::vector<Tensor> ws;
    for (int64_t out : {48, 16, 32})
      ws.push_back(test::randn({out, in}, 22 + out, DType::BF16, 0.125));
    // x's gradient through the layers in `which`, each layer's output weighted differently.
    auto grad_through = [&](const std::vector<size_t>& which) {
      Tensor x = x0.clone().set_requires_grad(true);
      Tensor loss;
      for (size_t i : which) {
        Tensor y = fp8_linear(x, ws[i], Tensor(), dynamic_ctx());
        Tensor term = sum(mul(y, static_cast<double>(i + 1)));
        loss = loss.defined() ? add(loss, term) : term;
      }
      loss.backward();
      return cast(x.grad(), DType::F32);
    };
    const Tensor together = grad_through({0, 1, 2});
    const Tensor apart = add(add(grad_through({0}), grad_through({1})), grad_through({2}));
    test::expect_close(together, apart, 2e-2, 2e-2, "summed input gradient");
    // Not one layer's alone: each contributes.
    std::vector<double> t = together.to_vector(), one = grad_through({0}).to_vector();
    double most = 0;
    for (size_t i = 0; i < t.size(); ++i) most = std::max(most, std::abs(t[i] - one[i]));
    EXPECT_GT(most, 1.0);
  }
}

// The fused fp8 Llama MLP (CPU emulation) against its three projections layer by layer: rows not
// a multiple of 16 and an intermediate size not a multiple of 16 exercise the padding.
TEST(Fp8Linear, SwigluMlpMatchesLayerByLayer) {
  for (bool residual : {false, true}) {
    test::expect_fused_mlp_matches_layers(Device::cpu(), 32, 64, 128, residual);
    test::expect_fused_mlp_matches_layers(Device::cpu(), 74, 64, 72, residual);
  }
}

// Where the fused form does not apply it declines (the caller runs the layers one by one).
TEST(Fp8Linear, SwigluMlpDeclinesOutsideDelayedFp8) {
  test::Fp8MlpContexts c = test::fp8_mlp_contexts(Device::cpu());
  Tensor x = test::randn({4, 64}, 1, DType::BF16), wg = test::randn({32, 64}, 2, DType::BF16);
  Tensor wd = test::randn({64, 32}, 3, DType::BF16);
  EXPECT_TRUE(fp8_swiglu_mlp(x, wg, wg, wd, c.gate, c.up, c.down).defined());
  EXPECT_FALSE(fp8_swiglu_mlp(cast(x, DType::F32), wg, wg, wd, c.gate, c.up, c.down).defined());
  test::Fp8MlpContexts hp = c;
  hp.up.recipe.hp_wgrad = true;
  EXPECT_FALSE(fp8_swiglu_mlp(x, wg, wg, wd, hp.gate, hp.up, hp.down).defined());
  test::Fp8MlpContexts other = test::fp8_mlp_contexts(Device::cpu());
  EXPECT_FALSE(fp8_swiglu_mlp(x, wg, wg, wd, c.gate, c.up, other.down).defined());
  auto off = std::make_shared<Fp8Autocast>();
  off->enabled = false;
  test::Fp8MlpContexts eval = c;
  for (Fp8LinearContext* ctx : {&eval.gate, &eval.up, &eval.down}) ctx->autocast = off;
  EXPECT_FALSE(fp8_swiglu_mlp(x, wg, wg, wd, eval.gate, eval.up, eval.down).defined());
  test::Fp8MlpContexts dyn = c;
  for (Fp8LinearContext* ctx : {&dyn.gate, &dyn.up, &dyn.down})
    ctx->recipe.scaling = Fp8Scaling::Dynamic;
  EXPECT_FALSE(fp8_swiglu_mlp(x, wg, wg, wd, dyn.gate, dyn.up, dyn.down).defined());
  // A residual of another dtype or shape is refused before any cast records an amax.
  test::Fp8MlpContexts fresh = test::fp8_mlp_contexts(Device::cpu());
  const std::vector<double> amaxes = fresh.gate.delayed->current_amaxes().to_vector();
  for (const Tensor& bad :
       {test::randn({4, 64}, 4, DType::F32), test::randn({4, 32}, 5, DType::BF16)})
    EXPECT_THROW(fp8_swiglu_mlp(x, wg, wg, wd, fresh.gate, fresh.up, fresh.down, bad),
                 std::invalid_argument);
  EXPECT_EQ(fresh.gate.delayed->current_amaxes().to_vector(), amaxes);
}

}  // namespace
}  // namespace accel
