// Model-state memory per rank (peak bytes of the Params, Grads and OptimizerState categories,
// counted by the runtime's allocator) against the ZeRO paper's formulas for 16-bit compute with
// fp32 Adam, P parameters over N ranks:
//   DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N, within 10%.
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

}  // namespace
}  // namespace accel
