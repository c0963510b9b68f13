// fp8 benchmark: cuBLASLt fp8 GEMM TFLOP/s through our wrapper (fprop with fast accumulation,
// dgrad/wgrad precise) against bf16 at 8192-sized and Llama-3.2-1B shapes (goal >= 1000 TFLOP/s
// on an H200), and the fused cast(+amax+transpose) kernels' bandwidth against a plain copy (goal
// >= 80%), also grouped over a mixture of experts' operands. Plain main: `bench_fp8_gemm [--iters
// N]`.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "ops/fp8.h"
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

double tflops(double ms, int64_t M, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(M) * N * K / (ms * 1e-3) / 1e12;
}

void gemm_row(const char* what, int64_t M, int64_t N, int64_t K) {
  const Device gpu = Device::cuda(0);
  Fp8Tensor a = fp8_cast_dynamic(randn({M, K}, DType::BF16), DType::E4M3);
  Fp8Tensor b = fp8_cast_dynamic(randn({N, K}, DType::BF16, 0.02), DType::E4M3);
  Fp8Tensor g = fp8_cast_dynamic(randn({M, K}, DType::BF16, 1e-3), DType::E5M2);
  Tensor out = Tensor::empty({M, N}, DType::BF16, gpu);
  Tensor out32 = Tensor::empty({M, N}, DType::F32, gpu);
  const double fast =
      time_ms([&] { fp8_gemm(out, a.data, a.scale_inv, b.data, b.scale_inv, true); });
  const double precise =
      time_ms([&] { fp8_gemm(out, a.data, a.scale_inv, b.data, b.scale_inv, false); });
  const double e5m2 =
      time_ms([&] { fp8_gemm(out, g.data, g.scale_inv, b.data, b.scale_inv, false); });
  const double wgrad =
      time_ms([&] { fp8_gemm(out32, g.data, g.scale_inv, b.data, b.scale_inv, false); });
  Tensor xa = randn({1, M, K}, DType::BF16), xb = randn({1, N, K}, DType::BF16);
  Tensor o16 = Tensor::empty({1, M, N}, DType::BF16, gpu);
  const double bf16 =
      time_ms([&] { cuda_backend().matmul(o16, xa, xb, false, true, 1.0, 0.0, Tensor()); });
  std::printf(
      "%-26s M=%5lld N=%6lld K=%5lld | fp8 fast %7.1f | fp8 precise %7.1f | e5m2xe4m3 %7.1f | "
      "-> f32 %7.1f | bf16 %7.1f TFLOP/s | fp8/bf16 %.2fx\n",
      what, (long long)M, (long long)N, (long long)K, tflops(fast, M, N, K),
      tflops(precise, M, N, K), tflops(e5m2, M, N, K), tflops(wgrad, M, N, K),
      tflops(bf16, M, N, K), bf16 / fast);
}

void cast_row(const char* what, int64_t R, int64_t C, bool rowwise, bool columnwise,
              DType fmt = DType::E4M3, double std = 1.0) {
  const Device gpu = Device::cuda(0);
  Tensor x = randn({R, C}, DType::BF16, std);
  Tensor y = Tensor::empty({R, C}, DType::BF16, gpu);
  const double copy_ms = time_ms([&] { y.copy_(x); });
  const double copy_bw = 2.0 * x.nbytes() / (copy_ms * 1e-3);
  Tensor scale = Tensor::ones({1}, DType::F32, gpu), amax = Tensor::zeros({1}, DType::F32, gpu);
  Fp8CastOptions o{rowwise, columnwise, 16};
  const double ms = time_ms([&] { fp8_cast(x, fmt, scale, amax, o); });
  const double bytes = x.nbytes() + (rowwise ? x.numel() : 0) + (columnwise ? x.numel() : 0);
  const double bw = bytes / (ms * 1e-3);
  const double dyn_ms = time_ms([&] { fp8_cast_dynamic(x, fmt, o); });
  const double dyn_bytes = bytes + x.nbytes();  // the amax pass reads x once more
  std::printf(
      "%-38s %s [%lld, %lld] %8.3f ms %7.1f GB/s = %5.1f%% of copy (%7.1f GB/s) | dynamic %8.3f "
      "ms %5.1f%% of copy\n",
      what, dtype_name(fmt), (long long)R, (long long)C, ms, bw / 1e9, 100.0 * bw / copy_bw,
      copy_bw / 1e9, dyn_ms, 100.0 * dyn_bytes / (dyn_ms * 1e-3) / copy_bw);
}

// The grouped cast of a mixture of experts' rows (fp8_cast_grouped: every group with its own
// scale and amax, one launch; dynamic: one grouped amax launch first) against the same groups
// cast one by one, each as a fraction of the copy bandwidth.
void grouped_cast_row(const char* what, const std::vector<int64_t>& sizes, int64_t C) {
  const Device gpu = Device::cuda(0);
  int64_t R = 0;
  for (int64_t n : sizes) R += n;
  Tensor x = randn({R, C}, DType::BF16);
  Tensor y = Tensor::empty({R, C}, DType::BF16, gpu);
  const double copy_bw = 2.0 * x.nbytes() / (time_ms([&] { y.copy_(x); }) * 1e-3);
  std::vector<Tensor> rows;
  Fp8GroupScales delayed, dynamic;
  int64_t begin = 0;
  for (int64_t n : sizes) {
    rows.push_back(narrow(x, 0, begin, n));
    begin += n;
    delayed.scales.push_back(Tensor::ones({1}, DType::F32, gpu));
    delayed.amaxes.push_back(Tensor::zeros({1}, DType::F32, gpu));
  }
  const Fp8CastOptions o{true, true, 16};
  const double grouped = time_ms([&] { fp8_cast_grouped(rows, DType::E4M3, delayed, o); });
  const double one_by_one = time_ms([&] {
    for (size_t g = 0; g < rows.size(); ++g)
      fp8_cast(rows[g], DType::E4M3, delayed.scales[g], delayed.amaxes[g], o);
  });
  const double grouped_dyn = time_ms([&] { fp8_cast_grouped(rows, DType::E4M3, dynamic, o); });
  const double dyn_one_by_one = time_ms([&] {
    for (const Tensor& r : rows) fp8_cast_dynamic(r, DType::E4M3, o);
  });
  const double bytes = x.nbytes() + 2.0 * x.numel();
  auto pct = [&](double ms, double b) { return 100.0 * b / (ms * 1e-3) / copy_bw; };
  std::printf(
      "%-38s %zu groups [%lld, %lld] + transpose | grouped %7.3f ms %5.1f%% of copy | one by one "
      "%7.3f ms | dynamic: grouped %7.3f ms %5.1f%% | one by one %7.3f ms\n",
      what, sizes.size(), (long long)R, (long long)C, grouped, pct(grouped, bytes), one_by_one,
      grouped_dyn, pct(grouped_dyn, bytes + x.nbytes()), dyn_one_by_one);
}

// The fused swiglu casts of the fp8 MLP (fp8_swiglu_mlp) at a llama-1b shape against the unfused
// sequence they replace, and their bytes over the copy bandwidth.
void swiglu_cast_rows(int64_t R, int64_t C) {
  const Device gpu = Device::cuda(0);
  Tensor gate = randn({R, C}, DType::BF16), up = randn({R, C}, DType::BF16);
  Tensor grad = randn({R, C}, DType::BF16, 1e-3), y = Tensor::empty({R, C}, DType::BF16, gpu);
  const double copy_ms = time_ms([&] { y.copy_(gate); });
  const double copy_bw = 2.0 * gate.nbytes() / (copy_ms * 1e-3);
  Tensor scale = Tensor::ones({1}, DType::F32, gpu), amax = Tensor::zeros({1}, DType::F32, gpu);
  const Fp8CastOptions both{true, true, 16};
  auto target = [&](DType fmt, Fp8Tensor& q) {
    q.data = Tensor::empty({R, C}, fmt, gpu);
    q.data_t = Tensor::empty({C, R}, fmt, gpu);
    q.scale_inv = Tensor::empty({1}, DType::F32, gpu);
    return Fp8CastTarget{scale, q.data, q.data_t, amax, q.scale_inv};
  };
  Fp8Tensor h, dg, du;
  const Fp8CastTarget th = target(DType::E4M3, h), tg = target(DType::E5M2, dg),
                      tu = target(DType::E5M2, du);
  const double fwd = time_ms([&] { cuda_backend().fp8_swiglu_cast(gate, up, th); });
  const double fwd_unfused = time_ms([&] {
    Tensor hb = Tensor::empty({R, C}, DType::BF16, gpu);
    cuda_backend().swiglu(hb, gate, up);
    fp8_cast(hb, DType::E4M3, scale, amax, both);
  });
  const double bwd =
      time_ms([&] { cuda_backend().fp8_swiglu_backward_cast(grad, gate, up, tg, tu); });
  const double bwd_unfused = time_ms([&] {
    Tensor a = Tensor::empty({R, C}, DType::BF16, gpu), b = Tensor::empty({R, C}, DType::BF16, gpu);
    cuda_backend().swiglu_backward(a, b, grad, gate, up);
    fp8_cast(a, DType::E5M2, scale, amax, both);
    fp8_cast(b, DType::E5M2, scale, amax, both);
  });
  const double n = static_cast<double>(R * C);
  const double fwd_bytes = 2 * 2 * n + 2 * n;      // read gate, up; write data, data_t
  const double bwd_bytes = 3 * 2 * n + 2 * 2 * n;  // read grad, gate, up; write 2 x (data, data_t)
  std::printf(
      "swiglu -> e4m3 + transpose (fused)     [%lld, %lld] %8.3f ms = %5.1f%% of copy | unfused "
      "(swiglu, cast) %8.3f ms\n",
      (long long)R, (long long)C, fwd, 100.0 * fwd_bytes / (fwd * 1e-3) / copy_bw, fwd_unfused);
  std::printf(
      "swiglu grads -> 2 x e5m2 + transposes  [%lld, %lld] %8.3f ms = %5.1f%% of copy | unfused "
      "(backward, 2 casts) %8.3f ms\n",
      (long long)R, (long long)C, bwd, 100.0 * bwd_bytes / (bwd * 1e-3) / copy_bw, bwd_unfused);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
  if (!cuda::available()) {
    std::printf("bench_fp8_gemm: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  const cudaDeviceProp& prop = cuda::device_properties(0);
  std::printf("device: %s (sm_%d%d), %d SMs; %d iterations each\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, g_iters);
  std::printf("\n-- GEMMs: out [M, N] = a [M, K] . b [N, K]^T (TN) --\n");
  gemm_row("square 8192", 8192, 8192, 8192);
  gemm_row("square 4096", 4096, 4096, 4096);
  gemm_row("llama-1b qkv (8192 tok)", 8192, 3072, 2048);
  gemm_row("llama-1b mlp up (8192 tok)", 8192, 8192, 2048);
  gemm_row("llama-1b mlp down (8192 tok)", 8192, 2048, 8192);
  gemm_row("llama-1b wgrad up (K=tok)", 8192, 2048, 8192);
  // One expert of moe-small (1024 of its 16384 routed rows): fp8 experts run one such GEMM each.
  gemm_row("moe-small expert gate/up", 1024, 1024, 1536);
  gemm_row("moe-small expert down", 1024, 1536, 1024);
  gemm_row("moe-small expert wgrad (K=rows)", 1024, 1536, 1024);
  std::printf(
      "\n-- casts bf16 -> fp8 with amax (delayed: given scale; dynamic: amax pass first) --\n");
  cast_row("cast rowwise", 8192, 8192, true, false);
  cast_row("cast + transpose", 8192, 8192, true, true);
  cast_row("transpose only", 8192, 8192, false, true);
  cast_row("cast + transpose (llama-1b act)", 8192, 2048, true, true);
  cast_row("cast + transpose (llama-1b mlp act)", 8192, 8192, true, true);
  cast_row("grad cast + transpose (llama-1b)", 8192, 2048, true, true, DType::E5M2, 1e-3);
  cast_row("grad cast + transpose (llama-1b mlp)", 8192, 8192, true, true, DType::E5M2, 1e-3);
  std::printf("\n-- the fp8 MLP's fused swiglu casts (llama-1b: 8192 tokens x 8192) --\n");
  swiglu_cast_rows(8192, 8192);
  std::printf("\n-- grouped casts of a mixture of experts' operands (moe-small: 16 experts) --\n");
  std::vector<int64_t> ragged;  // 16 experts around 1024 rows of 16384, as a router spreads them
  for (int64_t e = 0; e < 16; ++e) ragged.push_back(1024 + (e % 2 ? 1 : -1) * (37 * e % 200));
  grouped_cast_row("experts' rows (gate/up input)", ragged, 1536);
  grouped_cast_row("experts' rows (down input)", ragged, 1024);
  grouped_cast_row("experts' weights (gate/up)", std::vector<int64_t>(16, 1024), 1536);
  return 0;
}
#else
int main() {
  std::printf("bench_fp8_gemm: built without CUDA, nothing to measure\n");
  return 0;
}
#endif
