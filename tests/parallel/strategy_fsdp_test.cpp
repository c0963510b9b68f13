// FSDP (distributed_type FSDP, fsdp_version 2): unit choice by fsdp_auto_wrap_policy; parity with
// the single process at world sizes 2, 3 and 4 with resharding on and off, activation
// checkpointing on and off and parameter offload on and off (10 steps, 1e-5 relative, fp32);
// gather/reduce-scatter counts per step; fp32 reduction of bf16 gradients; SHARDED_STATE_DICT
// save + resume; FULL_STATE_DICT export that load_hf_weights reads.
#include <cstring>
#include <filesystem>
#include <map>

#include "parallel/fsdp.h"
#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"
#include "tools/trainer/checkpoint.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using namespace testing;

constexpr double kRel = 1e-5;

struct FsdpCase {
  int world = 2;
  bool reshard = true;
  bool ac = false;
  bool offload = false;
  std::string wrap = "TRANSFORMER_BASED_WRAP";
  int64_t min_params = 0;
  std::string state_dict = "SHARDED_STATE_DICT";
  DType compute = DType::F32;
};

Config fsdp_config(const FsdpCase& c) {
  Config cfg;
  cfg.distributed_type = "FSDP";
  cfg.fsdp.fsdp_version = 2;
  cfg.fsdp.fsdp_reshard_after_forward = c.reshard;
  cfg.fsdp.fsdp_activation_checkpointing = c.ac;
  cfg.fsdp.fsdp_offload_params = c.offload;
  cfg.fsdp.fsdp_auto_wrap_policy = c.wrap;
  cfg.fsdp.fsdp_min_num_params = c.min_params;
  cfg.fsdp.fsdp_state_dict_type = c.state_dict;
  return cfg;
}

// As make_trainee, but the strategy comes from the config through make_strategy (as in the
// trainer, which also turns on activation checkpointing for fsdp_activation_checkpointing).
Trainee make_fsdp_trainee(const RunSpec& s, const FsdpCase& c, std::shared_ptr<ProcessGroup> pg,
                          uint64_t model_seed) {
  Trainee t;
  t.model = std::make_unique<LlamaForCausalLM>(tiny_llama(s.layers), DType::F32, Device::cpu(),
                                               model_seed);
  Config cfg = fsdp_config(c);
  t.model->set_activation_checkpointing(cfg.fsdp.fsdp_activation_checkpointing);
  t.strategy = make_strategy(cfg, pg, c.compute);
  t.strategy->setup(*t.model, test_optimizer(s.optimizer));
  return t;
}

// The single-process run, computed in the rank process that checks against it: computing it in the
// parent before fork() leaves the children with the parent's CPU worker threads gone (the
// children then hang in parallel_for).
RunResult reference() {
  RunSpec s;
  return run_training(s, nullptr, 0, s.seed);
}

std::string case_name(const ::testing::TestParamInfo<FsdpCase>& info) {
  const FsdpCase& c = info.param;
  std::string n = "world" + std::to_string(c.world);
  if (!c.reshard) n += "_noreshard";
  if (c.ac) n += "_ac";
  if (c.offload) n += "_offload";
  if (c.wrap == "SIZE_BASED_WRAP") n += "_sizewrap";
  if (c.wrap == "NO_WRAP") n += "_nowrap";
  return n;
}

class FsdpParity : public ::testing::TestWithParam<FsdpCase> {};

TEST_P(FsdpParity, MatchesSingleProcess) {
  const FsdpCase c = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(c.world, [&](int rank) -> int {
    const RunResult ref = reference();
    World w = make_world(rank, c.world, port);
    RunSpec s;
    s.world = c.world;
    Trainee t = make_fsdp_trainee(s, c, w.pg, rank == 0 ? s.seed : s.seed + 1 + rank);
    RANK_CHECK(t.strategy->name() == "fsdp", "strategy %s", t.strategy->name().c_str());
    for (int step = 0; step < s.steps; ++step) {
      double norm = 0;
      double loss = train_step(s, t, step, rank, w.pg.get(), &norm);
      RANK_CHECK(close_rel(loss, ref.losses[step], kRel), "step %d: loss %.9g, single %.9g",
                 step + 1, loss, ref.losses[step]);
      RANK_CHECK(close_rel(norm, ref.grad_norms[step], kRel),
                 "step %d: gradient norm %.9g, single %.9g", step + 1, norm, ref.grad_norms[step]);
    }
    std::string diff = compare_weights(full_weights(*t.strategy), ref.final_weights, kRel);
    RANK_CHECK(diff.empty(), "final weights differ from the single process: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

std::vector<FsdpCase> parity_cases() {
  std::vector<FsdpCase> out;
  for (int world : {2, 3, 4}) {
    FsdpCase base;
    base.world = world;
    out.push_back(base);
    FsdpCase c = base;
    c.reshard = false;
    out.push_back(c);
    c = base;
    c.ac = true;
    out.push_back(c);
    c = base;
    c.offload = true;
    out.push_back(c);
  }
  FsdpCase c;
  c.world = 3;
  c.reshard = false;
  c.ac = true;
  c.offload = true;
  out.push_back(c);
  c = FsdpCase{};
  c.wrap = "SIZE_BASED_WRAP";
  c.min_params = 1000;
  out.push_back(c);
  c = FsdpCase{};
  c.wrap = "NO_WRAP";
  out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fsdp, FsdpParity, ::testing::ValuesIn(parity_cases()), case_name);

std::vector<std::string> unit_types(Module& root, const FsdpOptions& o) {
  std::vector<std::string> out;
  for (Module* m : fsdp_units(root, o)) out.push_back(m->type_name());
  return out;
}

TEST(FsdpUnits, WrapPolicies) {
  LlamaForCausalLM model(tiny_llama(3), DType::F32, Device::cpu(), 1);
  FsdpOptions o;
  EXPECT_EQ(unit_types(model, o), std::vector<std::string>(3, "LlamaDecoderLayer"));
  o.auto_wrap_policy = "NO_WRAP";
  EXPECT_TRUE(fsdp_units(model, o).empty());
  // A decoder layer of the tiny model: attention 32*32 + 2*32*16 + 32*32 = 3072, MLP 3*32*64 =
  // 6144, two norms 64: 9280 parameters.
  o.auto_wrap_policy = "SIZE_BASED_WRAP";
  o.min_num_params = 5000;  // the MLPs qualify, attentions do not; layers have a unit below
  EXPECT_EQ(unit_types(model, o), std::vector<std::string>(3, "LlamaMLP"));
  o.min_num_params = 3000;  // attention and MLP of every layer, in forward order
  std::vector<std::string> want;
  for (int i = 0; i < 3; ++i) {
    want.push_back("LlamaAttention");
    want.push_back("LlamaMLP");
  }
  EXPECT_EQ(unit_types(model, o), want);
  o.min_num_params = int64_t(1) << 40;  // nothing reaches it: the root only
  EXPECT_TRUE(fsdp_units(model, o).empty());
  o.auto_wrap_policy = "TRANSFORMER_BASED_WRAP";
  o.layer_cls_to_wrap = {"NoSuchLayer"};
  EXPECT_THROW(fsdp_units(model, o), std::invalid_argument);
}

TEST(FsdpConfig, BadKeysAreNamed) {
  Config cfg = fsdp_config(FsdpCase{});
  cfg.fsdp.fsdp_version = 1;
  try {
    make_strategy(cfg, nullptr, DType::F32);
    FAIL() << "fsdp_version 1 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_version"), std::string::npos) << e.what();
  }
  cfg = fsdp_config(FsdpCase{});
  cfg.fsdp.fsdp_state_dict_type = "LOCAL_STATE_DICT";
  EXPECT_THROW(make_strategy(cfg, nullptr, DType::F32), std::invalid_argument);
  cfg = fsdp_config(FsdpCase{});
  EXPECT_EQ(make_strategy(cfg, nullptr, DType::F32)->name(), "fsdp");
}

// Collectives per optimizer step, 2 layers: with resharding the root and both layers are gathered
// for the forward and the first layer again for its backward (the last one stays gathered from
// its forward into the backward): 4; without, once each: 3. One reduce-scatter per unit (3), in
// fp32 for bf16 compute: its payload is 4 bytes per padded element.
TEST(FsdpSchedule, GathersAndFp32ReduceScatter) {
  for (bool reshard : {true, false}) {
    const int world = 2;
    const int port = pick_free_port();
    auto exits = run_ranks(world, [&](int rank) -> int {
      World w = make_world(rank, world, port);
      RunSpec s;
      s.world = world;
      s.compute = DType::BF16;
      FsdpCase c;
      c.reshard = reshard;
      c.compute = DType::BF16;
      Trainee t = make_fsdp_trainee(s, c, w.pg, s.seed);
      auto* f = dynamic_cast<FlatDataParallel*>(t.strategy.get());
      RANK_CHECK(f && f->num_groups() == 3, "3 groups expected");
      int64_t padded = 0;
      for (int g = 0; g < f->num_groups(); ++g) padded += f->group(g).layout().padded_numel;
      train_step(s, t, 0, rank, w.pg.get());  // warm-up
      w.pg->reset_stats();
      train_step(s, t, 1, rank, w.pg.get());
      CommStats st = w.pg->stats();
      const int64_t gathers = st[CommKind::AllGather].calls;
      RANK_CHECK(gathers == (reshard ? 4 : 3), "reshard %d: %lld all-gathers", int(reshard),
                 static_cast<long long>(gathers));
      RANK_CHECK(st[CommKind::ReduceScatter].calls == 3, "%lld reduce-scatters",
                 static_cast<long long>(st[CommKind::ReduceScatter].calls));
      RANK_CHECK(st[CommKind::ReduceScatter].bytes == 4 * padded,
                 "reduce-scatter payload %lld bytes, want fp32 %lld",
                 static_cast<long long>(st[CommKind::ReduceScatter].bytes),
                 static_cast<long long>(4 * padded));
      // Everything is released after the step.
      for (int g = 0; g < f->num_groups(); ++g)
        RANK_CHECK(!f->group(g).materialized(), "group %d still gathered after the step", g);
      return 0;
    });
    expect_all_ok(exits);
  }
}

// Checkpoint at step 5 through the trainer's checkpoint code, resume into a differently
// initialized model: steps 6-10 identical. SHARDED_STATE_DICT writes shards only (no
// model.safetensors); FULL_STATE_DICT writes rank 0's gathered fp32 weights as Hugging Face
// model.safetensors, which load_hf_weights reads into a plain model.
void checkpoint_case(const std::string& type, int world) {
  const int port = pick_free_port();
  const fs::path dir =
      fs::temp_directory_path() / ("accel_fsdp_ckpt_" + type + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    RunSpec s;
    s.world = world;
    FsdpCase c;
    c.world = world;
    c.state_dict = type;
    Trainee t = make_fsdp_trainee(s, c, w.pg, s.seed);
    std::vector<double> losses;
    Weights at5;
    for (int step = 0; step < s.steps; ++step) {
      losses.push_back(train_step(s, t, step, rank, w.pg.get()));
      if (step + 1 == 5) {
        TrainerState st;
        st.step = 5;
        st.optimizer_steps = t.strategy->optimizer_steps();
        st.world_size = world;
        st.extra = t.strategy->checkpoint_manifest();
        CheckpointWriter writer{rank, world, [&] { w.pg->barrier()->wait(); }};
        save_checkpoint(dir.string(), st, t.strategy->full_state_dict(), t.model->config,
                        t.strategy->optimizer_state(), "", writer, 0);
        for (auto& [n, v] : full_weights(*t.strategy)) at5.push_back({n, v.clone()});
      }
    }
    const fs::path ck_dir = dir / "checkpoints" / "step_5";
    const bool has_model = fs::exists(ck_dir / "model.safetensors");
    RANK_CHECK(has_model == (type == "FULL_STATE_DICT"), "%s: model.safetensors %s", type.c_str(),
               has_model ? "written" : "missing");
    RANK_CHECK(fs::exists(ck_dir / ("optimizer.rank" + std::to_string(rank) + ".safetensors")),
               "no shard file for rank %d", rank);
    if (has_model) {
      LlamaForCausalLM plain(tiny_llama(s.layers), DType::F32, Device::cpu(), 99);
      load_hf_weights(plain, ck_dir.string());
      Weights loaded;
      for (Parameter* p : plain.parameters()) loaded.push_back({p->name, p->value});
      std::string diff = compare_weights(loaded, at5, 0.0);
      RANK_CHECK(diff.empty(), "exported weights differ: %s", diff.c_str());
    }
    Trainee r = make_fsdp_trainee(s, c, w.pg, 1000 + rank);
    LoadedCheckpoint ck = load_checkpoint(ck_dir.string(), rank, world);
    r.strategy->load_state(ck.weights, ck.optimizer_state, ck.state.optimizer_steps);
    for (int step = 5; step < s.steps; ++step) {
      double l = train_step(s, r, step, rank, w.pg.get());
      RANK_CHECK(l == losses[step], "resumed step %d: loss %.17g, uninterrupted %.17g", step + 1, l,
                 losses[step]);
    }
    return 0;
  });
  expect_all_ok(exits);
  fs::remove_all(dir);
}

TEST(FsdpCheckpoint, ShardedSaveAndResume) { checkpoint_case("SHARDED_STATE_DICT", 3); }
TEST(FsdpCheckpoint, FullStateDictExportAndResume) { checkpoint_case("FULL_STATE_DICT", 2); }

// fp8 all-gather: the Linear weights of each decoder layer (7 per layer), bf16 shards. One MAX
// all-reduce for the scales of all weights; per unit one all-gather of fp8 bytes (half the bytes
// of the bf16 all-gather of the same unit); the result bit-identical to gathering the bf16 weight
// and casting it with fp8_cast_dynamic.
void fp8_gather_case(int world) {
  const int port = pick_free_port();
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    Comm comm(w.pg);
    LlamaForCausalLM model(tiny_llama(2), DType::F32, Device::cpu(), 5);
    std::vector<std::vector<Parameter*>> units;
    for (Module* layer : fsdp_units(model, FsdpOptions{})) {
      units.emplace_back();
      for (Parameter* p : layer->parameters())
        if (p->value.dim() == 2) units.back().push_back(p);
    }
    RANK_CHECK(units.size() == 2 && units[0].size() == 7, "unexpected units");
    Fp8AllGather ag(units, world);
    // This rank's bf16 chunk of each unit (as FSDP keeps it), and the bf16 full buffers.
    std::vector<Tensor> shards, fulls;
    for (int u = 0; u < 2; ++u) {
      const FlatLayout& l = ag.layout(u);
      Tensor full = Tensor::zeros({l.padded_numel}, DType::BF16);
      for (const FlatSlot& s : l.slots) flat_view(full, s.offset, s.shape).copy_(s.param->value);
      fulls.push_back(full);
      shards.push_back(flat_view(full, rank * l.shard_numel, {l.shard_numel}).clone());
    }
    w.pg->reset_stats();
    ag.precompute_scales(shards, comm);
    CommStats st = w.pg->stats();
    RANK_CHECK(st[CommKind::AllReduce].calls == 1 && st[CommKind::AllReduce].bytes == 4 * 14,
               "amax all-reduce: %lld calls, %lld bytes (want 1 call, 56 bytes)",
               static_cast<long long>(st[CommKind::AllReduce].calls),
               static_cast<long long>(st[CommKind::AllReduce].bytes));
    for (int u = 0; u < 2; ++u) {
      const FlatLayout& l = ag.layout(u);
      w.pg->reset_stats();
      std::vector<Fp8Tensor> got = ag.gather(u, shards[u], comm);
      const CommCounter fp8 = w.pg->stats()[CommKind::AllGather];
      // Reference: all-gather the bf16 weights, then cast each with its own (dynamic) scale.
      Tensor hp = Tensor::zeros({l.padded_numel}, DType::BF16);
      Tensor chunk = flat_view(hp, rank * l.shard_numel, {l.shard_numel});
      chunk.copy_(shards[u]);
      w.pg->reset_stats();
      comm.all_gather(hp, chunk)->wait();
      const CommCounter bf16 = w.pg->stats()[CommKind::AllGather];
      RANK_CHECK(fp8.calls == 1 && fp8.bytes == l.padded_numel && 2 * fp8.bytes == bf16.bytes &&
                     2 * fp8.wire_bytes == bf16.wire_bytes,
                 "unit %d: fp8 all-gather %lld calls %lld bytes (%lld on the wire), bf16 %lld "
                 "bytes (%lld)",
                 u, static_cast<long long>(fp8.calls), static_cast<long long>(fp8.bytes),
                 static_cast<long long>(fp8.wire_bytes), static_cast<long long>(bf16.bytes),
                 static_cast<long long>(bf16.wire_bytes));
      for (size_t i = 0; i < l.slots.size(); ++i) {
        const FlatSlot& s = l.slots[i];
        Fp8CastOptions o;
        o.pad = 16;
        Fp8Tensor want = fp8_cast_dynamic(flat_view(hp, s.offset, s.shape), DType::E4M3, o);
        const Fp8Tensor& g = got[i];
        RANK_CHECK(
            g.rows == want.rows && g.cols == want.cols && g.data.shape() == want.data.shape(),
            "%s: shapes differ", s.name.c_str());
        Tensor gd = g.data.clone(), wd = want.data.clone();
        RANK_CHECK(std::memcmp(gd.data_ptr(), wd.data_ptr(), gd.nbytes()) == 0,
                   "%s: fp8 bytes differ from gather-then-cast", s.name.c_str());
        RANK_CHECK(g.scale_inv.item() == want.scale_inv.item(), "%s: scale_inv %.9g vs %.9g",
                   s.name.c_str(), g.scale_inv.item(), want.scale_inv.item());
      }
    }
    return 0;
  });
  expect_all_ok(exits);
}

TEST(FsdpFp8AllGather, BitIdenticalToGatherThenCastWithHalfTheBytes) {
  fp8_gather_case(2);
  fp8_gather_case(3);
}

}  // namespace
}  // namespace accel
