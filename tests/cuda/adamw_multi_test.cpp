// The multi-tensor AdamW op on the GPU (one launch per dtype combination over a chunked work list)
// with compute copies, against its CPU twin on fresh random inputs. Many tensors (more than one
// launch's table would need with small tables, many chunks), sizes that are not multiples of the
// vector width, a misaligned view (scalar path) and tensors spanning several chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "ops/optimizer.h"

namespace accel {
namespace {
using namespace cuda_test;

// Bytes of two tensors (brought to the host) are equal.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor g = got.to(Device::cpu()), w = want.to(Device::cpu());
  ASSERT_EQ(g.dtype(), w.dtype()) << what;
  ASSERT_EQ(g.shape(), w.shape()) << what;
  EXPECT_EQ(std::memcmp(g.data_ptr(), w.data_ptr(), g.nbytes()), 0) << what;
}

// A contiguous 1-d tensor on the GPU whose data starts one element past an aligned address, so
// the kernel must take its element-by-element path.
Tensor misaligned_gpu(const Tensor& host) {
  Tensor big = Tensor::empty({host.numel() + 1}, host.dtype(), gpu());
  Tensor view = big.as_strided({host.numel()}, {1}, 1);
  view.copy_(host);
  return view;
}

int64_t size_for(int i, std::mt19937_64& rng) {
  switch (i % 10) {
    case 0:
      return 1;
    case 1:
      return 7;
    case 2:
      return 4099;
    case 3:
      return 16384 * 2 + 5;  // three chunks, a short last one
    case 4:
      return 16384;  // exactly one chunk
    default:
      return std::uniform_int_distribution<int64_t>(2, 3000)(rng);
  }
}

TEST(CudaAdamWMulti, ManyTensorsWithCopiesMatchCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int count = 150;
  std::vector<Tensor> p, g, m, v, c;       // CPU twin
  std::vector<Tensor> pg, gg, mg, vg, cg;  // GPU
  std::vector<Tensor> p0, m0, v0;          // inputs, to see that every element moved
  for (int i = 0; i < count; ++i) {
    const int64_t n = size_for(i, rng);
    const DType gt = i % 3 == 0 ? DType::BF16 : (i % 3 == 1 ? DType::F32 : DType::F16);
    const DType ct = i % 4 == 3 ? DType::F16 : DType::BF16;
    p.push_back(random_tensor({n}, DType::F32, rng));
    g.push_back(random_tensor({n}, gt, rng));
    m.push_back(random_tensor({n}, DType::F32, rng, -0.1, 0.1));
    v.push_back(random_tensor({n}, DType::F32, rng, 1e-4, 0.01));
    c.push_back(cpu_out({n}, ct));
    p0.push_back(p.back().clone());
    m0.push_back(m.back().clone());
    v0.push_back(v.back().clone());
    const bool misaligned = i == 17 || i == 42;
    pg.push_back(misaligned ? misaligned_gpu(p.back()) : p.back().to(gpu()));
    gg.push_back(g.back().to(gpu()));
    mg.push_back(m.back().to(gpu()));
    vg.push_back(v.back().to(gpu()));
    cg.push_back(poisoned({n}, ct));  // an element the kernel skips stays NaN
  }
  const AdamWParams hp{1e-2, 0.9, 0.95, 1e-8, 0.1, 3};
  cpu_backend().adamw_step_multi(p, g, m, v, c, hp, 0.7);
  adamw_step_multi(pg, gg, mg, vg, hp, 0.7, cg);
  for (int i = 0; i < count; ++i) {
    const std::string what = "tensor " + std::to_string(i) + " of " + std::to_string(p[i].numel());
    expect_close(pg[i], p[i], 1e-5, 1e-6, what + " param");
    expect_close(mg[i], m[i], 1e-5, 1e-7, what + " exp_avg");
    expect_close(vg[i], v[i], 1e-5, 1e-9, what + " exp_avg_sq");
    expect_close(cg[i], c[i], 1e-2, 1e-3, what + " compute copy");
    // The copy is exactly copy_ of the GPU's own updated param.
    Tensor rounded = Tensor::empty(cg[i].shape(), cg[i].dtype(), gpu());
    rounded.copy_(pg[i]);
    expect_same_bits(cg[i], rounded, what + " compute copy vs copy_");
    // In-place outputs: no element kept its param, exp_avg and exp_avg_sq all three (an unwritten
    // one would; one of them alone can land on its old value by rounding).
    const std::vector<double> pa = pg[i].to_vector(), pb = p0[i].to_vector();
    const std::vector<double> ma = mg[i].to_vector(), mb = m0[i].to_vector();
    const std::vector<double> va = vg[i].to_vector(), vb = v0[i].to_vector();
    int64_t unchanged = 0;
    for (size_t k = 0; k < pa.size(); ++k)
      unchanged += pa[k] == pb[k] && ma[k] == mb[k] && va[k] == vb[k];
    EXPECT_EQ(unchanged, 0) << what << ": elements left as they were";
  }
}

// With copies or without, per-tensor or multi: the GPU numbers are the same bits, and the copies
// are what a separate copy_ after the update would write.
TEST(CudaAdamWMulti, CopiesEqualUpdateThenCopyBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> pa, ga, ma, va, ca, pb, mb, vb;
  for (int i = 0; i < 40; ++i) {
    const int64_t n = size_for(i, rng);
    Tensor p = random_tensor({n}, DType::F32, rng), g = random_tensor({n}, DType::BF16, rng);
    Tensor m = random_tensor({n}, DType::F32, rng, -0.1, 0.1);
    Tensor v = random_tensor({n}, DType::F32, rng, 1e-4, 0.01);
    pa.push_back(p.to(gpu()));
    ga.push_back(g.to(gpu()));
    ma.push_back(m.to(gpu()));
    va.push_back(v.to(gpu()));
    ca.push_back(poisoned({n}, DType::BF16));
    pb.push_back(p.to(gpu()));
    mb.push_back(m.to(gpu()));
    vb.push_back(v.to(gpu()));
  }
  for (int64_t step = 1; step <= 2; ++step) {
    const AdamWParams hp{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
    adamw_step_multi(pa, ga, ma, va, hp, 0.5, ca);
    for (size_t i = 0; i < pb.size(); ++i) adamw_step(pb[i], ga[i], mb[i], vb[i], hp, 0.5);
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    const std::string what = "tensor " + std::to_string(i);
    expect_same_bits(pa[i], pb[i], what + " param");
    expect_same_bits(ma[i], mb[i], what + " exp_avg");
    expect_same_bits(va[i], vb[i], what + " exp_avg_sq");
    Tensor rounded = Tensor::empty(pb[i].shape(), DType::BF16, gpu());
    rounded.copy_(pb[i]);
    expect_same_bits(ca[i], rounded, what + " compute copy");
  }
}

// More tensors than one launch's table holds (320): the op splits them over launches.
TEST(CudaAdamWMulti, MoreTensorsThanOneLaunchHolds) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> p, g, m, v, c, pg, gg, mg, vg, cg;
  for (int i = 0; i < 700; ++i) {
    const int64_t n = 1 + i % 9;
    p.push_back(random_tensor({n}, DType::F32, rng));
    g.push_back(random_tensor({n}, DType::F32, rng));
    m.push_back(random_tensor({n}, DType::F32, rng, -0.1, 0.1));
    v.push_back(random_tensor({n}, DType::F32, rng, 1e-4, 0.01));
    c.push_back(cpu_out({n}, DType::BF16));
    pg.push_back(p.back().to(gpu()));
    gg.push_back(g.back().to(gpu()));
    mg.push_back(m.back().to(gpu()));
    vg.push_back(v.back().to(gpu()));
    cg.push_back(poisoned({n}, DType::BF16));
  }
  const AdamWParams hp{1e-2, 0.9, 0.95, 1e-8, 0.1, 1};
  cpu_backend().adamw_step_multi(p, g, m, v, c, hp, 1.0);
  adamw_step_multi(pg, gg, mg, vg, hp, 1.0, cg);
  for (size_t i = 0; i < p.size(); ++i) {
    const std::string what = "tensor " + std::to_string(i);
    expect_close(pg[i], p[i], 1e-5, 1e-6, what + " param");
    expect_close(vg[i], v[i], 1e-5, 1e-9, what + " exp_avg_sq");
    expect_close(cg[i], c[i], 1e-2, 1e-3, what + " compute copy");
  }
}

// The Optimizer on the GPU with compute copies, as the strategies use it.
TEST(CudaAdamWMulti, OptimizerWithCopiesMatchesCpuOptimizer) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<Tensor> p, pg, c, cg, g, gg;
  std::vector<std::string> names;
  for (int i = 0; i < 12; ++i) {
    const int64_t n = size_for(i, rng);
    p.push_back(random_tensor({n}, DType::F32, rng));
    pg.push_back(p.back().to(gpu()));
    c.push_back(cpu_out({n}, DType::BF16));
    cg.push_back(poisoned({n}, DType::BF16));
    g.push_back(random_tensor({n}, DType::BF16, rng));
    gg.push_back(g.back().to(gpu()));
    names.push_back("w" + std::to_string(i));
  }
  OptimizerOptions opts;
  Optimizer cpu_opt(opts, p, names, c), gpu_opt(opts, pg, names, cg);
  cpu_opt.step(g, 1e-3, 0.8);
  gpu_opt.step(gg, 1e-3, 0.8);
  for (size_t i = 0; i < p.size(); ++i) {
    expect_close(pg[i], p[i], 1e-5, 1e-6, names[i] + " param");
    expect_close(cg[i], c[i], 1e-2, 1e-3, names[i] + " compute copy");
  }
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {
using namespace cuda_test;

// Moments within one bf16 ulp of the CPU's (the fp32 math before the rounding differs in its
// last bits between the kernels, which can put the two on either side of a bf16 midpoint), or
// within 1e-7 absolute: where the update's terms cancel (beta1 m ~ -(1 - beta1) g) the result
// is of the size of the terms' fp32 rounding (about 1e-8 for the terms of at most 1 here), which
// the GPU's fused multiply-add and the CPU's separate roundings leave differently (seen on the
// H200: gpu -1.5e-8 where the CPU's terms cancelled to 0).
void expect_within_a_bf16_ulp(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), DType::BF16) << what;
  ASSERT_EQ(want.dtype(), DType::BF16) << what;
  const std::vector<double> a = got.to(Device::cpu()).to_vector(), b = want.to_vector();
  ASSERT_EQ(a.size(), b.size()) << what;
  int64_t off = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double ulp = std::ldexp(std::abs(b[i]) > 0 ? std::abs(b[i]) : 1e-30, -7);
    if (std::abs(a[i] - b[i]) > std::max(ulp, 1e-7) && off++ < 5)
      ADD_FAILURE() << what << " element " << i << ": gpu " << a[i] << ", cpu " << b[i];
  }
}

// optimizer.state_dtype bf16: the multi-tensor kernel with bf16 exp_avg / exp_avg_sq (fp32, bf16
// and f16 gradients, with and without compute copies, vector and scalar paths) against the CPU
// kernel, and over several steps through the Optimizer.
TEST(CudaAdamWMulti, Bf16StateMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (bool copies : {true, false}) {
    std::vector<Tensor> p, g, m, v, c, pg, gg, mg, vg, cg;
    for (int i = 0; i < 60; ++i) {
      const int64_t n = size_for(i, rng);
      const DType gt = i % 3 == 0 ? DType::BF16 : (i % 3 == 1 ? DType::F32 : DType::F16);
      p.push_back(random_tensor({n}, DType::F32, rng));
      g.push_back(random_tensor({n}, gt, rng));
      m.push_back(random_tensor({n}, DType::BF16, rng, -0.1, 0.1));
      v.push_back(random_tensor({n}, DType::BF16, rng, 1e-4, 0.01));
      const bool misaligned = i == 11;
      pg.push_back(misaligned ? misaligned_gpu(p.back()) : p.back().to(gpu()));
      gg.push_back(g.back().to(gpu()));
      mg.push_back(misaligned ? misaligned_gpu(m.back()) : m.back().to(gpu()));
      vg.push_back(v.back().to(gpu()));
      if (copies) {
        c.push_back(cpu_out({n}, DType::BF16));
        cg.push_back(poisoned({n}, DType::BF16));
      }
    }
    const AdamWParams hp{1e-2, 0.9, 0.95, 1e-8, 0.1, 4};
    cpu_backend().adamw_step_multi(p, g, m, v, c, hp, 0.6);
    adamw_step_multi(pg, gg, mg, vg, hp, 0.6, cg);
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string what = "tensor " + std::to_string(i) + (copies ? " (copies)" : "");
      expect_close(pg[i], p[i], 1e-5, 1e-6, what + " param");
      expect_within_a_bf16_ulp(mg[i], m[i], what + " exp_avg");
      expect_within_a_bf16_ulp(vg[i], v[i], what + " exp_avg_sq");
      if (copies) {
        Tensor rounded = Tensor::empty(cg[i].shape(), DType::BF16, gpu());
        rounded.copy_(pg[i]);
        expect_same_bits(cg[i], rounded, what + " compute copy vs copy_");
      }
    }
  }
  // Ten steps through the Optimizer (bf16 state allocated by it) on both devices.
  OptimizerOptions opts;
  opts.state_dtype = DType::BF16;
  std::vector<Tensor> p, pg;
  std::vector<std::string> names;
  for (int i = 0; i < 8; ++i) {
    const int64_t n = size_for(i, rng);
    p.push_back(random_tensor({n}, DType::F32, rng));
    pg.push_back(p.back().to(gpu()));
    names.push_back("w" + std::to_string(i));
  }
  Optimizer cpu_opt(opts, p, names), gpu_opt(opts, pg, names);
  for (int step = 0; step < 10; ++step) {
    std::vector<Tensor> g, gg;
    for (const Tensor& t : p) {
      g.push_back(random_tensor(t.shape(), DType::BF16, rng));
      gg.push_back(g.back().to(gpu()));
    }
    cpu_opt.step(g, 1e-3);
    gpu_opt.step(gg, 1e-3);
  }
  // Each step moves a param by at most about lr (Adam's m / sqrt(v) is of size 1), and moments
  // rounded to bf16 on either side of a midpoint change that move by under 2^-7 of it; over ten
  // steps: 10 x lr x 2^-7 (seen on the H200: 2.2e-5).
  for (size_t i = 0; i < p.size(); ++i)
    expect_close(pg[i], p[i], 1e-4, 10 * 1e-3 * std::ldexp(1.0, -7), names[i] + " param");
  for (const auto& [key, t] : gpu_opt.state_tensors()) EXPECT_EQ(t.dtype(), DType::BF16) << key;
}

// SGD with a bf16 momentum buffer on the GPU against the CPU kernel.
TEST(CudaSgd, Bf16MomentumBufferMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = 10007;
  Tensor p = random_tensor({n}, DType::F32, rng), buf = random_tensor({n}, DType::BF16, rng);
  Tensor pg = p.to(gpu()), bufg = buf.to(gpu());
  for (int step = 0; step < 3; ++step) {
    Tensor g = random_tensor({n}, DType::BF16, rng);
    sgd_step(p, g, buf, 0.05, 0.9, 0.01, 0.5);
    sgd_step(pg, g.to(gpu()), bufg, 0.05, 0.9, 0.01, 0.5);
  }
  // A buffer element one bf16 ulp apart (rounded on either side of a midpoint) moves its param
  // by lr x that ulp in each later step: at most 3 x 0.05 x 2^-8 x max |buffer| (seen on the
  // H200: one element of 10007 at 3e-6).
  double max_buf = 0;
  for (double b : buf.to_vector()) max_buf = std::max(max_buf, std::abs(b));
  expect_close(pg, p, 1e-5, 3 * 0.05 * std::ldexp(max_buf, -8), "param");
  expect_within_a_bf16_ulp(bufg, buf, "momentum buffer");
}

}  // namespace
}  // namespace accel
