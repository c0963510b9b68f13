// Generation on the GPU: the KV cache's logits against the full forward pass of the same bf16
// model on the GPU, and the fp32 model's cached logits against the CPU's.
#include "tools/trainer/generate.h"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/cuda/cuda_test_util.h"

namespace {

using namespace accel;

DecoderConfig small_config() {
  DecoderConfig c;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.vocab_size = 300;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.1;
  return c;
}

// Logits of positions 0..n-1: the prompt's through an empty cache, then one position at a time.
std::vector<double> cached_logits(CausalLM& model, const std::vector<int64_t>& ids, int64_t prompt,
                                  Device d) {
  NoGradGuard no_grad;
  KVCache cache;
  std::vector<int64_t> first(ids.begin(), ids.begin() + prompt);
  std::vector<double> out =
      model.forward(Tensor::from_vector(first, {1, prompt}, DType::I64, d), &cache).to_vector();
  for (size_t t = static_cast<size_t>(prompt); t < ids.size(); ++t) {
    std::vector<double> l =
        model
            .forward(Tensor::from_vector(std::vector<int64_t>{ids[t]}, {1, 1}, DType::I64, d),
                     &cache)
            .to_vector();
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

double max_rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / std::max(scale, 1e-30);
}

std::vector<int64_t> some_ids() {
  std::vector<int64_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 11) % 300);
  return ids;
}

TEST(CudaGenerate, Bf16CacheMatchesTheFullForwardOnTheGpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const Device d = cuda_test::gpu();
  CausalLM model(small_config(), DType::BF16, d, 5);
  const std::vector<int64_t> ids = some_ids();
  NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(ids.size());
  const std::vector<double> full =
      model.forward(Tensor::from_vector(ids, {1, n}, DType::I64, d)).to_vector();
  const std::vector<double> got = cached_logits(model, ids, 9, d);
  ASSERT_EQ(got.size(), full.size());
  // bf16 activations: the two paths round differently (fused attention against fp32 softmax).
  EXPECT_LT(max_rel_error(got, full), 3e-2);
}

TEST(CudaGenerate, Fp32CacheMatchesTheCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  CausalLM gpu_model(small_config(), DType::F32, cuda_test::gpu(), 5);
  CausalLM cpu_model(small_config(), DType::F32, Device::cpu(), 5);
  const std::vector<int64_t> ids = some_ids();
  const std::vector<double> g = cached_logits(gpu_model, ids, 9, cuda_test::gpu());
  const std::vector<double> c = cached_logits(cpu_model, ids, 9, Device::cpu());
  EXPECT_LT(max_rel_error(g, c), 2e-3);  // tf32 may be on for GEMMs
}

TEST(CudaGenerate, SamplingOnTheGpuStreamsTheRequestedTokens) {
  ACCEL_SKIP_WITHOUT_CUDA();
  CausalLM model(small_config(), DType::BF16, cuda_test::gpu(), 5);
  SamplingOptions o;
  o.temperature = 0.8;
  o.top_k = 20;
  o.top_p = 0.9;
  o.max_new_tokens = 30;
  int seen = 0;
  const std::vector<uint32_t> out =
      generate(model, {1, 2, 3}, o, cuda_test::gpu(), [&](uint32_t id) {
        EXPECT_LT(id, 300u);
        ++seen;
      });
  EXPECT_EQ(out.size(), 30u);
  EXPECT_EQ(seen, 30);
  EXPECT_EQ(generate(model, {1, 2, 3}, o, cuda_test::gpu()), out);  // same seed, same tokens
}

}  // namespace
