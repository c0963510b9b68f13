// A step with NaN gradients is skipped by every strategy, and every rank names the same first bad
// parameter in model order, although with sharding each rank sees only its own chunks.
#include <cmath>

#include "parallel/fsdp.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {

using namespace testing;

Parameter* find_param(Module& m, const std::string& name) {
  for (Parameter* p : m.parameters())
    if (p->name == name) return p;
  return nullptr;
}

// One step in which `poisoned` (a parameter name, or "") gets a NaN gradient on this rank: the
// loss gains NaN * sum(weight), which leaves every other gradient finite.
StepResult poisoned_step(const RunSpec& s, Trainee& t, int rank, const std::string& poisoned) {
  t.strategy->begin_micro_batch(true);
  auto [ids, labels] = rank_batch(s, 0, 0, rank, t.model->config.vocab_size);
  Tensor loss = CausalLM::loss(t.model->forward(ids), labels);
  if (!poisoned.empty()) {
    Parameter* p = find_param(*t.model, poisoned);
    if (!p) throw std::logic_error("no parameter " + poisoned);
    loss = add(loss, mul(sum(p->value), std::nan("")));
  }
  loss.backward();
  t.strategy->end_micro_batch();
  return t.strategy->step(s.lr, s.clip, 1.0);
}

TEST(StrategyNonFinite, EveryRankNamesTheFirstBadParameterInModelOrder) {
  // Rank 0 poisons lm_head (last in model order), rank 1 the final norm (just before it); rank 2
  // nothing. Whoever owns which chunk, the answer is the norm.
  const char* want = "model.norm.weight";
  const int world = 3, port = pick_free_port();
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    const std::string poisoned = rank == 0 ? "lm_head.weight" : rank == 1 ? want : "";
    for (const char* kind : {"ddp", "zero1", "zero2", "zero3", "fsdp"}) {
      RunSpec s;
      s.world = world;
      s.strategy = kind;
      Trainee t;
      if (s.strategy == "fsdp") {
        t.model =
            std::make_unique<CausalLM>(tiny_llama(s.layers), DType::F32, Device::cpu(), s.seed);
        t.strategy = std::make_unique<FsdpStrategy>(w.pg, FsdpOptions{});
        t.strategy->setup(*t.model, test_optimizer());
      } else {
        t = make_trainee(s, w.pg, s.seed);
      }
      StepResult bad = poisoned_step(s, t, rank, poisoned);
      RANK_CHECK(bad.skipped, "%s: a NaN gradient did not skip the step", kind);
      RANK_CHECK(bad.first_non_finite == want, "%s: named '%s', want %s", kind,
                 bad.first_non_finite.c_str(), want);
      StepResult good = poisoned_step(s, t, rank, "");
      RANK_CHECK(!good.skipped && good.first_non_finite.empty(),
                 "%s: the clean step after it was skipped or named '%s'", kind,
                 good.first_non_finite.c_str());
    }
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyNonFinite, SingleProcessNamesTheFirstBadParameter) {
  RunSpec s;
  s.strategy = "single";
  Trainee t = make_trainee(s, nullptr, s.seed);
  Weights before;
  for (const auto& [name, w] : full_weights(*t.strategy)) before.push_back({name, w.clone()});
  StepResult r = poisoned_step(s, t, 0, "model.layers.1.mlp.down_proj.weight");
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.first_non_finite, "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(compare_weights(full_weights(*t.strategy), before, 0.0), "") << "the skipped step";
  StepResult good = poisoned_step(s, t, 0, "");
  EXPECT_FALSE(good.skipped);
  EXPECT_TRUE(good.first_non_finite.empty());
}

}  // namespace
}  // namespace accel
