// optimizer.state_dtype bf16 on the CPU: AdamW's moments (and SGD's momentum buffer) stored in
// bf16 beside fp32 params. One step against torch's formulas in float64 (the update uses the
// fp32 moments before they are rounded; the stored moments are their round-to-nearest-even),
// many steps against the fp32-state run, the multi-tensor path against the per-tensor one bit for
// bit, the Optimizer's allocation, memory and checkpoint conversions, and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "ops/optimizer.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace accel {
namespace {

std::vector<double> uniform(size_t n, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// The value rounded to bf16 (round to nearest even) and back.
double bf16_round(double x) { return bf16_to_f32(f32_to_bf16(static_cast<float>(x))); }

// One bf16 ulp at |x| (8 significant bits).
double bf16_ulp(double x) {
  if (x == 0) return std::ldexp(1.0, -133);
  int e = 0;
  std::frexp(std::abs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

TEST(AdamWBf16State, OneStepMatchesFloat64Reference) {
  std::mt19937_64 rng(2025);
  const size_t n = 5000;
  // Moments that bf16 holds exactly, so that both sides start from the same numbers.
  std::vector<double> p = uniform(n, rng, -1, 1), g = uniform(n, rng, -0.5, 0.5);
  std::vector<double> m = uniform(n, rng, -0.05, 0.05), v = uniform(n, rng, 1e-5, 0.01);
  for (double& x : m) x = bf16_round(x);
  for (double& x : v) x = bf16_round(x);
  Tensor tp = Tensor::from_vector(p, {int64_t(n)}, DType::F32);
  Tensor tg = Tensor::from_vector(g, {int64_t(n)}, DType::F32);
  Tensor tm = Tensor::from_vector(m, {int64_t(n)}, DType::BF16);
  Tensor tv = Tensor::from_vector(v, {int64_t(n)}, DType::BF16);
  p = tp.to_vector();
  g = tg.to_vector();
  const AdamWParams h{1e-2, 0.9, 0.95, 1e-8, 0.1, 7};
  adamw_step(tp, tg, tm, tv, h, 0.75);
  EXPECT_EQ(tm.dtype(), DType::BF16);
  EXPECT_EQ(tv.dtype(), DType::BF16);

  const double bc1 = 1 - std::pow(h.beta1, double(h.step)),
               bc2 = 1 - std::pow(h.beta2, double(h.step));
  const std::vector<double> gp = tp.to_vector(), gm = tm.to_vector(), gv = tv.to_vector();
  int bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    const double gi = 0.75 * g[i];
    const double mi = h.beta1 * m[i] + (1 - h.beta1) * gi;
    const double vi = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
    const double pi =
        p[i] * (1 - h.lr * h.weight_decay) - h.lr * (mi / bc1) / (std::sqrt(vi / bc2) + h.eps);
    // The update ran in fp32 on the unrounded moments: fp32 accuracy on the param.
    if (std::abs(gp[i] - pi) > 2e-6 * std::abs(pi) + 1e-7) {
      ADD_FAILURE() << "param " << i << ": " << gp[i] << " vs float64 " << pi;
      ++bad;
    }
    // The stored moments are the fp32 results rounded once: within half a bf16 ulp of float64
    // plus fp32's own error (a bf16 midpoint may go either way).
    if (std::abs(gm[i] - mi) > 0.5 * bf16_ulp(mi) + 1e-6 * std::abs(mi) + 1e-12) {
      ADD_FAILURE() << "exp_avg " << i << ": " << gm[i] << " vs float64 " << mi;
      ++bad;
    }
    if (std::abs(gv[i] - vi) > 0.5 * bf16_ulp(vi) + 1e-6 * vi) {
      ADD_FAILURE() << "exp_avg_sq " << i << ": " << gv[i] << " vs float64 " << vi;
      ++bad;
    }
  }
}

TEST(AdamWBf16State, StoredMomentsAreTheFp32MomentsRounded) {
  // The same step with fp32 state from the same (bf16-exact) moments: the bf16 run's stored
  // moments are exactly the fp32 run's moments rounded to nearest even, and its param is the
  // fp32 run's param bit for bit (the update never sees the rounded values).
  std::mt19937_64 rng(7);
  const int64_t n = 3001;
  std::vector<double> m = uniform(size_t(n), rng, -0.05, 0.05),
                      v = uniform(size_t(n), rng, 0, 0.01);
  for (double& x : m) x = bf16_round(x);
  for (double& x : v) x = bf16_round(x);
  const Tensor p0 = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::F32);
  const Tensor g = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16);
  Tensor p32 = p0.clone(), m32 = Tensor::from_vector(m, {n}, DType::F32),
         v32 = Tensor::from_vector(v, {n}, DType::F32);
  Tensor p16 = p0.clone(), m16 = Tensor::from_vector(m, {n}, DType::BF16),
         v16 = Tensor::from_vector(v, {n}, DType::BF16);
  const AdamWParams h{3e-3, 0.9, 0.95, 1e-8, 0.1, 2};
  adamw_step(p32, g, m32, v32, h);
  adamw_step(p16, g, m16, v16, h);
  EXPECT_EQ(std::memcmp(p32.data_ptr(), p16.data_ptr(), p32.nbytes()), 0);
  Tensor m_round = Tensor::empty({n}, DType::BF16), v_round = Tensor::empty({n}, DType::BF16);
  m_round.copy_(m32);
  v_round.copy_(v32);
  EXPECT_EQ(std::memcmp(m_round.data_ptr(), m16.data_ptr(), m16.nbytes()), 0);
  EXPECT_EQ(std::memcmp(v_round.data_ptr(), v16.data_ptr(), v16.nbytes()), 0);
}

TEST(AdamWBf16State, ManyStepsStayCloseToFp32State) {
  // 200 steps on a quadratic with noisy gradients: bf16 moments give nearly the fp32 trajectory.
  std::mt19937_64 rng(11);
  const int64_t n = 512;
  const std::vector<double> target = uniform(size_t(n), rng, -1, 1);
  OptimizerOptions o32, o16;
  o16.state_dtype = DType::BF16;
  Tensor w32 = Tensor::zeros({n}, DType::F32), w16 = Tensor::zeros({n}, DType::F32);
  Optimizer a(o32, {w32}, {"w"}), b(o16, {w16}, {"w"});
  std::normal_distribution<double> noise(0.0, 0.05);
  for (int step = 0; step < 200; ++step) {
    std::vector<double> na(static_cast<size_t>(n));
    for (double& x : na) x = noise(rng);
    auto grad = [&](const Tensor& w) {
      std::vector<double> wv = w.to_vector(), gv(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        gv[size_t(i)] = wv[size_t(i)] - target[size_t(i)] + na[size_t(i)];
      return Tensor::from_vector(gv, {n}, DType::F32);
    };
    a.step({grad(w32)}, 1e-2);
    b.step({grad(w16)}, 1e-2);
  }
  const std::vector<double> x = w32.to_vector(), y = w16.to_vector();
  double max_diff = 0, err32 = 0, err16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::abs(x[size_t(i)] - y[size_t(i)]));
    err32 += std::pow(x[size_t(i)] - target[size_t(i)], 2);
    err16 += std::pow(y[size_t(i)] - target[size_t(i)], 2);
  }
  EXPECT_LT(max_diff, 0.02);
  EXPECT_NEAR(std::sqrt(err16 / n), std::sqrt(err32 / n), 0.01);
}

TEST(AdamWBf16State, MultiEqualsPerTensorBitForBit) {
  std::mt19937_64 rng(5);
  std::vector<Tensor> pa, ga, ma, va, ca, pb, mb, vb;
  for (int64_t size : {1, 7, 4099, 64, 3}) {
    const Tensor p = Tensor::from_vector(uniform(size_t(size), rng, -1, 1), {size}, DType::F32);
    const Tensor g = Tensor::from_vector(uniform(size_t(size), rng, -1, 1), {size}, DType::BF16);
    const Tensor m = Tensor::from_vector(uniform(size_t(size), rng, -.1, .1), {size}, DType::BF16);
    const Tensor v = Tensor::from_vector(uniform(size_t(size), rng, 0, .01), {size}, DType::BF16);
    pa.push_back(p.clone());
    ga.push_back(g);
    ma.push_back(m.clone());
    va.push_back(v.clone());
    ca.push_back(Tensor::empty({size}, DType::BF16));
    pb.push_back(p.clone());
    mb.push_back(m.clone());
    vb.push_back(v.clone());
  }
  for (int64_t step = 1; step <= 3; ++step) {
    const AdamWParams h{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
    adamw_step_multi(pa, ga, ma, va, h, 0.5, ca);
    for (size_t i = 0; i < pb.size(); ++i) adamw_step(pb[i], ga[i], mb[i], vb[i], h, 0.5);
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(std::memcmp(pa[i].data_ptr(), pb[i].data_ptr(), pa[i].nbytes()), 0) << i;
    EXPECT_EQ(std::memcmp(ma[i].data_ptr(), mb[i].data_ptr(), ma[i].nbytes()), 0) << i;
    EXPECT_EQ(std::memcmp(va[i].data_ptr(), vb[i].data_ptr(), va[i].nbytes()), 0) << i;
    Tensor rounded = Tensor::empty(pb[i].shape(), DType::BF16);
    rounded.copy_(pb[i]);
    EXPECT_EQ(std::memcmp(ca[i].data_ptr(), rounded.data_ptr(), rounded.nbytes()), 0) << i;
  }
}

TEST(SgdBf16State, MomentumBufferMatchesFloat64Reference) {
  std::mt19937_64 rng(3);
  const int64_t n = 2000;
  std::vector<double> p = uniform(size_t(n), rng, -1, 1), buf(size_t(n), 0.0);
  Tensor tp = Tensor::from_vector(p, {n}, DType::F32), tb = Tensor::zeros({n}, DType::BF16);
  p = tp.to_vector();
  const double lr = 0.05, mom = 0.9, wd = 0.01;
  for (int step = 0; step < 3; ++step) {
    const Tensor tg = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::F32);
    const std::vector<double> g = tg.to_vector();
    sgd_step(tp, tg, tb, lr, mom, wd);
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = size_t(i);
      const double b = bf16_round(buf[k]) * mom + g[k] + wd * p[k];  // the stored buffer is bf16
      p[k] -= lr * b;
      buf[k] = b;
    }
    // Re-anchor on the run's own param (fp32 rounding compounds otherwise).
    const std::vector<double> got = tp.to_vector(), gb = tb.to_vector();
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = size_t(i);
      ASSERT_NEAR(got[k], p[k], 1e-5) << "step " << step << " param " << i;
      ASSERT_NEAR(gb[k], buf[k], 0.5 * bf16_ulp(buf[k]) + 1e-5 * std::abs(buf[k]))
          << "step " << step << " buffer " << i;
      p[k] = got[k];
    }
  }
}

TEST(OptimizerBf16State, AllocatesHalfTheBytesAndConvertsOnLoad) {
  const Device cpu = Device::cpu();
  const int cat = static_cast<int>(MemCategory::OptimizerState);
  auto state_bytes = [&](DType state, OptimizerName name) {
    const int64_t before = memory_stats(cpu).current[cat];
    OptimizerOptions o;
    o.name = name;
    o.state_dtype = state;
    Tensor w = Tensor::zeros({1000}, DType::F32, cpu, MemCategory::Params);
    Optimizer opt(o, {w}, {"w"});
    for (const auto& [key, t] : opt.state_tensors()) EXPECT_EQ(t.dtype(), state) << key;
    return memory_stats(cpu).current[cat] - before;
  };
  EXPECT_EQ(state_bytes(DType::F32, OptimizerName::AdamW), 8000);
  EXPECT_EQ(state_bytes(DType::BF16, OptimizerName::AdamW), 4000);
  EXPECT_EQ(state_bytes(DType::F32, OptimizerName::Sgd), 4000);
  EXPECT_EQ(state_bytes(DType::BF16, OptimizerName::Sgd), 2000);

  // load_state converts: fp32 tensors are rounded to nearest even, bf16 ones copied exactly.
  OptimizerOptions o;
  o.state_dtype = DType::BF16;
  Tensor w = Tensor::zeros({3}, DType::F32);
  Optimizer opt(o, {w}, {"w"});
  const std::vector<double> m = {1.0 + 1.0 / 512, -3.0, 0.1}, v = {0.5, 1e-3, 2.0};
  opt.load_state({{"w.exp_avg", Tensor::from_vector(m, {3}, DType::F32)},
                  {"w.exp_avg_sq", Tensor::from_vector(v, {3}, DType::BF16)}},
                 4);
  EXPECT_EQ(opt.step_count(), 4);
  const auto st = opt.state_tensors();
  const std::vector<double> gm = st[0].second.to_vector(), gv = st[1].second.to_vector();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(gm[i], bf16_round(m[i])) << i;
    EXPECT_EQ(gv[i], bf16_round(v[i])) << i;
  }
  EXPECT_EQ(gm[0], 1.0);  // 1 + 2^-9 is a midpoint: to even
}

TEST(OptimizerBf16State, Refusals) {
  OptimizerOptions o;
  o.state_dtype = DType::BF16;
  Tensor w64 = Tensor::zeros({4}, DType::F64);
  EXPECT_THROW(Optimizer(o, {w64}, {"w"}), std::logic_error);
  o.state_dtype = DType::F16;
  Tensor w = Tensor::zeros({4}, DType::F32);
  EXPECT_THROW(Optimizer(o, {w}, {"w"}), std::logic_error);
  // The kernels: exp_avg and exp_avg_sq of different dtypes, bf16 state beside an f64 param.
  const Tensor g = Tensor::zeros({4}, DType::F32);
  const AdamWParams h{1e-3, 0.9, 0.95, 1e-8, 0.0, 1};
  EXPECT_THROW(adamw_step(w, g, Tensor::zeros({4}, DType::BF16), Tensor::zeros({4}, DType::F32), h),
               std::invalid_argument);
  EXPECT_THROW(adamw_step(w64, Tensor::zeros({4}, DType::F64), Tensor::zeros({4}, DType::BF16),
                          Tensor::zeros({4}, DType::BF16), h),
               std::invalid_argument);
  EXPECT_THROW(adamw_step(w, g, Tensor::zeros({4}, DType::F16), Tensor::zeros({4}, DType::F16), h),
               std::invalid_argument);
}

}  // namespace
}  // namespace accel
