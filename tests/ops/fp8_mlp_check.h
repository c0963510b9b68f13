// Shared by the CPU (tests/ops) and CUDA (tests/cuda) tests of fp8_swiglu_mlp: the fused MLP
// against the same three projections run layer by layer, bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel::test {

struct Fp8MlpContexts {
  Fp8LinearContext gate, up, down;
};

// Three fp8 projections sharing one delayed-scaling state (HYBRID, history 4, max), as
// models/fp8_linear.cpp sets them up.
inline Fp8MlpContexts fp8_mlp_contexts(Device device) {
  Fp8Recipe r;
  r.scaling = Fp8Scaling::Delayed;
  r.amax_history_len = 4;
  r.amax_algo = AmaxAlgo::Max;
  auto state = std::make_shared<Fp8DelayedScaling>(r, device);
  Fp8MlpContexts c;
  for (Fp8LinearContext* ctx : {&c.gate, &c.up, &c.down}) {
    ctx->recipe = r;
    ctx->delayed = state;
    ctx->slot_input = state->add_slot(r.forward_dtype);
    ctx->slot_weight = state->add_slot(r.forward_dtype);
    ctx->slot_grad_output = state->add_slot(r.backward_dtype);
  }
  return c;
}

// Two training steps (a scale update between them, so the second runs with scales other than 1)
// of y = down(swiglu(gate(x), up(x))) + x / 4 for x [2, rows / 2, hidden] bf16: fused and layer
// by layer must give the same output, gradients and amaxes. With a residual r (y = r + the MLP +
// x / 4; the layers add r after the down projection): the same gradients (r's included) and
// amaxes, bit for bit, and the output within one rounding of bf16 (the fused MLP rounds r + the
// down GEMM once, inside the GEMM, where nothing is padded).
inline void expect_fused_mlp_matches_layers(Device device, int64_t rows, int64_t hidden,
                                            int64_t inter, bool with_residual = false) {
  SCOPED_TRACE("rows " + std::to_string(rows) + " hidden " + std::to_string(hidden) +
               " intermediate " + std::to_string(inter) +
               (with_residual ? " with a residual" : ""));
  const DType bf = DType::BF16;
  const Tensor x0 = randn({2, rows / 2, hidden}, 1, bf).to(device);
  const Tensor r0 = randn({2, rows / 2, hidden}, 6, bf).to(device);
  const std::vector<double> r_host = r0.to(Device::cpu()).to_vector();
  const Tensor wg0 = randn({inter, hidden}, 2, bf, 1.0 / std::sqrt(double(hidden))).to(device);
  const Tensor wu0 = randn({inter, hidden}, 3, bf, 1.0 / std::sqrt(double(hidden))).to(device);
  const Tensor wd0 = randn({hidden, inter}, 4, bf, 1.0 / std::sqrt(double(inter))).to(device);
  const Tensor gy = randn({2, rows / 2, hidden}, 5, bf, 1e-3).to(device);
  Fp8MlpContexts fused = fp8_mlp_contexts(device), layers = fp8_mlp_contexts(device);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<std::vector<double>> got[2];
    for (int way = 0; way < 2; ++way) {
      Fp8MlpContexts& c = way == 0 ? fused : layers;
      Tensor x = x0.clone().set_requires_grad(true), wg = wg0.clone().set_requires_grad(true),
             wu = wu0.clone().set_requires_grad(true), wd = wd0.clone().set_requires_grad(true);
      Tensor r = with_residual ? r0.clone().set_requires_grad(true) : Tensor();
      Tensor y;
      if (way == 0) {
        y = fp8_swiglu_mlp(x, wg, wu, wd, c.gate, c.up, c.down, r);
        ASSERT_TRUE(y.defined()) << "fp8_swiglu_mlp declined";
      } else {
        Tensor g, u;
        {
          Fp8SharedInputCast one_cast(x);
          g = fp8_linear(x, wg, Tensor(), c.gate);
          u = fp8_linear(x, wu, Tensor(), c.up);
        }
        y = fp8_linear(swiglu(g, u), wd, Tensor(), c.down);
        if (with_residual) y = add(r, y);
      }
      // x feeds one more op, whose gradient reaches x first: the fused MLP folds it into its
      // dgrad GEMMs as the layers one by one do.
      const Tensor mlp_out = y.detach();
      y = add(y, mul(x, 0.25));
      y.backward(gy);
      for (const Tensor& t : {mlp_out, x.grad(), wg.grad(), wu.grad(), wd.grad(),
                              c.gate.delayed->current_amaxes(), with_residual ? r.grad() : gy})
        got[way].push_back(t.to(Device::cpu()).to_vector());
      c.gate.delayed->update();
    }
    const char* names[] = {"MLP output", "grad x", "grad gate",    "grad up",
                           "grad down",  "amaxes", "grad residual"};
    for (int i = 0; i < 7; ++i) {
      ASSERT_EQ(got[0][i].size(), got[1][i].size()) << names[i];
      // One rounding against two. The layers round the product p, then r + p: apart by at most
      // half an ulp of p and one of the sum, both within an ulp of |r| + |sum| (8 bits).
      const bool one_rounding = with_residual && i == 0;
      size_t bad = 0, first = 0, differ = 0;
      for (size_t j = 0; j < got[0][i].size(); ++j) {
        const double a = got[0][i][j], b = got[1][i][j];
        differ += a != b;
        int e = 0;
        if (one_rounding)
          std::frexp(std::fabs(r_host[j]) + std::max(std::fabs(a), std::fabs(b)), &e);
        const bool ok = one_rounding ? std::fabs(a - b) <= std::ldexp(1.0, e - 7) : a == b;
        if (!ok && bad++ == 0) first = j;
      }
      EXPECT_EQ(bad, 0u) << names[i] << ": first difference at " << first << ": fused "
                         << got[0][i][first] << " vs layers " << got[1][i][first];
      // Folded where nothing is padded (some sums then round otherwise), added after elsewhere.
      if (one_rounding && rows % 16 == 0 && hidden % 16 == 0) {
        EXPECT_GT(differ, 0u) << "the residual was not folded into the down GEMM";
      } else if (one_rounding) {
        EXPECT_EQ(differ, 0u) << "padded: the residual is added after, as the layers add it";
      }
    }
  }
}

}  // namespace accel::test
