// What a new sequence length costs on CUDA (issue 22: padded SFT batches). One llama-1b decoder
// layer's GEMMs, attention and SwiGLU, forward and backward through autograd in bf16, at 8 rows of
// S tokens, S chosen per step as padded batches do: fixed, new every step, new every step rounded
// up to a multiple of 64, and new every step with GEMM tuning off (ACCEL_GEMM_TUNING=0's
// heuristic-only choice). Per mode: the mean step time of steps at a length not seen before and of
// steps at a seen one, GEMM plans made (cuBLASLt heuristic query, plus timing 8 candidates when
// tuning is on), and cudaMalloc calls of the caching allocator. The attention graphs cuDNN builds
// per new length show in the time only. Plain main: `bench_padded_shapes [--steps N]`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "ops/backend.h"
#include "ops/ops.h"
#include "runtime/tensor.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cublaslt.h"
#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"
#endif

using namespace accel;

#ifdef ACCEL_WITH_CUDA
namespace {

constexpr int64_t kB = 8, kH = 2048, kHQ = 32, kHKV = 8, kD = 64, kI = 8192, kMaxSeq = 2048;

Tensor randn(const Shape& s, double std) {
  Tensor x = Tensor::empty(s, DType::BF16, Device::cuda(0));
  cuda_backend().rand_normal(x, 1234, 0, 0.0, std);
  return x;
}

struct Layer {
  Tensor wq = randn({kHQ * kD, kH}, 0.02), wk = randn({kHKV * kD, kH}, 0.02),
         wv = randn({kHKV * kD, kH}, 0.02), wo = randn({kH, kHQ*kD}, 0.02),
         wg = randn({kI, kH}, 0.02), wu = randn({kI, kH}, 0.02), wd = randn({kH, kI}, 0.02);
  Layer() {
    for (Tensor* w : {&wq, &wk, &wv, &wo, &wg, &wu, &wd}) w->set_requires_grad(true);
  }
  // One forward and backward at S tokens per row; returns when the GPU is done.
  void step(int64_t s) {
    Tensor x = randn({kB, s, kH}, 1.0);
    x.set_requires_grad(true);
    Tensor q = reshape(linear(x, wq), {kB, s, kHQ, kD});
    Tensor k = reshape(linear(x, wk), {kB, s, kHKV, kD});
    Tensor v = reshape(linear(x, wv), {kB, s, kHKV, kD});
    Tensor a = linear(reshape(attention(q, k, v), {kB, s, kHQ * kD}), wo);
    Tensor y = linear(swiglu(linear(a, wg), linear(a, wu)), wd);
    y.backward(Tensor::ones(y.shape(), DType::BF16, Device::cuda(0)));
    for (Tensor* w : {&wq, &wk, &wv, &wo, &wg, &wu, &wd}) w->zero_grad();
    cuda::synchronize(0);
  }
};

int64_t plans_made() {
  const cuda::lt::TuningStats t = cuda::lt::tuning_stats();
  return t.tuned + t.heuristic_only;
}

// Runs `steps` steps at length_of(i); prints the new-length and seen-length step times.
void mode(Layer& layer, const char* name, int steps, const std::function<int64_t(int)>& length_of) {
  std::set<int64_t> seen;
  double new_ms = 0, seen_ms = 0;
  int n_new = 0, n_seen = 0;
  const int64_t plans0 = plans_made();
  const int64_t mallocs0 = cuda::allocator_stats(0).num_device_mallocs;
  for (int i = 0; i < steps; ++i) {
    const int64_t s = std::min(kMaxSeq, length_of(i));
    const bool fresh = seen.insert(s).second;
    const auto t0 = std::chrono::steady_clock::now();
    layer.step(s);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    (fresh ? new_ms : seen_ms) += ms;
    (fresh ? n_new : n_seen) += 1;
  }
  std::printf(
      "%-28s %4zu lengths  new-length step %8.2f ms (%3d)  seen-length step %8.2f ms (%3d)"
      "  GEMM plans made %5lld  cudaMalloc %5lld\n",
      name, seen.size(), n_new ? new_ms / n_new : 0.0, n_new, n_seen ? seen_ms / n_seen : 0.0,
      n_seen, static_cast<long long>(plans_made() - plans0),
      static_cast<long long>(cuda::allocator_stats(0).num_device_mallocs - mallocs0));
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 60;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  if (!cuda::available()) {
    std::printf("bench_padded_shapes: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  std::printf("one llama-1b layer fwd+bwd, bf16, %lld rows of S tokens, %d steps per mode\n",
              static_cast<long long>(kB), steps);
  Layer layer;
  // Lengths 642..1998, all 2 mod 4 (never a multiple of 64, distinct for 340 steps); the untuned
  // mode's are odd, so no mode reuses another's plans.
  auto varied = [](int i) { return int64_t{642} + 4 * ((int64_t{i} * 37) % 340); };
  mode(layer, "warm-up, S = 1024", 5, [](int) { return int64_t{1024}; });
  mode(layer, "fixed S = 1024", steps, [](int) { return int64_t{1024}; });
  mode(layer, "new S every step", steps, varied);
  mode(layer, "new S, padded to 64", steps, [&](int i) { return (varied(i + 7) + 63) / 64 * 64; });
  cuda::lt::set_gemm_tuning(false);
  mode(layer, "new S, GEMM tuning off", steps, [&](int i) { return varied(i + 11) + 1; });
  return 0;
}
#else
int main() {
  std::printf("bench_padded_shapes: built without CUDA, nothing to measure\n");
  return 0;
}
#endif
