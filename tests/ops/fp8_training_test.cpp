// fp8 training of a Llama on the CPU emulation: which layers convert, the recipe an fp8_config
// gives, evaluation scopes, the per-step amax all-reduce (2 ranks), and short training runs whose
// loss must fall and stay within a few percent of bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "tests/ops/fp8_training_check.h"
#include "tests/parallel/harness.h"

namespace accel {
namespace {

DecoderConfig tiny_config() {
  DecoderConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  return c;
}

Fp8Config te_config() {
  Fp8Config c;
  c.backend = Fp8Backend::TE;
  c.amax_history_len = 16;
  c.amax_compute_algo = AmaxComputeAlgo::Max;
  return c;
}

Fp8Config ao_config() {
  Fp8Config c;
  c.backend = Fp8Backend::AO;
  return c;
}

std::vector<std::string> fp8_names(const std::vector<Fp8LayerChoice>& layers) {
  std::vector<std::string> out;
  for (const auto& l : layers)
    if (l.fp8) out.push_back(l.name);
  return out;
}

TEST(Fp8Layers, TransformerEngineConvertsEveryAlignedLinear) {
  CausalLM model(tiny_config(), DType::F32, Device::cpu(), 1);
  auto te = choose_fp8_layers(model, te_config());
  ASSERT_EQ(te.size(), 15u);  // 2 x (q k v o gate up down) + lm_head
  EXPECT_EQ(fp8_names(te).size(), 15u);
  EXPECT_EQ(te.front().name, "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(te.back().name, "lm_head");
  EXPECT_EQ(te.back().out_features, 64);

  DecoderConfig odd = tiny_config();
  odd.intermediate_size = 120;  // gate/up/down not divisible by 16
  CausalLM m2(odd, DType::F32, Device::cpu(), 1);
  auto t2 = choose_fp8_layers(m2, te_config());
  EXPECT_EQ(fp8_names(t2).size(), 15u - 6u);
  for (const auto& l : t2)
    if (l.name.find("mlp") != std::string::npos) {
      EXPECT_FALSE(l.fp8) << l.name;
      EXPECT_NE(l.reason.find("divisible by 16"), std::string::npos);
    }
  Fp8Config ao = ao_config();
  ao.pad_inner_dim = true;
  EXPECT_EQ(fp8_names(choose_fp8_layers(m2, ao)).size(), 13u);  // padded: only first/last stay
}

TEST(Fp8Layers, TorchAoKeepsFirstLastAndExcludedLayers) {
  CausalLM model(tiny_config(), DType::F32, Device::cpu(), 1);
  auto ao = choose_fp8_layers(model, ao_config());
  EXPECT_FALSE(ao.front().fp8);
  EXPECT_FALSE(ao.back().fp8);
  EXPECT_EQ(fp8_names(ao).size(), 13u);
  Fp8Config ex = ao_config();
  ex.exclude_modules = {"mlp.down_proj"};
  auto ao2 = choose_fp8_layers(model, ex);
  EXPECT_EQ(fp8_names(ao2).size(), 11u);  // both down_proj layers excluded
  for (const auto& l : ao2) {
    if (l.name.find("down_proj") != std::string::npos) {
      EXPECT_FALSE(l.fp8) << l.name;
    }
  }
  // With a tied head, Hugging Face's last Linear is the (tied) lm_head, listed here too and kept
  // in high precision: the last down_proj converts (tests/models/fp8_tied_head_test.cpp has the
  // tied head under every recipe).
  DecoderConfig tied = tiny_config();
  tied.tie_word_embeddings = true;
  CausalLM mt(tied, DType::F32, Device::cpu(), 1);
  auto at = choose_fp8_layers(mt, ao_config());
  ASSERT_EQ(at.size(), 15u);
  EXPECT_FALSE(at.front().fp8);
  EXPECT_EQ(at.back().display_name(), "lm_head (tied to model.embed_tokens)");
  EXPECT_FALSE(at.back().fp8);
  EXPECT_EQ(at[13].name, "model.layers.1.mlp.down_proj");
  EXPECT_TRUE(at[13].fp8);
}

TEST(Fp8Recipe, FromConfig) {
  Fp8Config c = te_config();
  Fp8Recipe r = fp8_recipe_from_config(c);
  EXPECT_EQ(r.scaling, Fp8Scaling::Delayed);
  EXPECT_EQ(r.forward_dtype, DType::E4M3);
  EXPECT_EQ(r.backward_dtype, DType::E5M2);
  EXPECT_EQ(r.amax_algo, AmaxAlgo::Max);
  EXPECT_EQ(r.amax_history_len, 16);
  c.fp8_format = Fp8Format::E4M3;
  c.override_linear_precision_wgrad = true;
  c.margin = 2;
  c.interval = 3;
  r = fp8_recipe_from_config(c);
  EXPECT_EQ(r.backward_dtype, DType::E4M3);
  EXPECT_TRUE(r.hp_wgrad);
  EXPECT_FALSE(r.hp_fprop);
  EXPECT_EQ(r.margin, 2);
  EXPECT_EQ(r.interval, 3);
  c.use_mxfp8_block_scaling = true;
  EXPECT_EQ(fp8_recipe_from_config(c).scaling, Fp8Scaling::MxBlock);
  // Settings the config loader refuses (tests/runtime/config_test.cpp has their messages) are
  // a caller's bug here.
  c.fp8_format = Fp8Format::E5M2;
  EXPECT_THROW(fp8_recipe_from_config(c), std::logic_error);
  Fp8Config ao = ao_config();
  EXPECT_EQ(fp8_recipe_from_config(ao).scaling, Fp8Scaling::Dynamic);
  ao.use_mxfp8_block_scaling = true;
  EXPECT_THROW(fp8_recipe_from_config(ao), std::logic_error);
  ao.backend = Fp8Backend::MSAMP;
  ao.use_mxfp8_block_scaling = false;
  EXPECT_THROW(fp8_recipe_from_config(ao), std::logic_error);
}

// fp8_config.recipe_name: torchao's Float8LinearConfig.from_recipe_name and DeepSeek-V3's recipe.
TEST(Fp8Recipe, FromRecipeName) {
  Fp8Config ao = ao_config();
  ao.recipe_name = Fp8RecipeName::Tensorwise;
  Fp8Recipe t = fp8_recipe_from_config(ao);
  EXPECT_EQ(t.scaling, Fp8Scaling::Dynamic);
  EXPECT_EQ(t.backward_dtype, DType::E5M2);
  ao.recipe_name = Fp8RecipeName::Rowwise;
  Fp8Recipe r = fp8_recipe_from_config(ao);
  EXPECT_EQ(r.scaling, Fp8Scaling::Rowwise);
  EXPECT_EQ(r.forward_dtype, DType::E4M3);
  EXPECT_EQ(r.backward_dtype, DType::E4M3);
  EXPECT_TRUE(r.pow2_scales);
  EXPECT_FALSE(r.hp_wgrad || r.hp_dgrad || r.hp_fprop || r.dgrad_weight_tensorwise);
  ao.recipe_name = Fp8RecipeName::RowwiseWithGwHp;
  Fp8Recipe g = fp8_recipe_from_config(ao);
  EXPECT_EQ(g.scaling, Fp8Scaling::Rowwise);
  EXPECT_EQ(g.backward_dtype, DType::E4M3);
  EXPECT_FALSE(g.pow2_scales);
  EXPECT_TRUE(g.hp_wgrad);
  EXPECT_TRUE(g.dgrad_weight_tensorwise);
  EXPECT_FALSE(g.hp_dgrad || g.hp_fprop);
  ao.recipe_name = Fp8RecipeName::Blockwise;
  Fp8Recipe b = fp8_recipe_from_config(ao);
  EXPECT_EQ(b.scaling, Fp8Scaling::Blockwise);
  EXPECT_EQ(b.forward_dtype, DType::E4M3);
  EXPECT_EQ(b.backward_dtype, DType::E4M3);
  EXPECT_FALSE(b.pow2_scales || b.hp_wgrad || b.dgrad_weight_tensorwise);
  Fp8Config te = te_config();
  te.recipe_name = Fp8RecipeName::Rowwise;  // the config loader refuses it with TE
  EXPECT_THROW(fp8_recipe_from_config(te), std::logic_error);
  CausalLM m(tiny_config(), DType::F32, Device::cpu(), 1);
  std::string d = apply_fp8(m, ao, Device::cpu())->describe();
  EXPECT_NE(d.find("dynamic blockwise scaling"), std::string::npos) << d;
}

TEST(Fp8Training, DescribeNamesTheEffectiveRecipe) {
  CausalLM model(tiny_config(), DType::F32, Device::cpu(), 1);
  auto te = apply_fp8(model, te_config(), Device::cpu());
  std::string d = te->describe();
  EXPECT_NE(d.find("backend TE: delayed scaling (amax_history_len 16, amax_compute_algo max"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("e4m3 forward / e5m2 gradients"), std::string::npos) << d;
  EXPECT_NE(d.find("15 of 15 linear layers in fp8"), std::string::npos) << d;
  EXPECT_NE(d.find("evaluation in bf16"), std::string::npos) << d;
  EXPECT_NE(d.find("emulation"), std::string::npos) << d;
  EXPECT_EQ(te->delayed()->num_slots(), 45);

  CausalLM m2(tiny_config(), DType::F32, Device::cpu(), 1);
  Fp8Config mx = te_config();
  mx.use_mxfp8_block_scaling = true;
  std::string dm = apply_fp8(m2, mx, Device::cpu())->describe();
  EXPECT_NE(dm.find("EMULATED"), std::string::npos) << dm;

  CausalLM m3(tiny_config(), DType::F32, Device::cpu(), 1);
  std::string da = apply_fp8(m3, ao_config(), Device::cpu())->describe();
  EXPECT_NE(da.find("dynamic per-tensor scaling"), std::string::npos) << da;
  EXPECT_NE(da.find("kept in bf16: model.layers.0.self_attn.q_proj"), std::string::npos) << da;
  EXPECT_NE(da.find("kept in bf16: lm_head"), std::string::npos) << da;
}

// Smaller still than tiny_config(): 5 runs of 30 steps must take ~1 s.
DecoderConfig train_config() {
  DecoderConfig c = tiny_config();
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.vocab_size = 32;
  return c;
}

TEST(Fp8Training, TinyLlamaLossFallsAndTracksBf16) {
  Fp8Config mx = te_config();
  mx.use_mxfp8_block_scaling = true;
  mx.fp8_format = Fp8Format::E4M3;
  Fp8Config te_e4m3 = te_config();
  te_e4m3.fp8_format = Fp8Format::E4M3;
  te_e4m3.amax_compute_algo = AmaxComputeAlgo::MostRecent;
  testing::expect_fp8_tracks_bf16(train_config(), {{"TE delayed HYBRID", te_config()},
                                                   {"TE delayed E4M3", te_e4m3},
                                                   {"AO dynamic", ao_config()},
                                                   {"MXFP8 emulated", mx}});
}

// fp8_config.recipe_name's rowwise, rowwise_with_gw_hp and blockwise recipes train like bf16 (the
// same model, data and 30 steps as above).
TEST(Fp8Training, AoRecipesLossFallsAndTracksBf16) {
  std::vector<testing::NamedFp8Config> runs;
  for (Fp8RecipeName name :
       {Fp8RecipeName::Rowwise, Fp8RecipeName::RowwiseWithGwHp, Fp8RecipeName::Blockwise}) {
    Fp8Config c = ao_config();
    c.recipe_name = name;
    runs.push_back({name_of(name), c});
  }
  testing::expect_fp8_tracks_bf16(train_config(), runs);
}

// TE's recipe trains through the fused MLP (fp8_swiglu_mlp) in every layer, with the losses of the
// projections run layer by layer; AO's (dynamic scaling) keeps the layers.
TEST(Fp8Training, FusedMlpTrainsLikeLayerByLayer) {
  for (const Fp8Config& cfg : {te_config(), ao_config()}) {
    int taken = 0, calls = 0;
    auto count = [&](CausalLM& m) {
      for (auto& [name, mod] : m.named_modules())
        if (auto* mlp = dynamic_cast<GatedMLP*>(mod)) {
          ASSERT_TRUE(mlp->fused_fn) << name;
          mlp->fused_fn = [&, f = mlp->fused_fn](const Tensor& x, const Tensor& residual) {
            Tensor y = f(x, residual);
            ++calls;
            taken += y.defined();
            return y;
          };
        }
    };
    auto layers = [](CausalLM& m) {
      for (auto& [name, mod] : m.named_modules())
        if (auto* mlp = dynamic_cast<GatedMLP*>(mod)) mlp->fused_fn = nullptr;
    };
    const std::vector<double> fused = testing::fp8_train_losses(train_config(), &cfg, 4, count),
                              plain = testing::fp8_train_losses(train_config(), &cfg, 4, layers);
    // The fused MLP makes the residual add in its down GEMM (rounded once; the layers round the
    // projection, then the sum): the losses agree to about 1e-5, not bit for bit
    // (tests/ops/fp8_mlp_check.h compares the two exactly, up to that one rounding).
    ASSERT_EQ(fused.size(), plain.size());
    for (size_t i = 0; i < fused.size(); ++i)
      EXPECT_NEAR(fused[i], plain[i], 2e-4 * std::fabs(plain[i])) << name_of(cfg.backend);
    EXPECT_EQ(calls, 4 * 2) << name_of(cfg.backend);  // 2 layers x 4 steps
    EXPECT_EQ(taken, cfg.backend == Fp8Backend::TE ? calls : 0) << name_of(cfg.backend);
  }
}

TEST(Fp8Training, EvalScope) {
  CausalLM plain(tiny_config(), DType::F32, Device::cpu(), 7);
  CausalLM model(tiny_config(), DType::F32, Device::cpu(), 7);
  Fp8Config cfg = te_config();
  auto fp8 = apply_fp8(model, cfg, Device::cpu());
  auto [ids, targets] = testing::arithmetic_batch(1, 2, 16, 64);
  NoGradGuard no_grad;
  const std::vector<double> want = plain.forward(ids).to_vector();
  {
    Fp8EvalScope eval(fp8.get());
    EXPECT_EQ(model.forward(ids).to_vector(), want);  // bf16 path: exactly the plain model
  }
  for (double v : fp8->delayed()->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
  EXPECT_NE(model.forward(ids).to_vector(), want);  // outside the scope: fp8, recording
  EXPECT_GT(fp8->delayed()->current_amaxes().to_vector()[0], 0.0);

  CausalLM m2(tiny_config(), DType::F32, Device::cpu(), 7);
  cfg.use_autocast_during_eval = true;
  auto fp8b = apply_fp8(m2, cfg, Device::cpu());
  {
    Fp8EvalScope eval(fp8b.get());
    EXPECT_NE(m2.forward(ids).to_vector(), want);  // fp8, but nothing recorded
  }
  for (double v : fp8b->delayed()->amax_history().to_vector()) EXPECT_EQ(v, 0.0);
  EXPECT_TRUE(fp8b->autocast().record_amax);
  Fp8EvalScope none(nullptr);  // no fp8: a no-op
}

TEST(Fp8Training, StepEndReducesThenUpdates) {
  CausalLM model(tiny_config(), DType::F32, Device::cpu(), 3);
  auto fp8 = apply_fp8(model, te_config(), Device::cpu());
  auto [ids, targets] = testing::arithmetic_batch(2, 2, 16, 64);
  CausalLM::loss(model.forward(ids), targets).backward();
  int calls = 0;
  fp8->step_end([&](const Tensor& amaxes) {
    ++calls;
    EXPECT_EQ(amaxes.numel(), 45);
    for (double v : amaxes.to_vector()) EXPECT_GT(v, 0.0);
    amaxes.fill_(2.0);  // as if another rank had seen larger values
  });
  EXPECT_EQ(calls, 1);
  std::vector<double> s = fp8->delayed()->scales().to_vector();
  EXPECT_EQ(s[0], 224.0);        // input slot, e4m3
  EXPECT_EQ(s[2], 57344.0 / 2);  // grad-output slot, e5m2
  EXPECT_EQ(fp8->delayed()->updates(), 1);
  // Dynamic scaling has nothing to reduce.
  CausalLM m2(tiny_config(), DType::F32, Device::cpu(), 3);
  auto ao = apply_fp8(m2, ao_config(), Device::cpu());
  ao->step_end([&](const Tensor&) { ++calls; });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(ao->delayed(), nullptr);
}

// OpenMP's thread pool does not survive fork(): a forked rank must not start parallel regions
// (earlier tests of this binary have started the pool).
extern "C" void omp_set_num_threads(int) __attribute__((weak));

TEST(Fp8Training, AmaxAllReduceGivesEveryRankTheSameScales) {
  const int n = 2, port = testing::pick_free_port();
  auto exits = testing::run_ranks(n, [&](int rank) {
    if (omp_set_num_threads) omp_set_num_threads(1);
    testing::World w = testing::make_world(rank, n, port);
    CausalLM model(tiny_config(), DType::F32, Device::cpu(), 3);
    auto fp8 = apply_fp8(model, te_config(), Device::cpu());
    auto [ids, targets] =
        testing::arithmetic_batch(100 + rank, 2, 16, 64);  // different data per rank
    CausalLM::loss(model.forward(ids), targets).backward();
    Tensor local = fp8->delayed()->current_amaxes().clone();
    fp8->step_end(w.pg.get());
    Tensor all = Tensor::empty({n * local.numel()});
    w.pg->all_gather(all, local)->wait();
    Tensor scales = fp8->delayed()->scales().clone();
    Tensor all_scales = Tensor::empty({n * scales.numel()});
    w.pg->all_gather(all_scales, scales)->wait();
    std::vector<double> a = all.to_vector(), sc = all_scales.to_vector();
    const int64_t k = local.numel();
    bool differs = false;
    for (int64_t i = 0; i < k; ++i) {
      differs = differs || a[i] != a[k + i];
      const float m = static_cast<float>(std::max(a[i], a[k + i]));
      const float fmax = i % 3 == 2 ? kE5M2Max : kE4M3Max;
      RANK_CHECK(sc[i] == fp8_scale_for_amax(m, fmax, 0, 1.0f), "slot %lld", (long long)i);
      RANK_CHECK(sc[i] == sc[k + i], "slot %lld differs across ranks", (long long)i);
    }
    RANK_CHECK(differs, "the ranks' local amaxes should differ");
    return 0;
  });
  testing::expect_all_ok(exits);
}

}  // namespace
}  // namespace accel
