// A tied LM head (tie_word_embeddings: the logits come from model.embed_tokens.weight) under fp8
// on the CPU emulation: it is an fp8 layer under TE and MXFP8 and stays in high precision under AO;
// its numbers are those of an untied fp8 head whose weight equals the embedding; it trains like
// bf16, evaluates and generates in either eval mode, follows the single process under DDP, ZeRO-3
// and FSDP on two CPU ranks, and its delayed-scaling state round-trips (a state written before
// tied heads ran in fp8 loads with the head starting afresh).
#include <gtest/gtest.h>

#include <cmath>

#include "models/fp8_linear.h"
#include "parallel/fsdp.h"
#include "runtime/config.h"
#include "tests/ops/fp8_training_check.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {
using namespace accel::testing;

Fp8Config te_config() { return te_test_config(); }

Fp8Config ao_config() {
  Fp8Config c;
  c.backend = Fp8Backend::AO;
  return c;
}

Fp8Config mx_config() { return mxfp8_test_config(); }

const Fp8LayerChoice* find_layer(const std::vector<Fp8LayerChoice>& layers,
                                 const std::string& name) {
  for (const Fp8LayerChoice& l : layers)
    if (l.name == name) return &l;
  return nullptr;
}

TEST(Fp8TiedHead, AnFp8LayerUnderTeAndMxfp8NotUnderAo) {
  CausalLM tied(tiny_llama(2, true), DType::F32, Device::cpu(), 1);
  ASSERT_EQ(tied.lm_head, nullptr);
  for (const Fp8Config& cfg : {te_config(), mx_config()}) {
    SCOPED_TRACE(cfg.use_mxfp8_block_scaling ? "MXFP8" : "TE");
    const auto layers = choose_fp8_layers(tied, cfg);
    ASSERT_EQ(layers.size(), 15u);  // 2 x 7 projections + the tied head, last as in HF's model
    const Fp8LayerChoice& head = layers.back();
    EXPECT_EQ(head.name, "lm_head");
    EXPECT_EQ(head.tied_to, "model.embed_tokens");
    EXPECT_EQ(head.display_name(), "lm_head (tied to model.embed_tokens)");
    EXPECT_EQ(head.out_features, 64);
    EXPECT_EQ(head.in_features, 32);
    EXPECT_TRUE(head.fp8);
    for (const Fp8LayerChoice& l : layers) EXPECT_TRUE(l.fp8) << l.name;
  }
  CausalLM m(tiny_llama(2, true), DType::F32, Device::cpu(), 1);
  auto te = apply_fp8(m, te_config(), Device::cpu());
  EXPECT_EQ(te->num_fp8_layers(), 15);
  ASSERT_NE(te->layer_context("lm_head"), nullptr);
  EXPECT_TRUE(static_cast<bool>(m.tied_head_fn));
  // Its own three delayed-scaling slots, after the projections' (as an untied head's).
  EXPECT_EQ(te->delayed()->num_slots(), 45);
  EXPECT_EQ(te->layer_context("lm_head")->slot_input, 42);
  const std::string d = te->describe();
  EXPECT_NE(d.find("15 of 15 linear layers in fp8"), std::string::npos) << d;
  EXPECT_NE(d.find("in fp8: lm_head (tied to model.embed_tokens) [out 64, in 32]"),
            std::string::npos)
      << d;

  // AO: Hugging Face's last Linear is the (tied) lm_head, which AO keeps in high precision; the
  // last down_proj converts.
  CausalLM a(tiny_llama(2, true), DType::F32, Device::cpu(), 1);
  const auto ao_layers = choose_fp8_layers(a, ao_config());
  ASSERT_EQ(ao_layers.size(), 15u);
  EXPECT_EQ(ao_layers.back().tied_to, "model.embed_tokens");
  EXPECT_FALSE(ao_layers.back().fp8);
  EXPECT_NE(ao_layers.back().reason.find("last linear layer"), std::string::npos);
  EXPECT_TRUE(find_layer(ao_layers, "model.layers.1.mlp.down_proj")->fp8);
  EXPECT_FALSE(find_layer(ao_layers, "model.layers.0.self_attn.q_proj")->fp8);
  auto ao = apply_fp8(a, ao_config(), Device::cpu());
  EXPECT_EQ(ao->layer_context("lm_head"), nullptr);
  EXPECT_FALSE(static_cast<bool>(a.tied_head_fn));
  EXPECT_EQ(ao->num_fp8_layers(), 13);
  const std::string da = ao->describe();
  EXPECT_NE(da.find("kept in bf16: lm_head (tied to model.embed_tokens) [out 64, in 32]: last"),
            std::string::npos)
      << da;

  // A tied head whose vocabulary is not a multiple of 16 stays in bf16 under TE, as an untied one.
  DecoderConfig odd = tiny_llama(2, true);
  odd.vocab_size = 60;
  CausalLM o(odd, DType::F32, Device::cpu(), 1);
  const auto odd_layers = choose_fp8_layers(o, te_config());
  EXPECT_FALSE(odd_layers.back().fp8);
  EXPECT_NE(odd_layers.back().reason.find("divisible by 16"), std::string::npos);
}

// The untied model of the same seed holds the same parameters (initialization walks the
// parameters in order; lm_head comes last), with lm_head.weight set to the embedding.
struct TiedAndUntied {
  std::unique_ptr<CausalLM> tied, untied;
  std::unique_ptr<Fp8Training> fp8_tied, fp8_untied;
};

TiedAndUntied make_pair(const Fp8Config& cfg, uint64_t seed) {
  TiedAndUntied p;
  p.tied = std::make_unique<CausalLM>(tiny_llama(2, true), DType::F32, Device::cpu(), seed);
  p.untied = std::make_unique<CausalLM>(tiny_llama(2, false), DType::F32, Device::cpu(), seed);
  {
    NoGradGuard no_grad;
    p.untied->lm_head->weight.value.copy_(p.tied->model.embed_tokens.weight.value);
  }
  p.fp8_tied = apply_fp8(*p.tied, cfg, Device::cpu());
  p.fp8_untied = apply_fp8(*p.untied, cfg, Device::cpu());
  return p;
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

TEST(Fp8TiedHead, EqualsAnUntiedFp8HeadHoldingTheEmbedding) {
  for (const Fp8Config& cfg : {te_config(), mx_config()}) {
    SCOPED_TRACE(cfg.use_mxfp8_block_scaling ? "MXFP8" : "TE");
    TiedAndUntied p = make_pair(cfg, 5);
    for (Parameter* t : p.tied->parameters()) {
      bool found = false;
      for (Parameter* u : p.untied->parameters())
        if (u->name == t->name) {
          found = true;
          EXPECT_EQ(t->value.to_vector(), u->value.to_vector()) << t->name;
        }
      EXPECT_TRUE(found) << t->name;
    }
    RunSpec s;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto [ids, labels] = rank_batch(s, step, 0, 0, 64);
      // Logits and the loss (the trainer's forward_loss) with the same fp8 numerics: step 0
      // casts with scale 1, later steps with the scales the same amaxes gave.
      EXPECT_EQ(p.tied->forward(ids).to_vector(), p.untied->forward(ids).to_vector());
      Tensor lt = p.tied->forward_loss(ids, labels), lu = p.untied->forward_loss(ids, labels);
      EXPECT_EQ(lt.item(), lu.item());
      lt.backward();
      lu.backward();
      if (p.fp8_tied->delayed()) {
        EXPECT_EQ(p.fp8_tied->delayed()->current_amaxes().to_vector(),
                  p.fp8_untied->delayed()->current_amaxes().to_vector());
      }
      // The head's gradient flows into the embedding: the tied embedding's gradient is the
      // untied embedding's plus the untied head's (up to the order of the fp32 sums).
      const std::vector<double> ge = p.tied->model.embed_tokens.weight.value.grad().to_vector();
      std::vector<double> want = p.untied->model.embed_tokens.weight.value.grad().to_vector();
      const std::vector<double> gh = p.untied->lm_head->weight.value.grad().to_vector();
      for (size_t i = 0; i < want.size(); ++i) want[i] += gh[i];
      EXPECT_LT(max_rel_diff(ge, want), 1e-6);
      EXPECT_NE(gh, std::vector<double>(gh.size(), 0.0));
      EXPECT_EQ(p.tied->model.norm.weight.value.grad().to_vector(),
                p.untied->model.norm.weight.value.grad().to_vector());
      for (Parameter* q : p.tied->parameters()) q->value.zero_grad();
      for (Parameter* q : p.untied->parameters()) q->value.zero_grad();
      p.fp8_tied->step_end(static_cast<ProcessGroup*>(nullptr));
      p.fp8_untied->step_end(static_cast<ProcessGroup*>(nullptr));
      if (p.fp8_tied->delayed()) {
        EXPECT_EQ(p.fp8_tied->delayed()->scales().to_vector(),
                  p.fp8_untied->delayed()->scales().to_vector());
        // The tied head's slots moved off scale 1: it recorded amaxes.
        const Fp8LinearContext* head = p.fp8_tied->layer_context("lm_head");
        const std::vector<double> sc = p.fp8_tied->delayed()->scales().to_vector();
        EXPECT_NE(sc[head->slot_weight], 1.0);
        EXPECT_NE(sc[head->slot_grad_output], 1.0);
      }
    }
  }
}

// A tied tiny Llama with the vocabulary of the untied runs (tests/ops/fp8_training_test.cpp).
DecoderConfig tied_train_config() {
  DecoderConfig c = tiny_llama(2, true);
  c.vocab_size = 32;
  return c;
}

TEST(Fp8TiedHead, TrainsAndTracksBf16) {
  expect_fp8_tracks_bf16(tied_train_config(), {{"tied TE delayed", te_config()},
                                               {"tied MXFP8 emulated", mx_config()},
                                               {"tied AO dynamic", ao_config()}});
  // Under TE the tied head itself runs in fp8: the same run with the head in bf16 (neither its
  // logits nor its fused loss in fp8) differs from its first step on (the head's GEMM is the only
  // difference).
  const Fp8Config te = te_config();
  const std::vector<double> head_fp8 = fp8_train_losses(tied_train_config(), &te, 3),
                            head_bf16 =
                                fp8_train_losses(tied_train_config(), &te, 3, [](CausalLM&m) {
                                  m.tied_head_fn = nullptr;
                                  m.head_loss_fn = nullptr;
                                });
  EXPECT_NE(head_fp8[0], head_bf16[0]);
}

TEST(Fp8TiedHead, EvaluationAndGenerationInEitherMode) {
  CausalLM plain(tiny_llama(2, true), DType::F32, Device::cpu(), 7);
  CausalLM model(tiny_llama(2, true), DType::F32, Device::cpu(), 7);
  auto fp8 = apply_fp8(model, te_config(), Device::cpu());
  RunSpec s;
  auto [ids, labels] = rank_batch(s, 0, 0, 0, 64);
  NoGradGuard no_grad;
  const std::vector<double> want = plain.forward(ids).to_vector();
  const double want_loss = plain.forward_loss(ids, labels).item();
  auto greedy = [](CausalLM& m, int n) {
    KVCache cache;
    std::vector<int64_t> out;
    Tensor logits = m.forward(Tensor::from_vector(std::vector<int64_t>{3, 17, 5}, {1, 3}), &cache);
    for (int i = 0; i < n; ++i) {
      const std::vector<double> row = logits.to_vector();
      const int64_t V = logits.size(2);
      const size_t last = row.size() - static_cast<size_t>(V);
      int64_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (row[last + v] > row[last + best]) best = v;
      out.push_back(best);
      logits = m.forward(Tensor::from_vector(std::vector<int64_t>{best}, {1, 1}), &cache);
    }
    return out;
  };
  const std::vector<int64_t> want_tokens = greedy(plain, 6);
  {
    Fp8EvalScope eval(fp8.get());  // bf16: the tied head is the plain model's
    EXPECT_EQ(model.forward(ids).to_vector(), want);
    // The converted head's loss is the plain loss over its logits; the bf16 model's is fused.
    EXPECT_NEAR(model.forward_loss(ids, labels).item(), want_loss, 1e-5 * want_loss);
    EXPECT_EQ(greedy(model, 6), want_tokens);
  }
  for (double v : fp8->delayed()->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
  // Outside the scope the head runs in fp8 and records its amaxes.
  EXPECT_NE(model.forward(ids).to_vector(), want);
  const Fp8LinearContext* head = fp8->layer_context("lm_head");
  EXPECT_GT(fp8->delayed()->current_amaxes().to_vector()[head->slot_input], 0.0);

  // use_autocast_during_eval: fp8 in evaluation and generation, nothing recorded.
  CausalLM m2(tiny_llama(2, true), DType::F32, Device::cpu(), 7);
  Fp8Config cfg = te_config();
  cfg.use_autocast_during_eval = true;
  auto fp8b = apply_fp8(m2, cfg, Device::cpu());
  {
    Fp8EvalScope eval(fp8b.get());
    EXPECT_NE(m2.forward(ids).to_vector(), want);
    EXPECT_EQ(greedy(m2, 6).size(), 6u);
  }
  for (double v : fp8b->delayed()->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
}

// ---- strategies -------------------------------------------------------------------------------

struct Fp8Run {
  std::unique_ptr<Fp8Training> fp8;
  Trainee t;
};

// The delayed-scaling state every run below starts from: the single process's after one forward
// and backward of a batch no step trains on (so that step 1 does not cast with scale 1), as a
// rank of `world` takes it (fp8_state_for_ranks).
Fp8CheckpointState warm_up_state(const RunSpec& s, int world) {
  RunSpec one = s;
  one.world = 1;
  CausalLM m(tiny_llama(2, true), DType::F32, Device::cpu(), s.seed);
  auto fp8 = apply_fp8(m, te_config(), Device::cpu());
  auto [ids, labels] = rank_batch(one, 1000, 0, 0, 64);
  m.forward_loss(ids, labels).backward();
  fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  return fp8_state_for_ranks(fp8_checkpoint_state(*fp8), world);
}

// The trainer's order: model, apply_fp8, strategy, setup. `how`: reference (one process,
// tests/parallel/strategy_test_util.h), single, ddp, zero3, or fsdp (from a loaded config).
Fp8Run make_fp8_run(const std::string& how, const RunSpec& s, std::shared_ptr<ProcessGroup> pg) {
  Fp8Run r;
  r.t.model = std::make_unique<CausalLM>(tiny_llama(2, true), DType::F32, Device::cpu(), s.seed);
  r.t.model->set_activation_checkpointing(s.activation_checkpointing);
  r.fp8 = apply_fp8(*r.t.model, te_config(), Device::cpu());
  if (fp8_load_checkpoint_state(*r.fp8, warm_up_state(s, s.world), "warm-up") != "")
    throw std::logic_error("warm-up state: unexpected note");
  if (how == "fsdp") {
    const Config cfg = load_config(
        "",
        {"distributed_type=FSDP", "num_processes=" + std::to_string(s.world), "model.name=llama"});
    r.t.strategy = make_strategy(cfg, pg, s.compute);
  } else {
    RunSpec spec = s;
    spec.strategy = how;
    r.t.strategy = make_test_strategy(spec, pg);
  }
  r.t.strategy->setup(*r.t.model, test_optimizer());
  return r;
}

// One optimizer step as the trainer runs it (forward_loss, then the fp8 update with the amax
// all-reduce); the global mean loss.
double fp8_step(const RunSpec& s, Fp8Run& r, int step, int rank, ProcessGroup* pg) {
  double loss_sum = 0;
  for (int micro = 0; micro < s.accum; ++micro) {
    r.t.strategy->begin_micro_batch(micro == s.accum - 1);
    auto [ids, labels] = rank_batch(s, step, micro, rank, 64);
    Tensor loss = r.t.model->forward_loss(ids, labels, {}, 1.0 / s.accum);
    loss_sum += loss.item();
    mul(loss, 1.0 / s.accum).backward();
    r.t.strategy->end_micro_batch();
  }
  r.t.strategy->step(s.lr, s.clip, 1.0);
  r.fp8->step_end(pg);
  return mean_over_ranks(loss_sum / s.accum, pg);
}

RunResult run_fp8(const std::string& how, const RunSpec& s, std::shared_ptr<ProcessGroup> pg,
                  int rank, std::vector<double>* scales = nullptr) {
  Fp8Run r = make_fp8_run(how, s, pg);
  RunResult out;
  for (int step = 0; step < s.steps; ++step)
    out.losses.push_back(fp8_step(s, r, step, rank, pg.get()));
  for (auto& [name, w] : full_weights(*r.t.strategy))
    out.final_weights.push_back({name, w.clone()});
  if (scales) *scales = r.fp8->delayed()->scales().to_vector();
  return out;
}

// The single process on the global batch against 2 ranks on half of it each (the trainer's
// split), all from a warm-up's scales (warm_up_state): the numbers agree up to the order of fp32
// sums. The MAX all-reduce gives every rank the single process's input and weight amaxes, and a
// rank's output gradients are exactly twice the single process's (its loss is a mean over half
// the tokens; the gradient reduction averages), so its grad_output scales are exactly half and
// its fp8 codes the same. The 2-rank strategies are also compared with each other (DDP the
// reference).
TEST(Fp8TiedHead, StrategiesFollowTheSingleProcess) {
  RunSpec s;
  s.steps = 5;
  std::vector<double> ref_scales;
  const RunResult ref = run_fp8("reference", s, nullptr, 0, &ref_scales);
  ASSERT_LT(ref.losses.back(), ref.losses.front()) << "the reference does not learn";
  const double tol = 1e-5;
  for (ActivationCheckpointing mode :
       {ActivationCheckpointing::Full, ActivationCheckpointing::Selective}) {
    SCOPED_TRACE(name_of(mode));
    RunSpec ckpt = s;
    ckpt.activation_checkpointing = mode;
    const RunResult single = run_fp8("single", ckpt, nullptr, 0);
    EXPECT_EQ(compare_losses(single.losses, ref.losses, tol), "");
    EXPECT_EQ(compare_weights(single.final_weights, ref.final_weights, tol), "");
  }
  const int world = 2;
  const int port = pick_free_port();
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    RunSpec d = s;
    d.world = world;
    std::vector<double> ddp_scales;
    const RunResult ddp = run_fp8("ddp", d, w.pg, rank, &ddp_scales);
    for (const char* how : {"ddp", "zero3", "fsdp"}) {
      RunSpec dd = d;
      // ZeRO-3 with selective checkpointing, FSDP with full.
      dd.activation_checkpointing = std::string(how) == "ddp" ? ActivationCheckpointing::None
                                    : std::string(how) == "zero3"
                                        ? ActivationCheckpointing::Selective
                                        : ActivationCheckpointing::Full;
      std::vector<double> scales = ddp_scales;
      const RunResult got = std::string(how) == "ddp" ? ddp : run_fp8(how, dd, w.pg, rank, &scales);
      if (rank == 0) {
        double worst = 0;
        for (size_t i = 0; i < got.losses.size(); ++i)
          worst = std::max(worst, std::abs(got.losses[i] - ref.losses[i]) / ref.losses[i]);
        std::printf(
            "tied fp8 %s x %d: largest relative loss difference to the single process %.2e\n", how,
            world, worst);
      }
      std::string e = compare_losses(got.losses, ref.losses, tol);
      RANK_CHECK(e.empty(), "%s vs the single process: %s", how, e.c_str());
      e = compare_weights(got.final_weights, ref.final_weights, tol);
      RANK_CHECK(e.empty(), "%s vs the single process: %s", how, e.c_str());
      e = compare_losses(got.losses, ddp.losses, tol);
      RANK_CHECK(e.empty(), "%s vs ddp: %s", how, e.c_str());
      e = compare_weights(got.final_weights, ddp.final_weights, tol);
      RANK_CHECK(e.empty(), "%s vs ddp: %s", how, e.c_str());
      // The tied head's slots (the last three: input, weight, grad_output).
      RANK_CHECK(scales.size() == ref_scales.size(), "%s: %zu scales", how, scales.size());
      const size_t n = scales.size();
      const double want[3] = {ref_scales[n - 3], ref_scales[n - 2], ref_scales[n - 1] / 2};
      for (size_t k = 0; k < 3; ++k)
        RANK_CHECK(std::abs(scales[n - 3 + k] - want[k]) <= 1e-5 * want[k],
                   "%s: head slot %zu scale %g, the single process's gives %g", how, k,
                   scales[n - 3 + k], want[k]);
    }
    return 0;
  });
  expect_all_ok(exits);
}

// ---- delayed-scaling state ---------------------------------------------------------------------

TEST(Fp8TiedHead, StateHoldsTheHeadAndAStateFromBeforeLoadsWithTheHeadAfresh) {
  CausalLM model(tiny_llama(2, true), DType::F32, Device::cpu(), 3);
  auto fp8 = apply_fp8(model, te_config(), Device::cpu());
  RunSpec s;
  for (int step = 0; step < 2; ++step) {
    auto [ids, labels] = rank_batch(s, step, 0, 0, 64);
    model.forward_loss(ids, labels).backward();
    fp8->step_end(static_cast<ProcessGroup*>(nullptr));
  }
  const Fp8CheckpointState st = fp8_checkpoint_state(*fp8);
  EXPECT_EQ(st.metadata.at("tied_lm_head"), "fp8");
  int head_tensors = 0;
  for (const auto& [name, t] : st.tensors) head_tensors += name.rfind("lm_head.", 0) == 0;
  EXPECT_EQ(head_tensors, 9);  // 3 roles x (amax_history, scale, scale_inv)

  // The same state into a fresh run: exact, no note.
  CausalLM m2(tiny_llama(2, true), DType::F32, Device::cpu(), 3);
  auto fp8b = apply_fp8(m2, te_config(), Device::cpu());
  EXPECT_EQ(fp8_load_checkpoint_state(*fp8b, st, "ck"), "");
  EXPECT_EQ(fp8b->delayed()->scales().to_vector(), fp8->delayed()->scales().to_vector());
  EXPECT_EQ(fp8b->delayed()->amax_history().to_vector(),
            fp8->delayed()->amax_history().to_vector());

  // A state written when the tied head ran in bf16: no lm_head tensors, no tied_lm_head key.
  Fp8CheckpointState old;
  for (const auto& [name, t] : st.tensors)
    if (name.rfind("lm_head.", 0) != 0) old.tensors.push_back({name, t});
  old.metadata = st.metadata;
  old.metadata.erase("tied_lm_head");
  CausalLM m3(tiny_llama(2, true), DType::F32, Device::cpu(), 3);
  auto fp8c = apply_fp8(m3, te_config(), Device::cpu());
  const std::string note = fp8_load_checkpoint_state(*fp8c, old, "ck");
  EXPECT_NE(note.find("lm_head (tied to model.embed_tokens) has no saved state"), std::string::npos)
      << note;
  EXPECT_NE(note.find("starts afresh"), std::string::npos) << note;
  const std::vector<double> want = fp8->delayed()->scales().to_vector(),
                            got = fp8c->delayed()->scales().to_vector();
  const Fp8LinearContext* head = fp8c->layer_context("lm_head");
  for (size_t i = 0; i < got.size(); ++i) {
    const bool head_slot = static_cast<int>(i) == head->slot_input ||
                           static_cast<int>(i) == head->slot_weight ||
                           static_cast<int>(i) == head->slot_grad_output;
    if (head_slot)
      EXPECT_EQ(got[i], 1.0) << "slot " << i;
    else
      EXPECT_EQ(got[i], want[i]) << "slot " << i;
  }
  EXPECT_EQ(fp8c->delayed()->updates(), fp8->delayed()->updates());

  // A state that says it holds the tied head but lacks it is refused, naming the layer.
  Fp8CheckpointState broken = old;
  broken.metadata["tied_lm_head"] = "fp8";
  CausalLM m4(tiny_llama(2, true), DType::F32, Device::cpu(), 3);
  auto fp8d = apply_fp8(m4, te_config(), Device::cpu());
  try {
    fp8_load_checkpoint_state(*fp8d, broken, "ck");
    ADD_FAILURE() << "not refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("have no saved state (lm_head)"), std::string::npos)
        << e.what();
  }
  // An untied model's state does not fit a tied run with other layers missing either; the head
  // layer name alone is shared, which the model check of a resume (lm_head.weight) keeps apart.
}

}  // namespace
}  // namespace accel
