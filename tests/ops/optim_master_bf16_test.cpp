// optimizer.master_weights bf16 on the CPU: bf16 params are the master weights, updated in fp32
// and stochastically rounded (ops/optim_math.h). The rounding is unbiased and deterministic for a
// seed; one AdamW / SGD step equals a float64 reference put through the same rounding (the same
// random bits); many steps follow the fp32-master trajectory where round-to-nearest would stall;
// the multi-tensor path equals the per-tensor one; the Optimizer's seeds depend on the parameter
// and the element, not on how its tensors split the parameter (what makes every sharding round
// alike); and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "ops/optim_math.h"
#include "ops/optimizer.h"
#include "runtime/dtype.h"
#include "runtime/random.h"
#include "runtime/tensor.h"

namespace accel {
namespace {

std::vector<double> uniform(size_t n, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

Tensor converted(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype);
  out.copy_(t);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// The bf16 neighbours of x: toward zero (truncation) and away from it, and where x sits between
// them (0 at the lower, 1 at the upper) in bf16 ulps.
struct Neighbours {
  double low, high, frac;
};
Neighbours neighbours(double x) {
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const double low = bf16_to_f32(static_cast<uint16_t>(u >> 16));
  const double high = bf16_to_f32(static_cast<uint16_t>((u >> 16) + 1));
  return {low, high, (x - low) / (high - low)};
}

// x rounded by element i's random bits of stream r, computed from the float64 value: away from
// zero exactly when the 16 random bits reach (1 - frac) * 2^16. The kernel rounds its fp32 value,
// a few fp32 ulps (2^-16 bf16 ulps each) from float64: `near` marks bits within 4 of the
// threshold, where the two may part.
double reference_round(double x, const StochasticRounding& r, int64_t i, bool* near) {
  const Neighbours nb = neighbours(x);
  const double bits = philox::bits(r.seed, r.first, static_cast<uint64_t>(i)) & 0xffffu;
  const double threshold = (1.0 - nb.frac) * 65536.0;
  *near = std::abs(bits - threshold) <= 4;
  return bits >= threshold ? nb.high : nb.low;
}

TEST(StochasticRounding, IsUnbiased) {
  // 200,000 roundings of one value (one stream, consecutive elements): their mean is the value
  // within 5 standard errors (ulp * sqrt(p (1 - p) / n)); round-to-nearest or truncation would be
  // off by up to half an ulp, hundreds of standard errors.
  const int64_t n = 200000;
  const StochasticRounding r{0x5eed, 1000};
  for (double x : {1.0 + 0.3 / 128, -3.0 - 0.9 * 2 / 128, 1e-3 * (1 + 0.01 / 128), 0.7771}) {
    const Neighbours nb = neighbours(x);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double y = bf16_to_f32(optim_math::stochastic_bf16(static_cast<float>(x), r, i));
      ASSERT_TRUE(y == nb.low || y == nb.high) << x << " rounded to " << y;
      sum += y;
    }
    const double ulp = std::abs(nb.high - nb.low), p = nb.frac;
    const double se = ulp * std::sqrt(p * (1 - p) / static_cast<double>(n));
    EXPECT_NEAR(sum / static_cast<double>(n), static_cast<float>(x), 5 * se + 1e-12 * ulp)
        << "x " << x << ", ulp " << ulp << ", p " << p;
  }
}

TEST(StochasticRounding, IsDeterministicForASeedAndKeepsBf16Values) {
  std::mt19937_64 rng(3);
  const std::vector<double> xs = uniform(4096, rng, -2, 2);
  auto round_all = [&](uint64_t seed) {
    std::vector<uint16_t> out;
    for (size_t i = 0; i < xs.size(); ++i)
      out.push_back(optim_math::stochastic_bf16(static_cast<float>(xs[i]),
                                                StochasticRounding{seed, 0}, int64_t(i)));
    return out;
  };
  EXPECT_EQ(round_all(42), round_all(42));
  const std::vector<uint16_t> a = round_all(42), b = round_all(43);
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  EXPECT_GT(differ, 500) << "another seed must draw other bits";
  // Values bf16 holds exactly never move; NaN stays NaN; Inf stays Inf.
  for (uint32_t i = 0; i < 5000; ++i) {
    const uint16_t h = f32_to_bf16(static_cast<float>(xs[i % xs.size()]));
    EXPECT_EQ(optim_math::f32_to_bf16_stochastic(bf16_to_f32(h), 0xffffu * (i & 1) + i), h);
  }
  // The CUDA kernel's four-at-a-time bits are philox::bits' own.
  const StochasticRounding r{0x1234567890abcdefull, 8};
  for (int64_t i = 0; i < 64; i += 4) {
    const philox::U4 b = optim_math::stochastic_bits4(r, i);
    const uint32_t four[] = {b.x, b.y, b.z, b.w};
    for (int k = 0; k < 4; ++k) EXPECT_EQ(four[k], philox::bits(r.seed, r.first, i + k)) << i + k;
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(optim_math::f32_to_bf16_stochastic(NAN, 0xffff))));
  EXPECT_EQ(bf16_to_f32(optim_math::f32_to_bf16_stochastic(INFINITY, 0xffff)), INFINITY);
}

// One AdamW step of bf16 masters against float64 put through the same random bits. fp32 and
// bf16 moments, fp32 and bf16 gradients.
void check_adamw_step(DType grad_dtype, DType state_dtype) {
  SCOPED_TRACE(std::string("grad ") + dtype_name(grad_dtype) + ", state " +
               dtype_name(state_dtype));
  std::mt19937_64 rng(2026);
  const int64_t n = 20000;
  Tensor tp = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16);
  Tensor tg = Tensor::from_vector(uniform(size_t(n), rng, -0.5, 0.5), {n}, grad_dtype);
  Tensor tm = Tensor::from_vector(uniform(size_t(n), rng, -0.05, 0.05), {n}, state_dtype);
  Tensor tv = Tensor::from_vector(uniform(size_t(n), rng, 1e-5, 0.01), {n}, state_dtype);
  const std::vector<double> p = tp.to_vector(), g = tg.to_vector(), m = tm.to_vector(),
                            v = tv.to_vector();
  const AdamWParams h{1e-2, 0.9, 0.95, 1e-8, 0.1, 7};
  const StochasticRounding r{0xabcdef, 123456789};
  adamw_step(tp, tg, tm, tv, h, 0.75, &r);
  const double bc1 = 1 - std::pow(h.beta1, double(h.step)),
               bc2 = 1 - std::pow(h.beta2, double(h.step));
  const std::vector<double> gp = tp.to_vector(), gm = tm.to_vector(), gv = tv.to_vector();
  const double state_tol = state_dtype == DType::BF16 ? 1.0 / 256 : 2e-6;
  int near = 0, bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i) {
    const double gi = 0.75 * g[i];
    const double mi = h.beta1 * m[i] + (1 - h.beta1) * gi;
    const double vi = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
    const double pi =
        p[i] * (1 - h.lr * h.weight_decay) - h.lr * (mi / bc1) / (std::sqrt(vi / bc2) + h.eps);
    bool close_call = false;
    const double want = reference_round(pi, r, i, &close_call);
    if (gp[i] != want) {
      // fp32's rounding of the update moved the value past the threshold the bits set: then it
      // is the other neighbour.
      const Neighbours nb = neighbours(pi);
      if (close_call && (gp[i] == nb.low || gp[i] == nb.high)) {
        ++near;
      } else {
        ADD_FAILURE() << "param " << i << ": " << gp[i] << ", float64 " << pi << " rounds to "
                      << want;
        ++bad;
      }
    }
    // Relative to the terms summed (exp_avg may cancel to near zero).
    if (std::abs(gm[i] - mi) > state_tol * (std::abs(m[i]) + std::abs(gi)) ||
        std::abs(gv[i] - vi) > state_tol * vi) {
      ADD_FAILURE() << "moments " << i << ": " << gm[i] << ", " << gv[i] << " vs float64 " << mi
                    << ", " << vi;
      ++bad;
    }
  }
  EXPECT_LE(near, 5) << "close calls must be rare (about 1 in 8,000 elements)";
}

TEST(AdamWBf16Master, OneStepMatchesFloat64ThroughTheSameRounding) {
  check_adamw_step(DType::BF16, DType::F32);
  check_adamw_step(DType::F32, DType::F32);
  check_adamw_step(DType::BF16, DType::BF16);
}

TEST(SgdBf16Master, OneStepMatchesFloat64ThroughTheSameRounding) {
  std::mt19937_64 rng(9);
  const int64_t n = 20000;
  for (DType state : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(state));
    Tensor tp = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16);
    Tensor tg = Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16);
    Tensor tb = Tensor::from_vector(uniform(size_t(n), rng, -0.1, 0.1), {n}, state);
    const std::vector<double> p = tp.to_vector(), g = tg.to_vector(), b = tb.to_vector();
    const StochasticRounding r{77, 0};
    sgd_step(tp, tg, tb, 0.05, 0.9, 0.01, 0.5, &r);
    const std::vector<double> gp = tp.to_vector(), gb = tb.to_vector();
    int bad = 0, near = 0;
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      const double bi = 0.9 * b[i] + (0.5 * g[i] + 0.01 * p[i]);
      bool close_call = false;
      const double want = reference_round(p[i] - 0.05 * bi, r, i, &close_call);
      if (gp[i] != want) {
        if (close_call) {
          ++near;
        } else {
          ADD_FAILURE() << "param " << i << ": " << gp[i] << " vs " << want;
          ++bad;
        }
      }
      const double tol = state == DType::BF16 ? 1.0 / 256 : 2e-6;
      if (std::abs(gb[i] - bi) > tol * (std::abs(b[i]) + std::abs(g[i]) + std::abs(p[i]))) {
        ADD_FAILURE() << "buffer " << i << ": " << gb[i] << " vs " << bi;
        ++bad;
      }
    }
    EXPECT_LE(near, 5);
  }
}

TEST(AdamWBf16Master, FollowsTheFp32MasterWhereRoundToNearestStalls) {
  // 400 steps of AdamW toward a target, lr 1e-4: each update is ~1/40 of a bf16 ulp at |w| ~ 0.5
  // (ulp 2^-9), so bf16 weights rounded to nearest never move, while stochastic rounding moves
  // them on average as the fp32 master moves.
  std::mt19937_64 rng(5);
  const int64_t n = 4096;
  const std::vector<double> w0 = uniform(size_t(n), rng, 0.5, 0.9);
  OptimizerOptions o;
  o.weight_decay = 0;
  OptimizerOptions o16 = o;
  o16.master_dtype = DType::BF16;
  o16.rounding_seed = 99;
  Tensor w16 = Tensor::from_vector(w0, {n}, DType::BF16), start = w16.clone();
  Tensor w32 = converted(w16, DType::F32), nearest = w16.clone();
  Optimizer opt32(o, {w32}, {"w"}), opt16(o16, {w16}, {"w"});
  Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n}), w_rne = w32.clone();
  for (int step = 1; step <= 400; ++step) {
    // A constant gradient sign: every weight drifts down at lr per step.
    Tensor g = Tensor::full({n}, 1.0, DType::F32);
    opt32.step({g}, 1e-4);
    opt16.step({g}, 1e-4);
    adamw_step(w_rne, g, m, v, AdamWParams{1e-4, 0.9, 0.95, 1e-8, 0, step});
    nearest.copy_(w_rne);  // round to nearest every step: the bf16 weights the model would get
    w_rne.copy_(nearest);
  }
  const std::vector<double> a = w32.to_vector(), b = w16.to_vector(), s = start.to_vector(),
                            c = nearest.to_vector();
  double moved32 = 0, moved16 = 0, moved_rne = 0;
  for (int64_t i = 0; i < n; ++i) {
    moved32 += s[i] - a[i];
    moved16 += s[i] - b[i];
    moved_rne += s[i] - c[i];
  }
  moved32 /= n;
  moved16 /= n;
  moved_rne /= n;
  EXPECT_NEAR(moved32, 400 * 1e-4, 4e-3);  // Adam's step is ~lr for a constant gradient
  EXPECT_NEAR(moved16, moved32, 0.02 * moved32) << "stochastic rounding follows the fp32 master";
  EXPECT_EQ(moved_rne, 0.0) << "round to nearest stalls (why bf16 masters need SR)";
}

TEST(AdamWBf16Master, MultiTensorEqualsPerTensor) {
  std::mt19937_64 rng(13);
  std::vector<Tensor> p, g, m, v, p1, m1, v1;
  std::vector<StochasticRounding> r;
  for (int i = 0; i < 5; ++i) {
    const int64_t n = 100 + 917 * i;
    p.push_back(Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16));
    g.push_back(Tensor::from_vector(uniform(size_t(n), rng, -1, 1), {n}, DType::BF16));
    m.push_back(Tensor::zeros({n}));
    v.push_back(Tensor::zeros({n}));
    p1.push_back(p.back().clone());
    m1.push_back(m.back().clone());
    v1.push_back(v.back().clone());
    r.push_back({uint64_t(1000 + i), uint64_t(7 * i)});
  }
  const AdamWParams h{1e-3, 0.9, 0.95, 1e-8, 0.1, 1};
  adamw_step_multi(p, g, m, v, h, 1.0, {}, r);
  for (size_t i = 0; i < p.size(); ++i) {
    adamw_step(p1[i], g[i], m1[i], v1[i], h, 1.0, &r[i]);
    EXPECT_TRUE(same_bits(p[i], p1[i])) << i;
    EXPECT_TRUE(same_bits(m[i], m1[i])) << i;
  }
}

// Two steps of one Optimizer over whole parameters, and of one whose tensors split the same
// parameters differently (as shards do, with padding between): bit for bit the same.
TEST(OptimizerBf16Master, RoundingDependsOnTheParameterAndElementNotTheLayout) {
  std::mt19937_64 rng(21);
  const int64_t na = 1000, nb = 333;
  const Tensor a0 = Tensor::from_vector(uniform(size_t(na), rng, -1, 1), {na}, DType::BF16);
  const Tensor b0 = Tensor::from_vector(uniform(size_t(nb), rng, -1, 1), {nb}, DType::BF16);
  for (OptimizerName name : {OptimizerName::AdamW, OptimizerName::Sgd}) {
    OptimizerOptions o;
    o.name = name;
    o.master_dtype = DType::BF16;
    o.rounding_seed = 1234;
    Tensor a = a0.clone(), b = b0.clone();
    Optimizer whole(o, {a, b}, {"a", "b"});
    // Chunk 0: a[0, 600); chunk 1: a[600, 1000), 5 padding elements, b whole, 3 padding.
    const int64_t n1 = 400 + 5 + nb + 3;
    Tensor c0 = a0.as_strided({600}, {1}, 0).clone(), c1 = Tensor::zeros({n1}, DType::BF16);
    c1.as_strided({400}, {1}, 0).copy_(a0.as_strided({400}, {1}, 600));
    c1.as_strided({nb}, {1}, 405).copy_(b0);
    Optimizer split(
        o, {c0, c1}, {"chunk0", "chunk1"}, {},
        {{ParamSpan{0, 600, "a", 0}}, {ParamSpan{0, 400, "a", 600}, {405, nb, "b", 0}}});
    for (int step = 0; step < 2; ++step) {
      Tensor ga = Tensor::from_vector(uniform(size_t(na), rng, -1, 1), {na}, DType::BF16);
      Tensor gb = Tensor::from_vector(uniform(size_t(nb), rng, -1, 1), {nb}, DType::BF16);
      Tensor g1 = Tensor::zeros({n1}, DType::BF16);
      g1.as_strided({400}, {1}, 0).copy_(ga.as_strided({400}, {1}, 600));
      g1.as_strided({nb}, {1}, 405).copy_(gb);
      whole.step({ga, gb}, 1e-2);
      split.step({ga.as_strided({600}, {1}, 0).clone(), g1}, 1e-2);
    }
    EXPECT_TRUE(same_bits(c0, a.as_strided({600}, {1}, 0).clone()));
    EXPECT_TRUE(
        same_bits(c1.as_strided({400}, {1}, 0).clone(), a.as_strided({400}, {1}, 600).clone()));
    EXPECT_TRUE(same_bits(c1.as_strided({nb}, {1}, 405).clone(), b));
    // Padding is no parameter's: untouched.
    for (double x : c1.as_strided({5}, {1}, 400).to_vector()) EXPECT_EQ(x, 0.0);
    // Not trivially equal: the step moved the weights, and another seed rounds differently.
    EXPECT_FALSE(same_bits(a, a0));
    OptimizerOptions other = o;
    other.rounding_seed = 1235;
    Tensor a2 = a0.clone(), b2 = b0.clone();
    Optimizer reseeded(other, {a2, b2}, {"a", "b"});
    std::mt19937_64 rng2(21);
    Tensor ga = Tensor::from_vector(uniform(size_t(na), rng2, -1, 1), {na}, DType::BF16);
    Tensor a3 = a0.clone(), b3 = b0.clone();
    Optimizer same_seed(o, {a3, b3}, {"a", "b"});
    reseeded.step({ga, Tensor()}, 1e-2);
    same_seed.step({ga, Tensor()}, 1e-2);
    EXPECT_FALSE(same_bits(a2, a3)) << "the rounding_seed must change the rounding";
  }
}

TEST(OptimizerBf16Master, StateInTheStateDtypeAndRefusals) {
  OptimizerOptions o;
  o.master_dtype = DType::BF16;
  Tensor w = Tensor::zeros({8}, DType::BF16);
  {
    Optimizer opt(o, {w}, {"w"});
    for (const auto& [key, t] : opt.state_tensors()) EXPECT_EQ(t.dtype(), DType::F32) << key;
  }
  o.state_dtype = DType::BF16;
  {
    Optimizer opt(o, {w}, {"w"});
    for (const auto& [key, t] : opt.state_tensors()) EXPECT_EQ(t.dtype(), DType::BF16) << key;
  }
  // fp32 params with bf16 masters, bf16 params with fp32 masters, copies, spans past the end.
  EXPECT_THROW(Optimizer(o, {Tensor::zeros({8})}, {"w"}), std::logic_error);
  OptimizerOptions fp32 = o;
  fp32.master_dtype = DType::F32;
  EXPECT_THROW(Optimizer(fp32, {w}, {"w"}), std::logic_error);
  EXPECT_THROW(Optimizer(o, {w}, {"w"}, {Tensor::zeros({8}, DType::BF16)}), std::logic_error);
  EXPECT_THROW(Optimizer(o, {w}, {"w"}, {}, {{ParamSpan{4, 5, "w", 0}}}), std::logic_error);
  // The kernels: a bf16 param needs its rounding; an fp32 one takes none.
  Tensor g = Tensor::zeros({8}, DType::BF16), m = Tensor::zeros({8}), v = Tensor::zeros({8});
  const AdamWParams h{1e-3, 0.9, 0.95, 1e-8, 0, 1};
  EXPECT_THROW(adamw_step(w, g, m, v, h), std::invalid_argument);
  const StochasticRounding r{1, 0};
  Tensor w32 = Tensor::zeros({8});
  EXPECT_THROW(adamw_step(w32, g, m, v, h, 1.0, &r), std::invalid_argument);
  EXPECT_THROW(sgd_step(w, g, m, 0.1, 0.9, 0), std::invalid_argument);
}

}  // namespace
}  // namespace accel
