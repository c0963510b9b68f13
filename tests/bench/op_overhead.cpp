// Per-op overhead of our own layer (argument checks, dispatch, output allocation, autograd
// recording) on tiny tensors, where the math itself costs nanoseconds. Goal: a few microseconds.
#include <benchmark/benchmark.h>

#include "ops/ops.h"

namespace accel {
namespace {

void BM_AddNoGrad(benchmark::State& state) {
  Tensor a = Tensor::ones({4}), b = Tensor::ones({4});
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b));
}
BENCHMARK(BM_AddNoGrad);

void BM_AddRecorded(benchmark::State& state) {
  Tensor a = Tensor::ones({4}), b = Tensor::ones({4});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b));
}
BENCHMARK(BM_AddRecorded);

void BM_AddRecordedAndBackward(benchmark::State& state) {
  Tensor a = Tensor::ones({4}), b = Tensor::ones({4});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  Tensor seed = Tensor::ones({4});
  for (auto _ : state) {
    add(a, b).backward(seed);
    a.zero_grad();
    b.zero_grad();
  }
}
BENCHMARK(BM_AddRecordedAndBackward);

void BM_AddBroadcastNoGrad(benchmark::State& state) {
  Tensor a = Tensor::ones({2, 4}), b = Tensor::ones({4});
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b));
}
BENCHMARK(BM_AddBroadcastNoGrad);

void BM_MatmulTiny(benchmark::State& state) {
  Tensor a = Tensor::ones({4, 4}), b = Tensor::ones({4, 4});
  for (auto _ : state) benchmark::DoNotOptimize(matmul(a, b));
}
BENCHMARK(BM_MatmulTiny);

}  // namespace
}  // namespace accel

BENCHMARK_MAIN();
