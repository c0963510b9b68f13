// The snapshot block reserved at setup (issue 24): a run with periodic background saves
// allocates the host block of its checkpoint snapshots before the first step, sized from
// metadata only, so that no save in the training loop allocates or page-locks memory.
//   - Strategy::full_state_dict_layout describes full_state_dict exactly (names, shapes, dtypes,
//     devices, order) and, like snapshot_layout, runs no collective: single, DDP, ZeRO-1/2/3
//     (with and without 16-bit weights), FSDP FULL and SHARDED, expert parallelism, on 2 forked
//     CPU ranks;
//   - on every rank the block reserved from snapshot_layout is the first save's: one allocation,
//     of exactly the snapshot's bytes, and the save allocates nothing and warns about nothing;
//   - accel-train reserves once, before step 1, when saves are async and periodic, and never for
//     synchronous or at_end-only runs (or an every_steps that reaches no step); the checkpoints
//     of an async run with its reserved block are bit-identical to those of a synchronous run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "parallel/expert_parallel.h"
#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"
#include "tools/trainer/checkpoint_buffer.h"
#include "tools/trainer/checkpointing.h"

namespace fs = std::filesystem;

namespace accel {
namespace {

using testing::expect_all_ok;
using testing::make_world;
using testing::pick_free_port;
using testing::run_ranks;
using testing::World;

// ---- which runs reserve ------------------------------------------------------------------------

TEST(CheckpointReservation, OnlyAsyncPeriodicSavesThatFallInsideTheRun) {
  CheckpointConfig c;  // defaults: every_steps 0, at_end, synchronous
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 0, 100));
  c.async = true;  // at_end only: the one save allocates its block, as before
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 0, 100));
  c.every_steps = 10;
  EXPECT_TRUE(reserves_snapshot_at_setup(c, 0, 100));
  EXPECT_TRUE(reserves_snapshot_at_setup(c, 0, 11));     // a save at step 10
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 0, 10));    // step 10 is at_end's save
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 0, 5));     // every_steps past max_steps
  EXPECT_TRUE(reserves_snapshot_at_setup(c, 85, 100));   // resumed: a save at step 90
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 90, 100));  // resumed at 90: none before 100
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 100, 100));
  c.at_end = false;
  EXPECT_TRUE(reserves_snapshot_at_setup(c, 0, 100));
  c.async = false;  // synchronous: allocated at the first save, as before
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 0, 100));
  c.async = true;
  c.every_steps = std::numeric_limits<int64_t>::max();
  EXPECT_FALSE(reserves_snapshot_at_setup(c, 3, std::numeric_limits<int64_t>::max()));
}

// ---- the strategies' layouts and the reservation on each rank ----------------------------------

// Host memory that counts its blocks ("pinned" ones are pageable memory that says it is pinned).
class CountingMemory : public HostMemory {
 public:
  CountingMemory(bool pinned, int* count) : pinned_(pinned), n_(count) {}
  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    ++*n_;
    return allocate_storage(nbytes, Device::cpu(), MemCategory::Other);
  }
  bool pinned() const override { return pinned_; }

 private:
  bool pinned_;
  int* n_;
};

struct Case {
  std::string name;
  int world = 2;
  DistributedType type = DistributedType::MultiCpu;
  int zero_stage = 2;
  bool save_16bit = false;
  FsdpStateDictType fsdp_state = FsdpStateDictType::Sharded;
  DType compute = DType::F32;
  int ep = 1;  // > 1: a mixture of experts, its experts split over ep ranks
  bool save_optimizer = true;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

DecoderConfig model_of(const Case& c) {
  DecoderConfig m = testing::tiny_llama(2);
  if (c.ep == 1) return m;
  m.model_type = "qwen3_moe";
  m.hidden_size = 16;
  m.num_attention_heads = 2;
  m.num_key_value_heads = 1;
  m.head_dim = 8;
  m.intermediate_size = 32;
  m.moe_intermediate_size = 8;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.mlp_only_layers = {1};
  return m;
}

int64_t collective_calls(const ProcessGroup* pg, const Strategy& s) {
  int64_t n = 0;
  const CommStats own = s.group_comm_stats();
  for (int k = 0; k < kNumCommKinds; ++k) n += own.kind[k].calls;
  if (pg) {
    const CommStats world = pg->stats();
    for (int k = 0; k < kNumCommKinds; ++k) n += world.kind[k].calls;
  }
  return n;
}

// The bytes of the block a snapshot's tensors sit in, as carve lays them out.
size_t snapshot_bytes(const CheckpointSnapshot& s) {
  size_t n = 0;
  auto add = [&n](const Tensor& t) { n += (t.nbytes() + 255) / 256 * 256; };
  for (const auto& [name, t] : s.full_weights) add(t);
  for (const ParamStateSlice& p : s.slices)
    for (const auto& [kind, t] : p.tensors) add(t);
  return n;
}

class ReservationPerStrategy : public ::testing::TestWithParam<Case> {};

TEST_P(ReservationPerStrategy, LayoutIsTheFullStateDictAndTheReservedBlockTheFirstSaves) {
  const Case c = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(c.world, [&](int rank) -> int {
    std::shared_ptr<ProcessGroup> pg;
    World w;
    if (c.world > 1) {
      w = make_world(rank, c.world, port);
      pg = w.pg;
    }
    const DecoderConfig mc = model_of(c);
    std::unique_ptr<ExpertParallelContext> ctx;
    if (c.ep > 1)
      ctx = std::make_unique<ExpertParallelContext>(
          make_expert_parallel(pg, c.ep, mc.num_experts, Device::cpu()));
    Config cfg = default_config();
    cfg.num_processes = c.world;
    cfg.use_cpu = true;
    cfg.distributed_type = c.world > 1 ? c.type : DistributedType::No;
    cfg.distributed.expert_parallel_size = c.ep;
    cfg.deepspeed.zero_stage = c.zero_stage;
    cfg.deepspeed.zero3_save_16bit_model = c.save_16bit;
    cfg.fsdp.fsdp_state_dict_type = c.fsdp_state;
    cfg.fsdp.fsdp_transformer_layer_cls_to_wrap = mc.hf_class("DecoderLayer");
    CausalLM model(mc, DType::F32, Device::cpu(), 7, ctx.get());
    std::unique_ptr<Strategy> strategy = make_strategy(cfg, pg, c.compute, ctx.get());
    strategy->setup(model, testing::test_optimizer());

    const int64_t calls = collective_calls(pg.get(), *strategy);
    const std::vector<StateDictEntry> layout = strategy->full_state_dict_layout();
    const SnapshotLayout snap = snapshot_layout(*strategy, rank, c.save_optimizer);
    RANK_CHECK(collective_calls(pg.get(), *strategy) == calls,
               "%s rank %d: the layouts ran %lld collectives", c.name.c_str(), rank,
               static_cast<long long>(collective_calls(pg.get(), *strategy) - calls));
    const std::vector<std::pair<std::string, Tensor>> weights = strategy->full_state_dict();
    RANK_CHECK(layout.size() == weights.size(), "%s rank %d: layout %zu entries, state dict %zu",
               c.name.c_str(), rank, layout.size(), weights.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      const StateDictEntry& e = layout[i];
      const Tensor& t = weights[i].second;
      RANK_CHECK(e.name == weights[i].first && e.shape == t.shape() && e.dtype == t.dtype() &&
                     e.device == t.device(),
                 "%s rank %d entry %zu: layout %s %s %s, state dict %s %s %s", c.name.c_str(), rank,
                 i, e.name.c_str(), shape_str(e.shape).c_str(), dtype_name(e.dtype),
                 weights[i].first.c_str(), shape_str(t.shape()).c_str(), dtype_name(t.dtype()));
    }

    int pinned = 0, pageable = 0;
    std::vector<std::string> warnings;
    SnapshotBuffer b(std::make_unique<CountingMemory>(true, &pinned),
                     std::make_unique<CountingMemory>(false, &pageable),
                     [&warnings](const std::string& m) { warnings.push_back(m); });
    b.reserve(snap.tensors, snap.on_gpu);
    const int64_t reserved_blocks = snap.bytes() > 0 ? 1 : 0;
    RANK_CHECK(b.allocations() == reserved_blocks && b.capacity() == snap.bytes(),
               "%s rank %d: %lld blocks of %zu bytes reserved for %zu", c.name.c_str(), rank,
               static_cast<long long>(b.allocations()), b.capacity(), snap.bytes());
    RANK_CHECK(pinned == 0, "%s rank %d: CPU state took page-locked memory", c.name.c_str(), rank);
    const CheckpointSnapshot s = take_snapshot(*strategy, rank, c.world, c.save_optimizer, &b);
    RANK_CHECK(b.allocations() == reserved_blocks && warnings.empty(),
               "%s rank %d: the first save allocated again (%lld blocks) %s", c.name.c_str(), rank,
               static_cast<long long>(b.allocations()),
               warnings.empty() ? "" : warnings[0].c_str());
    RANK_CHECK(snapshot_bytes(s) == snap.bytes() && b.capacity() == snap.bytes(),
               "%s rank %d: the snapshot holds %zu bytes, %zu were reserved", c.name.c_str(), rank,
               snapshot_bytes(s), snap.bytes());
    RANK_CHECK(s.full_weights.size() == (rank == 0 ? weights.size() : 0),
               "%s rank %d: %zu full weights", c.name.c_str(), rank, s.full_weights.size());
    return 0;
  });
  expect_all_ok(exits);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&out](Case c) { out.push_back(c); };
  Case single;
  single.name = "single";
  single.world = 1;
  add(single);
  Case ddp;
  ddp.name = "ddp";
  add(ddp);
  for (int stage : {1, 2, 3}) {
    Case z;
    z.name = "zero" + std::to_string(stage);
    z.type = DistributedType::DeepSpeed;
    z.zero_stage = stage;
    add(z);
  }
  Case z3_16;  // the 16-bit compute weights gathered into model.safetensors
  z3_16.name = "zero3_16bit_bf16";
  z3_16.type = DistributedType::DeepSpeed;
  z3_16.zero_stage = 3;
  z3_16.save_16bit = true;
  z3_16.compute = DType::BF16;
  add(z3_16);
  Case z2_weights_only;
  z2_weights_only.name = "zero2_without_optimizer";
  z2_weights_only.type = DistributedType::DeepSpeed;
  z2_weights_only.save_optimizer = false;
  add(z2_weights_only);
  for (FsdpStateDictType t : {FsdpStateDictType::Full, FsdpStateDictType::Sharded}) {
    Case f;
    f.name = t == FsdpStateDictType::Full ? "fsdp_full" : "fsdp_sharded";
    f.type = DistributedType::Fsdp;
    f.fsdp_state = t;
    add(f);
  }
  for (DistributedType t : {DistributedType::MultiCpu, DistributedType::Fsdp}) {
    Case e;
    e.name = t == DistributedType::Fsdp ? "ep2_fsdp_full" : "ep2_ddp";
    e.type = t;
    e.fsdp_state = FsdpStateDictType::Full;
    e.ep = 2;
    add(e);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(CheckpointReservation, ReservationPerStrategy,
                         ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ---- the trainer ------------------------------------------------------------------------------

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class CheckpointReservationTrainer : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = tool_test::fresh_test_dir("accel_ckpt_reserve"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // A 5-step CPU run with `checkpoint` (YAML flow mapping entries) into dir_/name.
  tool_test::Result train(const std::string& name, const std::string& checkpoint) {
    fs::create_directories(dir_ / name);
    const fs::path cfg = tool_test::write_config(
        dir_ / name,
        "model: {hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 2, intermediate_size: 32, vocab_size: 64, "
        "max_position_embeddings: 32}\n"
        "data: {source: synthetic}\n"
        "training: {seed: 7, max_steps: 5, micro_batch_size: 2, seq_len: 16, log_every: 1, "
        "progress: plain, device: cpu, sample_tokens: 0, eval_every: 0}\n"
        "logging: {tensorboard: false}\n"
        "checkpoint: {keep_last: 0, " +
            checkpoint + "}\n");
    return tool_test::run_accel_train("--config " + cfg.string() + " --output-dir " +
                                      (dir_ / name / "out").string());
  }
  fs::path step_dir(const std::string& name, int step) {
    return dir_ / name / "out" / "checkpoints" / ("step_" + std::to_string(step));
  }
  fs::path dir_;
};

// Periodic background saves (steps 2 and 4, and at_end's 5): one reservation, before step 1
// and said once; no save outgrows it (that would warn); every checkpoint is bit-identical to the
// synchronous run's, which reserves nothing.
TEST_F(CheckpointReservationTrainer, AsyncPeriodicRunReservesOnceAndSavesTheBytesOfASyncRun) {
  const tool_test::Result a = train("async", "every_steps: 2, async: true");
  ASSERT_EQ(a.code, 0) << a.output;
  const std::string line = "checkpoint: reserved ";
  EXPECT_EQ(count_of(a.output, line), 1u) << a.output;
  const size_t at = a.output.find(line);
  ASSERT_NE(at, std::string::npos) << a.output;
  EXPECT_NE(a.output.find(" bytes) of pageable host memory for background saves in ", at),
            std::string::npos)
      << a.output;  // CPU state: pageable
  const size_t first_step = a.output.find("step 1/");
  ASSERT_NE(first_step, std::string::npos) << a.output;
  EXPECT_LT(at, first_step) << a.output;
  // No save outgrew the block (that warns) or was refused pinned memory.
  EXPECT_EQ(a.output.find("reserved at setup does not hold"), std::string::npos) << a.output;
  EXPECT_EQ(a.output.find("pinned (page-locked) host memory"), std::string::npos) << a.output;
  EXPECT_EQ(count_of(a.output, "saved checkpoint "), 3u) << a.output;

  const tool_test::Result s = train("sync", "every_steps: 2, async: false");
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_EQ(s.output.find(line), std::string::npos) << s.output;
  EXPECT_EQ(count_of(s.output, "saved checkpoint "), 3u) << s.output;

  for (int step : {2, 4, 5}) {
    for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors"}) {
      const std::string want = file_bytes(step_dir("sync", step) / f);
      ASSERT_GT(want.size(), 1000u) << f;
      EXPECT_TRUE(file_bytes(step_dir("async", step) / f) == want)
          << "step " << step << " " << f << ": the async save differs from the synchronous one";
    }
    nlohmann::json x, y;
    std::ifstream(step_dir("async", step) / "trainer_state.json") >> x;
    std::ifstream(step_dir("sync", step) / "trainer_state.json") >> y;
    EXPECT_EQ(x["state"], y["state"]) << "step " << step;  // every slice and its checksum
    EXPECT_EQ(verify_checkpoint(step_dir("async", step).string()), std::vector<std::string>{});
  }
}

// Runs whose saves are not periodic and asynchronous allocate at their first save, as before.
TEST_F(CheckpointReservationTrainer, SyncAndAtEndOnlyRunsReserveNothing) {
  for (const auto& [name, checkpoint] : std::vector<std::pair<std::string, std::string>>{
           {"at_end_async", "every_steps: 0, async: true"},
           {"at_end_sync", "every_steps: 0"},
           {"sync_periodic", "every_steps: 2, async: false"},
           {"every_past_max", "every_steps: 10, async: true"}}) {
    const tool_test::Result r = train(name, checkpoint);
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
    EXPECT_EQ(r.output.find("checkpoint: reserved"), std::string::npos) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("saved checkpoint "), std::string::npos) << name << "\n" << r.output;
    EXPECT_TRUE(fs::exists(step_dir(name, 5) / "trainer_state.json")) << name;
  }
}

}  // namespace
}  // namespace accel
