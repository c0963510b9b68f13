// Selective activation checkpointing (training.activation_checkpointing: selective): every decoder
// layer keeps its GEMM and attention outputs, and backward recomputes only the cheap work between
// them. Its gradients are those without checkpointing, bit for bit, in every family (MoE routers
// and their aux loss included); the activations a forward leaves for backward lie strictly between
// none and full checkpointing (the allocator's count); fp8 delayed scaling ends every step in the
// state it has without checkpointing.
#include <gtest/gtest.h>

#include <cstdio>

#include "models/fp8_linear.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {
using namespace accel::testing;

constexpr ActivationCheckpointing kNone = ActivationCheckpointing::None,
                                  kFull = ActivationCheckpointing::Full,
                                  kSelective = ActivationCheckpointing::Selective;

DecoderConfig family_config(const std::string& family) {
  DecoderConfig c = tiny_family(family);
  c.output_router_logits = c.is_moe();  // the aux loss's gradient flows through the router stats
  return c;
}

// Two documents in each row of rank_batch's 8 tokens: 5 and 3 tokens, positions restarting.
TokenLayout two_documents_per_row(int64_t rows) {
  std::vector<int64_t> pos, seg;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < 8; ++t) {
      pos.push_back(t < 5 ? t : t - 5);
      seg.push_back(t < 5 ? 0 : 1);
    }
  TokenLayout l;
  l.position_ids = Tensor::from_vector(pos, {rows, 8});
  l.segment_ids = Tensor::from_vector(seg, {rows, 8}, DType::I32);
  return l;
}

struct Gradients {
  double loss = 0, aux_loss = 0;
  std::vector<std::vector<int64_t>> expert_counts;
  std::vector<std::pair<std::string, std::vector<double>>> grads;
};

// One forward_loss and backward of a fresh model (seed 5) on rank_batch's first batch (12 x 8).
Gradients gradients(const DecoderConfig& c, ActivationCheckpointing mode,
                    const TokenLayout& layout = {}) {
  CausalLM m(c, DType::F32, Device::cpu(), 5);
  m.set_activation_checkpointing(mode);
  auto [ids, labels] = rank_batch(RunSpec{}, 0, 0, 0, c.vocab_size);
  Tensor loss = m.forward_loss(ids, labels, layout);
  Gradients out;
  out.loss = loss.item();
  if (Tensor aux = m.router_aux_loss(); aux.defined()) out.aux_loss = aux.item();
  loss.backward();
  out.expert_counts = m.expert_counts();
  for (Parameter* p : m.parameters()) {
    if (!p->value.grad().defined()) throw std::logic_error(p->name + " has no gradient");
    out.grads.push_back({p->name, p->value.grad().to_vector()});
  }
  return out;
}

// Bit for bit: the recomputation runs the same kernels on the same inputs as the forward (the
// kept GEMM and attention outputs are the forward's own tensors), and every backward function
// then receives the tensors it receives without checkpointing.
void expect_identical(const Gradients& got, const Gradients& want) {
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.aux_loss, want.aux_loss);
  EXPECT_EQ(got.expert_counts, want.expert_counts);  // the recomputation routes nothing twice
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_EQ(got.grads[i].second, want.grads[i].second) << got.grads[i].first;
}

class SelectiveCheckpointing : public ::testing::TestWithParam<const char*> {};

TEST_P(SelectiveCheckpointing, GradientsAreThoseWithoutCheckpointingBitForBit) {
  const DecoderConfig c = family_config(GetParam());
  const Gradients none = gradients(c, kNone);
  if (c.is_moe()) {
    ASSERT_GT(none.aux_loss, 0);
  }
  expect_identical(gradients(c, kSelective), none);
}

INSTANTIATE_TEST_SUITE_P(Families, SelectiveCheckpointing,
                         ::testing::Values("llama", "qwen2", "qwen3", "mistral", "qwen3_moe",
                                           "mixtral"));

TEST(SelectiveCheckpointingLayout, PackedDocumentsGiveTheGradientsWithoutCheckpointing) {
  const DecoderConfig c = family_config("qwen3");
  const TokenLayout layout = two_documents_per_row(12);
  expect_identical(gradients(c, kSelective, layout), gradients(c, kNone, layout));
}

struct ActivationBytes {
  int64_t saved = 0;  // held from the end of forward to backward
  int64_t peak = 0;   // the most held during forward and backward
};

// The activation bytes (the allocator's count) one training step of a fresh model holds.
ActivationBytes activation_bytes(const DecoderConfig& c, ActivationCheckpointing mode) {
  CausalLM m(c, DType::F32, Device::cpu(), 5);
  m.set_activation_checkpointing(mode);
  auto [ids, labels] = rank_batch(RunSpec{}, 0, 0, 0, c.vocab_size);
  const auto held = [] {
    return memory_stats(Device::cpu()).current[static_cast<int>(MemCategory::Activations)];
  };
  reset_peak_memory_stats(Device::cpu());
  const int64_t before = held();
  Tensor loss = m.forward_loss(ids, labels);
  ActivationBytes out;
  out.saved = held() - before;
  loss.backward();
  out.peak = memory_stats(Device::cpu()).peak[static_cast<int>(MemCategory::Activations)] - before;
  return out;
}

// What a selective llama layer keeps beyond its input (fp32, N tokens): the q, k, v, o, gate and
// up projections' outputs, and attention's output with its log-sum-exp. The down projection's
// output, the MLP's residual summed in, is the layer's output: the next layer's input, which full
// checkpointing keeps too.
int64_t kept_bytes_per_layer(const DecoderConfig& c, int64_t rows, int64_t seq) {
  const int64_t N = rows * seq, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  const int64_t projections = N * (q + 2 * kv + c.hidden_size + 2 * c.intermediate_size);
  const int64_t attention = N * q + rows * c.num_attention_heads * seq;
  return 4 * (projections + attention);
}

TEST(SelectiveCheckpointingMemory, KeepsMoreThanFullAndLessThanNone) {
  for (const char* family : {"llama", "qwen3", "qwen3_moe"}) {
    SCOPED_TRACE(family);
    DecoderConfig c = family_config(family);
    c.num_hidden_layers = 4;
    if (c.is_moe()) c.mlp_only_layers = {1};
    const ActivationBytes none = activation_bytes(c, kNone), full = activation_bytes(c, kFull),
                          selective = activation_bytes(c, kSelective);
    const double L = static_cast<double>(c.num_hidden_layers);
    std::printf(
        "%s, 4 layers, 12 x 8 tokens, fp32: activations saved for backward per layer: none "
        "%.0f, selective %.0f, full %.0f bytes (whole step, the rest included: %lld / %lld / "
        "%lld); peak %lld / %lld / %lld bytes\n",
        family, none.saved / L, selective.saved / L, full.saved / L,
        static_cast<long long>(none.saved), static_cast<long long>(selective.saved),
        static_cast<long long>(full.saved), static_cast<long long>(none.peak),
        static_cast<long long>(selective.peak), static_cast<long long>(full.peak));
    EXPECT_LT(selective.saved, none.saved);
    EXPECT_GT(selective.saved, full.saved);
    EXPECT_LT(selective.peak, none.peak);
    EXPECT_GT(selective.peak, full.peak);
    // Llama's layers keep exactly their projections' and attention's outputs beyond what full
    // checkpointing keeps (the layer inputs).
    if (std::string(family) == "llama") {
      EXPECT_EQ(selective.saved - full.saved, c.num_hidden_layers * kept_bytes_per_layer(c, 12, 8));
    }
  }
}

struct Fp8Run {
  std::vector<double> losses, amax_history, scales;
  Weights weights;
};

// TE's recipe (delayed scaling; the CPU emulation) with bf16 compute copies, as the trainer runs
// it: forward_loss, backward, the optimizer step, then the amax history roll and scale update.
Fp8Run fp8_run(const DecoderConfig& c, ActivationCheckpointing mode) {
  CausalLM model(c, DType::F32, Device::cpu(), 42);
  model.set_activation_checkpointing(mode);
  Fp8Config te;
  te.backend = Fp8Backend::TE;
  te.amax_history_len = 4;
  std::unique_ptr<Fp8Training> fp8 = apply_fp8(model, te, Device::cpu());
  SingleProcessStrategy strategy(DType::BF16);
  strategy.setup(model, test_optimizer());
  Fp8Run out;
  for (int step = 0; step < 3; ++step) {
    auto [ids, labels] = rank_batch(RunSpec{}, step, 0, 0, c.vocab_size);
    Tensor loss = model.forward_loss(ids, labels);
    out.losses.push_back(loss.item());
    loss.backward();
    strategy.step(3e-3, 1.0, 1.0);
    fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  }
  out.amax_history = fp8->delayed()->amax_history().to_vector();
  out.scales = fp8->delayed()->scales().to_vector();
  for (auto& [name, w] : full_weights(strategy)) out.weights.push_back({name, w.clone()});
  return out;
}

// The recomputation casts each GEMM input to fp8 again (with the step's scale, into the same
// max-accumulating amax slot); the kept GEMM outputs are not cast again. Every amax, scale, loss
// and weight is the run's without checkpointing (the swiglu MLP's fused fp8 path included).
TEST(SelectiveCheckpointingFp8, DelayedScalingStateIsThatWithoutCheckpointing) {
  for (const char* family : {"llama", "qwen3"}) {
    SCOPED_TRACE(family);
    const DecoderConfig c = family_config(family);
    const Fp8Run none = fp8_run(c, kNone), selective = fp8_run(c, kSelective);
    ASSERT_GT(*std::max_element(none.amax_history.begin(), none.amax_history.end()), 0);
    EXPECT_EQ(selective.losses, none.losses);
    EXPECT_EQ(selective.amax_history, none.amax_history);
    EXPECT_EQ(selective.scales, none.scales);
    EXPECT_EQ(compare_weights(selective.weights, none.weights, 0.0), "");
  }
}

}  // namespace
}  // namespace accel
