// Shared by the fp8 training tests of an untied head (tests/ops/fp8_training_test.cpp), a tied
// one (tests/models/fp8_tied_head_test.cpp) and the head fused with the loss
// (tests/models/fp8_lm_head_test.cpp): short training runs of a tiny decoder on the CPU
// emulation, whose loss must fall and stay within a few percent of bf16; the recipes they run.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "parallel/ddp.h"

namespace accel::testing {

// TE's delayed recipe as the model tests run it (a 4-step history, max), and MXFP8 (emulated,
// E4M3) on top of it.
inline Fp8Config te_test_config() {
  Fp8Config c;
  c.backend = Fp8Backend::TE;
  c.amax_history_len = 4;
  c.amax_compute_algo = AmaxComputeAlgo::Max;
  return c;
}
inline Fp8Config mxfp8_test_config() {
  Fp8Config c = te_test_config();
  c.use_mxfp8_block_scaling = true;
  c.fp8_format = Fp8Format::E4M3;
  return c;
}

// Arithmetic sequences t_i = (a + d i) mod V: the next token follows from the previous two.
inline std::pair<Tensor, Tensor> arithmetic_batch(uint64_t seed, int64_t B, int64_t S, int64_t V) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(B * S), tg(B * S);
  for (int64_t b = 0; b < B; ++b) {
    int64_t a = static_cast<int64_t>(rng() % V), d = 1 + static_cast<int64_t>(rng() % 7);
    for (int64_t t = 0; t < S; ++t) ids[b * S + t] = (a + d * t) % V;
    for (int64_t t = 0; t < S; ++t) tg[b * S + t] = t + 1 < S ? ids[b * S + t + 1] : -100;
  }
  return {Tensor::from_vector(ids, {B, S}), Tensor::from_vector(tg, {B, S})};
}

// The losses of `steps` steps of model `c` (seed 42) through the trainer's loss (forward_loss),
// bf16 compute, AdamW at 3e-3 without weight decay, on 8 arithmetic rows of 24 tokens; in fp8
// from `fp8_cfg` when given. `adjust` (if set) edits the model after fp8 is applied.
inline std::vector<double> fp8_train_losses(
    const DecoderConfig& c, const Fp8Config* fp8_cfg, int steps,
    const std::function<void(CausalLM&)>& adjust = nullptr) {
  CausalLM model(c, DType::F32, Device::cpu(), 42);
  std::unique_ptr<Fp8Training> fp8 = fp8_cfg ? apply_fp8(model, *fp8_cfg, Device::cpu()) : nullptr;
  if (adjust) adjust(model);
  SingleProcessStrategy strategy(DType::BF16);
  OptimizerOptions oo;
  oo.weight_decay = 0.0;
  strategy.setup(model, oo);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto [ids, targets] = arithmetic_batch(static_cast<uint64_t>(s), 8, 24, c.vocab_size);
    Tensor loss = model.forward_loss(ids, targets);
    losses.push_back(loss.item());
    loss.backward();
    strategy.step(3e-3, 1.0, 1.0);
    if (fp8) fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  }
  return losses;
}

struct NamedFp8Config {
  const char* name;
  Fp8Config cfg;
};

// 30 steps of bf16 and of each recipe: the bf16 baseline learns; each fp8 run stays finite,
// differs from bf16 (its fp8 layers ran), lowers the loss by a fifth and ends (mean of the last
// 5 steps) within 3% of bf16.
inline void expect_fp8_tracks_bf16(const DecoderConfig& c,
                                   const std::vector<NamedFp8Config>& runs) {
  const int steps = 30;
  auto tail_mean = [](const std::vector<double>& v) {
    return std::accumulate(v.end() - 5, v.end(), 0.0) / 5.0;
  };
  const std::vector<double> bf16 = fp8_train_losses(c, nullptr, steps);
  const double ref = tail_mean(bf16);
  ASSERT_LT(ref, 0.8 * bf16.front()) << "the bf16 baseline does not learn";
  for (const NamedFp8Config& r : runs) {
    const std::vector<double> l = fp8_train_losses(c, &r.cfg, steps);
    for (double v : l) ASSERT_TRUE(std::isfinite(v)) << r.name;
    EXPECT_NE(l, bf16) << r.name << ": identical to bf16, the fp8 layers did not run";
    const double got = tail_mean(l);
    EXPECT_LT(got, 0.8 * l.front()) << r.name << ": loss does not fall";
    EXPECT_LT(std::fabs(got - ref) / ref, 0.03)
        << r.name << ": final loss " << got << " vs bf16 " << ref;
    std::printf("%s: first %.4f final %.4f (bf16 %.4f -> %.4f, %+.2f%%)\n", r.name, l.front(), got,
                bf16.front(), ref, 100.0 * (got - ref) / ref);
  }
}

}  // namespace accel::testing
