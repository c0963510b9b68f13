// rope_type dynamic over a sequence of forwards of varying length, as transformers'
// dynamic_rope_update keeps it per model instance: the frequencies of the longest sequence since
// the last reset (max_seq_len_cached), recomputed only for a longer one, back to the original ones
// for a sequence shorter than max_position_embeddings. Checked against hand-computed frequencies
// and against the prefix property of causal attention (a forward of the first n tokens with the
// frequencies of a longer forward gives that forward's first n logits). The numbers of
// transformers itself: DecoderFixture.DynamicRopeSequence (decoder_fixture_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "models/decoder.h"
#include "models/rope_scaling.h"
#include "tests/models/tiny_decoder.h"

namespace accel {
namespace {

constexpr double kTheta = 10000.0, kFactor = 2.0;
constexpr int64_t kDim = 8, kMax = 8;

RopeScaling dynamic_scaling() {
  RopeScaling s;
  s.rope_type = "dynamic";
  s.factor = kFactor;
  return s;
}

// NTK by hand, in double: past kMax the base becomes theta * (f L / max - (f - 1))^(d / (d - 2)).
std::vector<double> by_hand(int64_t len) {
  const double l = static_cast<double>(std::max(len, kMax));
  const double base =
      kTheta * std::pow(kFactor * l / kMax - (kFactor - 1), static_cast<double>(kDim) / (kDim - 2));
  std::vector<double> out;
  for (int64_t i = 0; i < kDim / 2; ++i) out.push_back(std::pow(base, -2.0 * i / kDim));
  return out;
}

TEST(DynamicRopeState, KeepsTheLongestLengthUntilAShortSequenceResets) {
  DynamicRope d(dynamic_scaling(), kTheta, kDim, kMax);
  EXPECT_EQ(d.max_seq_len_cached(), kMax);
  // (forward length, transformers' max_seq_len_cached after it = the length whose frequencies
  // the forward uses). 8 is not below max_position_embeddings: no reset.
  const std::vector<std::pair<int64_t, int64_t>> seq = {{5, 8},   {12, 12}, {10, 12}, {16, 16},
                                                        {9, 16},  {8, 16},  {6, 8},   {11, 11},
                                                        {13, 13}, {13, 13}, {7, 8},   {3, 8}};
  for (const auto& [len, cached] : seq) {
    SCOPED_TRACE("length " + std::to_string(len));
    const RopeFrequencies& f = d.update(len);
    EXPECT_EQ(d.max_seq_len_cached(), cached);
    const std::vector<double> want = by_hand(cached);
    ASSERT_EQ(f.inv_freq.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(f.inv_freq[i], want[i], 1e-6 * want[i]) << i;
    // Bit for bit what the stateless computation gives for that length.
    EXPECT_EQ(f.inv_freq, rope_frequencies(dynamic_scaling(), kTheta, kDim, kMax, cached).inv_freq);
    EXPECT_EQ(f.attention_scaling, 1.0);
    // The same length again changes nothing (a recomputation under activation checkpointing).
    EXPECT_EQ(d.update(len).inv_freq, f.inv_freq);
    EXPECT_EQ(d.max_seq_len_cached(), cached);
  }
  d.restore(14);
  EXPECT_EQ(d.max_seq_len_cached(), 14);
  EXPECT_EQ(d.current().inv_freq,
            rope_frequencies(dynamic_scaling(), kTheta, kDim, kMax, 14).inv_freq);
  d.restore(3);
  EXPECT_EQ(d.max_seq_len_cached(), kMax);
  EXPECT_EQ(d.current().inv_freq,
            rope_frequencies(dynamic_scaling(), kTheta, kDim, kMax, kMax).inv_freq);
}

DecoderConfig dynamic_model() {
  DecoderConfig c = testing::tiny_decoder(64);
  c.head_dim = kDim;
  c.max_position_embeddings = kMax;
  c.rope_theta = kTheta;
  c.rope_scaling = dynamic_scaling();
  return c;
}

Tensor prefix_ids(int64_t n) {
  std::vector<int64_t> v;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < n; ++t) v.push_back((7 * t + 13 * b + 3) % 64);
  return Tensor::from_vector(v, {2, n});
}

// The first n positions of logits [B, S, V].
std::vector<double> first(const Tensor& logits, int64_t n) {
  return contiguous(narrow(logits, 1, 0, n)).to_vector();
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LT(worst, 1e-5) << what;
}

TEST(DynamicRopeState, ForwardsOfVaryingLengthUseTheLongestSinceTheLastReset) {
  NoGradGuard no_grad;
  CausalLM m(dynamic_model(), DType::F32, Device::cpu(), 3);
  // One state for the model, as transformers' one rotary embedding: every layer reads it.
  for (DecoderLayer* layer : m.model.layers)
    EXPECT_EQ(layer->self_attn.dynamic_rope(), m.model.layers[0]->self_attn.dynamic_rope());
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), kMax);
  const Tensor l12 = m.forward(prefix_ids(12));
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), 12);
  // 10 tokens after 12: the frequencies of 12, so the first 10 logits of the 12-token forward.
  expect_close(m.forward(prefix_ids(10)).to_vector(), first(l12, 10), "10 after 12");
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), 12);
  // A fresh model computes 10 tokens with the frequencies of 10 (a per-forward rule would too).
  CausalLM fresh(dynamic_model(), DType::F32, Device::cpu(), 3);
  const std::vector<double> alone10 = fresh.forward(prefix_ids(10)).to_vector();
  EXPECT_NE(alone10, m.forward(prefix_ids(10)).to_vector());
  const Tensor l16 = m.forward(prefix_ids(16));
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), 16);
  expect_close(m.forward(prefix_ids(9)).to_vector(), first(l16, 9), "9 after 16");
  expect_close(m.forward(prefix_ids(8)).to_vector(), first(l16, 8), "8 after 16 (no reset)");
  // 6 < max_position_embeddings: back to the original frequencies, as a fresh model's.
  CausalLM fresh6(dynamic_model(), DType::F32, Device::cpu(), 3);
  EXPECT_EQ(m.forward(prefix_ids(6)).to_vector(), fresh6.forward(prefix_ids(6)).to_vector());
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), kMax);
  // Then 10 again is computed for its own length.
  EXPECT_EQ(m.forward(prefix_ids(10)).to_vector(), alone10);
  // A checkpoint's state restored into a fresh instance continues as the saved one.
  CausalLM restored(dynamic_model(), DType::F32, Device::cpu(), 3);
  restored.restore_dynamic_rope(16);
  EXPECT_EQ(restored.dynamic_rope_max_seq_len_cached(), 16);
  expect_close(restored.forward(prefix_ids(9)).to_vector(), first(l16, 9), "restored 16");
  // Other rope types have no state.
  DecoderConfig plain = dynamic_model();
  plain.rope_scaling = RopeScaling();
  plain.max_position_embeddings = 32;
  EXPECT_EQ(CausalLM(plain, DType::F32, Device::cpu(), 3).dynamic_rope_max_seq_len_cached(), -1);
}

// Packed documents: the length is the largest position + 1 (position_ids), as transformers takes
// max(position_ids) + 1.
TEST(DynamicRopeState, PackedPositionsSizeTheUpdate) {
  NoGradGuard no_grad;
  CausalLM m(dynamic_model(), DType::F32, Device::cpu(), 3);
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 14; ++t) pos.push_back(t < 11 ? t : t - 11);  // documents of 11 and 3
  TokenLayout layout;
  layout.position_ids = Tensor::from_vector(pos, {2, 14});
  std::vector<int64_t> seg;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 14; ++t) seg.push_back(t < 11 ? 0 : 1);
  layout.segment_ids = Tensor::from_vector(seg, {2, 14}, DType::I32);
  m.forward(prefix_ids(14), nullptr, layout);
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), 11);
}

// Activation checkpointing recomputes each layer in backward with the frequencies its forward
// used: the gradients of a 10-token step after a 12-token forward are those without it.
TEST(DynamicRopeState, ActivationCheckpointingRecomputesWithTheForwardsFrequencies) {
  std::vector<std::vector<double>> grads[2];
  for (int ac = 0; ac < 2; ++ac) {
    CausalLM m(dynamic_model(), DType::F32, Device::cpu(), 3);
    m.set_activation_checkpointing(ac == 1);
    {
      NoGradGuard no_grad;
      m.forward(prefix_ids(12));
    }
    Tensor ids = prefix_ids(10);
    m.forward_loss(ids, shift_labels(ids)).backward();
    EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), 12);
    for (Parameter* p : m.parameters()) grads[ac].push_back(p->value.grad().to_vector());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) expect_close(grads[1][i], grads[0][i], "grad");
}

// Generation over a KV cache: every new position raises the length by one, so past
// max_position_embeddings each step recomputes for its own length (as transformers' generate on a
// fresh instance); the next prompt, shorter than max_position_embeddings, resets.
TEST(DynamicRopeState, GenerationGrowsOneLengthAtATime) {
  NoGradGuard no_grad;
  CausalLM m(dynamic_model(), DType::F32, Device::cpu(), 3);
  KVCache cache;
  m.forward(contiguous(narrow(prefix_ids(6), 0, 0, 1)), &cache);
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), kMax);
  for (int64_t len = 7; len <= 12; ++len) {
    m.forward(Tensor::from_vector(std::vector<int64_t>{len % 64}, {1, 1}), &cache);
    EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), std::max(len, kMax));
  }
  KVCache next;
  m.forward(contiguous(narrow(prefix_ids(4), 0, 0, 1)), &next);
  EXPECT_EQ(m.dynamic_rope_max_seq_len_cached(), kMax);
}

}  // namespace
}  // namespace accel
