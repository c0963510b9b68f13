// Generation: the KV cache gives the logits of the full forward pass at every position, and the
// sampler follows transformers' rules (repetition penalty, temperature, top-k, top-p).
#include "tools/trainer/generate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace {

using namespace accel;

DecoderConfig small_config(int64_t kv_heads) {
  DecoderConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.max_position_embeddings = 16;
  c.rope_theta = 500.0;
  c.initializer_range = 0.2;  // large enough that the positions' logits differ clearly
  return c;
}

void expect_cache_matches_full_forward(int64_t kv_heads) {
  CausalLM model(small_config(kv_heads), DType::F32, Device::cpu(), 7);
  NoGradGuard no_grad;
  const std::vector<int64_t> ids = {3, 17, 42, 5, 9, 11, 30, 2, 49, 0};
  const int64_t n = static_cast<int64_t>(ids.size()), prompt = 4, V = 50;
  const std::vector<double> full =
      model.forward(Tensor::from_vector(ids, {1, n}, DType::I64)).to_vector();
  KVCache cache;
  std::vector<double> got;
  std::vector<int64_t> first(ids.begin(), ids.begin() + prompt);
  std::vector<double> part =
      model.forward(Tensor::from_vector(first, {1, prompt}, DType::I64), &cache).to_vector();
  got.insert(got.end(), part.begin(), part.end());
  for (int64_t t = prompt; t < n; ++t) {
    part =
        model.forward(Tensor::from_vector(std::vector<int64_t>{ids[t]}, {1, 1}, DType::I64), &cache)
            .to_vector();
    got.insert(got.end(), part.begin(), part.end());
    EXPECT_EQ(cache.length(), t + 1);
  }
  ASSERT_EQ(got.size(), full.size());
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    max_err = std::max(max_err, std::abs(got[i] - full[i]));
    max_abs = std::max(max_abs, std::abs(full[i]));
  }
  EXPECT_LT(max_err, 1e-5 * std::max(1.0, max_abs)) << "kv heads " << kv_heads;
  EXPECT_GT(max_abs, 0.1);
  (void)V;
}

TEST(KVCache, LogitsEqualTheFullForwardAtEveryPosition) { expect_cache_matches_full_forward(4); }
TEST(KVCache, GroupedKeyValueHeadsToo) { expect_cache_matches_full_forward(2); }

TEST(KVCache, PositionsBeyondTheModelAreRefused) {
  CausalLM model(small_config(4), DType::F32, Device::cpu(), 1);
  NoGradGuard no_grad;
  KVCache cache;
  model.forward(Tensor::from_vector(std::vector<int64_t>(16, 1), {1, 16}, DType::I64), &cache);
  EXPECT_THROW(
      model.forward(Tensor::from_vector(std::vector<int64_t>{1}, {1, 1}, DType::I64), &cache),
      std::invalid_argument);
}

TEST(Generate, GreedyIsTheArgmaxOfTheFullForward) {
  CausalLM model(small_config(2), DType::F32, Device::cpu(), 3);
  SamplingOptions o;
  o.temperature = 0;
  o.max_new_tokens = 6;
  const std::vector<uint32_t> prompt = {4, 8, 15};
  const std::vector<uint32_t> out = generate(model, prompt, o, Device::cpu());
  ASSERT_EQ(out.size(), 6u);
  // The same tokens, one full forward pass per token and no cache.
  NoGradGuard no_grad;
  std::vector<int64_t> seq(prompt.begin(), prompt.end());
  for (uint32_t want : out) {
    const int64_t n = static_cast<int64_t>(seq.size());
    std::vector<double> l =
        narrow(reshape(model.forward(Tensor::from_vector(seq, {1, n}, DType::I64)), {n, -1}), 0,
               n - 1, 1)
            .to_vector();
    const auto best = static_cast<uint32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(best, want);
    seq.push_back(best);
  }
}

TEST(Generate, StopsAfterTheStopTokenAndAtTheLastPosition) {
  CausalLM model(small_config(4), DType::F32, Device::cpu(), 3);
  SamplingOptions o;
  o.temperature = 0;
  o.max_new_tokens = 100;
  const std::vector<uint32_t> all = generate(model, {1, 2}, o, Device::cpu());
  EXPECT_EQ(all.size(), 15u);  // 16 positions: 2 of the prompt, the 15th token needs none
  o.stop_token = all[3];
  const std::vector<uint32_t> stopped = generate(model, {1, 2}, o, Device::cpu());
  EXPECT_LE(stopped.size(), 4u);
  EXPECT_EQ(stopped.back(), all[3]);
}

std::map<uint32_t, int> draw_counts(const std::vector<double>& logits, const SamplingOptions& o,
                                    const std::vector<uint32_t>& context, int n) {
  std::mt19937_64 rng(o.seed);
  std::map<uint32_t, int> c;
  for (int i = 0; i < n; ++i) ++c[sample_next(logits, context, o, rng)];
  return c;
}

TEST(Sampler, TopKAndTopPKeepTransformersTokenSets) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (log of them as logits).
  const std::vector<double> logits = {std::log(0.15), std::log(0.5), std::log(0.05), std::log(0.3)};
  SamplingOptions o;
  o.top_k = 2;
  auto c = draw_counts(logits, o, {}, 4000);
  EXPECT_EQ(c.size(), 2u);
  EXPECT_NEAR(c[1] / 4000.0, 0.5 / 0.8, 0.03);
  EXPECT_NEAR(c[3] / 4000.0, 0.3 / 0.8, 0.03);
  o.top_k = 0;
  o.top_p = 0.79;  // 0.5 < 0.79, then 0.5 + 0.3 reaches it: two tokens
  c = draw_counts(logits, o, {}, 2000);
  EXPECT_EQ(c.size(), 2u);
  o.top_p = 0.81;  // one more
  c = draw_counts(logits, o, {}, 2000);
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(c.count(2), 0u);
  o.top_p = 0.3;  // the most likely alone
  c = draw_counts(logits, o, {}, 500);
  EXPECT_EQ(c.size(), 1u);
  EXPECT_EQ(c[1], 500);
}

TEST(Sampler, TemperatureSharpensAndTheSeedRepeats) {
  const std::vector<double> logits = {1.0, 0.0};
  SamplingOptions o;
  o.temperature = 0.5;  // probabilities e^2 : 1
  auto c = draw_counts(logits, o, {}, 20000);
  EXPECT_NEAR(c[0] / 20000.0, std::exp(2.0) / (std::exp(2.0) + 1), 0.01);
  EXPECT_EQ(draw_counts(logits, o, {}, 300), draw_counts(logits, o, {}, 300));
  o.seed = 1;
  EXPECT_NE(draw_counts(logits, o, {}, 300), draw_counts(logits, SamplingOptions{}, {}, 300));
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  SamplingOptions o;
  o.temperature = 0;
  o.repetition_penalty = 2.0;
  std::mt19937_64 rng(0);
  // 3.0 seen -> 1.5 < 2.0: token 1 wins; without the penalty token 0 does.
  EXPECT_EQ(sample_next({3.0, 2.0}, {0}, o, rng), 1u);
  EXPECT_EQ(sample_next({3.0, 2.0}, {}, o, rng), 0u);
  // -1.0 seen -> -2.0 < -1.5.
  EXPECT_EQ(sample_next({-1.0, -1.5}, {0}, o, rng), 1u);
}

TEST(Sampler, BadOptionsAreRefusedByName) {
  SamplingOptions o;
  o.top_p = 0;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o = SamplingOptions{};
  o.temperature = -1;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o = SamplingOptions{};
  o.repetition_penalty = 0;
  EXPECT_THROW(o.validate(), std::invalid_argument);
}

TEST(TextStream, HoldsBackAPartialCharacterUntilItsBytesArrive) {
  std::unique_ptr<Tokenizer> tok = make_byte_tokenizer();
  TextStream s(*tok);
  EXPECT_EQ(s.add('a'), "a");
  // The byte tokenizer returns bytes as they are, so each byte of "é" is printable as it comes.
  std::string out = s.add(0xC3);
  out += s.add(0xA9);
  EXPECT_EQ(out, "\xC3\xA9");
  EXPECT_EQ(s.finish(), "");
}

}  // namespace
