// Fused neural-network kernels against the CPU backend: rms_norm, rope, embedding, optimizers.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace accel {
namespace {
using namespace cuda_test;

class CudaNn : public ::testing::TestWithParam<DType> {};

// A copy of the CPU tensor x on the GPU, contiguous but starting one element past a 16-byte
// boundary: the CUDA kernels' element-by-element fallbacks take it.
Tensor misaligned_gpu_copy(const Tensor& x) {
  Tensor buf = Tensor::empty({x.numel() + 1}, x.dtype(), gpu());
  Tensor v = buf.as_strided(x.shape(), contiguous_strides(x.shape()), 1);
  v.copy_(x);
  return v;
}

// Paths by (d, dtype), 16-byte vectors of 8 (bf16/f16) or 4 (f32) values:
//   d = 33: element-by-element block kernels (fwd, bwd).
//   one warp per row, forward up to 512 vectors (bf16 d <= 4096, f32 d <= 2048), backward up to 256
//   (bf16 d <= 2048, f32 d <= 1024); beyond that the vectorized block kernels: bf16 d = 4096 and
//   f32 d = 2048 backward, f32 d = 4096 and d = 8192 both ways.
// Row counts are not multiples of the 8 warps per block; 6007 rows give the backward's warps
// several rows each (its grid is one resident wave). The (d, rows) cases of every rms_norm test:
const std::pair<int64_t, int64_t> kNormCases[] = {{33, 301},   {64, 301},   {768, 301}, {768, 6007},
                                                  {2048, 301}, {4096, 301}, {8192, 45}};

TEST_P(CudaNn, RmsNormForwardBackward) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (auto [d, rows] : kNormCases) {
    const std::string what = " d=" + std::to_string(d) + " rows=" + std::to_string(rows);
    Tensor x = random_tensor({rows, d}, t, rng, -2, 2);
    Tensor w = random_tensor({d}, t, rng, 0.5, 1.5);
    Tensor want = cpu_out({rows, d}, t), wr = cpu_out({rows}, DType::F32);
    cpu_backend().rms_norm(want, wr, x, w, 1e-5);
    Tensor got = poisoned({rows, d}, t), gr = poisoned({rows}, DType::F32);
    cuda_backend().rms_norm(got, gr, x.to(gpu()), w.to(gpu()), 1e-5);
    expect_matches(got, want, t, "rms_norm out" + what);
    expect_close(gr, wr, 1e-5, 0, "rms_norm rstd" + what);
    Tensor g = random_tensor({rows, d}, t, rng);
    Tensor wgx = cpu_out({rows, d}, t), wgw = cpu_out({d}, t);
    cpu_backend().rms_norm_backward(wgx, wgw, g, x, w, wr, Tensor());
    Tensor ggx = poisoned({rows, d}, t), ggw = poisoned({d}, t);
    cuda_backend().rms_norm_backward(ggx, ggw, g.to(gpu()), x.to(gpu()), w.to(gpu()), gr, Tensor());
    expect_matches(ggx, wgx, t, "rms_norm grad_x" + what, 2.0);
    // grad_weight sums the rows: compare against its own scale.
    expect_close(ggw, wgw, tol_for(t).rtol, tol_for(t).atol_scale * 4 * rms(wgw),
                 "rms_norm grad_weight" + what);
    // Without grad_x, and again: the same grad_weight bit for bit (no atomics in the sums).
    Tensor ggw2 = poisoned({d}, t);
    cuda_backend().rms_norm_backward(Tensor(), ggw2, g.to(gpu()), x.to(gpu()), w.to(gpu()), gr,
                                     Tensor());
    expect_close(ggw2, ggw, 0, 0, "rms_norm grad_weight without grad_x" + what);
  }
}

// add_rms_norm (sum = x + r, then its norm) and the backward folding a pending gradient into
// grad_x, on the paths of RmsNormForwardBackward (same shapes), against the CPU twin. Also: sum is
// exactly the add kernel's, out exactly the GPU rms_norm of that sum (one code path), and an fp32
// folded grad_x exactly the GPU backward followed by the GPU add (the fold's add is not
// contracted).
TEST_P(CudaNn, AddRmsNormAndBackwardWithGradAdd) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (auto [d, rows] : kNormCases) {
    const std::string what = " d=" + std::to_string(d) + " rows=" + std::to_string(rows);
    const Shape s{rows, d};
    Tensor x = random_tensor(s, t, rng, -2, 2), r = random_tensor(s, t, rng, -2, 2);
    Tensor w = random_tensor({d}, t, rng, 0.5, 1.5);
    Tensor xg = x.to(gpu()), rg = r.to(gpu()), wg = w.to(gpu());

    Tensor wsum = cpu_out(s, t), want = cpu_out(s, t), wr = cpu_out({rows}, DType::F32);
    cpu_backend().add_rms_norm(wsum, want, wr, x, r, w, 1e-5);
    Tensor gsum = poisoned(s, t), got = poisoned(s, t), gr = poisoned({rows}, DType::F32);
    cuda_backend().add_rms_norm(gsum, got, gr, xg, rg, wg, 1e-5);
    expect_close(gsum, wsum, 0, 0, "add_rms_norm sum" + what);
    expect_matches(got, want, t, "add_rms_norm out" + what);
    expect_close(gr, wr, 1e-5, 0, "add_rms_norm rstd" + what);
    Tensor added = poisoned(s, t);
    cuda_backend().binary(BinaryOp::Add, added, xg, rg);
    expect_close(gsum, added, 0, 0, "add_rms_norm sum vs the add kernel" + what);
    Tensor plain = poisoned(s, t), plain_r = poisoned({rows}, DType::F32);
    cuda_backend().rms_norm(plain, plain_r, added, wg, 1e-5);
    expect_close(got, plain, 0, 0, "add_rms_norm out vs rms_norm of the sum" + what);
    expect_close(gr, plain_r, 0, 0, "add_rms_norm rstd vs rms_norm of the sum" + what);
    // Misaligned operands: the element-by-element block kernel.
    Tensor msum = poisoned(s, t), mout = poisoned(s, t), mr = poisoned({rows}, DType::F32);
    cuda_backend().add_rms_norm(msum, mout, mr, misaligned_gpu_copy(x), misaligned_gpu_copy(r), wg,
                                1e-5);
    expect_close(msum, wsum, 0, 0, "add_rms_norm sum, misaligned" + what);
    expect_matches(mout, want, t, "add_rms_norm out, misaligned" + what);

    // Backward with a pending gradient folded into grad_x.
    Tensor g = random_tensor(s, t, rng), pend = random_tensor(s, t, rng);
    Tensor pg = pend.to(gpu()), gg = g.to(gpu());
    Tensor wgx = cpu_out(s, t), wgw = cpu_out({d}, t);
    cpu_backend().rms_norm_backward(wgx, wgw, g, wsum, w, wr, pend);
    Tensor ggx = poisoned(s, t), ggw = poisoned({d}, t);
    cuda_backend().rms_norm_backward(ggx, ggw, gg, gsum, wg, gr, pg);
    expect_matches(ggx, wgx, t, "rms_norm grad_x + grad_x_add" + what, 2.0);
    Tensor ugx = poisoned(s, t), ugw = poisoned({d}, t);
    cuda_backend().rms_norm_backward(ugx, ugw, gg, gsum, wg, gr, Tensor());
    expect_close(ggw, ugw, 0, 0, "rms_norm grad_weight with and without grad_x_add" + what);
    if (t == DType::F32) {
      Tensor sum2 = poisoned(s, t);
      cuda_backend().binary(BinaryOp::Add, sum2, ugx, pg);
      expect_close(ggx, sum2, 0, 0, "fp32 folded grad_x vs backward then add" + what);
    } else {
      // One rounding instead of two: within a 16-bit ulp of backward-then-add.
      Tensor sum2 = poisoned(s, t);
      cuda_backend().binary(BinaryOp::Add, sum2, ugx, pg);
      expect_matches(ggx, sum2, t, "16-bit folded grad_x vs backward then add" + what);
    }
    // A misaligned pending gradient (copied to an aligned one first): the same bits.
    Tensor mgx = poisoned(s, t);
    cuda_backend().rms_norm_backward(mgx, Tensor(), gg, gsum, wg, gr, misaligned_gpu_copy(pend));
    expect_close(mgx, ggx, 0, 0, "rms_norm grad_x_add misaligned" + what);
    // Misaligned x: the element-by-element block backward, folding too.
    Tensor bgx = poisoned(s, t);
    cuda_backend().rms_norm_backward(bgx, Tensor(), gg, misaligned_gpu_copy(wsum), wg, gr, pg);
    expect_matches(bgx, wgx, t, "rms_norm grad_x + grad_x_add, misaligned x" + what, 2.0);
  }
}

// Vector path (16-byte chunks, several heads per thread) unless noted; it must equal the
// element-by-element kernel bit for bit (same angles, sincosf and roundings), which a misaligned
// copy of x takes.
TEST_P(CudaNn, RopeForwardAndInverse) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    Shape shape;
    int64_t offset;
    bool positions = false;  // per-token position_ids (packed documents) instead of the offset
    double theta = 10000.0, scaling = 1.0;
  };
  const Case cases[] = {
      {{2, 40, 3, 64}, 7},        // odd head count: one group of 3 heads
      {{2, 40, 3, 128}, 7},       //
      {{2, 48, 12, 64}, 0},       // llama-125m's heads (12 of 64)
      {{1, 64, 32, 64}, 1000},    // llama-1b's q heads, a late position offset
      {{1, 64, 8, 64}, 1000},     // llama-1b's k heads
      {{1, 16, 5, 64}, 3},        // 5 heads: groups of 4 and 1
      {{1, 4, 3, 1024}, 5},       // the largest head dim
      {{2, 10, 3, 36}, 7},        // D / 2 = 18, not a multiple of the vector: element by element
      {{2, 40, 3, 64}, 0, true},  // position_ids, vector kernel
      {{2, 10, 3, 36}, 0, true},  // position_ids, element by element
      {{1, 64, 8, 128}, 0, true, 1e6, 1.1386},      // Qwen3's head dim, YaRN-scaled cos/sin
      {{1, 16, 5, 64}, 100, false, 500000.0, 0.7},  // scaled, with an offset
  };
  for (const Case& c : cases) {
    const Shape& s = c.shape;
    Tensor x = random_tensor(s, t, rng, -2, 2);
    RopeFrequencies f = default_rope_frequencies(c.theta, s[3]);
    f.attention_scaling = c.scaling;
    Tensor ids_cpu, ids_gpu;
    if (c.positions) {
      // Documents of random lengths, each restarting at position 0; I32 for odd shapes.
      std::vector<int64_t> ids;
      for (int64_t b = 0; b < s[0]; ++b)
        for (int64_t i = 0, p = 0; i < s[1]; ++i, ++p) {
          if (rng() % 7 == 0) p = 0;
          ids.push_back(p);
        }
      ids_cpu = Tensor::from_vector(ids, {s[0], s[1]}, s[3] % 16 ? DType::I32 : DType::I64);
      ids_gpu = ids_cpu.to(gpu());
    }
    for (bool inverse : {false, true}) {
      const std::string what = std::string("rope") + (inverse ? " inverse " : " ") + shape_str(s) +
                               " offset " + std::to_string(c.offset) +
                               (c.positions ? " position_ids" : "") + " scaling " +
                               std::to_string(c.scaling);
      Tensor want = cpu_out(s, t);
      cpu_backend().rope(want, x, f, c.offset, ids_cpu, inverse);
      Tensor got = poisoned(s, t);
      cuda_backend().rope(got, x.to(gpu()), f, c.offset, ids_gpu, inverse);
      // Device sin/cos are within 2 ulp of libm's.
      expect_close(got, want, t == DType::F32 ? 2e-5 : 1e-2, t == DType::F32 ? 1e-5 : 1e-2, what);
      Tensor scalar = poisoned(s, t);
      cuda_backend().rope(scalar, misaligned_gpu_copy(x), f, c.offset, ids_gpu, inverse);
      expect_close(got, scalar, 0, 0, what + ": vector vs element-by-element kernel");
    }
  }
}

TEST_P(CudaNn, EmbeddingForwardBackwardWithRepeatedIds) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t vocab = 517, d = 96;
  Tensor w = random_tensor({vocab, d}, t, rng);
  for (DType id_t : {DType::I64, DType::I32}) {
    Tensor ids = random_ints({4, 333}, 0, 40, rng, id_t);  // many repeats
    Tensor want = cpu_out({4, 333, d}, t);
    cpu_backend().embedding(want, w, ids);
    Tensor got = poisoned({4, 333, d}, t);
    cuda_backend().embedding(got, w.to(gpu()), ids.to(gpu()));
    expect_close(got, want, 0, 0, "embedding");
    Tensor g = random_tensor({4, 333, d}, t, rng);
    Tensor wg = Tensor::zeros({vocab, d}, t);
    cpu_backend().embedding_backward(wg, g, ids);
    Tensor gg = Tensor::zeros({vocab, d}, t, gpu());
    cuda_backend().embedding_backward(gg, g.to(gpu()), ids.to(gpu()));
    expect_close(gg, wg, tol_for(t).rtol, tol_for(t).atol_scale * rms(wg), "embedding backward");
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaNn, ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaOptim, AdamWMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType gt : {DType::F32, DType::BF16}) {
    const int64_t n = 10001;
    Tensor p = random_tensor({n}, DType::F32, rng),
           m = random_tensor({n}, DType::F32, rng, -0.1, 0.1);
    Tensor v = random_tensor({n}, DType::F32, rng, 0.0, 0.01);
    Tensor pg = p.to(gpu()), mg = m.to(gpu()), vg = v.to(gpu());
    for (int64_t step = 1; step <= 3; ++step) {
      Tensor g = random_tensor({n}, gt, rng);
      AdamWParams hp{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
      cpu_backend().adamw_step(p, g, m, v, hp, 0.5);
      cuda_backend().adamw_step(pg, g.to(gpu()), mg, vg, hp, 0.5);
    }
    expect_close(pg, p, 1e-5, 1e-6, "adamw param");
    expect_close(mg, m, 1e-5, 1e-7, "adamw m");
    expect_close(vg, v, 1e-5, 1e-9, "adamw v");
  }
}

#ifdef ACCEL_WITH_CUDA
TEST(CudaOptim, AdamWMultiTensorMatchesPerTensorCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> p, g, m, v, pg, gg, mg, vg;
  for (int i = 0; i < 30; ++i) {  // more than one launch's worth, two grad dtypes
    const int64_t n = 1 + (i * 7919) % 5000;
    const DType gt = i % 3 == 0 ? DType::BF16 : DType::F32;
    p.push_back(random_tensor({n}, DType::F32, rng));
    g.push_back(random_tensor({n}, gt, rng));
    m.push_back(random_tensor({n}, DType::F32, rng, -0.1, 0.1));
    v.push_back(random_tensor({n}, DType::F32, rng, 0.0, 0.01));
    pg.push_back(p.back().to(gpu()));
    gg.push_back(g.back().to(gpu()));
    mg.push_back(m.back().to(gpu()));
    vg.push_back(v.back().to(gpu()));
  }
  AdamWParams hp{1e-3, 0.9, 0.95, 1e-8, 0.1, 4};
  for (size_t i = 0; i < p.size(); ++i) cpu_backend().adamw_step(p[i], g[i], m[i], v[i], hp, 0.7);
  cuda::adamw_step_multi(pg, gg, mg, vg, hp, 0.7);
  for (size_t i = 0; i < p.size(); ++i) {
    expect_close(pg[i], p[i], 1e-5, 1e-6, "adamw multi param " + std::to_string(i));
    expect_close(vg[i], v[i], 1e-5, 1e-9, "adamw multi v " + std::to_string(i));
  }
}
#endif

TEST(CudaOptim, SgdMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = 4097;
  Tensor p = random_tensor({n}, DType::F32, rng), buf = Tensor::zeros({n}, DType::F32);
  Tensor pg = p.to(gpu()), bg = buf.to(gpu());
  for (int step = 0; step < 3; ++step) {
    Tensor g = random_tensor({n}, DType::F32, rng);
    cpu_backend().sgd_step(p, g, buf, 0.1, 0.9, 0.01, 2.0);
    cuda_backend().sgd_step(pg, g.to(gpu()), bg, 0.1, 0.9, 0.01, 2.0);
  }
  expect_close(pg, p, 1e-5, 1e-6, "sgd param");
  expect_close(bg, buf, 1e-5, 1e-6, "sgd momentum");
}

}  // namespace
}  // namespace accel
