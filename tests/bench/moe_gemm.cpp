// Mixture-of-experts grouped GEMM benchmark: CudaBackend::grouped_matmul (one cuBLAS grouped call)
// TFLOP/s for the expert GEMMs of a layer (fprop x W^T, dgrad g W, wgrad g^T x) at MoE shapes,
// with balanced and skewed routing, beside one dense GEMM of the same total FLOPs and a loop of
// per-expert GEMMs (what grouping replaces); then one expert projection's forward + backward as
// the sparse block runs it, grouped_linear in bf16 against fp8_grouped_linear under TE (delayed)
// and AO (dynamic) scaling, at moe-small's shapes. Plain main: `bench_moe_gemm [--iters N]`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "ops/fp8.h"
#include "runtime/autograd.h"
#include "runtime/tensor.h"
#include "tests/bench/gpu_timing.h"
#ifdef ACCEL_WITH_CUDA
#include "runtime/cuda/context.h"
#endif

using namespace accel;

#ifdef ACCEL_WITH_CUDA
namespace {

using bench::g_iters;
using bench::randn;
using bench::time_ms;

double tflops(double ms, double flops) { return flops / (ms * 1e-3) / 1e12; }

// Rows per expert for `rows` routed rows: equal, or skewed (expert e drawn with weight 1/(e+1)^0.7,
// shuffled), which leaves some experts nearly empty as real routers early in training do.
std::vector<int64_t> group_sizes(int64_t experts, int64_t rows, bool skewed) {
  std::vector<int64_t> sizes(experts, rows / experts);
  for (int64_t e = 0; e < rows % experts; ++e) ++sizes[e];
  if (!skewed) return sizes;
  std::mt19937_64 rng(42);
  std::vector<double> w(experts);
  for (int64_t e = 0; e < experts; ++e) w[e] = 1.0 / std::pow(double(e + 1), 0.7);
  std::shuffle(w.begin(), w.end(), rng);
  std::discrete_distribution<int64_t> d(w.begin(), w.end());
  std::fill(sizes.begin(), sizes.end(), 0);
  for (int64_t r = 0; r < rows; ++r) ++sizes[d(rng)];
  return sizes;
}

// Row-slices of a [rows, cols] tensor, one per group (views: the layout grouped_linear uses).
std::vector<Tensor> slices(const Tensor& x, const std::vector<int64_t>& sizes) {
  std::vector<Tensor> out;
  const int64_t cols = x.shape()[1];
  int64_t r0 = 0;
  for (int64_t s : sizes) {
    out.push_back(x.as_strided({s, cols}, {cols, 1}, x.offset() + r0 * cols));
    r0 += s;
  }
  return out;
}

// One layer's expert operands in bf16: rows x [rows, k_in] with their output gradient g
// [rows, n_out], a weight [n_out, k_in] per expert, and the rows per expert.
struct Experts {
  std::vector<int64_t> sizes;
  Tensor x, g;
  std::vector<Tensor> w;
};
Experts experts_of(int64_t experts, int64_t rows, int64_t n_out, int64_t k_in, bool skewed) {
  const DType t = DType::BF16;
  Experts e{group_sizes(experts, rows, skewed),
            randn({rows, k_in}, t),
            randn({rows, n_out}, t, 1e-2),
            {}};
  for (int64_t i = 0; i < experts; ++i) e.w.push_back(randn({n_out, k_in}, t, 0.02));
  return e;
}

// One layer's GEMMs for weights [n_out, k_in] per expert over `rows` routed rows.
void moe_rows(const char* what, int64_t experts, int64_t rows, int64_t n_out, int64_t k_in,
              bool skewed) {
  const DType t = DType::BF16;
  const Device gpu = Device::cuda(0);
  const Experts ex = experts_of(experts, rows, n_out, k_in, skewed);
  const std::vector<int64_t>& sizes = ex.sizes;
  const Tensor &x = ex.x, &g = ex.g;
  const std::vector<Tensor>& w = ex.w;
  Tensor y = Tensor::empty({rows, n_out}, t, gpu), dx = Tensor::empty({rows, k_in}, t, gpu);
  std::vector<Tensor> dw;
  for (int64_t e = 0; e < experts; ++e) dw.push_back(Tensor::empty({n_out, k_in}, t, gpu));
  const std::vector<Tensor> xs = slices(x, sizes), gs = slices(g, sizes), ys = slices(y, sizes),
                            dxs = slices(dx, sizes);
  Backend& be = cuda_backend();
  const double flops = 2.0 * double(rows) * double(n_out) * double(k_in);
  const double fprop = time_ms([&] { be.grouped_matmul(ys, xs, w, false, true); });
  const double dgrad = time_ms([&] { be.grouped_matmul(dxs, gs, w, false, false); });
  const double wgrad = time_ms([&] { be.grouped_matmul(dw, gs, xs, true, false); });
  // The same FLOPs as one dense GEMM (fprop shape) and as a loop of per-expert GEMMs.
  Tensor x3 = x.as_strided({1, rows, k_in}, {rows * k_in, k_in, 1}, x.offset());
  Tensor w3 = w[0].as_strided({1, n_out, k_in}, {n_out * k_in, k_in, 1}, w[0].offset());
  Tensor y3 = y.as_strided({1, rows, n_out}, {rows * n_out, n_out, 1}, y.offset());
  const double dense = time_ms([&] { be.matmul(y3, x3, w3, false, true, 1.0, 0.0, Tensor()); });
  const double loop = time_ms([&] {
    for (int64_t e = 0; e < experts; ++e) {
      if (sizes[e] == 0) continue;
      be.matmul(
          ys[e].as_strided({1, sizes[e], n_out}, {sizes[e] * n_out, n_out, 1}, ys[e].offset()),
          xs[e].as_strided({1, sizes[e], k_in}, {sizes[e] * k_in, k_in, 1}, xs[e].offset()),
          w[e].as_strided({1, n_out, k_in}, {n_out * k_in, k_in, 1}, w[e].offset()), false, true,
          1.0, 0.0, Tensor());
    }
  });
  const auto [mn, mx] = std::minmax_element(sizes.begin(), sizes.end());
  std::printf(
      "%-34s E=%3lld rows=%6lld (%s, %lld..%lld per expert) N=%5lld K=%5lld bf16 | fprop %6.1f | "
      "dgrad %6.1f | wgrad %6.1f | dense same FLOPs %6.1f | loop of %lld GEMMs (fprop) %6.1f "
      "TFLOP/s\n",
      what, (long long)experts, (long long)rows, skewed ? "skewed" : "balanced", (long long)*mn,
      (long long)*mx, (long long)n_out, (long long)k_in, tflops(fprop, flops), tflops(dgrad, flops),
      tflops(wgrad, flops), tflops(dense, flops), (long long)experts, tflops(loop, flops));
}

// One expert projection (weights [n_out, k_in] per expert) forward + backward through autograd,
// fresh leaves each call: grouped_linear (bf16) against fp8_grouped_linear with one context per
// expert, TE (delayed scaling, scales from the state) and AO (dynamic). TFLOP/s over the three
// GEMMs' FLOPs; the fp8 times include the casts (one grouped cast per operand).
void fp8_experts_row(const char* what, int64_t experts, int64_t rows, int64_t n_out, int64_t k_in,
                     bool skewed) {
  const Device gpu = Device::cuda(0);
  const Experts ex = experts_of(experts, rows, n_out, k_in, skewed);
  const std::vector<int64_t>& sizes = ex.sizes;
  const Tensor &x = ex.x, &g = ex.g;
  const std::vector<Tensor>& w = ex.w;
  std::vector<Fp8LinearContext> te(experts), ao(experts);
  Fp8Recipe te_recipe, ao_recipe;
  ao_recipe.scaling = Fp8Scaling::Dynamic;
  auto state = std::make_shared<Fp8DelayedScaling>(te_recipe, gpu);
  std::vector<const Fp8LinearContext*> te_ptrs, ao_ptrs;
  for (int64_t e = 0; e < experts; ++e) {
    te[e].recipe = te_recipe;
    te[e].delayed = state;
    te[e].slot_input = state->add_slot(DType::E4M3);
    te[e].slot_weight = state->add_slot(DType::E4M3);
    te[e].slot_grad_output = state->add_slot(DType::E5M2);
    ao[e].recipe = ao_recipe;
    te_ptrs.push_back(&te[e]);
    ao_ptrs.push_back(&ao[e]);
  }
  auto step = [&](const std::function<Tensor(const Tensor&, const std::vector<Tensor>&)>& f) {
    return time_ms([&] {
      Tensor xl = x.detach();
      xl.set_requires_grad(true);
      std::vector<Tensor> wl;
      for (const Tensor& we : w) {
        wl.push_back(we.detach());
        wl.back().set_requires_grad(true);
      }
      f(xl, wl).backward(g);
    });
  };
  const double bf16 = step(
      [&](const Tensor& a, const std::vector<Tensor>& b) { return grouped_linear(a, b, sizes); });
  const double fp8_te = step([&](const Tensor& a, const std::vector<Tensor>& b) {
    return fp8_grouped_linear(a, b, sizes, te_ptrs);
  });
  const double fp8_ao = step([&](const Tensor& a, const std::vector<Tensor>& b) {
    return fp8_grouped_linear(a, b, sizes, ao_ptrs);
  });
  const double flops = 3 * 2.0 * double(rows) * double(n_out) * double(k_in);
  std::printf(
      "%-34s E=%3lld rows=%6lld (%s) N=%5lld K=%5lld fwd+bwd | bf16 %7.3f ms %6.1f | fp8 TE "
      "%7.3f ms %6.1f | fp8 AO %7.3f ms %6.1f TFLOP/s | TE/bf16 %.2fx\n",
      what, (long long)experts, (long long)rows, skewed ? "skewed" : "balanced", (long long)n_out,
      (long long)k_in, bf16, tflops(bf16, flops), fp8_te, tflops(fp8_te, flops), fp8_ao,
      tflops(fp8_ao, flops), bf16 / fp8_te);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
  if (!cuda::available()) {
    std::printf("bench_moe_gemm: no CUDA device\n");
    return 0;
  }
  const cudaDeviceProp& prop = cuda::device_properties(0);
  std::printf("device: %s (sm_%d%d), %d SMs; %d iterations each\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, g_iters);
  for (bool skewed : {false, true}) {
    // DeepSeek-MoE-16B-like: 16 experts x ~1k rows, hidden 2048, expert FFN 1408.
    moe_rows("16 experts, up (2048 -> 1408)", 16, 16 * 1024, 1408, 2048, skewed);
    moe_rows("16 experts, down (1408 -> 2048)", 16, 16 * 1024, 2048, 1408, skewed);
    // Qwen3-30B-A3B-like: 128 experts, top-8 over 8192 tokens, hidden 2048, expert FFN 768.
    moe_rows("128 experts top-8, up (2048 -> 768)", 128, 8 * 8192, 768, 2048, skewed);
    moe_rows("128 experts top-8, down (768 -> 2048)", 128, 8 * 8192, 2048, 768, skewed);
  }
  std::printf("\n-- one expert projection, forward + backward: bf16 against fp8 --\n");
  for (bool skewed : {false, true}) {
    // configs/moe-small.yaml: 16 experts of 1024, top-2 over 8192 tokens, hidden 1536.
    fp8_experts_row("moe-small gate/up (1536 -> 1024)", 16, 2 * 8192, 1024, 1536, skewed);
    fp8_experts_row("moe-small down (1024 -> 1536)", 16, 2 * 8192, 1536, 1024, skewed);
  }
  return 0;
}
#else
int main() {
  std::printf("bench_moe_gemm: built without CUDA\n");
  return 0;
}
#endif
