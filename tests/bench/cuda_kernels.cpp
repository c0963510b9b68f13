// CUDA kernel benchmark: each fused kernel's time against its memory floor (bytes moved over the
// copy bandwidth, 4.3 TB/s on an H200 unless --bw says otherwise), GEMM and attention TFLOP/s.
// Shapes are Llama-3.2-1B's at 8192 tokens per step (hidden 2048, MLP 8192, 32 q / 8 kv heads of
// 64, vocab 128256), plus llama-125m's rms_norm and rope (16384 tokens, hidden 768, 12 heads of
// 64). Plain main: `bench_cuda_kernels [--bw TBps] [--iters N]`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ops/backend.h"
#include "runtime/tensor.h"
#include "tests/bench/gpu_timing.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"
#endif

using namespace accel;

#ifdef ACCEL_WITH_CUDA
namespace {

using bench::g_iters;
using bench::randn;
using bench::time_ms;
double g_bw = 4.3e12;  // bytes per second

void row_mem(const char* name, double ms, double bytes) {
  const double floor_ms = bytes / g_bw * 1e3;
  std::printf("%-34s %9.3f ms %9.1f GB/s   floor %8.3f ms   %5.1f%% of floor speed\n", name, ms,
              bytes / (ms * 1e-3) / 1e9, floor_ms, 100.0 * floor_ms / ms);
}

void row_flops(const char* name, double ms, double flops) {
  std::printf("%-34s %9.3f ms %9.1f TFLOP/s\n", name, ms, flops / (ms * 1e-3) / 1e12);
}

// Projections that read one input (q/k/v, gate/up): the three GEMMs of a training step for each
// as it runs now (forward; input gradient folded into the next GEMM's addend; weight gradient)
// against one GEMM per pass over the weights packed along their output dim.
void project_rows(const char* name, int64_t n, int64_t in, const std::vector<int64_t>& outs) {
  Backend& be = cuda_backend();
  const DType bf = DType::BF16;
  int64_t total = 0;
  for (int64_t o : outs) total += o;
  const Tensor x = randn({1, n, in}, bf, 0.02), wp = randn({1, total, in}, bf, 0.02),
               dyp = randn({1, n, total}, bf, 0.02);
  std::vector<Tensor> ws, dys, ys, dws;
  for (int64_t o : outs) {
    ws.push_back(randn({1, o, in}, bf, 0.02));
    dys.push_back(randn({1, n, o}, bf, 0.02));
    ys.push_back(Tensor::empty({1, n, o}, bf, Device::cuda(0)));
    dws.push_back(Tensor::empty({1, o, in}, bf, Device::cuda(0)));
  }
  const Tensor yp = Tensor::empty({1, n, total}, bf, Device::cuda(0)),
               dwp = Tensor::empty({1, total, in}, bf, Device::cuda(0));
  const Tensor dx0 = Tensor::empty({1, n, in}, bf, Device::cuda(0)),
               dx1 = Tensor::empty({1, n, in}, bf, Device::cuda(0));
  const double flops = 2.0 * n * in * total;
  auto sep_fwd = [&] {
    for (size_t i = 0; i < outs.size(); ++i)
      be.matmul(ys[i], x, ws[i], false, true, 1.0, 0.0, Tensor());
  };
  auto sep_dgrad = [&] {  // the fold: each GEMM adds the sum so far as its addend
    for (size_t i = 0; i < outs.size(); ++i) {
      const Tensor& out = i % 2 ? dx1 : dx0;
      const Tensor add = i == 0 ? Tensor() : (i % 2 ? dx0 : dx1);
      be.matmul(out, dys[i], ws[i], false, false, 1.0, i == 0 ? 0.0 : 1.0, add);
    }
  };
  auto sep_wgrad = [&] {
    for (size_t i = 0; i < outs.size(); ++i)
      be.matmul(dws[i], dys[i], x, true, false, 1.0, 0.0, Tensor());
  };
  const double sf = time_ms(sep_fwd), sd = time_ms(sep_dgrad), sw = time_ms(sep_wgrad);
  const double pf = time_ms([&] { be.matmul(yp, x, wp, false, true, 1.0, 0.0, Tensor()); });
  const double pd = time_ms([&] { be.matmul(dx0, dyp, wp, false, false, 1.0, 0.0, Tensor()); });
  const double pw = time_ms([&] { be.matmul(dwp, dyp, x, true, false, 1.0, 0.0, Tensor()); });
  std::printf(
      "%-20s separate fwd %7.1f dgrad %7.1f wgrad %7.1f = %7.1f us | packed %7.1f %7.1f "
      "%7.1f = %7.1f us (%.0f / %.0f TFLOP/s)\n",
      name, sf * 1e3, sd * 1e3, sw * 1e3, (sf + sd + sw) * 1e3, pf * 1e3, pd * 1e3, pw * 1e3,
      (pf + pd + pw) * 1e3, 3 * flops / ((sf + sd + sw) * 1e9), 3 * flops / ((pf + pd + pw) * 1e9));
}

}  // namespace

int main(int argc, char** argv) {
  bool attn_only = false;    // --attention-only: just the tensor-core attention rows
  bool projections = false;  // --projections: just the separate-against-packed projection rows
  bool ce_only = false;      // --cross-entropy: just the cross-entropy rows
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--attention-only")) attn_only = true;
    if (!std::strcmp(argv[i], "--projections")) projections = true;
    if (!std::strcmp(argv[i], "--cross-entropy")) ce_only = true;
  }
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--bw")) g_bw = std::atof(argv[i + 1]) * 1e12;
    if (!std::strcmp(argv[i], "--iters")) g_iters = std::atoi(argv[i + 1]);
  }
  if (!cuda::available()) {
    std::printf("bench_cuda_kernels: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  Backend& be = cuda_backend();
  const cudaDeviceProp& prop = cuda::device_properties(0);
  std::printf("device: %s, %d SMs; floor bandwidth %.2f TB/s; %d iterations per kernel\n",
              prop.name, prop.multiProcessorCount, g_bw / 1e12, g_iters);
  const int64_t B = 4, S = 2048, N = B * S, H = 2048, I = 8192, HQ = 32, HKV = 8, D = 64;
  const int64_t V = 128256, VCHUNK = 1024;  // cross-entropy rows per chunk
  const DType bf = DType::BF16;
  if (projections) {
    project_rows("llama-1b q/k/v", N, H, {H, HKV * D, HKV * D});
    project_rows("llama-1b gate/up", N, H, {I, I});
    project_rows("llama-125m q/k/v", 16 * 1024, 768, {768, 768, 768});
    project_rows("llama-125m gate/up", 16 * 1024, 768, {2048, 2048});
    return 0;
  }
  if (!attn_only && !ce_only) {
    std::printf("\n-- memory-bound kernels (bf16 activations, N=%lld tokens) --\n", (long long)N);
    Tensor a = randn({N, I}, bf), b = Tensor::empty({N, I}, bf, Device::cuda(0));
    double ms = time_ms([&] { b.copy_(a); });
    row_mem("copy d2d (cudaMemcpyAsync)", ms, 2.0 * a.nbytes());
    Tensor c = Tensor::empty({N, I}, bf, Device::cuda(0));
    ms = time_ms([&] { be.binary(BinaryOp::Add, c, a, b); });
    row_mem("add bf16", ms, 3.0 * a.nbytes());
    Tensor f = randn({N, I}, DType::F32);
    ms = time_ms([&] { c.copy_(f); });
    row_mem("cast f32->bf16", ms, f.nbytes() + c.nbytes());
    Tensor up = randn({N, I}, bf), dout = randn({N, I}, bf),
           gg = Tensor::empty({N, I}, bf, Device::cuda(0));
    ms = time_ms([&] { be.swiglu(c, a, up); });
    row_mem("swiglu fwd", ms, 3.0 * a.nbytes());
    ms = time_ms([&] { be.swiglu_backward(gg, b, dout, a, up); });
    row_mem("swiglu bwd", ms, 5.0 * a.nbytes());
  }
  {
    Tensor x = randn({N, H}, bf), w = randn({H}, bf),
           out = Tensor::empty({N, H}, bf, Device::cuda(0));
    Tensor rstd = Tensor::empty({N}, DType::F32, Device::cuda(0));
    double ms = time_ms([&] { be.rms_norm(out, rstd, x, w, 1e-5); });
    row_mem("rms_norm fwd", ms, 2.0 * x.nbytes() + rstd.nbytes());
    Tensor g = randn({N, H}, bf), gx = Tensor::empty({N, H}, bf, Device::cuda(0));
    Tensor gw = Tensor::empty({H}, bf, Device::cuda(0));
    ms = time_ms([&] { be.rms_norm_backward(gx, gw, g, x, w, rstd, Tensor()); });
    row_mem("rms_norm bwd", ms, 3.0 * x.nbytes() + rstd.nbytes());
    // The residual add fused in: sum = x + r and its norm (reads x, r; writes sum, out); the
    // backward folding the residual stream's gradient into grad_x (reads g, x, pending).
    Tensor res = randn({N, H}, bf), sum = Tensor::empty({N, H}, bf, Device::cuda(0));
    ms = time_ms([&] { be.add_rms_norm(sum, out, rstd, x, res, w, 1e-5); });
    row_mem("add_rms_norm fwd", ms, 4.0 * x.nbytes() + rstd.nbytes());
    ms = time_ms([&] { be.rms_norm_backward(gx, gw, g, x, w, rstd, res); });
    row_mem("rms_norm bwd + grad add", ms, 4.0 * x.nbytes() + rstd.nbytes());
    Tensor ids = Tensor::empty({N}, DType::I64, Device::cuda(0));
    {
      std::vector<int64_t> host(N);
      for (int64_t i = 0; i < N; ++i) host[i] = (i * 7919) % 32000;
      ids = Tensor::from_vector(host, {N}, DType::I64, Device::cuda(0));
    }
    Tensor table = randn({V, H}, bf);
    ms = time_ms([&] { be.embedding(out, table, ids); });
    row_mem("embedding fwd", ms, 2.0 * out.nbytes() + ids.nbytes());
    Tensor gtable = Tensor::zeros({V, H}, bf, Device::cuda(0));
    ms = time_ms([&] { be.embedding_backward(gtable, g, ids); });
    row_mem("embedding bwd (sorted)", ms, 3.0 * g.nbytes() + 4.0 * ids.nbytes());
  }
  const RopeFrequencies f500k = default_rope_frequencies(500000.0, D),
                        f10k = default_rope_frequencies(10000.0, D);
  {
    Tensor q = randn({B, S, HQ, D}, bf), o = Tensor::empty({B, S, HQ, D}, bf, Device::cuda(0));
    double ms = time_ms([&] { be.rope(o, q, f500k, 0, Tensor(), false); });
    row_mem("rope fwd (q)", ms, 2.0 * q.nbytes());
    Tensor k = randn({B, S, HKV, D}, bf), ok = Tensor::empty(k.shape(), bf, Device::cuda(0));
    ms = time_ms([&] { be.rope(ok, k, f500k, 0, Tensor(), false); });
    row_mem("rope fwd (k)", ms, 2.0 * k.nbytes());
  }
  {  // llama-125m at 16384 tokens per step: hidden 768, 12 heads of 64.
    const int64_t n125 = 16384, h125 = 768;
    Tensor x = randn({n125, h125}, bf), w = randn({h125}, bf),
           out = Tensor::empty({n125, h125}, bf, Device::cuda(0));
    Tensor rstd = Tensor::empty({n125}, DType::F32, Device::cuda(0));
    double ms = time_ms([&] { be.rms_norm(out, rstd, x, w, 1e-5); });
    row_mem("rms_norm fwd (125m, d=768)", ms, 2.0 * x.nbytes() + rstd.nbytes());
    Tensor g = randn({n125, h125}, bf), gx = Tensor::empty({n125, h125}, bf, Device::cuda(0));
    Tensor gw = Tensor::empty({h125}, bf, Device::cuda(0));
    ms = time_ms([&] { be.rms_norm_backward(gx, gw, g, x, w, rstd, Tensor()); });
    row_mem("rms_norm bwd (125m, d=768)", ms, 3.0 * x.nbytes() + rstd.nbytes());
    Tensor res = randn({n125, h125}, bf), sum = Tensor::empty({n125, h125}, bf, Device::cuda(0));
    ms = time_ms([&] { be.add_rms_norm(sum, out, rstd, x, res, w, 1e-5); });
    row_mem("add_rms_norm fwd (125m, d=768)", ms, 4.0 * x.nbytes() + rstd.nbytes());
    ms = time_ms([&] { be.rms_norm_backward(gx, gw, g, x, w, rstd, res); });
    row_mem("rms_norm bwd + add (125m, d=768)", ms, 4.0 * x.nbytes() + rstd.nbytes());
    Tensor q = randn({16, 1024, 12, D}, bf), o = Tensor::empty(q.shape(), bf, Device::cuda(0));
    ms = time_ms([&] { be.rope(o, q, f10k, 0, Tensor(), false); });
    row_mem("rope fwd (125m q)", ms, 2.0 * q.nbytes());
    ms = time_ms([&] { be.rope(o, q, f10k, 0, Tensor(), true); });
    row_mem("rope inverse (125m q)", ms, 2.0 * q.nbytes());
  }
  {
    Tensor logits = randn({VCHUNK, V}, bf, 2.0),
           grad = Tensor::empty({VCHUNK, V}, bf, Device::cuda(0));
    std::vector<int64_t> host(VCHUNK);
    for (int64_t i = 0; i < VCHUNK; ++i) host[i] = (i * 104729) % V;
    Tensor tg = Tensor::from_vector(host, {VCHUNK}, DType::I64, Device::cuda(0));
    Tensor loss = Tensor::empty({VCHUNK}, DType::F32, Device::cuda(0));
    Tensor lse = Tensor::empty({VCHUNK}, DType::F32, Device::cuda(0));
    Tensor scale = Tensor::full({1}, 1.0 / N, DType::F32, Device::cuda(0));
    double ms = time_ms([&] { be.cross_entropy(loss, lse, logits, tg, -100); });
    row_mem("cross_entropy fwd (1024 rows)", ms, 1.0 * logits.nbytes());
    ms = time_ms([&] { be.cross_entropy_backward(grad, logits, lse, tg, -100, scale); });
    row_mem("cross_entropy bwd (1024 rows)", ms, 2.0 * logits.nbytes());
    // In place, as linear_cross_entropy runs it (the values drift to gradients: the same work).
    Tensor work = logits.clone();
    ms = time_ms([&] { be.cross_entropy_with_grad(loss, lse, work, work, tg, -100, scale); });
    row_mem("cross_entropy fwd + grad, one kernel, in place (1024 rows)", ms,
            2.0 * logits.nbytes());
    // llama-125m's chunk: 4,096 rows of a 32,000 vocabulary.
    Tensor l125 = randn({4096, 32000}, bf, 2.0),
           g125 = Tensor::empty(l125.shape(), bf, l125.device());
    std::vector<int64_t> h125(4096);
    for (int64_t i = 0; i < 4096; ++i) h125[i] = (i * 104729) % 32000;
    Tensor t125 = Tensor::from_vector(h125, {4096}, DType::I64, Device::cuda(0));
    Tensor loss125 = Tensor::empty({4096}, DType::F32, Device::cuda(0));
    Tensor lse125 = Tensor::empty({4096}, DType::F32, Device::cuda(0));
    ms = time_ms([&] {
      be.cross_entropy(loss125, lse125, l125, t125, -100);
      be.cross_entropy_backward(g125, l125, lse125, t125, -100, scale);
    });
    row_mem("cross_entropy fwd, then bwd (125m: 4096 x 32000)", ms, 3.0 * l125.nbytes());
    ms = time_ms(
        [&] { be.cross_entropy_with_grad(loss125, lse125, g125, g125, t125, -100, scale); });
    row_mem("cross_entropy fwd + grad, one kernel, in place (125m)", ms, 2.0 * l125.nbytes());
    ms = time_ms([&] { be.softmax(grad, logits, true); });
    row_mem("log_softmax (1024 rows)", ms, 2.0 * logits.nbytes());
  }
  if (ce_only) return 0;
  {
    const int64_t P = 64 << 20;  // 64M parameters
    Tensor p = randn({P}, DType::F32, 0.02), m = randn({P}, DType::F32, 0.01);
    Tensor v = Tensor::zeros({P}, DType::F32, Device::cuda(0)), g = randn({P}, bf, 0.01);
    AdamWParams hp{1e-4, 0.9, 0.95, 1e-8, 0.1, 1};
    double ms = time_ms([&] { be.adamw_step(p, g, m, v, hp, 1.0); });
    row_mem("adamw (f32 master, bf16 grad)", ms, P * (4.0 * 6 + 2.0));
    std::vector<Tensor> xs{g};
    ms = time_ms([&] { (void)be.sum_of_squares(xs); });
    row_mem("sum_of_squares (bf16, incl. sync)", ms, g.nbytes());
  }
  if (!attn_only) {
    std::printf("\n-- GEMMs (cuBLASLt, bf16 in, fp32 accumulate) --\n");
    struct G {
      const char* name;
      int64_t m, n, k;
      bool ta, tb;
    } gemms[] = {{"qkv proj  [8192x2048]x[3072x2048]^T", N, 3072, H, false, true},
                 {"mlp up    [8192x2048]x[16384x2048]^T", N, 2 * I, H, false, true},
                 {"mlp down  [8192x8192]x[2048x8192]^T", N, H, I, false, true},
                 {"lm head   [8192x2048]x[128256x2048]^T", N, V, H, false, true},
                 {"dW down   [8192x2048]^T x [8192x8192]", H, I, N, true, false}};
    for (const G& gm : gemms) {
      Tensor a = randn(gm.ta ? Shape{1, gm.k, gm.m} : Shape{1, gm.m, gm.k}, bf, 0.02);
      Tensor b = randn(gm.tb ? Shape{1, gm.n, gm.k} : Shape{1, gm.k, gm.n}, bf, 0.02);
      Tensor c = Tensor::empty({1, gm.m, gm.n}, bf, Device::cuda(0));
      double ms = time_ms([&] { be.matmul(c, a, b, gm.ta, gm.tb, 1.0, 0.0, Tensor()); });
      row_flops(gm.name, ms, 2.0 * gm.m * gm.n * gm.k);
    }
  }
  std::printf("\n-- causal attention (B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld, bf16) --\n",
              (long long)B, (long long)S, (long long)HQ, (long long)HKV, (long long)D);
  {
    Tensor q = randn({B, S, HQ, D}, bf), k = randn({B, S, HKV, D}, bf),
           v = randn({B, S, HKV, D}, bf);
    Tensor o = Tensor::empty({B, S, HQ, D}, bf, Device::cuda(0));
    Tensor lse = Tensor::empty({B, HQ, S}, DType::F32, Device::cuda(0));
    const double fwd_flops = 4.0 * B * HQ * S * S * D / 2;  // causal: half the score matrix
    // cuDNN's fused kernels (what "auto" runs for these problems), then ours.
    cuda::set_attention_impl("cudnn");
    double ms = time_ms([&] { be.attention(o, lse, q, k, v, AttentionMask{}, 0.125); });
    row_flops("attention fwd (cuDNN)", ms, fwd_flops);
    Tensor dq = Tensor::empty(q.shape(), bf, Device::cuda(0)),
           dk = Tensor::empty(k.shape(), bf, Device::cuda(0));
    Tensor dv = Tensor::empty(v.shape(), bf, Device::cuda(0)), dout = randn(q.shape(), bf);
    ms = time_ms(
        [&] { be.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, AttentionMask{}, 0.125); });
    row_flops("attention bwd (cuDNN)", ms, 2.5 * fwd_flops);
    cuda::set_attention_impl("flash");
    ms = time_ms([&] { be.attention(o, lse, q, k, v, AttentionMask{}, 0.125); });
    row_flops("attention fwd", ms, fwd_flops);
    // Both tensor-core backward paths (ACCEL_ATTN_BWD is read per call), then the caller's setting.
    const char* bwd_env = std::getenv("ACCEL_ATTN_BWD");
    const std::string bwd_saved = bwd_env ? bwd_env : "";
    for (const char* impl : {"fa2", "split"}) {
      setenv("ACCEL_ATTN_BWD", impl, 1);
      ms = time_ms([&] {
        be.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, AttentionMask{}, 0.125);
      });
      row_flops((std::string("attention bwd (") + impl + ")").c_str(), ms, 2.5 * fwd_flops);
    }
    // fa2 with one q head per block (fp32 dK/dV partial sums) instead of the whole group.
    const char* heads_env = std::getenv("ACCEL_ATTN_FA2_HEADS");
    const std::string heads_saved = heads_env ? heads_env : "";
    setenv("ACCEL_ATTN_BWD", "fa2", 1);
    setenv("ACCEL_ATTN_FA2_HEADS", "1", 1);
    ms = time_ms(
        [&] { be.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, AttentionMask{}, 0.125); });
    row_flops("attention bwd (fa2, 1 head/block)", ms, 2.5 * fwd_flops);
    if (heads_env)
      setenv("ACCEL_ATTN_FA2_HEADS", heads_saved.c_str(), 1);
    else
      unsetenv("ACCEL_ATTN_FA2_HEADS");
    {  // Head dim 128 at the same width (half the heads), for choosing the path per head dim.
      const int64_t hq2 = HQ / 2, hkv2 = HKV / 2, d2 = 2 * D;
      const double sc2 = 1.0 / std::sqrt(static_cast<double>(d2));
      Tensor q2 = randn({B, S, hq2, d2}, bf), k2 = randn({B, S, hkv2, d2}, bf),
             v2 = randn({B, S, hkv2, d2}, bf), dout2 = randn({B, S, hq2, d2}, bf);
      Tensor o2 = Tensor::empty(q2.shape(), bf, Device::cuda(0));
      Tensor lse2 = Tensor::empty({B, hq2, S}, DType::F32, Device::cuda(0));
      Tensor dq2 = Tensor::empty(q2.shape(), bf, Device::cuda(0)),
             dk2 = Tensor::empty(k2.shape(), bf, Device::cuda(0)),
             dv2 = Tensor::empty(v2.shape(), bf, Device::cuda(0));
      const double flops2 = 4.0 * B * hq2 * S * S * d2 / 2;
      ms = time_ms([&] { be.attention(o2, lse2, q2, k2, v2, AttentionMask{}, sc2); });
      row_flops("attention fwd (d128)", ms, flops2);
      for (const char* impl : {"fa2", "split"}) {
        setenv("ACCEL_ATTN_BWD", impl, 1);
        ms = time_ms([&] {
          be.attention_backward(dq2, dk2, dv2, dout2, q2, k2, v2, o2, lse2, AttentionMask{}, sc2);
        });
        row_flops((std::string("attention bwd (d128, ") + impl + ")").c_str(), ms, 2.5 * flops2);
      }
    }
    if (bwd_env)
      setenv("ACCEL_ATTN_BWD", bwd_saved.c_str(), 1);
    else
      unsetenv("ACCEL_ATTN_BWD");
    {  // the llama-125m shape: B=16 S=1024 H=12 (no grouping) D=64
      const int64_t b5 = 16, s5 = 1024, h5 = 12;
      Tensor q5 = randn({b5, s5, h5, D}, bf), k5 = randn({b5, s5, h5, D}, bf),
             v5 = randn({b5, s5, h5, D}, bf), do5 = randn({b5, s5, h5, D}, bf);
      Tensor o5 = Tensor::empty(q5.shape(), bf, Device::cuda(0));
      Tensor lse5 = Tensor::empty({b5, h5, s5}, DType::F32, Device::cuda(0));
      Tensor dq5 = Tensor::empty(q5.shape(), bf, Device::cuda(0)),
             dk5 = Tensor::empty(q5.shape(), bf, Device::cuda(0)),
             dv5 = Tensor::empty(q5.shape(), bf, Device::cuda(0));
      const double flops5 = 4.0 * b5 * h5 * s5 * s5 * D / 2;
      for (const char* impl : {"cudnn", "flash"}) {
        cuda::set_attention_impl(impl);
        const std::string tag = std::string(" (125m: B=16 S=1024 H=12, ") + impl + ")";
        ms = time_ms([&] { be.attention(o5, lse5, q5, k5, v5, AttentionMask{}, 0.125); });
        row_flops(("attention fwd" + tag).c_str(), ms, flops5);
        ms = time_ms([&] {
          be.attention_backward(dq5, dk5, dv5, do5, q5, k5, v5, o5, lse5, AttentionMask{}, 0.125);
        });
        row_flops(("attention bwd" + tag).c_str(), ms, 2.5 * flops5);
      }
    }
    {  // Masks at the shape above: a sliding window of S/4 (Mistral-style), and packed documents
       // of S/16, S/8 and 3S/16 positions in turn; FLOPs count only the visible (query, key) pairs.
      const int64_t w = S / 4;
      std::vector<int64_t> ids;
      for (int64_t d = 0; static_cast<int64_t>(ids.size()) < S; ++d)
        ids.insert(ids.end(),
                   std::min<int64_t>(S / 16 * (1 + d % 3), S - static_cast<int64_t>(ids.size())),
                   d);
      std::vector<int64_t> all_ids;
      for (int64_t b = 0; b < B; ++b) all_ids.insert(all_ids.end(), ids.begin(), ids.end());
      const Tensor seg = Tensor::from_vector(all_ids, {B, S}, DType::I32).to(Device::cuda(0));
      double window_pairs = 0, doc_pairs = 0;
      for (int64_t i = 0; i < S; ++i) {
        window_pairs += static_cast<double>(std::min<int64_t>(i + 1, w));
        int64_t start = i;
        while (start > 0 && ids[start - 1] == ids[i]) --start;
        doc_pairs += static_cast<double>(i - start + 1);
      }
      struct M {
        const char* name;
        AttentionMask mask;
        double pairs;
        bool cudnn;
      } masks[] = {{"window S/4", AttentionMask{true, w, {}}, window_pairs, true},
                   {"documents", AttentionMask{true, 0, seg}, doc_pairs, false}};
      for (const M& mk : masks)
        for (const char* impl : {"cudnn", "flash"}) {
          if (!mk.cudnn && std::string(impl) == "cudnn") continue;
          cuda::set_attention_impl(impl);
          const double flops = 4.0 * B * HQ * mk.pairs * D;
          const std::string tag = std::string(" (") + mk.name + ", " + impl + ")";
          ms = time_ms([&] { be.attention(o, lse, q, k, v, mk.mask, 0.125); });
          row_flops(("attention fwd" + tag).c_str(), ms, flops);
          ms = time_ms(
              [&] { be.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, mk.mask, 0.125); });
          row_flops(("attention bwd" + tag).c_str(), ms, 2.5 * flops);
        }
    }
    cuda::set_attention_impl("auto");
    if (attn_only) return 0;
    cuda::set_attention_impl("generic");
    ms = time_ms([&] { be.attention(o, lse, q, k, v, AttentionMask{}, 0.125); });
    row_flops("attention fwd (generic kernel)", ms, fwd_flops);
    ms = time_ms(
        [&] { be.attention_backward(dq, dk, dv, dout, q, k, v, o, lse, AttentionMask{}, 0.125); });
    row_flops("attention bwd (generic kernel)", ms, 2.5 * fwd_flops);
    cuda::set_attention_impl("auto");
  }
  const cuda::AllocatorStats st = cuda::allocator_stats(0);
  std::printf("\nallocator: %lld cudaMalloc calls for %lld requests, %.1f GiB reserved at peak\n",
              (long long)st.num_device_mallocs, (long long)st.num_allocations,
              st.peak_reserved_bytes / double(1 << 30));
  return 0;
}
#else
int main() {
  std::printf("bench_cuda_kernels: built without CUDA, nothing to measure\n");
  return 0;
}
#endif
