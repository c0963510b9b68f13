// The decoder layer's fused residual add + RMSNorm (add_rms_norm, and rms_norm's backward folding
// the residual stream's gradient) gives the model's numbers of the unfused ops, bit for bit in
// fp32 on the CPU.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "models/decoder.h"

namespace accel {
namespace {

// The decoder stack as it was written before the fusion: add, then rms_norm, each norm reading a
// copy (x * 1, exact) so that its backward has nothing pending to fold and the engine sums the
// residual gradients separately, as it used to. (The MLP's residual stays in its down projection,
// as the model has it: that fold is linear's, tested in tests/ops/linear_residual_test.cpp.)
Tensor unfused_forward(CausalLM& m, const Tensor& ids) {
  auto norm = [](RMSNorm& n, const Tensor& x) {
    return rms_norm(mul(x, 1.0), n.weight.value, n.eps);
  };
  Tensor x = m.model.embed_tokens.forward(ids);
  for (DecoderLayer* l : m.model.layers) {
    Tensor h = add(x, l->self_attn.forward(norm(l->input_layernorm, x)));
    x = l->mlp->forward(norm(l->post_attention_layernorm, h), h);
  }
  x = norm(m.model.norm, x);
  return m.lm_head ? m.lm_head->forward(x) : linear(x, m.model.embed_tokens.weight.value);
}

TEST(LlamaFusedNorm, ModelLossAndGradientsEqualTheUnfusedOpsBitForBit) {
  DecoderConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 50;
  CausalLM model(c, DType::F32, Device::cpu(), 7);
  {
    // Norm weights start at 1: make them matter.
    NoGradGuard no_grad;
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<double> dist(0.5, 1.5);
    for (Parameter* p : model.parameters())
      if (p->value.dim() == 1) {
        std::vector<double> v(static_cast<size_t>(p->value.numel()));
        for (double& e : v) e = dist(rng);
        p->value.copy_(Tensor::from_vector(v, p->value.shape(), p->value.dtype()));
      }
  }
  std::vector<int64_t> idv(2 * 9);
  for (size_t i = 0; i < idv.size(); ++i) idv[i] = static_cast<int64_t>((i * 17 + 5) % 50);
  Tensor ids = Tensor::from_vector(idv, {2, 9}, DType::I64);
  Tensor targets = shift_labels(ids);

  auto run = [&](bool fused) {
    for (Parameter* p : model.parameters()) p->value.zero_grad();
    Tensor logits = fused ? model.forward(ids) : unfused_forward(model, ids);
    Tensor loss = CausalLM::loss(logits, targets);
    loss.backward();
    std::vector<std::vector<double>> out{loss.to_vector(), logits.to_vector()};
    for (Parameter* p : model.parameters()) out.push_back(p->value.grad().to_vector());
    return out;
  };
  const auto fused = run(true), unfused = run(false);
  ASSERT_EQ(fused.size(), unfused.size());
  EXPECT_EQ(fused[0], unfused[0]) << "loss";
  EXPECT_EQ(fused[1], unfused[1]) << "logits";
  for (size_t i = 2; i < fused.size(); ++i)
    EXPECT_EQ(fused[i], unfused[i]) << "gradient of parameter " << i - 2;
}

}  // namespace
}  // namespace accel
