// fp8 training of mixture-of-experts models (CPU emulation): the experts' projections follow the
// dense layers' filter (one fp8 layer per expert projection, with its own scales), a rank under
// expert parallelism lists every expert so that the scaling state is the same on every rank, a
// tiny Qwen3-MoE and Mixtral train under TE and AO within 3% of bf16, and activation
// checkpointing's recomputation leaves the delayed-scaling state as it is without it.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "parallel/ddp.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

// Every dimension a multiple of 16 (the router [4, 32] excepted, which stays in bf16 under TE).
DecoderConfig tiny_fp8_moe(const std::string& type) {
  DecoderConfig c;
  c.model_type = type;
  c.hidden_size = 32;
  c.intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.vocab_size = 32;
  c.max_position_embeddings = 32;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  if (type == "qwen3_moe") {
    c.moe_intermediate_size = 32;
    c.norm_topk_prob = true;
    c.mlp_only_layers = {1};
  }
  c.router_aux_loss_coef = 0.02;
  c.output_router_logits = true;
  return c;
}

Fp8Config te_config() {
  Fp8Config c;
  c.backend = Fp8Backend::TE;
  c.amax_history_len = 4;
  c.amax_compute_algo = AmaxComputeAlgo::Max;
  return c;
}

Fp8Config ao_config() {
  Fp8Config c;
  c.backend = Fp8Backend::AO;
  return c;
}

TEST(MoeFp8, ExpertsFollowTheDenseLayersFilter) {
  CausalLM model(tiny_fp8_moe("qwen3_moe"), DType::F32, Device::cpu(), 3);
  int64_t experts = 0;
  for (const Fp8LayerChoice& ch : choose_fp8_layers(model, te_config()))
    if (ch.expert >= 0) {
      ++experts;
      EXPECT_TRUE(ch.fp8) << ch.name << ": " << ch.reason;
      EXPECT_EQ(ch.name.find("model.layers.0.mlp.experts."), 0u) << ch.name;
    }
  EXPECT_EQ(experts, 4 * 3);  // layer 0 sparse: 4 experts of 3 projections
  const auto layers = choose_fp8_layers(model, ao_config());
  for (const char* name :
       {"model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.3.up_proj",
        "model.layers.0.mlp.experts.2.down_proj"}) {
    auto it = std::find_if(layers.begin(), layers.end(),
                           [&](const Fp8LayerChoice& c) { return c.name == name; });
    ASSERT_NE(it, layers.end()) << name;
    EXPECT_TRUE(it->fp8) << name << ": " << it->reason;
  }
  // The start-up lines count the expert projections among the fp8 layers.
  auto fp8 = apply_fp8(model, te_config(), Device::cpu());
  const std::string d = fp8->describe();
  // 2 x 4 attention projections, layer 1's dense MLP (3), 12 expert projections, lm_head; the
  // router (out 4) stays in bf16.
  EXPECT_NE(d.find("fp8: 24 of 25 linear layers in fp8"), std::string::npos) << d;
  EXPECT_NE(d.find("in fp8: 12 mixture-of-experts expert projections"), std::string::npos) << d;
  EXPECT_EQ(fp8->delayed()->num_slots(), 24 * 3);
  // AO's exclude_modules keeps all experts in bf16, but never some of one projection.
  Fp8Config ao = ao_config();
  ao.exclude_modules = {"experts"};
  for (const Fp8LayerChoice& ch : choose_fp8_layers(model, ao))
    if (ch.expert >= 0) {
      EXPECT_FALSE(ch.fp8) << ch.name;
    }
  ao.exclude_modules = {"experts.3."};
  const std::string m = testing::error_of([&] { choose_fp8_layers(model, ao); });
  EXPECT_NE(m.find("fp8_config.exclude_modules keeps 1 of the 4 experts' "
                   "model.layers.0.mlp.experts.*.gate_proj in high precision"),
            std::string::npos)
      << m;
}

TEST(MoeFp8, MixtralExpertsAndUnalignedExperts) {
  CausalLM mixtral(tiny_fp8_moe("mixtral"), DType::F32, Device::cpu(), 3);
  std::vector<std::string> names;
  for (const Fp8LayerChoice& ch : choose_fp8_layers(mixtral, te_config()))
    if (ch.expert >= 0 && ch.fp8) names.push_back(ch.name);
  ASSERT_EQ(names.size(), 2u * 4 * 3);  // both layers sparse
  EXPECT_EQ(names[0], "model.layers.0.block_sparse_moe.experts.0.w1");
  EXPECT_EQ(names[1], "model.layers.0.block_sparse_moe.experts.0.w3");
  EXPECT_EQ(names[2], "model.layers.0.block_sparse_moe.experts.0.w2");
  // Experts of width 24 stay in bf16 under TE (Accelerate's rule for every Linear).
  DecoderConfig c = tiny_fp8_moe("qwen3_moe");
  c.moe_intermediate_size = 24;
  CausalLM odd(c, DType::F32, Device::cpu(), 3);
  for (const Fp8LayerChoice& ch : choose_fp8_layers(odd, te_config()))
    if (ch.expert >= 0) {
      EXPECT_FALSE(ch.fp8) << ch.name;
      EXPECT_NE(ch.reason.find("not divisible by 16"), std::string::npos) << ch.reason;
    }
}

// A rank that holds experts 2 and 3 lists the same layers as the single process (and so has the
// same slots and saved state), but runs only its own.
TEST(MoeFp8, AnExpertParallelRankListsEveryExpert) {
  ExpertParallelContext ep;
  ep.ep_size = 2;
  ep.ep_rank = 1;
  ep.num_experts = 4;
  ep.expert_begin = 2;
  ep.expert_end = 4;
  CausalLM single(tiny_fp8_moe("qwen3_moe"), DType::F32, Device::cpu(), 3);
  CausalLM rank(tiny_fp8_moe("qwen3_moe"), DType::F32, Device::cpu(), 3, &ep);
  auto names = [](CausalLM& m) {
    std::vector<std::string> out;
    for (const Fp8LayerChoice& ch : choose_fp8_layers(m, te_config()))
      out.push_back(ch.name + (ch.fp8 ? "" : " (bf16)"));
    return out;
  };
  EXPECT_EQ(names(rank), names(single));
  auto fp8 = apply_fp8(rank, te_config(), Device::cpu());
  auto fp8_single = apply_fp8(single, te_config(), Device::cpu());
  EXPECT_EQ(fp8->delayed()->num_slots(), fp8_single->delayed()->num_slots());
  EXPECT_NE(fp8->layer_context("model.layers.0.mlp.experts.0.gate_proj"), nullptr);
}

// Arithmetic sequences t_i = (a + b i) mod V: the next token follows from the previous two.
std::pair<Tensor, Tensor> make_batch(uint64_t seed, int64_t B, int64_t S, int64_t V) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(B * S), tg(B * S);
  for (int64_t b = 0; b < B; ++b) {
    int64_t a = static_cast<int64_t>(rng() % V), d = 1 + static_cast<int64_t>(rng() % 7);
    for (int64_t t = 0; t < S; ++t) ids[b * S + t] = (a + d * t) % V;
    for (int64_t t = 0; t < S; ++t) tg[b * S + t] = t + 1 < S ? ids[b * S + t + 1] : -100;
  }
  return {Tensor::from_vector(ids, {B, S}), Tensor::from_vector(tg, {B, S})};
}

struct Training {
  std::vector<double> losses;
  std::vector<double> amax_history, scales;  // the delayed-scaling state at the end (TE)
  double expert_amax = 0;                    // the largest amax recorded in an expert slot (TE)
};

Training train(const std::string& type, const Fp8Config* cfg, int steps,
               ActivationCheckpointing checkpointing = ActivationCheckpointing::None) {
  CausalLM model(tiny_fp8_moe(type), DType::F32, Device::cpu(), 42);
  model.set_activation_checkpointing(checkpointing);
  std::unique_ptr<Fp8Training> fp8 = cfg ? apply_fp8(model, *cfg, Device::cpu()) : nullptr;
  SingleProcessStrategy strategy(DType::BF16);
  OptimizerOptions oo;
  oo.weight_decay = 0.0;
  strategy.setup(model, oo);
  Training out;
  for (int s = 0; s < steps; ++s) {
    auto [ids, targets] = make_batch(static_cast<uint64_t>(s), 8, 24, 32);
    Tensor loss = model.forward_loss(ids, targets);
    out.losses.push_back(loss.item());
    loss.backward();
    strategy.step(3e-3, 1.0, 1.0);
    if (fp8 && fp8->delayed()) {
      const std::vector<double> amaxes = fp8->delayed()->current_amaxes().to_vector();
      for (const Fp8LayerChoice& c : fp8->layers())
        if (c.expert >= 0 && c.fp8) {
          const Fp8LinearContext* ctx = fp8->layer_context(c.name);
          for (int slot : {ctx->slot_input, ctx->slot_weight, ctx->slot_grad_output})
            out.expert_amax = std::max(out.expert_amax, amaxes[static_cast<size_t>(slot)]);
        }
    }
    if (fp8) fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  }
  if (fp8 && fp8->delayed()) {
    out.amax_history = fp8->delayed()->amax_history().to_vector();
    out.scales = fp8->delayed()->scales().to_vector();
  }
  return out;
}

double tail_mean(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - n, v.end(), 0.0) / static_cast<double>(n);
}

class MoeFp8Training : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeFp8Training, TrainsWithin3PercentOfBf16) {
  const std::string type = GetParam();
  const int steps = 30;
  const std::vector<double> bf16 = train(type, nullptr, steps).losses;
  const double ref = tail_mean(bf16, 5);
  ASSERT_LT(ref, 0.8 * bf16.front()) << "the bf16 baseline does not learn";
  Fp8Config ao_experts_bf16 = ao_config();
  ao_experts_bf16.exclude_modules = {"experts"};
  const std::vector<double> ao_dense_only = train(type, &ao_experts_bf16, steps).losses;
  struct Run {
    const char* name;
    Fp8Config cfg;
  };
  for (const Run& r : {Run{"TE delayed", te_config()}, Run{"AO dynamic", ao_config()}}) {
    const Training t = train(type, &r.cfg, steps);
    const std::vector<double>& l = t.losses;
    for (double v : l) ASSERT_TRUE(std::isfinite(v)) << r.name;
    EXPECT_NE(l, bf16) << r.name << ": identical to bf16, the fp8 layers did not run";
    const double got = tail_mean(l, 5);
    EXPECT_LT(got, 0.8 * l.front()) << r.name << ": loss does not fall";
    EXPECT_LT(std::fabs(got - ref) / ref, 0.03)
        << r.name << ": final loss " << got << " vs bf16 " << ref;
    std::printf("%s %s: first %.4f final %.4f (bf16 %.4f -> %.4f)\n", type.c_str(), r.name,
                l.front(), got, bf16.front(), ref);
    // The experts themselves ran in fp8: TE recorded their amaxes, and AO differs from AO with
    // the experts excluded.
    if (r.cfg.backend == Fp8Backend::TE) {
      EXPECT_GT(t.expert_amax, 0.0) << r.name;
    } else {
      EXPECT_NE(l, ao_dense_only) << r.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, MoeFp8Training, ::testing::Values("qwen3_moe", "mixtral"));

// The recomputation in backward (full or selective) casts the same tensors again: a max into the
// same amax accumulator, so the delayed-scaling state (and every loss) equals the run without
// checkpointing.
TEST(MoeFp8, ActivationCheckpointingLeavesTheScalingStateAsItIs) {
  const Fp8Config te = te_config();
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    const Training plain = train(type, &te, 4);
    for (ActivationCheckpointing mode :
         {ActivationCheckpointing::Full, ActivationCheckpointing::Selective}) {
      SCOPED_TRACE(name_of(mode));
      const Training ckpt = train(type, &te, 4, mode);
      EXPECT_EQ(ckpt.losses, plain.losses) << type;
      EXPECT_EQ(ckpt.amax_history, plain.amax_history) << type;
      EXPECT_EQ(ckpt.scales, plain.scales) << type;
    }
  }
}

// The experts' slots are in the checkpointed state, under their layer names.
TEST(MoeFp8, StateHoldsEveryExpertsSlots) {
  CausalLM model(tiny_fp8_moe("mixtral"), DType::F32, Device::cpu(), 3);
  auto fp8 = apply_fp8(model, te_config(), Device::cpu());
  auto [ids, targets] = make_batch(1, 2, 8, 32);
  model.forward_loss(ids, targets).backward();
  fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  const Fp8CheckpointState st = fp8_checkpoint_state(*fp8);
  std::map<std::string, Tensor> by_name(st.tensors.begin(), st.tensors.end());
  for (const char* name : {"model.layers.1.block_sparse_moe.experts.3.w2.grad_output.amax_history",
                           "model.layers.0.block_sparse_moe.experts.0.w1.input.scale",
                           "model.layers.0.block_sparse_moe.experts.2.w3.weight.scale_inv"})
    EXPECT_TRUE(by_name.count(name)) << name;
  // Loaded into a fresh run, the state is the same.
  CausalLM other(tiny_fp8_moe("mixtral"), DType::F32, Device::cpu(), 3);
  auto fp8b = apply_fp8(other, te_config(), Device::cpu());
  EXPECT_EQ(fp8_load_checkpoint_state(*fp8b, st, "test"), "");
  EXPECT_EQ(fp8b->delayed()->amax_history().to_vector(),
            fp8->delayed()->amax_history().to_vector());
  EXPECT_EQ(fp8b->delayed()->scales().to_vector(), fp8->delayed()->scales().to_vector());
  EXPECT_EQ(st.metadata.at("moe_experts"), "fp8");

  // A state written when the experts ran in bf16 (no expert slots, no moe_experts key) loads:
  // every other layer takes its saved state, the experts start afresh, and the note says so.
  Fp8CheckpointState before;
  before.metadata = st.metadata;
  before.metadata.erase("moe_experts");
  for (const auto& [name, t] : st.tensors)
    if (name.find(".experts.") == std::string::npos) before.tensors.push_back({name, t});
  CausalLM third(tiny_fp8_moe("mixtral"), DType::F32, Device::cpu(), 3);
  auto fp8c = apply_fp8(third, te_config(), Device::cpu());
  const std::string note = fp8_load_checkpoint_state(*fp8c, before, "old");
  EXPECT_NE(note.find("24 mixture-of-experts expert projections have no saved state"),
            std::string::npos)
      << note;
  const Fp8LinearContext* q = fp8c->layer_context("model.layers.0.self_attn.q_proj");
  const Fp8LinearContext* w1 = fp8c->layer_context("model.layers.0.block_sparse_moe.experts.0.w1");
  const std::vector<double> sc = fp8c->delayed()->scales().to_vector();
  EXPECT_EQ(sc[q->slot_input], fp8->delayed()->scales().to_vector()[q->slot_input]);
  EXPECT_NE(sc[q->slot_input], 1.0);  // a saved scale, not the initial one
  EXPECT_EQ(sc[w1->slot_input], 1.0);
  // With the key (the experts were in fp8), missing experts are refused.
  before.metadata["moe_experts"] = "fp8";
  const std::string refused =
      testing::error_of([&] { fp8_load_checkpoint_state(*fp8c, before, "new"); });
  EXPECT_NE(refused.find("24 fp8 layer(s) of this run have no saved state"), std::string::npos)
      << refused;
}

}  // namespace
}  // namespace accel
