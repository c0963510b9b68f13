// Model-state memory per rank (peak bytes of the Params, Grads and OptimizerState categories,
// counted by the runtime's allocator) against the ZeRO paper's formulas for 16-bit compute with
// fp32 Adam, P parameters over N ranks:
//   DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N, within 10%; and the single
// process against the reference implementation.
// The model is deep and narrow, 40 layers (why: expect_model_states_follow, strategy_test_util.h).
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {

using namespace testing;

double formula(const std::string& kind, double P, int N) {
  if (kind == "ddp") return 16 * P;
  if (kind == "zero1") return 4 * P + 12 * P / N;
  if (kind == "zero2") return 2 * P + 14 * P / N;
  return 16 * P / N;
}

TEST(StrategyMemory, ModelStateBytesMatchTheZeroFormulasInBf16) {
  for (int world : {2, 4}) expect_model_states_follow(RunSpec(), world, formula);
}

// The single process runs the engine, but keeps what the reference (one fp32 master, one compute
// copy and the optimizer state per parameter, autograd's own gradients) keeps: the same peak of
// all memory together in setup and in training, no gradient between steps (DDP's flat buckets
// would keep 2P), and model states of 16P in training (bf16: 2P + 2P + 12P; fp32: the master is
// the compute weight, 4P + 4P + 8P).
TEST(StrategyMemory, SingleProcessHoldsWhatTheReferenceHolds) {
  const Device cpu = Device::cpu();
  const int grads = static_cast<int>(MemCategory::Grads);
  for (DType compute : {DType::BF16, DType::F32}) {
    struct Measured {
      double setup_peak = 0, train_peak = 0, states = 0, grads_after_step = 0, after_step = 0;
    };
    auto measure = [&](const char* kind) {
      RunSpec s;
      s.strategy = kind;
      s.compute = compute;
      s.layers = 40;
      s.global_batch = 4;
      const MemoryStats base = memory_stats(cpu);
      reset_peak_memory_stats(cpu);
      Measured out;
      {
        Trainee t = make_trainee(s, nullptr, s.seed);
        const double P = static_cast<double>(t.model->config.num_parameters());
        auto rel = [&](int64_t bytes, int64_t from) {
          return static_cast<double>(bytes - from) / P;
        };
        out.setup_peak = rel(memory_stats(cpu).peak_total, base.current_total);
        reset_peak_memory_stats(cpu);
        for (int step = 0; step < 2; ++step) train_step(s, t, step, 0, nullptr);
        const MemoryStats m = memory_stats(cpu);
        out.train_peak = rel(m.peak_total, base.current_total);
        out.grads_after_step = rel(m.current[grads], base.current[grads]);
        out.after_step = rel(m.current_total, base.current_total);
        for (MemCategory c :
             {MemCategory::Params, MemCategory::Grads, MemCategory::OptimizerState}) {
          const int i = static_cast<int>(c);
          out.states += rel(m.peak[i], base.current[i]);
        }
      }
      std::fprintf(stderr,
                   "%s %s: peak %.3fP in setup, %.3fP in training, model states %.3fP, after a "
                   "step %.3fP (gradients %.3fP)\n",
                   kind, dtype_name(compute), out.setup_peak, out.train_peak, out.states,
                   out.after_step, out.grads_after_step);
      return out;
    };
    const Measured ref = measure("reference"), single = measure("single");
    const char* what = dtype_name(compute);
    EXPECT_LE(single.setup_peak, ref.setup_peak * 1.01) << what;
    EXPECT_LE(single.train_peak, ref.train_peak * 1.01) << what;
    EXPECT_LE(single.after_step, ref.after_step * 1.01) << what;
    EXPECT_EQ(single.grads_after_step, 0.0) << what;
    EXPECT_NEAR(single.states, 16, 1.6) << what;
  }
}

}  // namespace
}  // namespace accel
