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

TEST_P(CudaNn, RmsNormForwardBackward) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int64_t d : {33, 64, 768, 2048}) {  // 33: the element-by-element path
    const int64_t rows = 301;
    Tensor x = random_tensor({rows, d}, t, rng, -2, 2);
    Tensor w = random_tensor({d}, t, rng, 0.5, 1.5);
    Tensor want = cpu_out({rows, d}, t), wr = cpu_out({rows}, DType::F32);
    cpu_backend().rms_norm(want, wr, x, w, 1e-5);
    Tensor got = poisoned({rows, d}, t), gr = poisoned({rows}, DType::F32);
    cuda_backend().rms_norm(got, gr, x.to(gpu()), w.to(gpu()), 1e-5);
    expect_matches(got, want, t, "rms_norm out d=" + std::to_string(d));
    expect_close(gr, wr, 1e-5, 0, "rms_norm rstd");
    Tensor g = random_tensor({rows, d}, t, rng);
    Tensor wgx = cpu_out({rows, d}, t), wgw = cpu_out({d}, t);
    cpu_backend().rms_norm_backward(wgx, wgw, g, x, w, wr);
    Tensor ggx = poisoned({rows, d}, t), ggw = poisoned({d}, t);
    cuda_backend().rms_norm_backward(ggx, ggw, g.to(gpu()), x.to(gpu()), w.to(gpu()), gr);
    expect_matches(ggx, wgx, t, "rms_norm grad_x", 2.0);
    // grad_weight sums 301 rows: compare against its own scale.
    expect_close(ggw, wgw, tol_for(t).rtol, tol_for(t).atol_scale * 4 * rms(wgw),
                 "rms_norm grad_weight");
  }
}

TEST_P(CudaNn, RopeForwardAndInverse) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int64_t d : {64, 128}) {
    const Shape s{2, 40, 3, d};
    Tensor x = random_tensor(s, t, rng, -2, 2);
    for (bool inverse : {false, true}) {
      Tensor want = cpu_out(s, t);
      cpu_backend().rope(want, x, 10000.0, 7, inverse);
      Tensor got = poisoned(s, t);
      cuda_backend().rope(got, x.to(gpu()), 10000.0, 7, inverse);
      // Angles up to ~50 rad: device sin/cos are within 2 ulp of libm's.
      expect_close(got, want, t == DType::F32 ? 2e-5 : 1e-2, t == DType::F32 ? 1e-5 : 1e-2,
                   std::string("rope") + (inverse ? " inverse" : ""));
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
