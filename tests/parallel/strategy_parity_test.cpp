// DDP and ZeRO-1/2/3 at world sizes 2, 3 (uneven partitions) and 4, and the single process, with
// gradient accumulation 1 and 2, against the single-process reference (ReferenceStrategy, which
// does not use the engine the strategies share) with the same global batch: the 10-step loss
// trajectory and the final parameters agree within 1e-5 relative (fp32). Every case also saves a
// checkpoint at step 5 through the trainer's checkpoint code, loads it into a freshly built model
// and strategy, and checks that steps 6-10 come out identical.
#include <filesystem>
#include <map>

#include "tests/parallel/strategy_test_util.h"
#include "tools/trainer/checkpoint.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using namespace testing;

constexpr double kRel = 1e-5;

const RunResult& reference(int accum) {
  static std::map<int, RunResult> cache;
  auto it = cache.find(accum);
  if (it != cache.end()) return it->second;
  RunSpec s;
  s.accum = accum;
  return cache.emplace(accum, run_training(s, nullptr, 0, s.seed)).first->second;
}

TEST(StrategyParityReference, ClippingIsActive) {
  // The parity runs would not test sharded clipping if the gradient norm never exceeded 1.
  const RunResult& ref = reference(1);
  int clipped = 0;
  for (double n : ref.grad_norms) clipped += n > 1.0;
  EXPECT_GE(clipped, 1);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

struct Case {
  std::string strategy;
  int world, accum;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.strategy + "_world" + std::to_string(info.param.world) + "_accum" +
         std::to_string(info.param.accum);
}

class StrategyParity : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyParity, MatchesSingleProcessAndResumes) {
  const Case c = GetParam();
  const RunResult& ref = reference(c.accum);
  const int port = pick_free_port();
  const fs::path dir = fs::temp_directory_path() /
                       ("accel_parity_" + case_name({c, 0}) + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto exits = run_ranks(c.world, [&](int rank) -> int {
    World w = make_world(rank, c.world, port);
    RunSpec s;
    s.strategy = c.strategy;
    s.world = c.world;
    s.accum = c.accum;
    Trainee t = make_trainee(s, w.pg, rank == 0 ? s.seed : s.seed + 1 + rank);
    std::vector<double> losses;
    for (int step = 0; step < s.steps; ++step) {
      double norm = 0;
      losses.push_back(train_step(s, t, step, rank, w.pg.get(), &norm));
      RANK_CHECK(close_rel(losses[step], ref.losses[step], kRel),
                 "step %d: loss %.9g, reference %.9g", step + 1, losses[step], ref.losses[step]);
      // AdamW hardly sees the scale of the gradients; the norm does (averaging, clipping).
      RANK_CHECK(close_rel(norm, ref.grad_norms[step], kRel),
                 "step %d: gradient norm %.9g, reference %.9g", step + 1, norm,
                 ref.grad_norms[step]);
      if (step + 1 == 5) {
        TrainerState st;
        st.step = 5;
        st.optimizer_steps = t.strategy->optimizer_steps();
        st.world_size = c.world;
        st.extra = t.strategy->checkpoint_manifest();
        CheckpointWriter writer{rank, c.world, [&] { w.pg->barrier()->wait(); }};
        save_checkpoint(dir.string(), st, *t.strategy, t.model->config, "", writer, 0);
      }
    }
    Weights final_weights = full_weights(*t.strategy);
    std::string diff = compare_weights(final_weights, ref.final_weights, kRel);
    RANK_CHECK(diff.empty(), "final weights differ from the reference: %s", diff.c_str());

    // Resume from step 5 into a model initialized differently.
    Trainee r = make_trainee(s, w.pg, 1000 + rank);
    LoadedCheckpoint ck = load_checkpoint((dir / "checkpoints" / "step_5").string());
    restore_strategy_state(ck, *r.strategy);
    for (int step = 5; step < s.steps; ++step) {
      double l = train_step(s, r, step, rank, w.pg.get());
      RANK_CHECK(l == losses[step], "resumed step %d: loss %.17g, uninterrupted %.17g", step + 1, l,
                 losses[step]);
    }
    diff = compare_weights(full_weights(*r.strategy), final_weights, 0.0);
    RANK_CHECK(diff.empty(), "resumed final weights differ: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
  fs::remove_all(dir);
}

std::vector<Case> all_cases() {
  std::vector<Case> out = {{"single", 1, 1}, {"single", 1, 2}};
  for (const char* s : {"ddp", "zero1", "zero2", "zero3"})
    for (int world : {2, 3, 4})
      for (int accum : {1, 2}) out.push_back({s, world, accum});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyParity, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace accel
