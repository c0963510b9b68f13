// optimizer.master_weights bf16 under every strategy on CPU ranks (bf16 compute): the bf16 compute
// weights are the masters (no fp32 copy anywhere), and each element's stochastic rounding depends
// only on its parameter and its place in it, so with the same gradient on every rank (each rank
// trains on the whole batch; averaging equal bf16 values over 2 or 3 ranks is exact) every
// strategy at world size 2 and 3 (and single) ends with the weights of the reference single
// process (tests/parallel/strategy_test_util.h, written without the engine) bit for bit, also with
// ZeRO-2/3 optimizer offload (a bf16 master of its own, copied to the compute weights). With the
// batch split over the ranks the usual bf16 tolerance holds; the reference stays near its
// fp32-master run; and the model-state memory per rank follows the ZeRO formulas without the
// fp32 master (DDP 12P, ZeRO-1 4P + 8P/N, ZeRO-2 2P + 10P/N, ZeRO-3 12P/N with fp32 moments;
// 8P, 4P + 4P/N, 2P + 6P/N, 8P/N with bf16 ones).
#include <cstring>
#include <map>

#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {

using namespace testing;

RunSpec bf16_master_spec() {
  RunSpec s;
  s.compute = DType::BF16;
  s.master_dtype = DType::BF16;
  return s;
}

// "" or the first weight whose bits differ.
std::string compare_bits(const Weights& got, const Weights& want) {
  std::map<std::string, Tensor> g(got.begin(), got.end());
  if (got.size() != want.size()) return "different number of tensors";
  for (const auto& [name, w] : want) {
    auto it = g.find(name);
    if (it == g.end()) return "missing " + name;
    const Tensor a = it->second.clone(), b = w.clone();
    if (a.dtype() != b.dtype() || a.nbytes() != b.nbytes() ||
        std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) != 0)
      return name + " (" + dtype_name(a.dtype()) + " vs " + dtype_name(b.dtype()) + ")";
  }
  return "";
}

TEST(StrategyMasterBf16, ReferenceTracksTheFp32MasterRun) {
  RunSpec fp32 = bf16_master_spec();
  fp32.master_dtype = DType::F32;
  const RunResult a = run_training(fp32, nullptr, 0, fp32.seed);
  const RunSpec s = bf16_master_spec();
  const RunResult b = run_training(s, nullptr, 0, s.seed);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  // Ten steps at lr 1e-3: the bf16 masters' rounding (2^-8 relative per element, unbiased) keeps
  // the losses within 1%.
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(b.losses[i], a.losses[i], 1e-2 * a.losses[i]) << "step " << i + 1;
  EXPECT_LT(b.losses.back(), b.losses.front());
  for (const auto& [name, w] : b.final_weights) EXPECT_EQ(w.dtype(), DType::BF16) << name;
  // Another rounding seed, other weights: the rounding is stochastic and seeded.
  RunSpec reseeded = s;
  reseeded.seed = s.seed + 1;
  const RunResult c = run_training(reseeded, nullptr, 0, s.seed);  // same initial weights
  EXPECT_NE(compare_bits(c.final_weights, b.final_weights), "");
}

struct Case {
  std::string strategy;
  int world;
  DType state;
  bool offload = false;  // deepspeed offload_optimizer: a bf16 master of its own on the host
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.strategy + "_world" + std::to_string(info.param.world) + "_state_" +
         dtype_name(info.param.state) + (info.param.offload ? "_offload" : "");
}

class StrategyMasterBf16Parity : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyMasterBf16Parity, EqualsTheReferenceBitForBit) {
  const Case c = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(c.world, [&](int rank) -> int {
    RunSpec ref_spec = bf16_master_spec();  // the reference strategy, written without the engine
    ref_spec.state_dtype = c.state;
    ref_spec.clip = 0;  // the norm's summation order differs between layouts; clipping off
    ref_spec.every_rank_takes_the_whole_batch = true;
    const RunResult ref = run_training(ref_spec, nullptr, 0, ref_spec.seed);
    World w = make_world(rank, c.world, port);
    RunSpec s = ref_spec;
    s.strategy = c.strategy;
    s.world = c.world;
    s.offload_optimizer = c.offload;
    Trainee t = make_trainee(s, w.pg, rank == 0 ? s.seed : s.seed + 1 + rank);
    // No fp32 master: every master tensor this rank holds is bf16.
    for (const auto& [key, st] : t.strategy->optimizer_state())
      if (key.size() > 7 && key.substr(key.size() - 7) == ".master")
        RANK_CHECK(st.dtype() == DType::BF16, "%s is %s, not bf16", key.c_str(),
                   dtype_name(st.dtype()));
    for (int step = 0; step < s.steps; ++step) {
      const double loss = train_step(s, t, step, rank, w.pg.get());
      // The mean over the ranks of equal losses (fp64) may round in its last bit.
      RANK_CHECK(close_rel(loss, ref.losses[step], 1e-12), "step %d: loss %.17g, reference %.17g",
                 step + 1, loss, ref.losses[step]);
    }
    const std::string diff = compare_bits(full_weights(*t.strategy), ref.final_weights);
    RANK_CHECK(diff.empty(), "final weights differ from the reference in %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, StrategyMasterBf16Parity,
    ::testing::Values(Case{"single", 1, DType::F32}, Case{"single", 1, DType::BF16},
                      Case{"ddp", 2, DType::F32}, Case{"ddp", 3, DType::BF16},
                      Case{"zero1", 2, DType::BF16}, Case{"zero1", 3, DType::F32},
                      Case{"zero2", 2, DType::F32}, Case{"zero2", 3, DType::BF16},
                      Case{"zero2", 3, DType::F32, true}, Case{"zero3", 2, DType::BF16},
                      Case{"zero3", 3, DType::F32}, Case{"zero3", 2, DType::F32, true},
                      Case{"fsdp", 2, DType::F32}, Case{"fsdp", 3, DType::BF16}),
    case_name);

// The batch split over the ranks as in training: the bf16 gradients are reduced in another
// order than the single process sums them, so the weights agree within bf16's tolerance (as
// the state_dtype parity tests' 1e-2 under bf16 compute).
class StrategyMasterBf16Split : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyMasterBf16Split, TracksTheReference) {
  const Case c = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(c.world, [&](int rank) -> int {
    RunSpec ref_spec = bf16_master_spec();
    ref_spec.state_dtype = c.state;
    const RunResult ref = run_training(ref_spec, nullptr, 0, ref_spec.seed);
    World w = make_world(rank, c.world, port);
    RunSpec s = ref_spec;
    s.strategy = c.strategy;
    s.world = c.world;
    Trainee t = make_trainee(s, w.pg, rank == 0 ? s.seed : s.seed + 1 + rank);
    for (int step = 0; step < s.steps; ++step) {
      const double loss = train_step(s, t, step, rank, w.pg.get());
      RANK_CHECK(close_rel(loss, ref.losses[step], 2e-3), "step %d: loss %.9g, reference %.9g",
                 step + 1, loss, ref.losses[step]);
    }
    const std::string diff = compare_weights(full_weights(*t.strategy), ref.final_weights, 1e-2);
    RANK_CHECK(diff.empty(), "final weights differ from the reference: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyMasterBf16Split,
                         ::testing::Values(Case{"single", 1, DType::F32},
                                           Case{"zero2", 2, DType::F32},
                                           Case{"fsdp", 3, DType::BF16}),
                         case_name);

double bf16_master_formula(const std::string& kind, double P, int N, double moments) {
  // bf16 params and grads (2P each), the masters are the params; Adam's two moments.
  if (kind == "ddp") return 4 * P + moments * P;
  if (kind == "zero1") return 4 * P + moments * P / N;
  if (kind == "zero2") return 2 * P + (2 + moments) * P / N;
  return (4 + moments) * P / N;
}

TEST(StrategyMasterBf16Memory, ModelStateBytesHaveNoFp32Master) {
  const int world = 2;
  const int port = pick_free_port();
  auto exits = run_ranks(
      world,
      [&](int rank) -> int {
        World w = make_world(rank, world, port);
        const Device cpu = Device::cpu();
        const MemCategory cats[] = {MemCategory::Params, MemCategory::Grads,
                                    MemCategory::OptimizerState};
        for (DType state : {DType::F32, DType::BF16})
          for (const char* kind : {"ddp", "zero1", "zero2", "zero3"}) {
            RunSpec s = bf16_master_spec();
            s.state_dtype = state;
            s.strategy = kind;
            s.world = world;
            s.layers = 40;
            s.global_batch = 4;
            s.bucket_cap_mb = 0.02;
            MemoryStats base = memory_stats(cpu);
            Trainee t = make_trainee(s, w.pg, s.seed);
            const double P = static_cast<double>(t.model->config.num_parameters());
            reset_peak_memory_stats(cpu);
            for (int step = 0; step < 2; ++step) train_step(s, t, step, rank, nullptr);
            MemoryStats m = memory_stats(cpu);
            double total = 0;
            for (MemCategory c : cats) {
              const int i = static_cast<int>(c);
              total += static_cast<double>(m.peak[i] - base.current[i]);
            }
            const double want = bf16_master_formula(kind, P, world, state == DType::F32 ? 8 : 4);
            RANK_CHECK(std::abs(total - want) <= 0.1 * want,
                       "%s N=%d, bf16 masters, %s moments: model states %.3fP, formula %.3fP", kind,
                       world, dtype_name(state), total / P, want / P);
          }
        return 0;
      },
      std::chrono::seconds(120));
  expect_all_ok(exits);
}

}  // namespace
}  // namespace accel
