// CausalLM::forward_loss with the LM head in fp8 (TE's delayed recipe and MXFP8, untied and tied)
// runs the head's GEMMs inside the chunked loss (fp8_linear_cross_entropy through head_loss_fn)
// with the numbers of the unfused fp8 head (its fp8_linear, then the loss): loss, every gradient
// and the scaling state over three steps, for several chunkings; the start-up description says
// so; the peak activation bytes of a step drop by the logits' size; training follows the unfused
// head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/fp8_linear.h"
#include "tests/ops/fp8_training_check.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {
using namespace accel::testing;

const Fp8Config te_config = te_test_config(), mx_config = mxfp8_test_config();

// The same model twice (one seed), both in fp8: `fused` runs forward_loss as installed (or with
// the head's fused loss over chunk_rows-row chunks), `unfused` without the fused loss (the head's
// fp8_linear, then the loss, as before the head ran fused).
struct Twin {
  std::unique_ptr<CausalLM> fused, unfused;
  std::unique_ptr<Fp8Training> fp8_fused, fp8_unfused;
};

Twin make_twin(const DecoderConfig& c, const Fp8Config& cfg, int64_t chunk_rows) {
  Twin t;
  t.fused = std::make_unique<CausalLM>(c, DType::F32, Device::cpu(), 3);
  t.unfused = std::make_unique<CausalLM>(c, DType::F32, Device::cpu(), 3);
  t.fp8_fused = apply_fp8(*t.fused, cfg, Device::cpu());
  t.fp8_unfused = apply_fp8(*t.unfused, cfg, Device::cpu());
  EXPECT_TRUE(static_cast<bool>(t.fused->head_loss_fn));
  t.unfused->head_loss_fn = nullptr;
  if (chunk_rows > 0) {
    const Fp8LinearContext* ctx = t.fp8_fused->layer_context("lm_head");
    t.fused->head_loss_fn = [ctx, chunk_rows](const Tensor& x, const Tensor& w,
                                              const Tensor& targets, double grad_scale) {
      return fp8_linear_cross_entropy(x, w, targets, *ctx, -100, chunk_rows, grad_scale);
    };
  }
  return t;
}

std::map<std::string, std::vector<double>> gradients(CausalLM& m) {
  std::map<std::string, std::vector<double>> g;
  for (Parameter* p : m.parameters()) {
    g[p->name] = p->value.grad().to_vector();
    p->value.zero_grad();
  }
  return g;
}

// The batch of step `step` with every 7th target ignored.
std::pair<Tensor, Tensor> masked_batch(int step, int64_t vocab) {
  auto [ids, labels] = rank_batch(RunSpec{}, step, 0, 0, vocab);
  std::vector<double> l = labels.to_vector();
  std::vector<int64_t> masked;
  for (size_t i = 0; i < l.size(); ++i)
    masked.push_back(i % 7 == 3 ? -100 : static_cast<int64_t>(l[i]));
  return {ids, Tensor::from_vector(masked, labels.shape(), DType::I64)};
}

TEST(Fp8LmHead, FusedForwardLossEqualsTheUnfusedHead) {
  for (bool tied : {false, true}) {
    for (const Fp8Config& cfg : {te_config, mx_config}) {
      // 96 tokens: one chunk, 16-row chunks (MXFP8: 32), 48 (64: ragged) and 80 (96) rows.
      for (int64_t chunk : {0, 16, 40, 80}) {
        SCOPED_TRACE(std::string(tied ? "tied" : "untied") +
                     (cfg.use_mxfp8_block_scaling ? " MXFP8" : " TE") + " chunk_rows " +
                     std::to_string(chunk));
        Twin t = make_twin(tiny_llama(2, tied), cfg, chunk);
        const std::string head = tied ? "model.embed_tokens.weight" : "lm_head.weight";
        for (int step = 0; step < 3; ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          auto [ids, labels] = masked_batch(step, 64);
          const double factor = 1.0 / 3;  // the trainer's weight of one of 3 micro-batches
          Tensor lf = t.fused->forward_loss(ids, labels, {}, factor);
          Tensor lu = t.unfused->forward_loss(ids, labels, {}, factor);
          EXPECT_EQ(lf.item(), lu.item());
          mul(lf, factor).backward();
          mul(lu, factor).backward();
          auto gf = gradients(*t.fused), gu = gradients(*t.unfused);
          for (const auto& [name, want] : gu) {
            const std::vector<double>& got = gf.at(name);
            if (name != head) {
              // The gradient reaching the final norm is the same, row by row: so is every
              // gradient behind it.
              EXPECT_EQ(got, want) << name;
              continue;
            }
            // The head's weight gradient is summed in fp32 over the chunks, the unfused one in
            // one GEMM (fp8_linear_cross_entropy_test.cpp: < 1e-5 of the largest element); a
            // tied embedding adds it to its lookup gradient.
            double largest = 0;
            for (double v : want) largest = std::max(largest, std::abs(v));
            ASSERT_GT(largest, 0.0);
            for (size_t i = 0; i < want.size(); ++i)
              ASSERT_NEAR(got[i], want[i], 1e-5 * largest) << name << " element " << i;
          }
          if (t.fp8_fused->delayed()) {
            EXPECT_EQ(t.fp8_fused->delayed()->current_amaxes().to_vector(),
                      t.fp8_unfused->delayed()->current_amaxes().to_vector());
          }
          t.fp8_fused->step_end(static_cast<ProcessGroup*>(nullptr));
          t.fp8_unfused->step_end(static_cast<ProcessGroup*>(nullptr));
          if (t.fp8_fused->delayed()) {
            EXPECT_EQ(t.fp8_fused->delayed()->amax_history().to_vector(),
                      t.fp8_unfused->delayed()->amax_history().to_vector());
            EXPECT_EQ(t.fp8_fused->delayed()->scales().to_vector(),
                      t.fp8_unfused->delayed()->scales().to_vector());
            // The head's slots recorded: its scales moved off 1.
            const Fp8LinearContext* h = t.fp8_fused->layer_context("lm_head");
            const std::vector<double> sc = t.fp8_fused->delayed()->scales().to_vector();
            EXPECT_NE(sc[h->slot_input], 1.0);
            EXPECT_NE(sc[h->slot_grad_output], 1.0);
          }
        }
      }
    }
  }
}

TEST(Fp8LmHead, DescriptionSaysTheHeadRunsFusedWithTheLoss) {
  for (bool tied : {false, true}) {
    for (const Fp8Config& cfg : {te_config, mx_config}) {
      CausalLM m(tiny_llama(2, tied), DType::F32, Device::cpu(), 1);
      const std::string d = apply_fp8(m, cfg, Device::cpu())->describe();
      const std::string line = std::string("in fp8: lm_head") +
                               (tied ? " (tied to model.embed_tokens)" : "") + " [out 64, in 32]: ";
      EXPECT_NE(d.find(line), std::string::npos) << d;
      EXPECT_NE(d.find("fused with the loss: its GEMMs run inside the chunked cross-entropy"),
                std::string::npos)
          << d;
      EXPECT_EQ(tied, d.find("its gradient added to the embedding's") != std::string::npos) << d;
    }
  }
  // AO keeps the head in high precision: no head line, linear_cross_entropy as in bf16.
  Fp8Config ao;
  ao.backend = Fp8Backend::AO;
  CausalLM m(tiny_llama(2), DType::F32, Device::cpu(), 1);
  const std::string d = apply_fp8(m, ao, Device::cpu())->describe();
  EXPECT_EQ(d.find("fused with the loss"), std::string::npos) << d;
  EXPECT_FALSE(static_cast<bool>(m.head_loss_fn));
}

// The activation bytes a training step holds at its peak (the allocator's count).
int64_t step_peak_bytes(CausalLM& m, const Tensor& ids, const Tensor& labels) {
  const int cat = static_cast<int>(MemCategory::Activations);
  const int64_t before = memory_stats(Device::cpu()).current[cat];
  reset_peak_memory_stats(Device::cpu());
  m.forward_loss(ids, labels).backward();
  const int64_t peak = memory_stats(Device::cpu()).peak[cat] - before;
  for (Parameter* p : m.parameters()) p->value.zero_grad();
  return peak;
}

TEST(Fp8LmHead, TheLogitsSizedBuffersAreGone) {
  DecoderConfig c = tiny_llama(2, false);
  c.vocab_size = 2048;
  RunSpec s;
  s.global_batch = 16;
  s.seq = 32;
  auto [ids, labels] = rank_batch(s, 0, 0, 0, c.vocab_size);
  const int64_t logits = s.global_batch * s.seq * c.vocab_size * 4;  // [tokens, vocab] f32
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    c.tie_word_embeddings = tied;
    Twin t = make_twin(c, te_config, 64);  // 8 chunks of 64 rows
    const int64_t fused = step_peak_bytes(*t.fused, ids, labels);
    const int64_t unfused = step_peak_bytes(*t.unfused, ids, labels);
    std::printf("%s: peak activation bytes fused %lld, unfused %lld (logits %lld)\n",
                tied ? "tied" : "untied", static_cast<long long>(fused),
                static_cast<long long>(unfused), static_cast<long long>(logits));
    // The unfused head holds the logits and, in backward, their gradient and its e5m2 copies;
    // the fused one a 64-row chunk of each.
    EXPECT_GE(unfused - fused, logits);
  }
}

// Training (bf16 compute, AdamW) with the fused head follows the unfused head: the first loss is
// the same, the later ones move only with the weight gradient's rounding.
TEST(Fp8LmHead, TrainsLikeTheUnfusedHead) {
  DecoderConfig c = tiny_llama(2, false);
  c.vocab_size = 32;
  for (bool tied : {false, true}) {
    c.tie_word_embeddings = tied;
    for (const Fp8Config& cfg : {te_config, mx_config}) {
      SCOPED_TRACE(std::string(tied ? "tied" : "untied") +
                   (cfg.use_mxfp8_block_scaling ? " MXFP8" : " TE"));
      const std::vector<double> fused = fp8_train_losses(c, &cfg, 8);
      const std::vector<double> unfused =
          fp8_train_losses(c, &cfg, 8, [](CausalLM& m) { m.head_loss_fn = nullptr; });
      EXPECT_EQ(fused.front(), unfused.front());
      for (size_t i = 0; i < fused.size(); ++i)
        EXPECT_NEAR(fused[i], unfused[i], 2e-3 * unfused[i]) << "step " << i;
    }
  }
}

}  // namespace
}  // namespace accel
