// FSDP (distributed_type FSDP, fsdp_version 2): unit choice by fsdp_auto_wrap_policy; parity with
// the single process at world sizes 2, 3 and 4 with resharding on and off, activation
// checkpointing on and off and parameter offload on and off (10 steps, 1e-5 relative, fp32);
// gather/reduce-scatter counts per step; fp32 reduction of bf16 gradients; SHARDED_STATE_DICT
// save + resume; FULL_STATE_DICT export that load_hf_weights reads; the fp8 all-gather (alone,
// and wired into training: equal to gathering bf16, equal to the single process, exact bytes);
// fsdp_cpu_ram_efficient_loading (only rank 0 reads model.init_from).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "models/fp8_linear.h"
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
  FsdpWrapPolicy wrap = FsdpWrapPolicy::TransformerBased;
  int64_t min_params = 0;
  FsdpStateDictType state_dict = FsdpStateDictType::Sharded;
  DType compute = DType::F32;
};

Config fsdp_config(const FsdpCase& c) {
  Config cfg;
  cfg.distributed_type = DistributedType::Fsdp;
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
  t.model = std::make_unique<CausalLM>(tiny_llama(s.layers), DType::F32, Device::cpu(), model_seed);
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
  if (c.wrap == FsdpWrapPolicy::SizeBased) n += "_sizewrap";
  if (c.wrap == FsdpWrapPolicy::NoWrap) n += "_nowrap";
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
  c.wrap = FsdpWrapPolicy::SizeBased;
  c.min_params = 1000;
  out.push_back(c);
  c = FsdpCase{};
  c.wrap = FsdpWrapPolicy::NoWrap;
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
  CausalLM model(tiny_llama(3), DType::F32, Device::cpu(), 1);
  FsdpOptions o;
  EXPECT_EQ(unit_types(model, o), std::vector<std::string>(3, "LlamaDecoderLayer"));
  o.auto_wrap_policy = FsdpWrapPolicy::NoWrap;
  EXPECT_TRUE(fsdp_units(model, o).empty());
  // A decoder layer of the tiny model: attention 32*32 + 2*32*16 + 32*32 = 3072, MLP 3*32*64 =
  // 6144, two norms 64: 9280 parameters.
  o.auto_wrap_policy = FsdpWrapPolicy::SizeBased;
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
  o.auto_wrap_policy = FsdpWrapPolicy::TransformerBased;
  o.layer_cls_to_wrap = {"NoSuchLayer"};
  EXPECT_THROW(fsdp_units(model, o), std::invalid_argument);
}

TEST(FsdpConfig, BadKeysAreNamedByTheConfigLoader) {
  // The config loader is the one place that checks fsdp_config (tests/runtime/config_test.cpp
  // has the messages); make_strategy takes what it validated.
  EXPECT_THROW(load_config("", {"distributed_type=FSDP", "num_processes=2",
                                "fsdp_config.fsdp_state_dict_type=LOCAL_STATE_DICT"}),
               ConfigError);
  Config cfg = fsdp_config(FsdpCase{});
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

// FSDP's shards are dim-0 shards: after setup and after training steps, rank r's fp32 master
// shard of every unit holds rows [r*c, min((r+1)*c, d0)) of each parameter (c = ceil(d0 / N)) at
// the parameter's place in the shard, zeros for the padded rows, and zeros after the last
// parameter; ZeRO-3 keeps the contiguous layout.
void dim0_shard_case(int world) {
  const int port = pick_free_port();
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    RunSpec s;
    s.world = world;
    FsdpCase c;
    c.world = world;
    Trainee t = make_fsdp_trainee(s, c, w.pg, s.seed);
    for (int step = 0; step < 2; ++step) {
      if (step) train_step(s, t, 0, rank, w.pg.get());
      auto* f = dynamic_cast<FlatDataParallel*>(t.strategy.get());
      std::map<std::string, Tensor> weights;
      for (auto& [n, v] : full_weights(*t.strategy)) weights[n] = v;
      std::map<std::string, Tensor> state;
      for (auto& [n, v] : t.strategy->optimizer_state()) state[n] = v;
      for (int g = 0; g < f->num_groups(); ++g) {
        const FlatLayout& l = f->group(g).layout();
        RANK_CHECK(l.mode == FlatLayout::Mode::Dim0, "group %d is not dim-0 sharded", g);
        const std::vector<double> shard = state.at(f->group(g).name() + ".master").to_vector();
        RANK_CHECK(static_cast<int64_t>(shard.size()) == l.shard_numel, "group %d shard size", g);
        int64_t pos = 0;
        for (const FlatSlot& slot : l.slots) {
          const Shape& shape = slot.shape;
          const int64_t d0 = shape.empty() ? 1 : shape[0], row = slot.numel / d0;
          const int64_t cr = (d0 + world - 1) / world;
          const std::vector<double> p = weights.at(slot.name).to_vector();
          for (int64_t k = 0; k < cr * row; ++k, ++pos) {
            const int64_t e = rank * cr * row + k;  // row rank*cr + k/row of the parameter
            const double want = e < d0 * row ? p[e] : 0.0;
            RANK_CHECK(shard[pos] == want, "%s: shard element %lld is %.9g, want %.9g (row %lld)",
                       slot.name.c_str(), static_cast<long long>(k), shard[pos], want,
                       static_cast<long long>(e / row));
          }
        }
        for (size_t i = static_cast<size_t>(pos); i < shard.size(); ++i)
          RANK_CHECK(shard[i] == 0.0, "group %d: padding element %zu is %.9g", g, i, shard[i]);
      }
    }
    // ZeRO-3 (and the other ZeRO stages) keep the contiguous layout.
    RunSpec z = s;
    z.strategy = "zero3";
    Trainee zt = make_trainee(z, w.pg, s.seed);
    auto* zf = dynamic_cast<FlatDataParallel*>(zt.strategy.get());
    RANK_CHECK(zf && zf->group(0).layout().mode == FlatLayout::Mode::Contiguous,
               "ZeRO-3's layout is not contiguous");
    return 0;
  });
  expect_all_ok(exits);
}

TEST(FsdpLayout, RankShardHoldsItsDim0RowsOfEveryParameter) {
  dim0_shard_case(3);
  dim0_shard_case(4);
}

// The "layout" of every group in a checkpoint's manifest: "dim0", "contiguous" or "mixed".
std::string st_layout(const fs::path& ck_dir) {
  std::ifstream in(ck_dir / "trainer_state.json");
  nlohmann::json j;
  in >> j;
  std::set<std::string> kinds;
  for (const auto& g : j.at("extra").at("groups")) kinds.insert(g.value("layout", "contiguous"));
  return kinds.size() == 1 ? *kinds.begin() : "mixed";
}

// Checkpoint at step 5 through the trainer's checkpoint code, resume into a differently
// initialized model: steps 6-10 identical. SHARDED_STATE_DICT writes dim-0 shards only (no
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
    c.state_dict = type == "FULL_STATE_DICT" ? FsdpStateDictType::Full : FsdpStateDictType::Sharded;
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
        save_checkpoint(dir.string(), st, *t.strategy, t.model->config, "", writer, 0);
        for (auto& [n, v] : full_weights(*t.strategy)) at5.push_back({n, v.clone()});
      }
    }
    const fs::path ck_dir = dir / "checkpoints" / "step_5";
    const bool has_model = fs::exists(ck_dir / "model.safetensors");
    RANK_CHECK(has_model == (type == "FULL_STATE_DICT"), "%s: model.safetensors %s", type.c_str(),
               has_model ? "written" : "missing");
    RANK_CHECK(fs::exists(ck_dir / ("optimizer.rank" + std::to_string(rank) + ".safetensors")),
               "no shard file for rank %d", rank);
    if (!has_model && rank == 0) {
      // accel-checkpoint consolidate rebuilds the full weights from the master slices the dim-0
      // shards held (the strategy's manifest says "layout": "dim0"), bit for bit.
      RANK_CHECK(st_layout(ck_dir) == "dim0", "the manifest's groups are not dim-0 laid out");
      const fs::path out = dir / "consolidated";
      const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " +
                              ck_dir.string() + " " + out.string() + " >/dev/null 2>&1";
      RANK_CHECK(std::system(cmd.c_str()) == 0, "%s failed (is accel-checkpoint built?)",
                 cmd.c_str());
      CausalLM plain(tiny_llama(s.layers), DType::F32, Device::cpu(), 98);
      load_hf_weights(plain, out.string());
      Weights loaded;
      for (Parameter* p : plain.parameters()) loaded.push_back({p->name, p->value});
      std::string diff = compare_weights(loaded, at5, 0.0);
      RANK_CHECK(diff.empty(), "consolidated weights differ: %s", diff.c_str());
    }
    if (has_model) {
      CausalLM plain(tiny_llama(s.layers), DType::F32, Device::cpu(), 99);
      load_hf_weights(plain, ck_dir.string());
      Weights loaded;
      for (Parameter* p : plain.parameters()) loaded.push_back({p->name, p->value});
      std::string diff = compare_weights(loaded, at5, 0.0);
      RANK_CHECK(diff.empty(), "exported weights differ: %s", diff.c_str());
    }
    Trainee r = make_fsdp_trainee(s, c, w.pg, 1000 + rank);
    LoadedCheckpoint ck = load_checkpoint(ck_dir.string());
    restore_strategy_state(ck, *r.strategy);
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
    CausalLM model(tiny_llama(2), DType::F32, Device::cpu(), 5);
    std::vector<std::vector<Parameter*>> units;
    for (Module* layer : fsdp_units(model, FsdpOptions{})) {
      units.emplace_back();
      for (Parameter* p : layer->parameters())
        if (p->value.dim() == 2) units.back().push_back(p);
    }
    RANK_CHECK(units.size() == 2 && units[0].size() == 7, "unexpected units");
    Fp8AllGather ag(units, world);  // FSDP's dim-0 layout
    // This rank's bf16 dim-0 shard of each unit (as FSDP keeps it), and the bf16 full buffers.
    std::vector<Tensor> shards, fulls;
    for (int u = 0; u < 2; ++u) {
      const FlatLayout& l = ag.layout(u);
      RANK_CHECK(l.mode == FlatLayout::Mode::Dim0, "unit %d is not dim-0 sharded", u);
      Tensor full = Tensor::zeros({l.flat_numel}, DType::BF16);
      for (const FlatSlot& s : l.slots) flat_view(full, s.offset, s.shape).copy_(s.param->value);
      fulls.push_back(full);
      Tensor shard = Tensor::empty({l.shard_numel}, DType::BF16);
      l.extract_shard(full, rank, shard);
      shards.push_back(shard);
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
      // Reference: all-gather the bf16 weights (rank-major, then the copy-out), then cast each
      // with its own (dynamic) scale. Every rank owns as many elements here (a multiple of 16),
      // so the fp8 gather moves exactly one byte per padded element.
      Tensor wire = Tensor::zeros({l.padded_numel}, DType::BF16);
      Tensor chunk = flat_view(wire, rank * l.shard_numel, {l.shard_numel});
      chunk.copy_(shards[u]);
      w.pg->reset_stats();
      comm.all_gather(wire, chunk)->wait();
      const CommCounter bf16 = w.pg->stats()[CommKind::AllGather];
      Tensor hp = Tensor::zeros({l.flat_numel}, DType::BF16);
      l.unpack(wire, hp);
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

// ---- fp8 all-gather in training ----------------------------------------------------------------

Config fp8_fsdp_config(const FsdpCase& c, bool all_gather) {
  Config cfg = fsdp_config(c);
  cfg.mixed_precision = MixedPrecision::Fp8;
  cfg.fp8.backend = Fp8Backend::AO;
  cfg.fp8.enable_fsdp_float8_all_gather = all_gather;
  return cfg;
}

struct Fp8Trainee {
  std::unique_ptr<Fp8Training> fp8;  // declared first: outlives the strategy (its providers)
  Trainee t;
};

// The trainer's order: model, apply_fp8, strategy, the fp8 layers handed to FSDP, setup. fsdp
// false: the single-process reference (bf16 compute, fp8 layers casting their weights
// dynamically).
Fp8Trainee make_fp8_trainee(const FsdpCase& c, bool fsdp, bool all_gather,
                            std::shared_ptr<ProcessGroup> pg, uint64_t seed) {
  Fp8Trainee f;
  const Config cfg = fp8_fsdp_config(c, all_gather);
  f.t.model = std::make_unique<CausalLM>(tiny_llama(2), DType::F32, Device::cpu(), seed);
  f.t.model->set_activation_checkpointing(c.ac);
  f.fp8 = apply_fp8(*f.t.model, cfg.fp8, Device::cpu());
  f.t.strategy =
      fsdp ? make_strategy(cfg, pg, DType::BF16) : std::make_unique<ReferenceStrategy>(DType::BF16);
  if (fsdp && all_gather) {  // as the trainer's precision part does (Precision::attach)
    Fp8WeightGathering::Fp8Layers layers;
    for (const Fp8LayerChoice& l : f.fp8->layers())
      if (l.fp8) layers.push_back({l.name, f.fp8->layer_context(l.name)});
    dynamic_cast<Fp8WeightGathering&>(*f.t.strategy).gather_fp8_weights(layers);
  }
  f.t.strategy->setup(*f.t.model, test_optimizer());
  return f;
}

// Mean loss of a no-grad forward on a fixed batch, under Fp8EvalScope (bf16 unless
// use_autocast_during_eval), averaged over the ranks.
double eval_loss(Fp8Trainee& f, const RunSpec& s, int rank, ProcessGroup* pg) {
  Fp8EvalScope scope(f.fp8.get());
  NoGradGuard no_grad;
  auto [ids, labels] = rank_batch(s, 99, 0, rank, f.t.model->config.vocab_size);
  return mean_over_ranks(CausalLM::loss(f.t.model->forward(ids), labels).item(), pg);
}

// Bytes of one all-gather of `layout` when the elements of the named weights travel as e4m3 and
// the others as bf16 (2 bytes): every rank sends max over ranks of (2 * other + fp8 elements) of
// the rows it owns (dim 0: rows [r*c, min((r+1)*c, d0)) of every parameter, computed here from
// the shapes, independently of the layout code), rounded up to 16 bytes.
int64_t expected_gather_bytes(const FlatLayout& l, const std::set<std::string>& fp8_weights) {
  int64_t most = 0;
  for (int r = 0; r < l.world; ++r) {
    int64_t b = 0;
    for (const FlatSlot& s : l.slots) {
      const int64_t d0 = s.shape.empty() ? 1 : s.shape[0], row = s.numel / d0;
      const int64_t c = (d0 + l.world - 1) / l.world;
      const int64_t rows = std::max<int64_t>(0, std::min(d0, (r + 1) * c) - r * c);
      b += rows * row * (fp8_weights.count(s.name) ? 1 : 2);
    }
    most = std::max(most, b);
  }
  return l.world * ((most + 15) / 16 * 16);
}

struct Fp8Case {
  int world = 2;
  bool reshard = true, ac = false, offload = false;
};

// Why bit-identical: the fp8 all-gather casts each weight's shard with 448 / (global amax of the
// bf16 weight), which is exactly the scale fp8_cast_dynamic computes from the gathered bf16
// weight, and the cast is elementwise, so every fp8 byte and scale equals the gather-then-cast
// path; nothing else differs (same gradients into the same reduce-scatter, same update).
// Against the single process every rank trains on the same rows (dynamic scaling of the
// activations is per tensor, so each rank's activation scales equal the single process's only
// on the same rows) without clipping (the norm over shards sums in another order): the fp32
// reduction averages identical bf16 gradients exactly and Adam is elementwise, so the weights,
// their fp8 casts and the losses are the same bits.
void fp8_training_case(const Fp8Case& fc) {
  const int world = fc.world;
  const int port = pick_free_port();
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    FsdpCase c;
    c.world = world;
    c.reshard = fc.reshard;
    c.ac = fc.ac;
    c.offload = fc.offload;
    c.compute = DType::BF16;
    RunSpec s;
    s.world = world;
    s.steps = 4;
    s.compute = DType::BF16;
    // 1) Different rows per rank: fp8 all-gather on vs off, bit for bit; bytes per step.
    Fp8Trainee on = make_fp8_trainee(c, true, true, w.pg, s.seed);
    Fp8Trainee off = make_fp8_trainee(c, true, false, w.pg, s.seed);
    auto* fs = dynamic_cast<FsdpStrategy*>(on.t.strategy.get());
    RANK_CHECK(fs && fs->fp8_all_gather() && on.fp8->num_fp8_layers() == 13,
               "fp8 all-gather not set up (%lld fp8 layers)",
               static_cast<long long>(on.fp8->num_fp8_layers()));
    std::set<std::string> fp8_names;
    for (const Fp8LayerChoice& l : on.fp8->layers())
      if (l.fp8) fp8_names.insert(l.name + ".weight");
    for (int step = 0; step < s.steps; ++step) {
      double n_on = 0, n_off = 0;
      w.pg->reset_stats();
      fs->reset_group_comm();
      const double l_on = train_step(s, on.t, step, rank, w.pg.get(), &n_on);
      const CommStats st_on = w.pg->stats();
      w.pg->reset_stats();
      const double l_off = train_step(s, off.t, step, rank, w.pg.get(), &n_off);
      const CommStats st_off = w.pg->stats();
      RANK_CHECK(l_on == l_off && n_on == n_off,
                 "step %d: fp8 all-gather loss %.17g norm %.17g, bf16 gather %.17g %.17g", step + 1,
                 l_on, n_on, l_off, n_off);
      // One more all-reduce per step (the amax MAX of all 13 fp8 weights, f32).
      const CommCounter ar_on = st_on[CommKind::AllReduce], ar_off = st_off[CommKind::AllReduce];
      RANK_CHECK(ar_on.calls == ar_off.calls + 1 && ar_on.bytes == ar_off.bytes + 4 * 13,
                 "all-reduces: %lld calls %lld bytes with fp8 all-gather, %lld %lld without",
                 static_cast<long long>(ar_on.calls), static_cast<long long>(ar_on.bytes),
                 static_cast<long long>(ar_off.calls), static_cast<long long>(ar_off.bytes));
      // Every gather of a unit moves exactly its packed bytes; the units' sum is what the
      // process group counted.
      const auto units = fs->unit_comm();
      int64_t total = 0, total_off = 0;
      for (int g = 0; g < fs->num_groups(); ++g) {
        const FlatLayout& l = fs->group(g).layout();
        const auto& gc = fs->group_comm()[g];
        const int64_t want = expected_gather_bytes(l, fp8_names);
        RANK_CHECK(gc.all_gathers > 0 && gc.all_gather_bytes == gc.all_gathers * want,
                   "group %d: %lld all-gathers of %lld bytes, want %lld bytes each", g,
                   static_cast<long long>(gc.all_gathers),
                   static_cast<long long>(gc.all_gather_bytes), static_cast<long long>(want));
        total += gc.all_gather_bytes;
        total_off += gc.all_gathers * 2 * l.padded_numel;
      }
      RANK_CHECK(total == st_on[CommKind::AllGather].bytes &&
                     total_off == st_off[CommKind::AllGather].bytes,
                 "all-gather bytes: units %lld, process group %lld (bf16: %lld vs %lld)",
                 static_cast<long long>(total),
                 static_cast<long long>(st_on[CommKind::AllGather].bytes),
                 static_cast<long long>(total_off),
                 static_cast<long long>(st_off[CommKind::AllGather].bytes));
      if (step == 0 && rank == 0) std::fprintf(stderr, "%s", fs->describe_unit_comm().c_str());
      if (step == 0 && world == 2 && fc.reshard) {
        // Hand-checked numbers, world 2, dim-0 shards (every parameter's first half of rows on
        // rank 0, the second on rank 1: 4640 elements each). A decoder layer holds q 1024, k 512,
        // v 512, o 1024, gate 2048, up 2048, down 2048, then the two norms (32 each).
        // Layer 1 (all 7 weights fp8): each rank sends 4608 e4m3 bytes + 32 bf16 norm elements
        // = 4672 bytes (a multiple of 16): 2 * 4672 = 9344 per gather (bf16: 18560). (With the
        // contiguous ZeRO layout rank 1 held all 64 norm elements: 9408.) Layer 0 keeps q_proj in
        // bf16 (AO's first linear layer): each rank sends 2 * 512 + 4096 + 2 * 32 = 5184 bytes:
        // 2 * 5184 = 10368 per gather (contiguous: 11328), gathered twice (forward and backward).
        // The root unit (embedding, norm, head: 4128 elements) in bf16, once: 2 * 4128 = 8256.
        RANK_CHECK(units.size() == 3 && units[0].name == "model.layers.0" &&
                       units[1].name == "model.layers.1" && units[2].name == "root",
                   "units %s", units.empty() ? "" : units[0].name.c_str());
        const int64_t want_bytes[3] = {2 * 10368, 9344, 8256};
        const int64_t want_fp8[3] = {8192, 9216, 0};
        for (int k = 0; k < 3; ++k)
          RANK_CHECK(
              units[k].comm.all_gather_bytes == want_bytes[k] && units[k].fp8_numel == want_fp8[k],
              "unit %s: %lld bytes (want %lld), %lld fp8 elements (want %lld)",
              units[k].name.c_str(), static_cast<long long>(units[k].comm.all_gather_bytes),
              static_cast<long long>(want_bytes[k]), static_cast<long long>(units[k].fp8_numel),
              static_cast<long long>(want_fp8[k]));
        // Layer 1, all of whose weights are fp8, moves about half of its bf16 bytes.
        RANK_CHECK(2 * units[1].comm.all_gather_bytes < units[1].compute_gather_bytes * 1.02,
                   "layer 1: %lld bytes, bf16 %lld",
                   static_cast<long long>(units[1].comm.all_gather_bytes),
                   static_cast<long long>(units[1].compute_gather_bytes));
      }
    }
    std::string diff =
        compare_weights(full_weights(*on.t.strategy), full_weights(*off.t.strategy), 0.0);
    RANK_CHECK(diff.empty(), "weights differ with fp8 all-gather: %s", diff.c_str());
    // Evaluation in bf16 (autocast off): the units are gathered in bf16 (the hp weights), the
    // result is that of the run without fp8 all-gather and finite.
    w.pg->reset_stats();
    const double e_on = eval_loss(on, s, rank, w.pg.get());
    const int64_t eval_gather = w.pg->stats()[CommKind::AllGather].bytes;
    const double e_off = eval_loss(off, s, rank, w.pg.get());
    int64_t bf16_forward = 0;
    for (int g = 0; g < fs->num_groups(); ++g)
      bf16_forward += 2 * fs->group(g).layout().padded_numel;
    RANK_CHECK(std::isfinite(e_on) && e_on == e_off && eval_gather == bf16_forward,
               "bf16 evaluation: %.17g with fp8 all-gather, %.17g without; gathered %lld bytes, "
               "bf16 %lld",
               e_on, e_off, static_cast<long long>(eval_gather),
               static_cast<long long>(bf16_forward));
    // 2) The same rows on every rank, no clipping: the single process, bit for bit.
    RunSpec same = s;
    same.world = 1;
    same.global_batch = 4;
    same.clip = 0;
    Fp8Trainee single = make_fp8_trainee(c, false, false, nullptr, s.seed);
    Fp8Trainee ag = make_fp8_trainee(c, true, true, w.pg, s.seed);
    for (int step = 0; step < s.steps; ++step) {
      const double l1 = train_step(same, single.t, step, 0, nullptr);
      const double l2 = train_step(same, ag.t, step, 0, w.pg.get());
      RANK_CHECK(l1 == l2, "same rows, step %d: single process %.17g, FSDP fp8 all-gather %.17g",
                 step + 1, l1, l2);
    }
    diff = compare_weights(full_weights(*ag.t.strategy), full_weights(*single.t.strategy), 0.0);
    RANK_CHECK(diff.empty(), "weights differ from the single process: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

TEST(FsdpFp8AllGather, TrainingWorld2EqualsBf16GatherAndSingleProcessWithExactBytes) {
  fp8_training_case({2, true, false, false});
}
TEST(FsdpFp8AllGather, TrainingWorld3NoReshardCheckpointingOffload) {
  fp8_training_case({3, false, true, true});
}

TEST(FsdpFp8AllGather, ConfigNeedsDynamicScaling) {
  Config cfg = fp8_fsdp_config(FsdpCase{}, true);
  EXPECT_NO_THROW(validate_config(cfg));
  cfg.fp8.backend = Fp8Backend::TE;  // delayed scaling: refused, naming the key and the fix
  try {
    validate_config(cfg);
    FAIL() << "enable_fsdp_float8_all_gather accepted with backend TE";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("enable_fsdp_float8_all_gather"), std::string::npos) << m;
    EXPECT_NE(m.find("backend: AO"), std::string::npos) << m;
  }
  cfg.mixed_precision = MixedPrecision::Bf16;  // fp8_config inert without fp8 (a notice)
  EXPECT_NO_THROW(validate_config(cfg));
  // Layers of another recipe handed to the fp8 all-gather are refused before setup.
  cfg = fp8_fsdp_config(FsdpCase{}, true);
  cfg.fp8.backend = Fp8Backend::TE;
  CausalLM model(tiny_llama(1), DType::F32, Device::cpu(), 1);
  auto fp8 = apply_fp8(model, cfg.fp8, Device::cpu());
  Fp8WeightGathering::Fp8Layers layers;
  for (const Fp8LayerChoice& l : fp8->layers())
    if (l.fp8) layers.push_back({l.name, fp8->layer_context(l.name)});
  auto s = make_strategy(cfg, nullptr, DType::BF16);
  EXPECT_THROW(dynamic_cast<Fp8WeightGathering&>(*s).gather_fp8_weights(layers),
               std::invalid_argument);
}

// ---- fsdp_cpu_ram_efficient_loading -------------------------------------------------------------

// Rank 0 writes a Hugging Face folder (the "pretrained" weights: seed 123). With
// fsdp_cpu_ram_efficient_loading only rank 0 is given its path; the other ranks get a path that
// does not exist (load_hf_weights would throw there) and start from their own random values.
// After setup every rank's weights are the file's, bit for bit, and training equals the run
// where every rank reads the file.
void ram_efficient_case(int world) {
  const int port = pick_free_port();
  const fs::path dir = fs::temp_directory_path() / ("accel_fsdp_init_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto exits = run_ranks(world, [&](int rank) -> int {
    World w = make_world(rank, world, port);
    RunSpec s;
    s.world = world;
    s.steps = 3;
    CausalLM pretrained(tiny_llama(s.layers), DType::F32, Device::cpu(), 123);
    if (rank == 0) save_hf_model(pretrained, pretrained.config, dir.string());
    w.pg->barrier()->wait();
    Weights file;
    for (Parameter* p : pretrained.parameters()) file.push_back({p->name, p->value.clone()});

    auto make = [&](bool efficient) {
      FsdpCase c;
      c.world = world;
      Config cfg = fsdp_config(c);
      cfg.fsdp.fsdp_cpu_ram_efficient_loading = efficient;
      cfg.model.init_from = rank == 0 || !efficient ? dir.string() : (dir / "absent").string();
      Trainee t;
      t.model =
          std::make_unique<CausalLM>(tiny_llama(s.layers), DType::F32, Device::cpu(), 1000 + rank);
      const bool reads = reads_init_weights(cfg, rank);
      if (reads) load_hf_weights(*t.model, cfg.model.init_from);  // as the trainer does
      t.strategy = make_strategy(cfg, w.pg, DType::F32);
      t.strategy->setup(*t.model, test_optimizer());
      return std::make_pair(std::move(t), reads);
    };
    auto [eff, reads] = make(true);
    RANK_CHECK(reads == (rank == 0), "rank %d reads init_from: %d", rank, int(reads));
    std::string diff = compare_weights(full_weights(*eff.strategy), file, 0.0);
    RANK_CHECK(diff.empty(), "weights after setup differ from the file: %s", diff.c_str());
    auto [normal, reads_all] = make(false);
    RANK_CHECK(reads_all, "without the flag every rank reads init_from");
    for (int step = 0; step < s.steps; ++step) {
      const double a = train_step(s, eff, step, rank, w.pg.get());
      const double b = train_step(s, normal, step, rank, w.pg.get());
      RANK_CHECK(a == b, "step %d: loss %.17g, every rank reading: %.17g", step + 1, a, b);
    }
    diff = compare_weights(full_weights(*eff.strategy), full_weights(*normal.strategy), 0.0);
    RANK_CHECK(diff.empty(), "trained weights differ: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
  fs::remove_all(dir);
}

TEST(FsdpRamEfficientLoading, OnlyRankZeroReadsInitFrom) {
  ram_efficient_case(2);
  ram_efficient_case(3);
}

}  // namespace
}  // namespace accel
