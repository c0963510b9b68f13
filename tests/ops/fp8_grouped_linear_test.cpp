// fp8_grouped_linear (the mixture-of-experts experts' GEMMs in fp8) on the CPU emulation: forward
// and backward equal a float64 reference of quantize-then-GEMM per group (each group cast with
// its own context's scales, the dense path's casts), an empty group casts nothing and gets a zero
// weight gradient, every group is bit for bit the fp8_linear of its rows, and a disabled autocast
// gives grouped_linear.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

// K = 24 and N = 40 are not multiples of 16 (the casts pad them); group 2 is empty.
const std::vector<int64_t> kGroups = {5, 19, 0, 8};
constexpr int64_t kIn = 24, kOut = 40;

struct Experts {
  std::shared_ptr<Fp8DelayedScaling> delayed;  // null for dynamic scaling
  std::vector<Fp8LinearContext> contexts;      // one per group
  std::vector<const Fp8LinearContext*> pointers() const {
    std::vector<const Fp8LinearContext*> out;
    for (const Fp8LinearContext& c : contexts) out.push_back(&c);
    return out;
  }
};

Experts make_experts(Fp8Scaling scaling, std::shared_ptr<const Fp8Autocast> autocast = nullptr,
                     size_t groups = kGroups.size()) {
  Experts e;
  Fp8Recipe r;
  r.scaling = scaling;
  r.amax_history_len = 4;
  if (scaling == Fp8Scaling::Delayed)
    e.delayed = std::make_shared<Fp8DelayedScaling>(r, Device::cpu());
  for (size_t g = 0; g < groups; ++g) {
    Fp8LinearContext c;
    c.recipe = r;
    c.autocast = autocast;
    if (e.delayed) {
      c.delayed = e.delayed;
      c.slot_input = e.delayed->add_slot(DType::E4M3);
      c.slot_weight = e.delayed->add_slot(DType::E4M3);
      c.slot_grad_output = e.delayed->add_slot(DType::E5M2);
    }
    e.contexts.push_back(c);
  }
  if (e.delayed) {
    // Scales near what the amaxes give that differ per group by factors other than powers of
    // two (those would round alike), so that a group cast with another group's scale shows.
    std::vector<float> s;
    for (size_t g = 0; g < groups; ++g)
      for (float base : {64.0f, 128.0f, 4096.0f}) s.push_back(base * (1.0f + 0.37f * float(g)));
    e.delayed->scales().copy_(Tensor::from_vector(s, {static_cast<int64_t>(s.size())}));
    std::vector<float> inv;
    for (float v : s) inv.push_back(1.0f / v);
    e.delayed->scale_invs().copy_(Tensor::from_vector(inv, {static_cast<int64_t>(inv.size())}));
  }
  return e;
}

struct Inputs {
  Tensor x, g;                  // [rows, in], [rows, out]
  std::vector<Tensor> weights;  // [out, in] each
};

Inputs make_inputs(DType dtype) {
  int64_t rows = 0;
  for (int64_t n : kGroups) rows += n;
  Inputs in;
  in.x = test::randn({rows, kIn}, 1, dtype);
  in.g = test::randn({rows, kOut}, 2, dtype, 1e-3);  // gradients are small, as in training
  for (size_t e = 0; e < kGroups.size(); ++e)
    in.weights.push_back(test::randn({kOut, kIn}, 10 + e, dtype, 0.2 * (1.0 + double(e))));
  return in;
}

struct Grads {
  Tensor y, dx;
  std::vector<Tensor> dw;
};

Grads run(const Inputs& in,
          const std::function<Tensor(const Tensor&, const std::vector<Tensor>&)>& f) {
  Tensor x = in.x.clone().set_requires_grad(true);
  std::vector<Tensor> w;
  for (const Tensor& t : in.weights) w.push_back(t.clone().set_requires_grad(true));
  Tensor y = f(x, w);
  y.backward(in.g);
  Grads out{y.detach(), x.grad(), {}};
  for (Tensor& t : w) out.dw.push_back(t.grad());
  return out;
}

// The fp8 codes of a cast (decoded, exact in f64) of t [r, c], and its scale_inv.
struct Codes {
  std::vector<double> v;  // [r, c]
  double scale_inv = 1;
};
Codes codes_of(const Fp8Tensor& q) {
  Tensor c = narrow(narrow(cast(q.data, DType::F32), 0, 0, q.rows), 1, 0, q.cols);
  return {contiguous(c).to_vector(), q.scale_inv.item()};
}
Codes quantize(const Tensor& t, DType fmt, const Experts& e, int slot) {
  Fp8CastOptions o;
  if (e.delayed) return codes_of(fp8_cast(t, fmt, e.delayed->scale(slot), Tensor(), o));
  return codes_of(fp8_cast_dynamic(t, fmt, o));
}

// out[i, j] = s * sum_k a[i, k] b[j, k] (a [m, K], b [n, K]) in f64.
std::vector<double> abt(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                        int64_t n, int64_t K, double s) {
  std::vector<double> out(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += a[i * K + k] * b[j * K + k];
      out[i * n + j] = s * acc;
    }
  return out;
}
std::vector<double> transposed(const std::vector<double>& a, int64_t r, int64_t c) {
  std::vector<double> t(a.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  return t;
}

// The f64 reference: per group, quantize x, w and g with the group's scales, then the GEMMs.
Grads reference(const Inputs& in, const Experts& e) {
  const int64_t rows = in.x.size(0);
  std::vector<double> y(rows * kOut), dx(rows * kIn);
  Grads out;
  int64_t begin = 0;
  for (size_t gi = 0; gi < kGroups.size(); ++gi) {
    const int64_t m = kGroups[gi];
    const Fp8LinearContext& c = e.contexts[gi];
    if (m == 0) {
      out.dw.push_back(Tensor::zeros({kOut, kIn}, DType::F64));
      continue;
    }
    const Codes qx = quantize(narrow(in.x, 0, begin, m), DType::E4M3, e, c.slot_input);
    const Codes qw = quantize(in.weights[gi], DType::E4M3, e, c.slot_weight);
    const Codes qg = quantize(narrow(in.g, 0, begin, m), DType::E5M2, e, c.slot_grad_output);
    const std::vector<double> yg = abt(qx.v, qw.v, m, kOut, kIn, qx.scale_inv * qw.scale_inv);
    const std::vector<double> dxg =
        abt(qg.v, transposed(qw.v, kOut, kIn), m, kIn, kOut, qg.scale_inv * qw.scale_inv);
    const std::vector<double> dwg = abt(transposed(qg.v, m, kOut), transposed(qx.v, m, kIn), kOut,
                                        kIn, m, qg.scale_inv * qx.scale_inv);
    std::copy(yg.begin(), yg.end(), y.begin() + begin * kOut);
    std::copy(dxg.begin(), dxg.end(), dx.begin() + begin * kIn);
    out.dw.push_back(Tensor::from_vector(dwg, {kOut, kIn}, DType::F64));
    begin += m;
  }
  out.y = Tensor::from_vector(y, {rows, kOut}, DType::F64);
  out.dx = Tensor::from_vector(dx, {rows, kIn}, DType::F64);
  return out;
}

// y and dx of the same groups without quantization, in f64.
Grads unquantized(const Inputs& in) {
  const int64_t rows = in.x.size(0);
  std::vector<double> y(rows * kOut), dx(rows * kIn);
  int64_t begin = 0;
  for (size_t gi = 0; gi < kGroups.size(); ++gi) {
    const int64_t m = kGroups[gi];
    if (m == 0) continue;
    const std::vector<double> x = contiguous(narrow(in.x, 0, begin, m)).to_vector();
    const std::vector<double> g = contiguous(narrow(in.g, 0, begin, m)).to_vector();
    const std::vector<double> w = in.weights[gi].to_vector();
    const std::vector<double> yg = abt(x, w, m, kOut, kIn, 1.0);
    const std::vector<double> dxg = abt(g, transposed(w, kOut, kIn), m, kIn, kOut, 1.0);
    std::copy(yg.begin(), yg.end(), y.begin() + begin * kOut);
    std::copy(dxg.begin(), dxg.end(), dx.begin() + begin * kIn);
    begin += m;
  }
  return {Tensor::from_vector(y, {rows, kOut}, DType::F64),
          Tensor::from_vector(dx, {rows, kIn}, DType::F64),
          {}};
}

// max |got - want| / max |want|.
double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> a = got.to_vector(), b = want.to_vector();
  double err = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    mag = std::max(mag, std::abs(b[i]));
  }
  return err / std::max(mag, 1e-300);
}

Tensor grouped_fp8(const Tensor& x, const std::vector<Tensor>& w, const Experts& e) {
  return fp8_grouped_linear(x, w, kGroups, e.pointers());
}

class Fp8GroupedLinear : public ::testing::TestWithParam<std::tuple<Fp8Scaling, DType>> {};

TEST_P(Fp8GroupedLinear, EqualsTheFloat64QuantizeThenGemmReference) {
  const auto [scaling, dtype] = GetParam();
  const Inputs in = make_inputs(dtype);
  Experts e = make_experts(scaling);
  const Grads want = reference(in, e);
  const Grads got =
      run(in, [&](const Tensor& x, const std::vector<Tensor>& w) { return grouped_fp8(x, w, e); });
  EXPECT_EQ(got.y.dtype(), dtype);
  EXPECT_EQ(got.dw[0].dtype(), dtype);
  // fp32 accumulation against f64 (f32 outputs), plus one rounding of a 16-bit output.
  const double tol = dtype == DType::F32 ? 1e-5 : 8e-3;
  EXPECT_LT(rel_error(got.y, want.y), tol);
  EXPECT_LT(rel_error(got.dx, want.dx), tol);
  for (size_t g = 0; g < kGroups.size(); ++g)
    if (kGroups[g] > 0) {
      EXPECT_LT(rel_error(got.dw[g], want.dw[g]), tol) << "group " << g;
    }
  // The empty group's weight gets zeros.
  for (double v : got.dw[2].to_vector()) ASSERT_EQ(v, 0.0);
  // Quantization happened: the unquantized product is farther off than the tolerance.
  const Grads hp = unquantized(in);
  EXPECT_GT(rel_error(hp.y, want.y), 4 * tol);
  EXPECT_GT(rel_error(hp.dx, want.dx), 4 * tol);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8GroupedLinear,
    ::testing::Combine(::testing::Values(Fp8Scaling::Delayed, Fp8Scaling::Dynamic),
                       ::testing::Values(DType::F32, DType::BF16)),
    [](const auto& i) {
      return std::string(std::get<0>(i.param) == Fp8Scaling::Delayed ? "Delayed" : "Dynamic") +
             "_" + dtype_name(std::get<1>(i.param));
    });

// Delayed scaling records every group's amaxes in the group's own slots (an empty group's stay 0).
TEST(Fp8GroupedLinearDelayed, RecordsEachGroupsAmaxesInItsSlots) {
  const Inputs in = make_inputs(DType::BF16);
  Experts e = make_experts(Fp8Scaling::Delayed);
  run(in, [&](const Tensor& x, const std::vector<Tensor>& w) { return grouped_fp8(x, w, e); });
  auto amax = [](const Tensor& t) {
    double m = 0;
    for (double v : t.to_vector()) m = std::max(m, std::abs(v));
    return m;
  };
  int64_t begin = 0;
  for (size_t g = 0; g < kGroups.size(); ++g) {
    const Fp8LinearContext& c = e.contexts[g];
    const int64_t m = kGroups[g];
    const double want_x = m ? amax(narrow(in.x, 0, begin, m)) : 0.0;
    const double want_w = m ? amax(in.weights[g]) : 0.0;
    const double want_g = m ? amax(narrow(in.g, 0, begin, m)) : 0.0;
    EXPECT_EQ(e.delayed->amax(c.slot_input).item(), want_x) << "group " << g;
    EXPECT_EQ(e.delayed->amax(c.slot_weight).item(), want_w) << "group " << g;
    EXPECT_EQ(e.delayed->amax(c.slot_grad_output).item(), want_g) << "group " << g;
    begin += m;
  }
}

// fp8_grouped_linear against fp8_linear over each group's rows with the group's context: output,
// every gradient and the amax histories bit for bit (one op, same numbers); groups without rows get
// zero weight gradients.
void expect_each_group_is_its_fp8_linear(const Inputs& in, const std::vector<int64_t>& groups,
                                         Fp8Scaling scaling) {
  Experts a = make_experts(scaling, nullptr, groups.size());
  Experts b = make_experts(scaling, nullptr, groups.size());
  const Grads got = run(in, [&](const Tensor& x, const std::vector<Tensor>& w) {
    return fp8_grouped_linear(x, w, groups, a.pointers());
  });
  const Grads want = run(in, [&](const Tensor& x, const std::vector<Tensor>& w) {
    std::vector<Tensor> parts;
    int64_t begin = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g] > 0)
        parts.push_back(fp8_linear(narrow(x, 0, begin, groups[g]), w[g], Tensor(), b.contexts[g]));
      begin += groups[g];
    }
    return cat(parts, 0);
  });
  EXPECT_EQ(got.y.to_vector(), want.y.to_vector());
  EXPECT_EQ(got.dx.to_vector(), want.dx.to_vector());
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g] > 0) {
      EXPECT_EQ(got.dw[g].to_vector(), want.dw[g].to_vector()) << g;
    } else {
      for (double v : got.dw[g].to_vector()) ASSERT_EQ(v, 0.0) << g;
    }
  }
  if (a.delayed) {
    EXPECT_EQ(a.delayed->amax_history().to_vector(), b.delayed->amax_history().to_vector());
  }
}

TEST(Fp8GroupedLinearDelayed, EachGroupIsTheFp8LinearOfItsRows) {
  expect_each_group_is_its_fp8_linear(make_inputs(DType::BF16), kGroups, Fp8Scaling::Delayed);
}

// The same under dynamic scaling and with aligned dimensions, where the GEMMs write the output and
// dx rows in place: a group's padded rows run into the next groups' rows (sizes 1, 2, 3 pad to
// 16) until those groups' GEMMs write them.
class Fp8GroupedLinearShapes : public ::testing::TestWithParam<std::tuple<Fp8Scaling, bool>> {};

TEST_P(Fp8GroupedLinearShapes, EachGroupIsTheFp8LinearOfItsRows) {
  const auto [scaling, aligned] = GetParam();
  const std::vector<int64_t> groups = {1, 2, 0, 3, 17, 1, 0};
  const int64_t in_f = aligned ? 32 : 24, out_f = aligned ? 48 : 40;
  int64_t rows = 0;
  for (int64_t n : groups) rows += n;
  Inputs in;
  in.x = test::randn({rows, in_f}, 1, DType::BF16);
  in.g = test::randn({rows, out_f}, 2, DType::BF16, 1e-3);
  for (size_t e = 0; e < groups.size(); ++e)
    in.weights.push_back(test::randn({out_f, in_f}, 10 + e, DType::BF16, 0.2 * (1.0 + double(e))));
  expect_each_group_is_its_fp8_linear(in, groups, scaling);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8GroupedLinearShapes,
    ::testing::Combine(::testing::Values(Fp8Scaling::Delayed, Fp8Scaling::Dynamic),
                       ::testing::Bool()),
    [](const auto& i) {
      return std::string(std::get<0>(i.param) == Fp8Scaling::Delayed ? "Delayed" : "Dynamic") +
             (std::get<1>(i.param) ? "_aligned" : "_padded");
    });

// Only the groups whose GEMMs want a gradient cast their output gradient: with x frozen and one
// expert's weight frozen, that expert's grad_output slot records nothing, as its fp8_linear would.
TEST(Fp8GroupedLinearDelayed, FrozenExpertCastsNoOutputGradient) {
  const Inputs in = make_inputs(DType::BF16);
  Experts a = make_experts(Fp8Scaling::Delayed), b = make_experts(Fp8Scaling::Delayed);
  std::vector<Tensor> w[2];
  for (int i = 0; i < 2; ++i)
    for (size_t g = 0; g < kGroups.size(); ++g)
      w[i].push_back(in.weights[g].clone().set_requires_grad(g != 1));
  fp8_grouped_linear(in.x, w[0], kGroups, a.pointers()).backward(in.g);
  std::vector<Tensor> parts;
  int64_t begin = 0;
  for (size_t g = 0; g < kGroups.size(); ++g) {
    if (kGroups[g] > 0)
      parts.push_back(
          fp8_linear(narrow(in.x, 0, begin, kGroups[g]), w[1][g], Tensor(), b.contexts[g]));
    begin += kGroups[g];
  }
  cat(parts, 0).backward(in.g);
  EXPECT_EQ(a.delayed->amax(a.contexts[1].slot_grad_output).item(), 0.0);
  EXPECT_GT(a.delayed->amax(a.contexts[0].slot_grad_output).item(), 0.0);
  EXPECT_EQ(a.delayed->amax_history().to_vector(), b.delayed->amax_history().to_vector());
  for (size_t g = 0; g < kGroups.size(); ++g)
    if (g != 1 && kGroups[g] > 0) {
      EXPECT_EQ(w[0][g].grad().to_vector(), w[1][g].grad().to_vector()) << g;
    }
}

// What the op keeps for backward: the fp8 transposes of the rows and of the weights of the groups
// with rows (one byte per element, padded to 16) and 16 bytes of scale_inv per group and operand,
// nothing in high precision (the output is the caller's). Measured as the activation bytes alive
// after the forward beyond the output.
TEST(Fp8GroupedLinearDelayed, KeepsOnlyTheFp8TransposesForBackward) {
  const std::vector<int64_t> groups = {70, 0, 33, 16};
  const int64_t in_f = 64, out_f = 96;
  int64_t rows = 0, rows_p = 0, with_rows = 0;
  for (int64_t n : groups) {
    rows += n;
    rows_p += (n + 15) / 16 * 16;
    with_rows += n > 0 ? 1 : 0;
  }
  Tensor x = test::randn({rows, in_f}, 1, DType::BF16).set_requires_grad(true);
  std::vector<Tensor> w;
  for (size_t e = 0; e < groups.size(); ++e)
    w.push_back(test::randn({out_f, in_f}, 10 + e, DType::BF16, 0.1).set_requires_grad(true));
  Experts e = make_experts(Fp8Scaling::Delayed, nullptr, groups.size());
  e.delayed->amax_history();  // the state's buffers exist before the measurement
  const int64_t before = memory_stats(Device::cpu()).current[int(MemCategory::Activations)];
  Tensor y = fp8_grouped_linear(x, w, groups, e.pointers());
  const int64_t kept = memory_stats(Device::cpu()).current[int(MemCategory::Activations)] - before;
  const int64_t y_bytes = (rows + 15) * out_f * 2;  // the output, with its padded rows' slack
  const int64_t fp8_copies = in_f * rows_p + with_rows * in_f * out_f;
  const int64_t scale_invs = 2 * 4 * 4 * static_cast<int64_t>(groups.size());
  EXPECT_LE(kept, y_bytes + fp8_copies + scale_invs);
  EXPECT_GE(kept, rows * out_f * 2 + fp8_copies);
  y.backward(Tensor::ones(y.shape(), y.dtype()));
}

TEST(Fp8GroupedLinearDelayed, DisabledAutocastIsGroupedLinearAndRecordsNothing) {
  const Inputs in = make_inputs(DType::BF16);
  auto off = std::make_shared<Fp8Autocast>();
  off->enabled = false;
  Experts e = make_experts(Fp8Scaling::Delayed, off);
  const Grads got =
      run(in, [&](const Tensor& x, const std::vector<Tensor>& w) { return grouped_fp8(x, w, e); });
  const Grads want = run(in, [](const Tensor& x, const std::vector<Tensor>& w) {
    return grouped_linear(x, w, kGroups);
  });
  EXPECT_EQ(got.y.to_vector(), want.y.to_vector());
  EXPECT_EQ(got.dx.to_vector(), want.dx.to_vector());
  for (double v : e.delayed->amax_history().to_vector()) ASSERT_EQ(v, 0.0);
}

TEST(Fp8GroupedLinearDelayed, RefusesBadArguments) {
  const Inputs in = make_inputs(DType::BF16);
  Experts e = make_experts(Fp8Scaling::Delayed);
  auto message = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& ex) {
      return ex.what();
    }
    return "";
  };
  std::vector<const Fp8LinearContext*> short_list = e.pointers();
  short_list.pop_back();
  EXPECT_NE(message([&] {
              fp8_grouped_linear(in.x, in.weights, kGroups, short_list);
            }).find("[fp8_grouped_linear] 3 fp8 contexts for 4 weights"),
            std::string::npos);
  std::vector<const Fp8LinearContext*> with_null = e.pointers();
  with_null[1] = nullptr;
  EXPECT_NE(message([&] {
              fp8_grouped_linear(in.x, in.weights, kGroups, with_null);
            }).find("contexts[1] is null"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8_grouped_linear(in.x, in.weights, {5, 19, 0, 7}, e.pointers());
            }).find("[fp8_grouped_linear] group sizes sum to 31, but x has 32 rows"),
            std::string::npos);
}

}  // namespace
}  // namespace accel
