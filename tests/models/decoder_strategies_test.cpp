// The families beyond Llama under the strategies, activation checkpointing and fp8: a tiny Qwen3
// (q/k norms, biases, head_dim apart from hidden / heads, tied embeddings), a tiny Mistral (a
// sliding window shorter than the sequence) and tiny Qwen3-MoE / Mixtral (experts in their
// decoder layers, FSDP's units) trained with FSDP (full checkpointing) and ZeRO-2 (selective) on
// 2 CPU ranks must follow the single process; fp8 (TE and AO, CPU emulation) converts their
// projections and learns.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "models/fp8_linear.h"
#include "parallel/fsdp.h"
#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {
using namespace accel::testing;

// `how`: reference (one process, tests/parallel/strategy_test_util.h), single, zero2, or fsdp (from
// a loaded config, so the wrap policy comes from model.name as in accel-train).
RunResult run_family(const std::string& family, const std::string& how, const RunSpec& s,
                     std::shared_ptr<ProcessGroup> pg, int rank) {
  Trainee t;
  t.model = std::make_unique<CausalLM>(tiny_family(family), DType::F32, Device::cpu(), s.seed);
  t.model->set_activation_checkpointing(s.activation_checkpointing);
  if (how == "fsdp") {
    const Config cfg =
        load_config("", {"distributed_type=FSDP", "num_processes=" + std::to_string(s.world),
                         "model.name=" + family});
    if (cfg.fsdp.fsdp_transformer_layer_cls_to_wrap != t.model->model.layers[0]->type_name())
      throw std::runtime_error("FSDP wraps " + cfg.fsdp.fsdp_transformer_layer_cls_to_wrap +
                               ", the model's layers are " + t.model->model.layers[0]->type_name());
    t.strategy = make_strategy(cfg, pg, s.compute);
  } else {
    RunSpec spec = s;
    spec.strategy = how;
    t.strategy = make_test_strategy(spec, pg);
  }
  t.strategy->setup(*t.model, test_optimizer());
  if (how == "fsdp") {
    // One unit per decoder layer plus the root: the layer filter knows the family's class name.
    auto* f = dynamic_cast<FlatDataParallel*>(t.strategy.get());
    if (!f || f->num_groups() != 3)
      throw std::runtime_error("FSDP: expected 3 units (2 layers + root), got " +
                               std::to_string(f ? f->num_groups() : -1));
  }
  RunResult out;
  for (int step = 0; step < s.steps; ++step)
    out.losses.push_back(train_step(s, t, step, rank, pg.get()));
  for (auto& [name, w] : full_weights(*t.strategy)) out.final_weights.push_back({name, w.clone()});
  return out;
}

class FamilyStrategies : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyStrategies, FsdpAndZero2OnTwoRanksFollowTheSingleProcess) {
  const std::string family = GetParam();
  RunSpec s;
  s.steps = 6;
  const RunResult ref = run_family(family, "reference", s, nullptr, 0);
  ASSERT_LT(ref.losses.back(), ref.losses.front()) << "the reference does not learn";
  // The single-process strategy with either activation checkpointing: the same run.
  for (ActivationCheckpointing mode :
       {ActivationCheckpointing::Full, ActivationCheckpointing::Selective}) {
    SCOPED_TRACE(name_of(mode));
    RunSpec ckpt = s;
    ckpt.activation_checkpointing = mode;
    const RunResult single = run_family(family, "single", ckpt, nullptr, 0);
    EXPECT_EQ(compare_losses(single.losses, ref.losses, 1e-5), "");
    EXPECT_EQ(compare_weights(single.final_weights, ref.final_weights, 1e-5), "");
  }
  // FSDP with full checkpointing, ZeRO-2 with selective.
  for (const char* how : {"fsdp", "zero2"}) {
    SCOPED_TRACE(how);
    const int world = 2;
    const int port = pick_free_port();
    auto exits = run_ranks(world, [&](int rank) -> int {
      World w = make_world(rank, world, port);
      RunSpec d = s;
      d.world = world;
      d.activation_checkpointing = std::string(how) == "fsdp" ? ActivationCheckpointing::Full
                                                              : ActivationCheckpointing::Selective;
      const RunResult got = run_family(family, how, d, w.pg, rank);
      const std::string losses = compare_losses(got.losses, ref.losses, 1e-5);
      RANK_CHECK(losses.empty(), "%s %s: %s", family.c_str(), how, losses.c_str());
      const std::string weights = compare_weights(got.final_weights, ref.final_weights, 1e-5);
      RANK_CHECK(weights.empty(), "%s %s: %s", family.c_str(), how, weights.c_str());
      return 0;
    });
    expect_all_ok(exits);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyStrategies,
                         ::testing::Values("qwen3", "mistral", "qwen3_moe", "mixtral"));

class FamilyFp8 : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyFp8, TeAndAoConvertTheProjectionsAndLearn) {
  const std::string family = GetParam();
  DecoderConfig c = tiny_family(family);
  auto train = [&](const Fp8Config* fp8_cfg, int* fp8_layers) {
    CausalLM model(c, DType::F32, Device::cpu(), 42);
    model.set_activation_checkpointing(ActivationCheckpointing::Full);
    std::unique_ptr<Fp8Training> fp8 =
        fp8_cfg ? apply_fp8(model, *fp8_cfg, Device::cpu()) : nullptr;
    if (fp8_layers) *fp8_layers = fp8 ? static_cast<int>(fp8->num_fp8_layers()) : 0;
    SingleProcessStrategy strategy(DType::BF16);
    strategy.setup(model, test_optimizer());
    RunSpec s;
    std::vector<double> losses;
    for (int step = 0; step < 12; ++step) {
      auto [ids, labels] = rank_batch(s, step, 0, 0, c.vocab_size);
      Tensor loss = CausalLM::loss(model.forward(ids), labels);
      losses.push_back(loss.item());
      loss.backward();
      strategy.step(3e-3, 1.0, 1.0);
      if (fp8) fp8->step_end(static_cast<ProcessGroup*>(nullptr));
    }
    return losses;
  };
  const std::vector<double> bf16 = train(nullptr, nullptr);
  Fp8Config te;
  te.backend = Fp8Backend::TE;
  te.amax_history_len = 16;
  Fp8Config ao;
  ao.backend = Fp8Backend::AO;
  for (const Fp8Config* cfg : {&te, &ao}) {
    SCOPED_TRACE(name_of(cfg->backend));
    int layers = 0;
    const std::vector<double> l = train(cfg, &layers);
    EXPECT_GT(layers, 0);
    for (double v : l) ASSERT_TRUE(std::isfinite(v));
    EXPECT_NE(l, bf16) << "identical to bf16: no fp8 layer ran";
    EXPECT_LT(l.back(), 0.9 * l.front()) << "loss does not fall";
    EXPECT_LT(std::fabs(l.back() - bf16.back()) / bf16.back(), 0.05)
        << "final loss " << l.back() << " vs bf16 " << bf16.back();
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyFp8, ::testing::Values("qwen3", "mistral"));

}  // namespace
}  // namespace accel
