// CUDA fp8 kernels against the CPU emulation: casts (fast tiled and generic paths, bit for bit),
// dynamic scaling, transposes, the delayed-scaling update, MX fake quantization, the cuBLASLt fp8
// GEMM, and the fp8 linear op. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ops/backend.h"
#include "ops/fp8.h"
#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cublaslt.h"
#endif

namespace accel {
namespace {

using cuda_test::expect_same_codes;
using cuda_test::gpu;
using cuda_test::random_tensor;
using cuda_test::with_specials;

TEST(CudaFp8, CastMatchesCpuBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(1);
  struct Case {
    int64_t R, C, pad;
    DType in;
  };
  // Tiled fast path (C % 8 == 0, padded to 16; tiles of 128 rows x 64 columns), partial tiles
  // (304 = 2 x 128 + 48 rows, 264 = 4 x 64 + 8 columns padded to 272), and the generic path.
  for (Case c : {Case{256, 512, 16, DType::BF16}, Case{100, 200, 16, DType::BF16},
                 Case{64, 64, 16, DType::F32}, Case{37, 53, 1, DType::BF16},
                 Case{37, 53, 16, DType::F16}, Case{5, 8, 16, DType::F32},
                 Case{304, 264, 16, DType::BF16}, Case{130, 72, 16, DType::F32}}) {
    for (DType fmt : {DType::E4M3, DType::E5M2}) {
      for (int mode = 0; mode < 3; ++mode) {
        const bool row = mode != 2, col = mode != 0;
        SCOPED_TRACE(std::to_string(c.R) + "x" + std::to_string(c.C) + " pad " +
                     std::to_string(c.pad) + " " + dtype_name(c.in) + " -> " + dtype_name(fmt) +
                     " row " + std::to_string(row) + " col " + std::to_string(col));
        Tensor x = with_specials(random_tensor({c.R, c.C}, c.in, rng, -300.0, 300.0));
        const float s = fmt == DType::E4M3 ? 1.37f : 91.0f;
        Tensor s_cpu = Tensor::full({1}, s), amax_cpu = Tensor::full({1}, 0.25);
        Fp8CastOptions o{row, col, c.pad};
        Fp8Tensor want = fp8_cast(x, fmt, s_cpu, amax_cpu, o);
        Tensor amax_gpu = Tensor::full({1}, 0.25, DType::F32, gpu());
        Fp8Tensor got = fp8_cast(x.to(gpu()), fmt, s_cpu.to(gpu()), amax_gpu, o);
        if (row) expect_same_codes(got.data, want.data, "data");
        if (col) expect_same_codes(got.data_t, want.data_t, "data_t");
        EXPECT_EQ(amax_gpu.item(), amax_cpu.item());
        EXPECT_EQ(got.scale_inv.item(), want.scale_inv.item());
      }
    }
  }
}

// The tiled cast on more tiles than one wave of blocks holds (4144 x 2064 padded: 33 x 33 tiles of
// 128 x 64; at most 8 blocks of 256 threads per SM, so blocks loop over several tiles and
// prefetch), rows not a multiple of the tile (4144 = 32 x 128 + 48), columns padded (2056 -> 2064),
// written into outputs poisoned with a nonzero code so that unwritten padding shows; amax and
// scale_inv too. Then the tensor without its specials through dynamic scaling (the amax pass
// over many blocks).
TEST(CudaFp8, CastManyTilesIntoPoisonedOutputsMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  const int64_t R = 4096 + 48, C = 2048 + 8;
  Tensor x0 = random_tensor({R, C}, DType::BF16, rng, -300.0, 300.0);
  Tensor x = with_specials(x0), xg = x.to(gpu());
  auto poisoned_fp8 = [](const Shape& shape, DType fmt) {
    Tensor t = Tensor::empty(shape, fmt);
    std::memset(t.data_ptr(), 0x5a, static_cast<size_t>(t.numel()));
    return t.to(gpu());
  };
  const int64_t Rp = R, Cp = C + 8;
  for (DType fmt : {DType::E4M3, DType::E5M2}) {
    const float s = fmt == DType::E4M3 ? 1.37f : 91.0f;
    Tensor s_cpu = Tensor::full({1}, s), amax_cpu = Tensor::full({1}, 0.25);
    Fp8Tensor want = fp8_cast(x, fmt, s_cpu, amax_cpu, Fp8CastOptions{true, true, 16});
    for (int mode = 0; mode < 3; ++mode) {  // e4m3: both, rowwise only; e5m2: columnwise only
      const bool row = mode != 2, col = mode != 0;
      if ((fmt == DType::E4M3) == (mode == 2)) continue;
      SCOPED_TRACE(std::string(dtype_name(fmt)) + " row " + std::to_string(row) + " col " +
                   std::to_string(col));
      Tensor data = row ? poisoned_fp8({Rp, Cp}, fmt) : Tensor();
      Tensor data_t = col ? poisoned_fp8({Cp, Rp}, fmt) : Tensor();
      Tensor amax_gpu = Tensor::full({1}, 0.25, DType::F32, gpu());
      Tensor scale_inv = Tensor::full({1}, NAN, DType::F32, gpu());
      cuda_backend().fp8_cast(xg, s_cpu.to(gpu()), data, data_t, amax_gpu, scale_inv);
      if (row) expect_same_codes(data, want.data, "data");
      if (col) expect_same_codes(data_t, want.data_t, "data_t");
      EXPECT_EQ(amax_gpu.item(), amax_cpu.item());
      EXPECT_EQ(scale_inv.item(), want.scale_inv.item());
    }
  }
  Fp8Tensor want = fp8_cast_dynamic(x0, DType::E5M2, {true, true, 16});
  Fp8Tensor got = fp8_cast_dynamic(x0.to(gpu()), DType::E5M2, {true, true, 16});
  EXPECT_EQ(got.scale.item(), want.scale.item());
  expect_same_codes(got.data, want.data, "dynamic data");
  expect_same_codes(got.data_t, want.data_t, "dynamic data_t");
}

// The amax pass finds a single large element wherever it sits: in the 4-vector unrolled part, the
// one-vector remainder, the scalar tail (numel % 8 != 0), in a tensor larger than one wave of
// blocks covers in one iteration, and through the scalar path of an unaligned view. NaN ignored.
TEST(CudaFp8, AmaxFindsTheMaximumAnywhere) {
  ACCEL_SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::BF16, DType::F32}) {
    for (int64_t n : {int64_t{1003}, int64_t{8 * 4096 + 5}, int64_t{12 * 1024 * 1024 + 3}}) {
      Tensor x = Tensor::full({n}, 0.5, dt, gpu());
      auto put = [&](int64_t i, double v) {
        narrow(x, 0, i, 1).copy_(Tensor::full({1}, v, dt).to(gpu()));
      };
      put(n / 3, NAN);
      for (int64_t p : {int64_t{0}, int64_t{1}, n / 2, n - 9, n - 8, n - 4, n - 1}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n) + " at " +
                     std::to_string(p));
        put(p, -96.0);
        EXPECT_EQ(fp8_amax(x).item(), 96.0);
        if (p > 0) {
          EXPECT_EQ(fp8_amax(narrow(x, 0, 1, n - 1)).item(), 96.0);  // unaligned
        }
        put(p, 0.5);
      }
      EXPECT_EQ(fp8_amax(x).item(), 0.5);
    }
  }
}

TEST(CudaFp8, DynamicCastAndTransposeMatchCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(2);
  for (double range : {1e-3, 1.0, 1e4}) {
    Tensor x = random_tensor({96, 160}, DType::BF16, rng, -range, range);
    Fp8Tensor want = fp8_cast_dynamic(x, DType::E4M3, {true, false, 16}, 1);
    Fp8Tensor got = fp8_cast_dynamic(x.to(gpu()), DType::E4M3, {true, false, 16}, 1);
    EXPECT_EQ(got.scale.item(), want.scale.item());
    EXPECT_EQ(got.scale_inv.item(), want.scale_inv.item());
    expect_same_codes(got.data, want.data, "dynamic data");
    expect_same_codes(fp8_with_transpose(got).data_t, fp8_with_transpose(want).data_t,
                      "byte transpose");
    EXPECT_EQ(fp8_amax(x.to(gpu())).item(), fp8_amax(x).item());
  }
  Fp8Tensor z = fp8_cast_dynamic(Tensor::zeros({16, 16}, DType::BF16, gpu()), DType::E5M2);
  EXPECT_EQ(z.scale.item(), 1.0);
}

TEST(CudaFp8, DelayedUpdateMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(3);
  for (int64_t L : {1, 2, 5, 130, 131, 300, 1024}) {
    for (bool use_max : {false, true}) {
      Fp8Recipe r;
      r.amax_history_len = L;
      r.amax_algo = use_max ? AmaxAlgo::Max : AmaxAlgo::MostRecent;
      r.margin = 1;
      r.interval = 2;
      Fp8DelayedScaling cpu(r, Device::cpu()), dev(r, gpu());
      for (int i = 0; i < 300; ++i) {
        DType f = i % 3 == 2 ? DType::E5M2 : DType::E4M3;
        cpu.add_slot(f);
        dev.add_slot(f);
      }
      for (int step = 0; step < 4; ++step) {
        Tensor h = random_tensor(cpu.amax_history().shape(), DType::F32, rng, 0.0, 10.0);
        std::vector<double> hv = h.to_vector();
        hv[0] = 0.0;
        hv[1] = INFINITY;
        hv[2] = NAN;
        hv[3] = 1e-40;
        h = Tensor::from_vector(hv, h.shape());
        cpu.amax_history().copy_(h);
        dev.amax_history().copy_(h.to(gpu()));
        cpu.update();
        dev.update();
        std::vector<double> a = cpu.scales().to_vector(), b = dev.scales().to_vector();
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_EQ(a[i], b[i]) << "L " << L << " max " << use_max << " slot " << i;
        ASSERT_EQ(cpu.scale_invs().to_vector(), dev.scale_invs().to_vector());
        std::vector<double> ha = cpu.amax_history().to_vector(),
                            hb = dev.amax_history().to_vector();
        for (size_t i = 0; i < ha.size(); ++i)
          ASSERT_TRUE(ha[i] == hb[i] || (std::isnan(ha[i]) && std::isnan(hb[i]))) << i;
      }
    }
  }
}

TEST(CudaFp8, MxFakeQuantMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(4);
  for (DType in : {DType::BF16, DType::F32})
    for (DType fmt : {DType::E4M3, DType::E5M2})
      for (int dim : {0, 1}) {
        Tensor x = with_specials(random_tensor({70, 100}, in, rng, -50.0, 50.0));
        Tensor want = fp8_mx_fake_quant(x, fmt, dim);
        Tensor got = fp8_mx_fake_quant(x.to(gpu()), fmt, dim);
        std::vector<double> a = got.to_vector(), b = want.to_vector();
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))
              << dtype_name(in) << " " << dtype_name(fmt) << " dim " << dim << " at " << i << ": "
              << a[i] << " vs " << b[i];
      }
}

double sqnr_db(const std::vector<double>& ref, const std::vector<double>& got) {
  double s = 0, e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += ref[i] * ref[i];
    e += (ref[i] - got[i]) * (ref[i] - got[i]);
  }
  return 10.0 * std::log10(s / std::max(e, 1e-300));
}

TEST(CudaFp8, GemmMatchesCpuEmulation) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  struct Case {
    int64_t M, N, K;
    DType fa, fb, out;
    bool fast;
  };
  for (Case c : {Case{64, 48, 96, DType::E4M3, DType::E4M3, DType::BF16, true},
                 Case{256, 512, 1024, DType::E4M3, DType::E4M3, DType::BF16, true},
                 Case{256, 512, 1024, DType::E4M3, DType::E4M3, DType::BF16, false},
                 Case{128, 64, 256, DType::E5M2, DType::E4M3, DType::BF16, false},
                 Case{128, 64, 256, DType::E4M3, DType::E5M2, DType::F32, false},
                 Case{32, 16, 512, DType::E5M2, DType::E4M3, DType::F32, false}}) {
    SCOPED_TRACE(std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) + " " +
                 dtype_name(c.fa) + "*" + dtype_name(c.fb) + "->" + dtype_name(c.out));
    Tensor a = random_tensor({c.M, c.K}, DType::F32, rng),
           b = random_tensor({c.N, c.K}, DType::F32, rng, -0.05, 0.05);
    Fp8Tensor qa = fp8_cast_dynamic(a, c.fa), qb = fp8_cast_dynamic(b, c.fb);
    Tensor want = fp8_gemm(qa.data, qa.scale_inv, qb.data, qb.scale_inv, c.out, c.fast);
    auto on_gpu = [](const Fp8Tensor& q) {
      Fp8Tensor g = q;
      g.data = q.data.to(gpu());
      g.scale_inv = q.scale_inv.to(gpu());
      return g;
    };
    Fp8Tensor ga = on_gpu(qa), gb = on_gpu(qb);
    Tensor got = fp8_gemm(ga.data, ga.scale_inv, gb.data, gb.scale_inv, c.out, c.fast);
    // Hopper's fp8 tensor cores accumulate partial sums with fewer bits than fp32 before they
    // are promoted (measured on the H200: ~4e-5 relative at K=256..512), so an fp32 output gets
    // a bf16-sized allowance rather than fp32's 1e-5.
    const double extra = c.out == DType::F32 ? 100.0 : (c.fast ? 2.0 : 1.0);
    cuda_test::expect_matches(got.to(Device::cpu()), want, c.out, "fp8 gemm vs cpu emulation",
                              extra);
    // Against the unquantized fp32 product.
    Tensor exact = matmul(a, transpose(b, 0, 1));
    if (c.fa == DType::E4M3 && c.fb == DType::E4M3) {
      EXPECT_GE(sqnr_db(exact.to_vector(), got.to_vector()), 25.0);
    }
  }
  Tensor bad = Tensor::zeros({16, 24}, DType::E4M3, gpu());
  Tensor s = Tensor::ones({1}, DType::F32, gpu());
  EXPECT_THROW(fp8_gemm(bad, s, bad, s, DType::BF16, true), std::invalid_argument);  // K % 16
}

#ifdef ACCEL_WITH_CUDA
// fp8 GEMMs go through the shared cuBLASLt context (ops/cuda/cublaslt.h): the first call of a
// problem times the candidates on the poisoned output, the second runs the cached algorithm, and
// both match the CPU emulation. A bf16 GEMM of the same sizes has its own plan (no key collision).
TEST(CudaFp8, GemmTunedThenCachedThroughSharedContext) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(11);
  const bool was = accel::cuda::lt::gemm_tuning();
  accel::cuda::lt::set_gemm_tuning(true);
  const int64_t M = 320, N = 176, K = 416;  // sizes no other test uses
  Tensor a = random_tensor({M, K}, DType::F32, rng), b = random_tensor({N, K}, DType::F32, rng);
  Fp8Tensor qa = fp8_cast_dynamic(a, DType::E4M3), qb = fp8_cast_dynamic(b, DType::E4M3);
  Tensor want = fp8_gemm(qa.data, qa.scale_inv, qb.data, qb.scale_inv, DType::BF16, false);
  Tensor da = qa.data.to(gpu()), sa = qa.scale_inv.to(gpu());
  Tensor db = qb.data.to(gpu()), sb = qb.scale_inv.to(gpu());
  int64_t plans_before = 0;
  for (int rep = 0; rep < 2; ++rep) {
    SCOPED_TRACE("call " + std::to_string(rep));
    const accel::cuda::lt::TuningStats s0 = accel::cuda::lt::tuning_stats();
    Tensor got = cuda_test::poisoned({M, N}, DType::BF16);
    fp8_gemm(got, da, sa, db, sb, false);
    const accel::cuda::lt::TuningStats s1 = accel::cuda::lt::tuning_stats();
    const int64_t new_plans = (s1.tuned + s1.heuristic_only) - (s0.tuned + s0.heuristic_only);
    if (rep == 0) {
      EXPECT_EQ(s1.tuned, s0.tuned + 1) << "the first fp8 call should time the candidates";
      plans_before = new_plans;
    } else {
      EXPECT_EQ(new_plans, 0);
      EXPECT_EQ(s1.cached_runs, s0.cached_runs + 1);
    }
    cuda_test::expect_matches(got.to(Device::cpu()), want, DType::BF16, "tuned fp8 gemm");
  }
  EXPECT_EQ(plans_before, 1);
  // The same M, N, K as a bf16 GEMM: a separate plan in the same cache.
  const accel::cuda::lt::TuningStats s2 = accel::cuda::lt::tuning_stats();
  Tensor x = random_tensor({1, M, K}, DType::BF16, rng),
         w = random_tensor({1, N, K}, DType::BF16, rng);
  Tensor want16 = cuda_test::cpu_out({1, M, N}, DType::BF16);
  cpu_backend().matmul(want16, x, w, false, true, 1.0, 0.0, Tensor());
  Tensor got16 = cuda_test::poisoned({1, M, N}, DType::BF16);
  cuda_backend().matmul(got16, x.to(gpu()), w.to(gpu()), false, true, 1.0, 0.0, Tensor());
  const accel::cuda::lt::TuningStats s3 = accel::cuda::lt::tuning_stats();
  EXPECT_EQ((s3.tuned + s3.heuristic_only) - (s2.tuned + s2.heuristic_only), 1);
  cuda_test::expect_matches(got16, want16, DType::BF16, "bf16 gemm after fp8", 4.0);
  accel::cuda::lt::set_gemm_tuning(was);
}
#endif

TEST(CudaFp8, LinearMatchesCpuEmulation) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(6);
  for (Fp8Scaling scaling : {Fp8Scaling::Dynamic, Fp8Scaling::Delayed, Fp8Scaling::MxBlock}) {
    Tensor x = random_tensor({4, 32, 128}, DType::BF16, rng);
    Tensor w = random_tensor({96, 128}, DType::BF16, rng, -0.1, 0.1);
    Tensor g = random_tensor({4, 32, 96}, DType::BF16, rng, -1e-3, 1e-3);
    std::vector<Tensor> results[2];
    for (int d = 0; d < 2; ++d) {
      const Device dev = d ? gpu() : Device::cpu();
      Fp8LinearContext ctx;
      ctx.recipe.scaling = scaling;
      if (scaling == Fp8Scaling::Delayed) {
        ctx.delayed = std::make_shared<Fp8DelayedScaling>(ctx.recipe, dev);
        ctx.slot_input = ctx.delayed->add_slot(DType::E4M3);
        ctx.slot_weight = ctx.delayed->add_slot(DType::E4M3);
        ctx.slot_grad_output = ctx.delayed->add_slot(DType::E5M2);
      }
      for (int step = 0; step < 2; ++step) {
        Tensor xd = d ? x.to(dev) : x.clone(), wd = d ? w.to(dev) : w.clone();
        xd.set_requires_grad(true);
        wd.set_requires_grad(true);
        Tensor y = fp8_linear(xd, wd, Tensor(), ctx);
        y.backward(g.to(dev));
        if (ctx.delayed) ctx.delayed->update();
        if (step == 1)
          results[d] = {y.detach().to(Device::cpu()), xd.grad().to(Device::cpu()),
                        wd.grad().to(Device::cpu())};
      }
    }
    const char* names[] = {"output", "input grad", "weight grad"};
    for (int i = 0; i < 3; ++i)
      cuda_test::expect_matches(results[1][i], results[0][i], DType::BF16,
                                std::string("fp8 linear ") + names[i], 2.0);
  }
}

// The wgrad GEMM writes the weight's dtype on the GPU: an fp32 weight's gradient is the cuBLASLt
// product with fp32 output bit for bit (same kernels, same operands), a bf16 weight's is the
// product with bf16 output, within one bf16 rounding of the fp32 product (the two outputs may
// come from different cuBLASLt kernels); both match the CPU twin (fp32 at the GEMM test's fp32
// allowance). Odd shapes (M=60, K=40, N=24) exercise the padding.
TEST(CudaFp8, WeightGradientIsFp32GemmOutputAndMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(8);
  const int64_t K = 40, N = 24;
  Tensor x = random_tensor({3, 20, K}, DType::BF16, rng);
  Tensor w = random_tensor({N, K}, DType::BF16, rng, -0.2, 0.2);
  Tensor g = random_tensor({3, 20, N}, DType::BF16, rng, -1e-3, 1e-3);
  // The reference on the GPU from the op's own casts and an fp32-output GEMM.
  Tensor x2 = reshape(x, {-1, K}).to(gpu()), g2 = reshape(g, {-1, N}).to(gpu());
  Fp8Tensor qx = fp8_cast_dynamic(x2, DType::E4M3, Fp8CastOptions{false, true, 16});
  Fp8Tensor qg = fp8_cast_dynamic(g2, DType::E5M2, Fp8CastOptions{false, true, 16});
  auto product = [&](DType out) {
    return contiguous(narrow(
        narrow(fp8_gemm(qg.data_t, qg.scale_inv, qx.data_t, qx.scale_inv, out, false), 0, 0, N), 1,
        0, K));
  };
  Tensor ref32 = product(DType::F32);
  for (DType wt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(wt));
    Tensor dws[2];
    for (int d = 0; d < 2; ++d) {
      const Device dev = d ? gpu() : Device::cpu();
      Fp8LinearContext ctx;
      ctx.recipe.scaling = Fp8Scaling::Dynamic;
      Tensor xd = x.to(dev).clone().set_requires_grad(true);
      Tensor wd = cast(w, wt).to(dev).clone().set_requires_grad(true);
      fp8_linear(xd, wd, Tensor(), ctx).backward(g.to(dev));
      ASSERT_EQ(wd.grad().dtype(), wt);
      dws[d] = wd.grad().to(Device::cpu());
    }
    EXPECT_EQ(dws[1].to_vector(), product(wt).to(Device::cpu()).to_vector());
    if (wt !=
        DType::F32)  // one rounding of the fp32 product: within half a bf16 ulp (+ fp32 noise)
      cuda_test::expect_matches(dws[1], cast(ref32, wt).to(Device::cpu()), wt,
                                "bf16 wgrad vs the fp32 product rounded", 1.0);
    cuda_test::expect_matches(dws[1], dws[0], wt, "fp8 linear weight grad vs cpu emulation",
                              wt == DType::F32 ? 100.0 : 2.0);
  }
}

}  // namespace
}  // namespace accel
