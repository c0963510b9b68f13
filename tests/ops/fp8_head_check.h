// Shared by the CPU (tests/ops/fp8_linear_cross_entropy_test.cpp) and CUDA
// (tests/cuda/linear_cross_entropy_test.cpp) tests of fp8_linear_cross_entropy: training steps of
// an LM head in fp8 fused with the loss, or unfused (fp8_linear, then cross_entropy), with
// everything a step produces: the loss, both gradients and the delayed-scaling state.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel::test {

// TE's delayed recipe as the tests run it (history 4, max), MXFP8 on top of it (emulated), or
// the delayed recipe with the wgrad GEMM in high precision (override_linear_precision).
enum class HeadRecipe { Delayed, DelayedE4M3, DelayedHpWgrad, Mxfp8 };
inline const char* head_recipe_name(HeadRecipe h) {
  switch (h) {
    case HeadRecipe::Delayed:
      return "TE delayed HYBRID";
    case HeadRecipe::DelayedE4M3:
      return "TE delayed E4M3";
    case HeadRecipe::DelayedHpWgrad:
      return "TE delayed, wgrad in high precision";
    case HeadRecipe::Mxfp8:
      return "MXFP8 (emulated)";
  }
  return "?";
}

// The head's context as models/fp8_linear.cpp makes it: its own input, weight and grad_output
// slots in a delayed-scaling state (none under MXFP8).
inline Fp8LinearContext fp8_head_context(HeadRecipe h, Device device) {
  Fp8LinearContext ctx;
  Fp8Recipe& r = ctx.recipe;
  r.scaling = h == HeadRecipe::Mxfp8 ? Fp8Scaling::MxBlock : Fp8Scaling::Delayed;
  r.amax_history_len = 4;
  r.amax_algo = AmaxAlgo::Max;
  if (h == HeadRecipe::DelayedE4M3 || h == HeadRecipe::Mxfp8) r.backward_dtype = DType::E4M3;
  r.hp_wgrad = h == HeadRecipe::DelayedHpWgrad;
  if (r.scaling == Fp8Scaling::Delayed) {
    ctx.delayed = std::make_shared<Fp8DelayedScaling>(r, device);
    ctx.slot_input = ctx.delayed->add_slot(r.forward_dtype);
    ctx.slot_weight = ctx.delayed->add_slot(r.forward_dtype);
    ctx.slot_grad_output = ctx.delayed->add_slot(r.backward_dtype);
  }
  return ctx;
}

struct HeadShape {
  int64_t rows, hidden, vocab;
};

// What one training step of the head gives (CPU copies).
struct HeadStep {
  double loss = 0;
  Tensor gx, gw;
  // Delayed scaling, after the step's update: the amax history and the scales.
  std::vector<double> history, scales, scale_invs;
};

// x [2, rows / 2, hidden] and a weight [vocab, hidden] in `dtype`, targets with every 5th row
// ignored (-100); three steps of (loss * grad_scale).backward(), a scale update after each (so the
// later steps cast with scales other than 1). fused: fp8_linear_cross_entropy with chunk_rows and
// grad_scale; else fp8_linear, then cross_entropy. x and the weight grow between steps (the same
// way for both paths), so that every step casts new values with new amaxes. With `scales_from`
// (another run's steps) each step after the first starts from that run's state after the step
// before, so that both cast with the same scales (a GPU run against the CPU's, whose summation
// orders differ).
inline std::vector<HeadStep> fp8_head_steps(Device device, HeadRecipe h, DType dtype,
                                            const HeadShape& s, bool fused, int64_t chunk_rows,
                                            double grad_scale,
                                            const std::vector<HeadStep>* scales_from = nullptr) {
  Fp8LinearContext ctx = fp8_head_context(h, device);
  const Tensor x0 = randn({2, s.rows / 2, s.hidden}, 11, dtype).to(device);
  const Tensor w0 =
      randn({s.vocab, s.hidden}, 12, dtype, 1.0 / std::sqrt(double(s.hidden))).to(device);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < s.rows; ++i) ids.push_back(i % 5 == 4 ? -100 : (i * 37 + 3) % s.vocab);
  const Tensor targets = Tensor::from_vector(ids, {2, s.rows / 2}, DType::I64).to(device);
  std::vector<HeadStep> out;
  for (int step = 0; step < 3; ++step) {
    if (scales_from && step > 0 && ctx.delayed) {
      const HeadStep& prev = (*scales_from)[static_cast<size_t>(step - 1)];
      const int64_t n = ctx.delayed->num_slots();
      ctx.delayed->load_state(
          {{"fp8.amax_history", Tensor::from_vector(prev.history, {4, n}, DType::F32)},
           {"fp8.scale", Tensor::from_vector(prev.scales, {n}, DType::F32)},
           {"fp8.scale_inv", Tensor::from_vector(prev.scale_invs, {n}, DType::F32)},
           {"fp8.updates", Tensor::from_vector(std::vector<int64_t>{step}, {1})}});
    }
    Tensor x = mul(x0, 1.0 + 0.5 * step).set_requires_grad(true);
    Tensor w = mul(w0, 1.0 + 0.25 * step).set_requires_grad(true);
    Tensor loss;
    if (fused) {
      loss = fp8_linear_cross_entropy(x, w, targets, ctx, -100, chunk_rows, grad_scale);
    } else {
      Tensor y = fp8_linear(x, w, Tensor(), ctx);
      loss = cross_entropy(reshape(y, {-1, s.vocab}), reshape(targets, {-1}));
    }
    mul(loss, grad_scale).backward();
    HeadStep r;
    r.loss = loss.item();
    r.gx = x.grad().to(Device::cpu());
    r.gw = w.grad().to(Device::cpu());
    if (ctx.delayed) {
      ctx.delayed->update();
      r.history = ctx.delayed->amax_history().to(Device::cpu()).to_vector();
      r.scales = ctx.delayed->scales().to(Device::cpu()).to_vector();
      r.scale_invs = ctx.delayed->scale_invs().to(Device::cpu()).to_vector();
    }
    out.push_back(r);
  }
  return out;
}

// How many elements of a and b differ, and the first that does, for messages.
inline std::string first_difference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) && bad++ == 0) first = i;
  if (bad == 0) return "";
  return std::to_string(bad) + " of " + std::to_string(a.size()) + " differ, first at " +
         std::to_string(first) + ": " + std::to_string(a[first]) + " vs " +
         std::to_string(b[first]);
}

}  // namespace accel::test
