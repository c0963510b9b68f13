// Model-state memory per rank (peak bytes of the Params, Grads and OptimizerState categories,
// counted by the runtime's allocator) against the ZeRO paper's formulas for 16-bit compute with
// fp32 Adam, P parameters over N ranks:
//   DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N, within 10%; and the single
// process against the reference implementation.
// The model is deep and narrow so that the transient buffers (a gradient bucket or two in
// flight; for ZeRO-3 the gathered root, the current and the prefetched layer) stay small next
// to the persistent states, as they do in a real model.
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
  for (int world : {2, 4}) {
    const int port = pick_free_port();
    auto exits = run_ranks(
        world,
        [&](int rank) -> int {
          World w = make_world(rank, world, port);
          const Device cpu = Device::cpu();
          const MemCategory cats[] = {MemCategory::Params, MemCategory::Grads,
                                      MemCategory::OptimizerState};
          for (const char* kind : {"ddp", "zero1", "zero2", "zero3"}) {
            RunSpec s;
            s.strategy = kind;
            s.world = world;
            s.compute = DType::BF16;
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
            std::string detail;
            for (MemCategory c : cats) {
              int i = static_cast<int>(c);
              double b = static_cast<double>(m.peak[i] - base.current[i]);
              total += b;
              detail += std::string(" ") + mem_category_name(c) + " " + std::to_string(b / P) + "P";
            }
            const double want = formula(kind, P, world);
            if (rank == 0)
              std::fprintf(stderr, "%s N=%d: model states %.3fP (formula %.3fP):%s\n", kind, world,
                           total / P, want / P, detail.c_str());
            RANK_CHECK(std::abs(total - want) <= 0.1 * want,
                       "%s N=%d: model states %.3fP, formula %.3fP (%s)", kind, world, total / P,
                       want / P, detail.c_str());
          }
          return 0;
        },
        std::chrono::seconds(120));
    expect_all_ok(exits);
  }
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
