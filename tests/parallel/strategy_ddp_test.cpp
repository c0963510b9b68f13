// DDP behaviour beyond loss parity (strategy_parity_test.cpp): broadcast at setup, bucket
// all-reduces issued during backward, no communication on accumulation micro-batches, unused
// parameters (error or zeros), the factory's choices.
#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {

using namespace testing;

TEST(StrategyDdp, SetupBroadcastsRankZerosWeights) {
  const int port = pick_free_port();
  RunSpec s;
  s.strategy = "ddp";
  s.world = 3;
  auto exits = run_ranks(3, [&](int rank) -> int {
    World w = make_world(rank, 3, port);
    Trainee t = make_trainee(s, w.pg, 100 + rank);  // different weights on every rank
    CausalLM rank0(tiny_llama(), DType::F32, Device::cpu(), 100);
    Weights want;
    for (Parameter* p : rank0.parameters()) want.push_back({p->name, p->value});
    std::string diff = compare_weights(full_weights(*t.strategy), want, 0.0);
    RANK_CHECK(diff.empty(), "rank %d after setup: %s", rank, diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyDdp, AllReducesDuringBackwardOfTheLastMicroBatchOnly) {
  const int port = pick_free_port();
  RunSpec s;
  s.strategy = "ddp";
  s.world = 2;
  s.accum = 2;
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    Trainee t = make_trainee(s, w.pg, s.seed);
    auto& ddp = dynamic_cast<FlatDataParallel&>(*t.strategy);
    const int buckets = ddp.num_groups();
    RANK_CHECK(buckets >= 4, "expected several buckets with a %.3f MB cap, got %d", s.bucket_cap_mb,
               buckets);
    // The embedding's gradient is the last one of the backward pass: by then every bucket
    // before it has been launched, and its own bucket is launched by the strategy's hook, which
    // runs before this one.
    int64_t at_last_grad = -1;
    t.model->model.embed_tokens.weight.value.add_grad_ready_hook(
        [&](const Tensor&) { at_last_grad = w.pg->stats()[CommKind::AllReduce].calls; });
    for (int step = 0; step < 2; ++step) {
      int64_t before = w.pg->stats()[CommKind::AllReduce].calls;
      for (int micro = 0; micro < 2; ++micro) {
        const bool last = micro == 1;
        t.strategy->begin_micro_batch(last);
        auto [ids, labels] = rank_batch(s, step, micro, rank, 64);
        Tensor loss = CausalLM::loss(t.model->forward(ids), labels);
        mul(loss, 0.5).backward();
        RANK_CHECK(at_last_grad - before == (last ? buckets : 0),
                   "micro-batch %d: %lld all-reduces issued during backward, want %d", micro,
                   static_cast<long long>(at_last_grad - before), last ? buckets : 0);
        t.strategy->end_micro_batch();
      }
      t.strategy->step(1e-2, 1.0, 1.0);
      int64_t after = w.pg->stats()[CommKind::AllReduce].calls;
      RANK_CHECK(after - before == buckets, "step %d: %lld all-reduces, want one per bucket (%d)",
                 step, static_cast<long long>(after - before), buckets);
      RANK_CHECK(w.pg->stats()[CommKind::ReduceScatter].calls == 0, "DDP reduce-scattered");
    }
    return 0;
  });
  expect_all_ok(exits);
}

// The buckets fire from the recomputed layers' backward as from the plain one.
TEST(StrategyDdp, SelectiveCheckpointingWithAccumulationMatchesSingleProcess) {
  RunSpec single;
  single.accum = 2;
  single.steps = 4;
  const RunResult ref = run_training(single, nullptr, 0, single.seed);
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    RunSpec s = single;
    s.world = 2;
    s.strategy = "ddp";
    s.activation_checkpointing = ActivationCheckpointing::Selective;
    const RunResult got = run_training(s, w.pg, rank, s.seed);
    const std::string d = compare_losses(got.losses, ref.losses, 1e-5) +
                          compare_weights(got.final_weights, ref.final_weights, 1e-5);
    RANK_CHECK(d.empty(), "ddp + selective checkpointing: %s", d.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

// Two parameters; the loss uses only `a`.
class OneUnused : public Module {
 public:
  OneUnused()
      : a(register_parameter("a", Tensor::full({40}, 0.5))),
        b(register_parameter("b", Tensor::full({24}, 1.0))) {
    finalize();
  }
  std::string type_name() const override { return "OneUnused"; }
  Tensor loss(const Tensor& x) {
    return with_forward_hooks(*this, [&] { return sum(mul(mul(a.value, a.value), x)); });
  }
  Parameter& a;
  Parameter& b;
};

TEST(StrategyDdp, UnusedParameterIsAnErrorNamingIt) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    for (const char* kind : {"ddp", "zero2"}) {
      OneUnused m;
      RunSpec s;
      s.strategy = kind;
      auto strategy = make_test_strategy(s, w.pg);
      strategy->setup(m, test_optimizer());
      strategy->begin_micro_batch(true);
      m.loss(Tensor::full({40}, 1.0 + rank)).backward();
      std::string what;
      try {
        strategy->end_micro_batch();
      } catch (const std::runtime_error& e) {
        what = e.what();
      }
      RANK_CHECK(what.find("'b'") != std::string::npos &&
                     what.find("find_unused_parameters") != std::string::npos,
                 "%s: got '%s'", kind, what.c_str());
    }
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyDdp, FindUnusedParametersReducesZeros) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    for (const char* kind : {"ddp", "zero1", "zero2", "zero3"}) {
      OneUnused m;
      RunSpec s;
      s.strategy = kind;
      s.find_unused = true;
      auto strategy = make_test_strategy(s, w.pg);
      strategy->setup(m, test_optimizer());
      strategy->begin_micro_batch(true);
      m.loss(Tensor::full({40}, 1.0 + rank)).backward();
      strategy->end_micro_batch();
      StepResult r = strategy->step(0.1, 0.0, 1.0);
      // d/da sum(a^2 x) = 2 a x, averaged over x = 1 and x = 2: 1.5 per element.
      RANK_CHECK(std::abs(r.grad_norm - 1.5 * std::sqrt(40.0)) < 1e-5, "%s: grad norm %g", kind,
                 r.grad_norm);
      for (auto& [name, t] : full_weights(*strategy)) {
        std::vector<double> v = t.to_vector();
        // AdamW's first step moves every element with a gradient by lr; b only decays.
        double want = name == "a" ? 0.5 * (1 - 0.1 * 0.1) - 0.1 : 1.0 * (1 - 0.1 * 0.1);
        for (double x : v)
          RANK_CHECK(std::abs(x - want) < 1e-6, "%s: %s = %g, want %g", kind, name.c_str(), x,
                     want);
      }
    }
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyFactory, PicksTheStrategyTheConfigNames) {
  Config cfg = default_config();
  EXPECT_EQ(make_strategy(cfg, nullptr, DType::F32)->name(), "single");
  cfg.distributed_type = DistributedType::MultiCpu;
  EXPECT_EQ(make_strategy(cfg, nullptr, DType::F32)->name(), "ddp");
  cfg.distributed_type = DistributedType::MultiGpu;
  EXPECT_EQ(make_strategy(cfg, nullptr, DType::F32)->name(), "ddp");
  cfg.distributed_type = DistributedType::DeepSpeed;
  for (int stage : {1, 2, 3}) {
    cfg.deepspeed.zero_stage = stage;
    EXPECT_EQ(make_strategy(cfg, nullptr, DType::BF16)->name(), "zero" + std::to_string(stage));
  }
  // zero_stage and offload rules are the config loader's (one place, one message each).
  cfg.num_processes = 2;
  cfg.deepspeed.zero_stage = 0;
  EXPECT_THROW(validate_config(cfg), ConfigError);
  cfg.deepspeed.zero_stage = 2;
  cfg.deepspeed.offload_param_device = OffloadDevice::Cpu;
  EXPECT_THROW(validate_config(cfg), ConfigError);
}

TEST(StrategyDdp, WorldSizeOneWithoutProcessGroupMatchesSingleProcess) {
  RunSpec single;
  RunSpec ddp = single;
  ddp.strategy = "ddp";
  RunResult a = run_training(single, nullptr, 0, single.seed);
  RunResult b = run_training(ddp, nullptr, 0, ddp.seed);
  EXPECT_EQ(compare_losses(b.losses, a.losses, 1e-12), "");
  EXPECT_EQ(compare_weights(b.final_weights, a.final_weights, 1e-12), "");
  for (const char* z : {"zero1", "zero2", "zero3"}) {
    RunSpec zs = single;
    zs.strategy = z;
    RunResult c = run_training(zs, nullptr, 0, zs.seed);
    EXPECT_EQ(compare_losses(c.losses, a.losses, 1e-12), "") << z;
    EXPECT_EQ(compare_weights(c.final_weights, a.final_weights, 1e-12), "") << z;
  }
}

// bf16 compute with two micro-batches at world size 1: the paths only world size 1 takes (the
// reduce-scatter skipped, ZeRO-3's shards kept as the flat buffers, the first micro-batch's
// gradient adopted as the shard, the optimizer writing the bf16 compute copies) against the
// single-process reference, which adds the micro-batches' bf16 gradients in the same order.
TEST(StrategyDdp, WorldSizeOneBf16WithAccumulationMatchesSingleProcess) {
  RunSpec single;
  single.compute = DType::BF16;
  single.accum = 2;
  single.steps = 6;
  RunResult a = run_training(single, nullptr, 0, single.seed);
  for (const char* z : {"ddp", "zero1", "zero2", "zero3"}) {
    RunSpec zs = single;
    zs.strategy = z;
    RunResult c = run_training(zs, nullptr, 0, zs.seed);
    EXPECT_EQ(compare_losses(c.losses, a.losses, 1e-6), "") << z;
    EXPECT_EQ(compare_weights(c.final_weights, a.final_weights, 1e-6), "") << z;
  }
}

}  // namespace
}  // namespace accel
