// ZeRO behaviour beyond loss parity (strategy_parity_test.cpp): the flat layout, storage release,
// true reduce-scatter during backward, the ZeRO-3 gather/release schedule, activation
// checkpointing, optimizer offload and the 16-bit save.
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {

using namespace testing;

std::vector<std::unique_ptr<Parameter>> make_params(const std::vector<int64_t>& sizes) {
  std::vector<std::unique_ptr<Parameter>> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto p = std::make_unique<Parameter>();
    p->name = "p" + std::to_string(i);
    p->value = Tensor::zeros({sizes[i]});
    out.push_back(std::move(p));
  }
  return out;
}

TEST(FlatLayout, ChunksCoverEveryElementOnceWithPaddingAtTheEnd) {
  auto owned = make_params({20, 300, 7, 41});
  std::vector<Parameter*> ps;
  for (auto& p : owned) ps.push_back(p.get());
  for (int world : {1, 2, 3, 4}) {
    FlatLayout l(ps, world);
    EXPECT_EQ(l.numel, 368);
    EXPECT_EQ(l.shard_numel % FlatLayout::kFlatAlignment, 0);
    EXPECT_EQ(l.padded_numel, l.shard_numel * world);
    EXPECT_GE(l.padded_numel, l.numel);
    EXPECT_LT(l.shard_numel * (world - 1), l.numel + FlatLayout::kFlatAlignment * world);
    for (size_t i = 0; i < l.slots.size(); ++i) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        FlatLayout::Range range = l.owned(i, r);
        if (range.size() == 0) continue;
        EXPECT_EQ(range.begin, next) << "world " << world << " slot " << i << " rank " << r;
        EXPECT_EQ(l.slots[i].offset + range.begin >= r * l.shard_numel, true);
        EXPECT_LE(l.slots[i].offset + range.end, (r + 1) * l.shard_numel);
        next = range.end;
      }
      EXPECT_EQ(next, l.slots[i].numel) << "world " << world << " slot " << i;
    }
  }
  // world 3: 368 -> 123 per rank -> 128 aligned; p1 [20, 320) straddles ranks 0, 1 and 2.
  FlatLayout l3(ps, 3);
  EXPECT_EQ(l3.shard_numel, 128);
  EXPECT_EQ(l3.owned(1, 0).size(), 108);
  EXPECT_EQ(l3.owned(1, 1).size(), 128);
  EXPECT_EQ(l3.owned(1, 2).size(), 64);
  EXPECT_EQ(l3.owned(3, 2).size(), 41);
  EXPECT_EQ(l3.owned(0, 2).size(), 0);
}

TEST(FlatLayout, BucketsRespectTheCapAndKeepTheOrder) {
  auto owned = make_params({100, 100, 300, 50, 50, 50});
  std::vector<Parameter*> ps;
  for (auto& p : owned) ps.push_back(p.get());
  auto b = make_buckets(ps, 250 * 4, 4);
  ASSERT_EQ(b.size(), 3u);  // [100 100] [300 (alone: over the cap)] [50 50 50]
  EXPECT_EQ(b[0].size(), 2u);
  EXPECT_EQ(b[1].size(), 1u);
  EXPECT_EQ(b[2].size(), 3u);
  EXPECT_EQ(b[2][0], ps[3]);
}

TEST(ReleasableStorage, ViewsSurviveReleaseAndRematerialize) {
  const Device cpu = Device::cpu();
  Tensor flat = Tensor::zeros({1000}, DType::F32, cpu, MemCategory::Comm);
  Tensor view = flat_view(flat, 100, {10, 20});
  int64_t before = memory_stats(cpu).current[static_cast<int>(MemCategory::Comm)];
  release_storage(*flat.storage());
  EXPECT_FALSE(storage_materialized(*flat.storage()));
  EXPECT_EQ(memory_stats(cpu).current[static_cast<int>(MemCategory::Comm)], before - 4000);
  materialize_storage(*flat.storage(), 4000);
  EXPECT_EQ(memory_stats(cpu).current[static_cast<int>(MemCategory::Comm)], before);
  view.fill_(3.0);
  EXPECT_EQ(flat.to_vector()[100 + 7 * 20 + 5], 3.0);
  release_storage(*flat.storage());
  view = Tensor();
  flat = Tensor();  // destroying a released storage un-counts nothing more
  EXPECT_EQ(memory_stats(cpu).current[static_cast<int>(MemCategory::Comm)], before - 4000);
}

TEST(StrategyZero, Stage2ReduceScattersDuringBackwardAndNeverAllReducesGradients) {
  const int port = pick_free_port();
  auto exits = run_ranks(3, [&](int rank) -> int {
    World w = make_world(rank, 3, port);
    for (const char* kind : {"zero1", "zero2"}) {
      RunSpec s;
      s.strategy = kind;
      s.world = 3;
      s.accum = 2;
      Trainee t = make_trainee(s, w.pg, s.seed);
      const int groups = dynamic_cast<FlatDataParallel&>(*t.strategy).num_groups();
      int64_t at_last_grad = -1;
      t.model->model.embed_tokens.weight.value.add_grad_ready_hook(
          [&](const Tensor&) { at_last_grad = w.pg->stats()[CommKind::ReduceScatter].calls; });
      w.pg->reset_stats();
      for (int micro = 0; micro < 2; ++micro) {
        int64_t before = w.pg->stats()[CommKind::ReduceScatter].calls;
        t.strategy->begin_micro_batch(micro == 1);
        auto [ids, labels] = rank_batch(s, 0, micro, rank, 64);
        mul(CausalLM::loss(t.model->forward(ids), labels), 0.5).backward();
        // Stage 2 reduces every micro-batch (its gradients are partitioned); stage 1 only the
        // last one. Either way the buckets go out while backward runs.
        int want = (std::string(kind) == "zero2" || micro == 1) ? groups : 0;
        RANK_CHECK(at_last_grad - before == want, "%s micro %d: %lld reduce-scatters in backward",
                   kind, micro, static_cast<long long>(at_last_grad - before));
        t.strategy->end_micro_batch();
      }
      t.strategy->step(1e-2, 1.0, 1.0);
      CommStats st = w.pg->stats();
      RANK_CHECK(st[CommKind::AllReduce].calls == 1, "%s: %lld all-reduces (only the norm)", kind,
                 static_cast<long long>(st[CommKind::AllReduce].calls));
      RANK_CHECK(st[CommKind::AllGather].calls == groups, "%s: %lld all-gathers, want %d", kind,
                 static_cast<long long>(st[CommKind::AllGather].calls), groups);
    }
    return 0;
  });
  expect_all_ok(exits);
}

// The trainer's make_strategy gives ZeRO-3 one gather unit per decoder layer in every family (the
// unit type follows model.name), not one unit holding the whole model.
TEST(StrategyZero, Stage3UnitsAreTheFamilysDecoderLayers) {
  for (const std::string family : {"llama", "qwen2", "qwen3", "mistral"}) {
    SCOPED_TRACE(family);
    const int port = pick_free_port();
    auto exits = run_ranks(1, [&](int rank) -> int {
      World w = make_world(rank, 1, port);
      Config cfg;
      cfg.distributed_type = DistributedType::DeepSpeed;
      cfg.deepspeed.zero_stage = 3;
      cfg.model.name = family;
      DecoderConfig c = tiny_llama(3);
      c.model_type = family;
      CausalLM model(c, DType::F32, Device::cpu(), 7);
      std::unique_ptr<Strategy> st = make_strategy(cfg, w.pg, DType::F32);
      st->setup(model, test_optimizer(OptimizerName::AdamW));
      auto& z = dynamic_cast<FlatDataParallel&>(*st);
      RANK_CHECK(z.num_groups() == 4, "%s: %d groups, want 3 layer units + root", family.c_str(),
                 z.num_groups());
      return 0;
    });
    expect_all_ok(exits);
  }
}

TEST(StrategyZero, Stage3GathersOneLayerAheadAndReleasesAfterUse) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    RunSpec s;
    s.strategy = "zero3";
    s.world = 2;
    s.layers = 4;
    Trainee t = make_trainee(s, w.pg, s.seed);
    auto& z = dynamic_cast<FlatDataParallel&>(*t.strategy);
    RANK_CHECK(z.num_groups() == 5, "4 layer units + root, got %d groups", z.num_groups());
    auto gathered_layers = [&] {
      int n = 0;
      for (int g = 0; g < 4; ++g) n += z.group(g).materialized();
      return n;
    };
    for (int g = 0; g < 5; ++g) RANK_CHECK(!z.group(g).materialized(), "group %d after setup", g);
    int most = 0;
    for (DecoderLayer* layer : t.model->model.layers) {
      layer->add_pre_forward_hook([&](Module&) { most = std::max(most, gathered_layers()); });
      for (Parameter* p : layer->parameters())
        p->value.add_grad_ready_hook(
            [&](const Tensor&) { most = std::max(most, gathered_layers()); });
    }
    for (int step = 0; step < 2; ++step) {
      w.pg->reset_stats();
      train_step(s, t, step, rank, nullptr);
      for (int g = 0; g < 5; ++g)
        RANK_CHECK(!z.group(g).materialized(), "group %d gathered after step %d", g, step);
      // Forward: the root and 4 layers; backward: layers 2, 1, 0 (layer 3 is kept from forward).
      RANK_CHECK(w.pg->stats()[CommKind::AllGather].calls == 8, "%lld all-gathers in a step",
                 static_cast<long long>(w.pg->stats()[CommKind::AllGather].calls));
      RANK_CHECK(w.pg->stats()[CommKind::ReduceScatter].calls == 5, "%lld reduce-scatters",
                 static_cast<long long>(w.pg->stats()[CommKind::ReduceScatter].calls));
    }
    RANK_CHECK(most == 2, "at most %d layers were gathered at once, want 2 (use + prefetch)", most);
    {
      NoGradGuard no_grad;  // evaluation: everything is released afterwards
      auto [ids, labels] = rank_batch(s, 5, 0, rank, 64);
      t.model->forward(ids);
    }
    for (int g = 0; g < 5; ++g) RANK_CHECK(!z.group(g).materialized(), "group %d after eval", g);
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyZero, Stage3WithActivationCheckpointingAndOffloadMatchesSingleProcess) {
  RunSpec single;
  single.layers = 3;
  single.steps = 6;
  const RunResult ref = run_training(single, nullptr, 0, single.seed);
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    RunSpec s = single;
    s.world = 2;
    s.accum = 1;
    s.strategy = "zero3";
    s.activation_checkpointing = ActivationCheckpointing::Full;
    RunResult a = run_training(s, w.pg, rank, s.seed);
    std::string d = compare_losses(a.losses, ref.losses, 1e-5) +
                    compare_weights(a.final_weights, ref.final_weights, 1e-5);
    RANK_CHECK(d.empty(), "zero3 + activation checkpointing: %s", d.c_str());
    s.strategy = "zero2";
    s.activation_checkpointing = ActivationCheckpointing::None;
    s.offload_optimizer = true;
    RunResult b = run_training(s, w.pg, rank, s.seed);
    d = compare_losses(b.losses, ref.losses, 1e-5) +
        compare_weights(b.final_weights, ref.final_weights, 1e-5);
    RANK_CHECK(d.empty(), "zero2 + optimizer offload: %s", d.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyZero, TiedEmbeddingsAndSgdMatchSingleProcess) {
  RunSpec tied;
  tied.tied_embeddings = true;
  tied.steps = 5;
  RunSpec sgd;
  sgd.optimizer = OptimizerName::Sgd;
  sgd.lr = 0.05;
  sgd.steps = 5;
  const RunResult ref_tied = run_training(tied, nullptr, 0, tied.seed);
  const RunResult ref_sgd = run_training(sgd, nullptr, 0, sgd.seed);
  const int port = pick_free_port();
  auto exits = run_ranks(3, [&](int rank) -> int {
    World w = make_world(rank, 3, port);
    // Each case: the spec, its single-process reference, the strategy run at world 3.
    const struct {
      const RunSpec& spec;
      const RunResult& ref;
      const char* what;
      const char* kind;
    } cases[] = {{tied, ref_tied, "tied embeddings", "ddp"},
                 {tied, ref_tied, "tied embeddings", "zero3"},
                 {sgd, ref_sgd, "sgd", "zero1"},
                 {sgd, ref_sgd, "sgd", "zero3"}};
    for (const auto& c : cases) {
      RunSpec s = c.spec;
      s.world = 3;
      s.strategy = c.kind;
      RunResult a = run_training(s, w.pg, rank, s.seed);
      std::string d = compare_losses(a.losses, c.ref.losses, 1e-5) +
                      compare_weights(a.final_weights, c.ref.final_weights, 1e-5);
      RANK_CHECK(d.empty(), "%s, %s: %s", c.kind, c.what, d.c_str());
    }
    return 0;
  });
  expect_all_ok(exits);
}

TEST(StrategyZero, OptimizerOffloadKeepsStateOnTheHost) {
  RunSpec s;
  s.strategy = "zero2";
  s.offload_optimizer = true;
  s.steps = 1;
  Trainee t = make_trainee(s, nullptr, s.seed);
  train_step(s, t, 0, 0, nullptr);
  for (auto& [name, tensor] : t.strategy->optimizer_state())
    EXPECT_TRUE(tensor.device().is_cpu()) << name;
  EXPECT_EQ(t.strategy->optimizer_steps(), 1);
}

TEST(StrategyZero, Stage3Saves16BitWeightsOnlyWhenAsked) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    RunSpec s;
    s.strategy = "zero3";
    s.world = 2;
    s.compute = DType::BF16;
    Trainee plain = make_trainee(s, w.pg, s.seed);
    RANK_CHECK(plain.strategy->full_state_dict().empty(), "zero3 without 16-bit save");
    RANK_CHECK(plain.strategy->forward_is_collective(), "zero3 forward is collective");
    s.save_16bit = true;
    Trainee t = make_trainee(s, w.pg, s.seed);
    train_step(s, t, 0, rank, w.pg.get());
    Weights w16 = t.strategy->full_state_dict();
    Weights w32 = full_weights(*t.strategy);
    RANK_CHECK(w16.size() == w32.size() && !w16.empty(), "%zu vs %zu tensors", w16.size(),
               w32.size());
    for (size_t i = 0; i < w16.size(); ++i) {
      RANK_CHECK(w16[i].second.dtype() == DType::BF16, "%s is not bf16", w16[i].first.c_str());
      Tensor want = Tensor::empty(w32[i].second.shape(), DType::BF16);
      want.copy_(w32[i].second);
      RANK_CHECK(w16[i].second.to_vector() == want.to_vector(), "%s is not the rounded master",
                 w16[i].first.c_str());
    }
    return 0;
  });
  expect_all_ok(exits);
}

}  // namespace
}  // namespace accel
